"""An engine's prefix cache as its own KV events describe it: which block hashes it holds.

Megatron's ``DynamoHelper`` (``megatron/core/inference/contexts/dynamic_context.py``)
reports, from rank zero:

* ``"stored"`` ``{"block_hashes": [int], "token_ids": [int], "num_block_tokens": [int],
  "parent_hash": int | None}``: complete prompt blocks now cached (after the step's
  forward pass; a cache hit is not announced again);
* ``"removed"`` ``{"block_hashes": [int]}`` in any order: blocks released or evicted. It
  may name hashes never announced (blocks imported from a prefill worker, stored events
  discarded by an interrupted step): those are ignored;
* ``"cleared"`` ``{}``: the whole cache is gone (a reset, a suspend in recompute mode).

``BlockSet`` applies them in order. Its memory is bounded: it holds at most ``capacity``
hashes (an engine cannot cache more blocks than its ``total_kv_blocks``; a flood of stored
events beyond that drops the oldest first, the blocks the engine's own LRU would have
evicted), so a misbehaving engine cannot grow the launcher without bound.
"""

from __future__ import annotations

import array
import itertools
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["KV_KINDS", "BlockSet", "kv_change", "pack_hashes", "unpack_hashes"]

KV_KINDS = ("stored", "removed", "cleared")
MAX_HASH = 2**64 - 1
DEFAULT_CAPACITY = 1 << 20
"""Blocks held before the engine's ``total_kv_blocks`` is known (a million: ~60 MB)."""


def kv_change(kind: str, payload: object) -> list[int]:
    """The block hashes a KV event names, or ValueError saying what is wrong with it."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"{kind} payload is a {type(payload).__name__}, not a map")
    if kind == "cleared":
        return []
    hashes = payload.get("block_hashes")
    if not isinstance(hashes, list):
        raise ValueError(f"{kind} payload has no block_hashes list")
    for value in hashes:
        if type(value) is not int or not 0 <= value <= MAX_HASH:
            raise ValueError(f"{kind} payload has a block hash that is not a 64-bit integer")
    return hashes


class BlockSet:
    """The block hashes one engine holds, kept from its KV events (see the module docs).

    Not thread-safe: one thread applies events (the engine-event receiver).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._blocks: dict[int, None] = {}  # insertion order: the oldest stored first
        self.capacity = capacity
        self.dropped = 0
        """Hashes dropped to stay within ``capacity``."""

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def apply(self, kind: str, hashes: Iterable[int]) -> None:
        """Apply one checked KV event (``kv_change``'s hashes) of ``kind``."""
        blocks = self._blocks
        if kind == "stored":
            for block_hash in hashes:
                blocks.pop(block_hash, None)  # stored again: the newest now
                blocks[block_hash] = None
            self._trim()
        elif kind == "removed":
            for block_hash in hashes:
                blocks.pop(block_hash, None)  # never announced: nothing to forget
        else:
            blocks.clear()

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` hashes from now on (the engine's ``total_kv_blocks``)."""
        self.capacity = max(1, capacity)
        self._trim()

    def _trim(self) -> None:
        blocks = self._blocks
        excess = len(blocks) - self.capacity
        if excess > 0:
            for block_hash in list(itertools.islice(blocks, excess)):
                del blocks[block_hash]
            self.dropped += excess

    def hashes(self) -> list[Any]:
        """Every held hash, oldest first (a copy)."""
        return list(self._blocks)


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Block hashes as little-endian unsigned 64-bit integers (how the relay sends them)."""
    packed = array.array("Q", hashes)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(data: bytes) -> array.array[int]:
    """The hashes ``pack_hashes`` packed; ValueError for bytes that are not whole hashes."""
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes are not a whole number of 64-bit hashes")
    packed = array.array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed
