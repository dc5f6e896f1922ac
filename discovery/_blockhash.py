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

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["block_hashes"]

_MOD = 2**63 - 1
_ROOT = bytes(32)


def block_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Megatron's hash of each complete block of ``tokens`` (at most ``limit`` blocks)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    blocks = len(tokens) // block_size
    if limit is not None:
        blocks = min(blocks, limit)
    if not blocks:
        return []
    try:
        data = struct.pack(f"<{blocks * block_size}q", *tokens[: blocks * block_size])
    except struct.error as exc:
        raise ValueError(f"prompt token ids must be 64-bit integers: {exc}") from exc
    step = block_size * 8
    digest = _ROOT
    out = []
    for start in range(0, len(data), step):
        digest = hashlib.sha256(digest + data[start : start + step]).digest()
        out.append(int.from_bytes(digest[:8], "little") % _MOD + 1)
    return out
