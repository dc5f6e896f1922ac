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
import threading
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

__all__ = ["KV_KINDS", "BlockSet", "Holders", "kv_change", "pack_hashes", "unpack_hashes"]

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


_Held = tuple[str, Container[int]]  # an engine id and its cached block hashes


class Holders:
    """Which engines hold each block asked about (a prompt's first block), kept up to date.

    Kept as KV events arrive, instead of asking every engine's set per pick.
    A block enters on its first ``of`` (found by looking in every engine's set once) and
    is kept up to date from then on by ``stored`` / ``removed`` / ``cleared`` / snapshot;
    at most ``limit`` blocks are kept (the oldest asked about go first). Reads take no
    lock (each entry is a frozenset replaced whole); changes take one.
    """

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._holders: dict[int, frozenset[str]] = {}

    def of(self, block_hash: int, sets: Callable[[], Iterable[_Held]]) -> frozenset[str]:
        """The engines holding ``block_hash``; ``sets()`` gives every engine's set (once)."""
        held = self._holders.get(block_hash)
        if held is not None:
            return held
        with self._lock:
            held = frozenset(engine_id for engine_id, blocks in sets() if block_hash in blocks)
            if len(self._holders) >= self._limit:
                del self._holders[next(iter(self._holders))]
            self._holders[block_hash] = held
        return held

    def stored(self, engine_id: str, hashes: Iterable[int]) -> None:
        """``engine_id`` now holds ``hashes`` too."""
        holders = self._holders
        if holders:
            with self._lock:
                for block_hash in holders.keys() & set(hashes):
                    holders[block_hash] = holders[block_hash] | {engine_id}

    def removed(self, engine_id: str, hashes: Iterable[int] | None = None) -> None:
        """``engine_id`` no longer holds ``hashes`` (None: any block)."""
        holders = self._holders
        if holders:
            with self._lock:
                named = holders.keys() if hashes is None else holders.keys() & set(hashes)
                for block_hash in named:
                    if engine_id in holders[block_hash]:
                        holders[block_hash] = holders[block_hash] - {engine_id}

    def replaced(self, engine_id: str, blocks: Container[int]) -> None:
        """``engine_id`` holds exactly ``blocks`` now (a snapshot)."""
        holders = self._holders
        if holders:
            with self._lock:
                for block_hash, held in holders.items():
                    if (block_hash in blocks) != (engine_id in held):
                        holders[block_hash] = held ^ {engine_id}


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
