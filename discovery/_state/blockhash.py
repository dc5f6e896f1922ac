"""Megatron-Core's prefix-cache block hash, so a router names blocks as the engine does.

Megatron (``megatron/core/inference/inference_request.py``, ``compute_block_hashes_batched``,
SHA-256 since 2026-04-24) hashes each complete block of ``block_size`` prompt tokens: the
tokens as little-endian int64, digest = SHA-256(previous block's 32-byte digest, 32 zero
bytes for block 0, followed by the block's bytes), value = (first 8 digest bytes as a
little-endian unsigned integer) mod (2^63 - 1), plus 1. The chain makes each hash name the
whole prefix up to its block. The engine reports these values in its ``"stored"`` and
``"removed"`` events; its data-parallel coordinator hashes prompts the same way.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from collections.abc import Sequence

__all__ = ["LazyBlockHashes", "block_hashes", "pack_tokens"]

_MOD = 2**63 - 1
_ROOT = bytes(32)


_NATIVE_INT64 = frozenset({"q", "l", "<q", "<l", "=q", "=l"} if sys.byteorder == "little" else ())
"""Buffer formats whose bytes are already Megatron's (8-byte little-endian signed ints)."""


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")  # compiled once per run length: prompts repeat them


def pack_tokens(tokens: Sequence[int], start: int, stop: int) -> bytes:
    """``tokens[start:stop]`` as little-endian int64 bytes, in one C call.

    Tokens held in a buffer of int64 (``array('q')``, a NumPy int64 array) are taken as
    they are, with no conversion per token. ValueError naming the problem for an id that
    is no 64-bit integer.
    """
    if not isinstance(tokens, list | tuple):
        try:
            view = memoryview(tokens)  # type: ignore[arg-type]
        except TypeError:
            pass  # a sequence without a buffer: packed below
        else:
            if view.format in _NATIVE_INT64 and view.itemsize == 8 and view.ndim == 1:
                return view[start:stop].tobytes()  # one copy in C (35 KB: ~2 us)
    try:
        # One struct.pack for the whole run: no Python loop per token or per block.
        return _packer(stop - start).pack(*tokens[start:stop])
    except struct.error as exc:
        raise ValueError(f"prompt token ids must be 64-bit integers: {exc}") from exc


def block_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Megatron's hash of each complete block of ``tokens`` (at most ``limit`` blocks)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    lazy = LazyBlockHashes(tokens, block_size)
    count = len(lazy) if limit is None else min(limit, len(lazy))
    if count:
        lazy.get(count - 1)
    return lazy.hashes[:count]


class LazyBlockHashes:
    """A prompt's block hashes, computed as they are asked for.

    A router that stops at the first block no engine holds hashes that one block only.
    Each call packs the blocks it hashes (all of them at once for ``all()``).
    ``known``: every complete block's hash, computed beforehand (a frontend that keeps each
    conversation's chain); then nothing is hashed here. ValueError unless it has one hash
    per complete block.
    """

    __slots__ = ("_block_size", "_blocks", "_digest", "_tokens", "hashes")

    def __init__(
        self, tokens: Sequence[int], block_size: int, known: Sequence[int] | None = None
    ) -> None:
        self._tokens = tokens
        self._block_size = block_size
        self._blocks = len(tokens) // block_size
        self._digest = _ROOT
        self.hashes: list[int] = []
        """The hashes computed so far, block 0 first."""
        if known is not None:
            if len(known) != self._blocks:
                raise ValueError(
                    f"{len(known)} block hashes given for a prompt of {self._blocks} complete "
                    f"blocks of {block_size} tokens: give every complete block's hash"
                )
            self.hashes = list(known)

    def __len__(self) -> int:
        """The number of complete blocks."""
        return self._blocks

    def get(self, index: int) -> int | None:
        """The hash of block ``index``, or None past the last complete block."""
        hashes = self.hashes
        if index < len(hashes):
            return hashes[index]
        if index >= self._blocks:
            return None
        first, size = len(hashes), self._block_size
        step = size * 8
        # The blocks asked for and no more, in one C call: a walk that stops at the first
        # block no engine holds packs only what it hashes (packing costs as much as hashing).
        data = memoryview(pack_tokens(self._tokens, first * size, (index + 1) * size))
        digest, sha256 = self._digest, hashlib.sha256
        for start in range(0, len(data), step):
            digest = sha256(digest + data[start : start + step]).digest()
            hashes.append(int.from_bytes(digest[:8], "little") % _MOD + 1)
        self._digest = digest
        return hashes[index]

    def all(self) -> list[int]:
        """Every complete block's hash."""
        if self._blocks:
            self.get(self._blocks - 1)
        return self.hashes
