"""Client-side routing over the live table: pick one engine per request.

A ``Router`` reads ``RoutingTable.snapshot()`` on every pick (a cached immutable view,
rebuilt only when the table changed) and rebuilds its own derived state when that view
changes. So a pick that starts after the table applied a batch sees that batch: an engine
the table dropped is never picked again, by any policy. Picks never touch etcd and never
block on I/O; ``pick()`` and ``release()`` are thread-safe (one lock) and cheap enough to
call from an asyncio event loop.

**Status, before anything else.** Only engines whose record status is among the router's
``statuses`` (default: ``ready``) are candidates: a ``starting`` engine takes nothing yet,
a ``draining`` one nothing new. A handle already held on an engine that starts draining
stays valid and releases normally (its in-flight count stays visible in ``in_flight()``).

**Filters, before any policy.** The router's ``selector`` and the per-call ``selector``
(both must hold: every ``key: value`` among the engine's labels), then fit:
``len(prompt_tokens) + max_tokens <= context_length``. When nothing is left the pick raises
``NoEngineAvailableError`` naming the filter that emptied the set; it never picks at random.

**Policies** (``RoutingPolicy``):

* ``round_robin``: the candidates in turn.
* ``load_balanced``: the lowest ``(in_flight + 1) / capacity``, where ``in_flight`` counts
  this router's unreleased handles and ``capacity = max_num_seqs *
  logical_data_parallel_size`` (``max_num_seqs`` is per data-parallel rank). An engine with
  twice the slots takes twice the load; exact ties rotate. Requests routed by other
  routers are not seen.
* ``first_prefix_block``: the first ``kv_cache_block_size`` prompt tokens are hashed and
  mapped to an engine by rendezvous (highest-random-weight) hashing, unweighted: each
  engine owns an equal share of first blocks, and removing an engine remaps only its
  share. Candidates with different block sizes are hashed on the smallest (logged once).
  A prompt shorter than one block has nothing cacheable and is load-balanced. A hot first
  block (a popular system prompt) stays on its engine whatever that engine's load.
* ``longest_prefix``: the router remembers the chained block hashes it recently sent to
  each engine (an approximate index, see below) and sends the prompt to the candidate
  holding the longest run of its leading blocks (ties: least loaded). When that engine's
  utilisation ``in_flight / capacity`` exceeds the least-loaded candidate's by more than
  ``load_gap`` (default 0.25: a quarter of its slots), or nothing matches, the request is
  load-balanced instead; either way its blocks are recorded for the engine that got it.
* ``auto`` (default): follow what the candidates advertise. An engine's advertised policy
  is its ``prefix_caching_coordinator_policy``, or ``load_balanced`` when it has
  ``enable_prefix_caching=False`` or no policy. When every candidate of a pick advertises
  the same policy (and, for the two prefix policies, the same ``kv_cache_block_size``),
  that policy is used. Otherwise the candidates are never hashed together: the pick is
  load-balanced over all of them and a warning naming the mix is logged once per mix.
  Give such fleets distinct labels and route each with its own selector to keep affinity.

An explicit policy applies to every candidate, whatever it advertises.

**Hashing** is deterministic across processes and machines: prompt tokens are packed as
little-endian int64 and hashed with BLAKE2b (64-bit digests; block ``i``'s hash covers
tokens ``[0, (i + 1) * block_size)``, so it identifies the whole prefix). An engine's
rendezvous score for a key is ``((key ^ seed) * 0x9E3779B97F4A7C15) mod 2**64`` with
``seed`` the BLAKE2b digest of its engine id; the highest score wins.

**Memory bound of the longest-prefix index.** Per engine, an LRU of at most
``min(prefix_index_blocks, total_kv_blocks)`` block hashes (``prefix_index_blocks``
defaults to 4096; an engine advertising ``total_kv_blocks=0`` gets ``prefix_index_blocks``),
plus a reverse map from hash to the engines holding it. Each remembered (engine, block)
pair costs about 200 bytes, so the index stays under ``engines * prefix_index_blocks *
200`` bytes (about 0.8 MB per engine by default). An engine's entries are dropped when it
leaves the table or changes its block size.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from types import MappingProxyType

from ._codec import EngineRecord, EngineStatus, RecordView, validate_status
from ._errors import NoEngineAvailableError
from ._metrics import NO_METRICS, MetricsHooks
from ._routing import RoutingTable
from ._store import RoutingSnapshot

__all__ = ["PickHandle", "Router", "RoutingPolicy"]

log = logging.getLogger(__name__)

DEFAULT_LOAD_GAP = 0.25
DEFAULT_PREFIX_INDEX_BLOCKS = 4096

_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd, so multiplying is a bijection mod 2**64
_SEED_PERSON = b"discovery/rdv"  # BLAKE2b personalisation: these digests mean nothing else
_BLOCK_PERSON = b"discovery/block"
_MAX_POOLS = 256  # cached candidate sets per table version; bounds memory under odd selectors
_SCORE = attrgetter("score")


class RoutingPolicy(enum.StrEnum):
    """How a Router chooses among the engines that pass its filters."""

    ROUND_ROBIN = "round_robin"
    """The candidates in turn."""
    LOAD_BALANCED = "load_balanced"
    """The fewest in-flight requests per slot (``max_num_seqs``)."""
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    """Rendezvous hashing of the prompt's first KV-cache block."""
    LONGEST_PREFIX = "longest_prefix"
    """The engine recently sent the longest run of the prompt's leading blocks."""
    AUTO = "auto"
    """What the candidates advertise in ``prefix_caching_coordinator_policy``."""


def _digest(data: bytes, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little")


def _pack(tokens: Sequence[int], count: int) -> bytes:
    try:
        return struct.pack(f"<{count}q", *tokens[:count])
    except struct.error as exc:
        raise ValueError(f"prompt token ids must be 64-bit integers: {exc}") from exc


def _first_block_key(tokens: Sequence[int], block_size: int) -> int:
    """The hash of the first block; equal to ``_block_hashes(...)[0]``."""
    return _digest(_pack(tokens, block_size), _BLOCK_PERSON)


def _block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every complete block: hash ``i`` covers the first ``i + 1`` blocks."""
    blocks = len(tokens) // block_size
    if not blocks:
        return []
    data = memoryview(_pack(tokens, blocks * block_size))
    step = block_size * 8
    hasher = hashlib.blake2b(digest_size=8, person=_BLOCK_PERSON)
    hashes = []
    for start in range(0, blocks * step, step):
        hasher.update(data[start : start + step])
        # digest() does not finalise the state: later updates extend the same prefix.
        hashes.append(int.from_bytes(hasher.digest(), "little"))
    return hashes


class _Engine:
    """The router's per-engine state: derived capabilities and in-flight count."""

    __slots__ = (
        "advertised",
        "block_size",
        "capacity",
        "context_length",
        "engine_id",
        "in_flight",
        "index_blocks",
        "record",
        "score",
        "seed",
    )

    def __init__(self, record: EngineRecord, index_blocks: int) -> None:
        self.engine_id = record.engine_id
        self.seed = _digest(record.engine_id.encode(), _SEED_PERSON)
        self.in_flight = 0
        self.set_record(record, index_blocks)

    def set_record(self, record: EngineRecord, index_blocks: int) -> None:
        caps = record.endpoint.capabilities
        self.record = record
        self.block_size = caps.kv_cache_block_size
        self.context_length = caps.context_length
        self.capacity = caps.max_num_seqs * caps.logical_data_parallel_size
        self.index_blocks = (
            min(index_blocks, caps.total_kv_blocks) if caps.total_kv_blocks else index_blocks
        )
        policy = caps.prefix_caching_coordinator_policy
        self.advertised = (
            RoutingPolicy(policy.value)
            if caps.enable_prefix_caching and policy is not None
            else RoutingPolicy.LOAD_BALANCED
        )
        self.score = (self.in_flight + 1) / self.capacity

    def acquire(self) -> None:
        self.in_flight += 1
        self.score = (self.in_flight + 1) / self.capacity

    def release(self) -> None:
        self.in_flight -= 1
        self.score = (self.in_flight + 1) / self.capacity


class _Pool:
    """The candidates of one (selector, fit) combination, with what each policy needs."""

    __slots__ = ("block_size", "by_block", "engines", "policy", "seeds")

    def __init__(self, engines: tuple[_Engine, ...], policy: RoutingPolicy) -> None:
        self.engines = engines
        self.policy = policy
        self.seeds = [engine.seed for engine in engines]
        self.block_size = min(engine.block_size for engine in engines)
        by_block: dict[int, set[str]] = {}
        for engine in engines:
            by_block.setdefault(engine.block_size, set()).add(engine.engine_id)
        self.by_block = {size: frozenset(ids) for size, ids in by_block.items()}


class _PrefixIndex:
    """Block hashes recently routed to each engine: a per-engine LRU plus a reverse map.

    The per-engine LRU is the memory bound; the reverse map (hash -> owning engine ids, a
    tuple because almost every hash has one owner) only holds what some LRU holds.
    """

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def longest(self, hashes: Iterable[int], candidates: frozenset[str]) -> tuple[int, set[str]]:
        """How many leading blocks the best candidates hold, and which candidates they are."""
        owners_of = self._owners
        matched = 0
        holders: set[str] = set()
        for block_hash in hashes:
            owners = owners_of.get(block_hash)
            if owners is None:
                break
            alive = candidates if not matched else holders
            still = {owner for owner in owners if owner in alive}
            if not still:
                break
            holders = still
            matched += 1
        return matched, holders

    def record(self, engine_id: str, limit: int, hashes: Iterable[int]) -> None:
        """Remember ``hashes`` as the newest blocks of ``engine_id``, evicting its oldest."""
        lru = self._lru.get(engine_id)
        if lru is None:
            lru = self._lru[engine_id] = OrderedDict()
        owners_of = self._owners
        for block_hash in hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)
                continue
            lru[block_hash] = None
            owners_of[block_hash] = (*owners_of.get(block_hash, ()), engine_id)
        while len(lru) > limit:
            self._disown(lru.popitem(last=False)[0], engine_id)

    def forget(self, engine_id: str) -> None:
        """Drop every block of ``engine_id``."""
        for block_hash in self._lru.pop(engine_id, ()):
            self._disown(block_hash, engine_id)

    def _disown(self, block_hash: int, engine_id: str) -> None:
        owners = tuple(owner for owner in self._owners[block_hash] if owner != engine_id)
        if owners:
            self._owners[block_hash] = owners
        else:
            del self._owners[block_hash]


class PickHandle(RecordView):
    """The engine chosen for one request; hold it for the request's life, then release.

    A context manager: leaving the ``with`` block releases it. ``release()`` is
    idempotent and never fails, also after the engine left the table.
    """

    __slots__ = ("_engine", "_lock", "_released", "matched_tokens", "policy", "record")

    def __init__(
        self,
        lock: threading.Lock,
        engine: _Engine,
        policy: RoutingPolicy,
        matched_tokens: int,
    ) -> None:
        self._lock = lock
        self._engine = engine
        self._released = False
        self.record: EngineRecord = engine.record
        """The chosen engine's record, as it was when picked."""
        self.policy = policy
        """The policy that chose the engine (a fallback shows as ``load_balanced``)."""
        self.matched_tokens = matched_tokens
        """For ``longest_prefix``: prompt tokens the engine was recently sent; else 0."""

    @property
    def released(self) -> bool:
        """Whether ``release()`` has run."""
        return self._released

    def release(self) -> None:
        """Stop counting this request against its engine. Idempotent."""
        with self._lock:
            if not self._released:
                self._released = True
                self._engine.release()

    def __enter__(self) -> PickHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<PickHandle {self.engine_id} policy={self.policy.value} {state}>"


class Router:
    """Picks an engine per request from a live RoutingTable (see the module docs).

    ``policy`` is a ``RoutingPolicy`` or its name; ``selector`` restricts every pick to
    engines carrying those labels; ``load_gap`` is the utilisation gap past which
    ``longest_prefix`` load-balances; ``prefix_index_blocks`` bounds the longest-prefix
    index per engine; ``statuses`` are the record statuses a candidate may have (default
    ``ready`` only; add ``starting`` for a warm-up client, say). The table must be started
    (or fed) separately; the router owns no thread and needs no closing. ``metrics``
    counts picks and exports in-flight requests.
    """

    def __init__(
        self,
        table: RoutingTable,
        *,
        policy: RoutingPolicy | str = RoutingPolicy.AUTO,
        selector: Mapping[str, str] | None = None,
        load_gap: float = DEFAULT_LOAD_GAP,
        prefix_index_blocks: int = DEFAULT_PREFIX_INDEX_BLOCKS,
        statuses: Iterable[EngineStatus | str] = (EngineStatus.READY,),
        metrics: MetricsHooks | None = None,
    ) -> None:
        try:
            self._policy = RoutingPolicy(policy)
        except ValueError:
            names = ", ".join(p.value for p in RoutingPolicy)
            raise ValueError(f"unknown routing policy {policy!r}; use one of {names}") from None
        if not load_gap >= 0:  # also rejects NaN
            raise ValueError(f"load_gap must be >= 0, got {load_gap!r}")
        if isinstance(prefix_index_blocks, bool) or not isinstance(prefix_index_blocks, int):
            raise TypeError("prefix_index_blocks must be an integer")
        if prefix_index_blocks <= 0:
            raise ValueError(f"prefix_index_blocks must be positive, got {prefix_index_blocks}")
        self._table = table
        self._metrics = metrics or NO_METRICS
        if metrics is not None:
            metrics.observe_router(self)
        self._selector = MappingProxyType(dict(selector or {}))
        self._statuses = frozenset(validate_status(status) for status in statuses)
        self._load_gap = float(load_gap)
        self._index_blocks = prefix_index_blocks
        self._lock = threading.Lock()
        self._snapshot: RoutingSnapshot | None = None
        self._engines: dict[str, _Engine] = {}
        self._ordered: tuple[_Engine, ...] = ()  # by context_length, longest first
        self._neg_context: list[int] = []  # ascending, for bisect
        self._min_context = 0
        self._pools: dict[tuple[tuple[tuple[str, str], ...], int], _Pool] = {}
        self._turn = 0
        self._index = _PrefixIndex()
        self._warned: set[object] = set()

    @property
    def policy(self) -> RoutingPolicy:
        """The configured policy."""
        return self._policy

    @property
    def selector(self) -> Mapping[str, str]:
        """The labels every picked engine carries."""
        return self._selector

    def pick(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: Mapping[str, str] | None = None,
    ) -> PickHandle:
        """Choose an engine for a request of ``prompt_tokens`` generating up to ``max_tokens``.

        ``selector`` adds labels the engine must carry for this call. Returns a held
        PickHandle; raises NoEngineAvailableError when no engine passes the filters.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError("max_tokens must be an integer")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        with self._lock:
            snapshot = self._table.snapshot()
            if snapshot is not self._snapshot:
                self._sync_locked(snapshot)
            try:
                pool = self._pool_locked(selector, len(prompt_tokens), max_tokens)
            except NoEngineAvailableError:
                self._metrics.no_engine()
                raise
            policy = pool.policy
            matched = 0
            if policy is RoutingPolicy.ROUND_ROBIN:
                engines = pool.engines
                engine = engines[self._turn % len(engines)]
                self._turn += 1
            elif policy is RoutingPolicy.LOAD_BALANCED:
                engine = self._least_loaded_locked(pool.engines)
            elif policy is RoutingPolicy.FIRST_PREFIX_BLOCK:
                engine, policy = self._rendezvous_locked(pool, prompt_tokens)
            else:
                engine, policy, matched = self._longest_prefix_locked(pool, prompt_tokens)
            engine.acquire()
        self._metrics.picked(policy.value)
        return PickHandle(self._lock, engine, policy, matched)

    def in_flight(self) -> dict[str, int]:
        """Unreleased handles per engine currently in the table (and the router's selector)."""
        with self._lock:
            snapshot = self._table.snapshot()
            if snapshot is not self._snapshot:
                self._sync_locked(snapshot)
            return {engine_id: e.in_flight for engine_id, e in self._engines.items()}

    def __repr__(self) -> str:
        return (
            f"<Router policy={self._policy.value} selector={dict(self._selector)} "
            f"engines={len(self._engines)}>"
        )

    # -- table changes -----------------------------------------------------------------

    def _sync_locked(self, snapshot: RoutingSnapshot) -> None:
        """Rebuild the derived state for a new table snapshot."""
        engines: dict[str, _Engine] = {}
        for engine_id, record in snapshot.items():
            if not record.matches(self._selector):
                continue
            engine = self._engines.get(engine_id)
            if engine is None:
                engine = _Engine(record, self._index_blocks)
            elif engine.record is not record:
                if record.endpoint.capabilities.kv_cache_block_size != engine.block_size:
                    self._index.forget(engine_id)  # its hashes no longer describe its blocks
                engine.set_record(record, self._index_blocks)  # keeps its in-flight count
            engines[engine_id] = engine
        for engine_id in self._engines.keys() - engines.keys():
            # Its handles still release, into the now detached _Engine they hold.
            self._index.forget(engine_id)
        # Engines of other statuses stay known (their in-flight counts) but are no candidates.
        candidates = (e for e in engines.values() if e.record.status in self._statuses)
        ordered = sorted(candidates, key=lambda e: (-e.context_length, e.engine_id))
        self._engines = engines
        self._ordered = tuple(ordered)
        self._neg_context = [-e.context_length for e in ordered]
        self._min_context = ordered[-1].context_length if ordered else 0
        self._pools.clear()
        self._snapshot = snapshot

    def _pool_locked(
        self, selector: Mapping[str, str] | None, prompt_len: int, max_tokens: int
    ) -> _Pool:
        need = prompt_len + max_tokens
        # Engines are ordered longest context first, so those that fit are a prefix.
        fit = (
            len(self._ordered)
            if need <= self._min_context
            else bisect.bisect_right(self._neg_context, -need)
        )
        key = (tuple(sorted(selector.items())) if selector else (), fit)
        pool = self._pools.get(key)
        if pool is None:
            engines = self._ordered[:fit]
            if selector:
                engines = tuple(e for e in engines if e.record.matches(selector))
            if not engines:
                raise self._no_engine_locked(selector, prompt_len, max_tokens)
            if len(self._pools) >= _MAX_POOLS:
                self._pools.clear()
            pool = self._pools[key] = _Pool(engines, self._resolve_locked(engines))
        return pool

    def _no_engine_locked(
        self, selector: Mapping[str, str] | None, prompt_len: int, max_tokens: int
    ) -> NoEngineAvailableError:
        total = len(self._snapshot or ())
        if not total:
            return NoEngineAvailableError(
                "the routing table is empty: no engine is registered in its namespace, or "
                "the table has not been started"
            )
        if not self._engines:
            return NoEngineAvailableError(
                f"none of the {total} engines in the table carries the router's labels "
                f"{dict(self._selector)}"
            )
        if not self._ordered:
            seen: dict[str, int] = {}
            for engine in self._engines.values():
                seen[engine.record.status] = seen.get(engine.record.status, 0) + 1
            return NoEngineAvailableError(
                f"none of the {len(self._engines)} engines the router sees is "
                f"{' or '.join(sorted(self._statuses))} "
                f"({', '.join(f'{n} {status}' for status, n in sorted(seen.items()))})"
            )
        matching = [e for e in self._ordered if e.record.matches(selector)]
        if not matching:
            return NoEngineAvailableError(
                f"none of the {len(self._engines)} engines the router sees carries the "
                f"labels {dict(selector or {})}"
            )
        return NoEngineAvailableError(
            f"no engine fits {prompt_len + max_tokens} tokens (prompt {prompt_len} + "
            f"max_tokens {max_tokens}): the largest context_length among the "
            f"{len(matching)} matching engines is {matching[0].context_length}"
        )

    def _resolve_locked(self, engines: tuple[_Engine, ...]) -> RoutingPolicy:
        """The policy a pool is routed with (never AUTO); logs a mix once."""
        if self._policy is RoutingPolicy.FIRST_PREFIX_BLOCK:
            sizes = sorted({e.block_size for e in engines})
            if len(sizes) > 1:
                self._warn_once(
                    ("sizes", tuple(sizes)),
                    "first_prefix_block: candidates use block sizes %s; hashing the first %d "
                    "tokens (the smallest) for all of them",
                    sizes,
                    sizes[0],
                )
        if self._policy is not RoutingPolicy.AUTO:
            return self._policy
        groups: dict[str, int] = {}
        for e in engines:
            name = e.advertised.value
            if e.advertised is not RoutingPolicy.LOAD_BALANCED:
                name += f" ({e.block_size}-token blocks)"
            groups[name] = groups.get(name, 0) + 1
        if len(groups) == 1:
            return engines[0].advertised
        self._warn_once(
            frozenset(groups),
            "auto: candidate engines advertise different routing (%s); load-balancing across "
            "them instead of mixing hash spaces. Label them apart to route each by its policy.",
            ", ".join(f"{name}: {count} engines" for name, count in sorted(groups.items())),
        )
        return RoutingPolicy.LOAD_BALANCED

    def _warn_once(self, key: object, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # -- policies ----------------------------------------------------------------------

    def _least_loaded_locked(self, engines: tuple[_Engine, ...]) -> _Engine:
        if len(engines) == 1:
            return engines[0]
        # min() keeps the first of equals, so rotating the start spreads exact ties.
        start = self._turn % len(engines)
        self._turn += 1
        return min(engines[start:] + engines[:start], key=_SCORE)

    def _rendezvous_locked(
        self, pool: _Pool, tokens: Sequence[int]
    ) -> tuple[_Engine, RoutingPolicy]:
        if len(tokens) < pool.block_size:
            return self._least_loaded_locked(pool.engines), RoutingPolicy.LOAD_BALANCED
        key = _first_block_key(tokens, pool.block_size)
        scores = [((key ^ seed) * _MIX) & _MASK64 for seed in pool.seeds]
        return pool.engines[scores.index(max(scores))], RoutingPolicy.FIRST_PREFIX_BLOCK

    def _longest_prefix_locked(
        self, pool: _Pool, tokens: Sequence[int]
    ) -> tuple[_Engine, RoutingPolicy, int]:
        chains: dict[int, list[int]] = {}
        best_tokens = 0
        holders: set[str] = set()
        for size, candidates in pool.by_block.items():
            chain = chains[size] = _block_hashes(tokens, size)
            blocks, owners = self._index.longest(chain, candidates)
            if blocks * size > best_tokens:
                best_tokens, holders = blocks * size, owners
        least = self._least_loaded_locked(pool.engines)
        engine, policy = least, RoutingPolicy.LOAD_BALANCED
        if holders:
            best = min(
                (self._engines[engine_id] for engine_id in holders),
                key=lambda e: (e.score, e.engine_id),
            )
            gap = best.in_flight / best.capacity - least.in_flight / least.capacity
            if gap <= self._load_gap:
                engine, policy = best, RoutingPolicy.LONGEST_PREFIX
        self._index.record(engine.engine_id, engine.index_blocks, chains[engine.block_size])
        return engine, policy, best_tokens if policy is RoutingPolicy.LONGEST_PREFIX else 0
