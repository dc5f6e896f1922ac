"""Client-side routing over the live table: pick one engine per request.

A ``Router`` reads ``RoutingTable.snapshot()`` on every pick (a cached immutable view,
rebuilt only when the table changed) and rebuilds its own derived state when that view
changes. So a pick that starts after the table applied a batch sees that batch: an engine
the table dropped is never picked again, by any policy. Picks never touch etcd and never
block on I/O; ``pick()`` and ``release()`` are thread-safe (one lock) and cheap enough to
call from an asyncio event loop.

**Status, before anything else.** Only engines whose record status is among the router's
``statuses`` (default: ``ready``) are candidates: a ``starting`` engine takes nothing yet,
a ``draining`` or ``paused`` one nothing new. A handle already held on an engine that
starts draining or is paused stays valid and releases normally (its in-flight count stays
visible in ``in_flight()``).

**Candidates.** The router sees the engines of the table that carry its ``selector``
labels. Each pick then filters them, in this order and in one place (``_pool_locked``):
fit (``len(prompt_tokens) + max_tokens <= context_length``), the per-call ``selector``
(every ``key: value`` among the engine's labels), weight versions (below), and fencing
(below). When fit, labels or ``min_weight_version`` leave nothing the pick raises
``NoEngineAvailableError`` naming the filter that emptied the set (and, for the version
filter, the versions present); it never picks at random. Fencing never empties a set.

**Weight versions** (a rollout fleet's ``weight_version``; no option: versions are not
looked at). ``min_weight_version=V`` keeps the candidates on version ``V`` or later.
``max_version_lag=K`` keeps those at most ``K`` versions behind the highest version among
the candidates, and ``weight_version="latest"`` is ``max_version_lag=0``: only the
engines on that highest version (given both, the smaller lag applies). "The candidates"
are the engines that passed the earlier filters (status, labels, fit), so the highest
version is that of a ready engine that could take this request: while a fleet is refitted,
the first engine ready on the new version takes every pick from the old ones, and a pick
never finds nothing while some ready engine fits. An engine without a version counts as
older than every version: ``min_weight_version`` never keeps it, and ``latest`` /
``max_version_lag`` keep it only when no candidate has a version (a fleet that does not
use versions routes as before). Given per pick, the three options replace the router's
for that pick (all three: give any one of them and the router's are not used).

**Policy** (``discovery._policies``): a ``RoutingPolicy`` name, whose built-in policy the
router builds with its ``load_factor``, ``load_gap`` and ``prefix_index_blocks``, or a
``Policy`` instance of your own. ``auto`` (default) follows what the candidates
advertise: an engine's advertised policy is its ``prefix_caching_coordinator_policy``, or
``load_balanced`` when it has ``enable_prefix_caching=False`` or no policy. When every
candidate of a pick advertises the same policy (and, for the two prefix policies, the
same ``kv_cache_block_size``), that policy is used. Otherwise the candidates are never
hashed together: the pick is load-balanced over all of them and a warning naming the mix
is logged once per mix. Give such fleets distinct labels and route each with its own
selector to keep affinity. An explicit policy applies to every candidate, whatever it
advertises.

**Fencing** (``discovery._fencing``): ``handle.release(failed=True)`` reports a failed
request; ``fence_after`` consecutive failures fence the engine for ``fence_seconds``,
doubled at each repeat without a success in between (up to ``fence_max_seconds``); a
success resets the counts. A fenced engine is no candidate until its fence ends. At most
``max_fenced_share`` of the engines the router sees are fenced at once, and when more than
that share of one pick's candidates (or all of them) are fenced, as can happen under a
narrow per-call selector, that pick ignores fencing (Envoy's panic mode). ``health()``
lists fenced and failing engines.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, NamedTuple

from ._errors import NoEngineAvailableError
from ._fencing import (
    DEFAULT_FENCE_AFTER,
    DEFAULT_FENCE_MAX_SECONDS,
    DEFAULT_FENCE_SECONDS,
    DEFAULT_MAX_FENCED_SHARE,
    FenceBook,
)
from ._metrics import NO_METRICS, MetricsHooks
from ._policies import (
    DEFAULT_INDEX_BLOCKS,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_GAP,
    DEFAULT_LOAD_WEIGHT,
    Candidate,
    Choice,
    FirstPrefixBlockPolicy,
    KvAwarePolicy,
    LoadBalancedPolicy,
    LongestPrefixPolicy,
    PickRequest,
    Policy,
    RoundRobinPolicy,
    RoutingPolicy,
)
from ._record import EngineRecord, EngineStatus, RecordView, validate_status
from ._routing import RoutingTable
from ._store import RoutingSnapshot

if TYPE_CHECKING:
    from ._follower import EngineStates

__all__ = ["PickHandle", "Router", "RouterHealth"]

log = logging.getLogger(__name__)

_CACHE_AFFINE = (RoutingPolicy.FIRST_PREFIX_BLOCK, RoutingPolicy.LONGEST_PREFIX)

_MAX_POOLS = 256  # cached candidate sets per table version; bounds memory under odd selectors
_NO_LABELS: Mapping[str, str] = MappingProxyType({})
LATEST = "latest"


class _Versions(NamedTuple):
    """A pick's weight-version filter: a floor, and a lag behind the highest version."""

    minimum: int | None = None
    lag: int | None = None

    @classmethod
    def of(
        cls, weight_version: str | None, min_weight_version: int | None, lag: int | None
    ) -> _Versions:
        if weight_version is not None and weight_version != LATEST:
            raise ValueError(f"weight_version must be None or 'latest', not {weight_version!r}")
        minimum = _non_negative("min_weight_version", min_weight_version)
        lag = _non_negative("max_version_lag", lag)
        if weight_version == LATEST:
            lag = 0
        return _NO_VERSIONS if minimum is None and lag is None else cls(minimum, lag)


_NO_VERSIONS = _Versions()


@dataclass(frozen=True)
class RouterHealth:
    """A point-in-time view of a Router, for health endpoints."""

    policy: str
    engines: int
    """Engines the router sees: in the table and carrying its labels."""
    in_flight: int
    """Unreleased handles on those engines."""
    fenced: Mapping[str, float]
    """Fenced engine id -> seconds until its fence ends."""
    failing: Mapping[str, int]
    """Engine id -> consecutive failed requests, for every engine with at least one."""
    fence_limit: int
    """How many engines may be fenced at once (``max_fenced_share`` of ``engines``)."""
    kv_fallbacks: int = 0
    """``kv_aware``: candidates scored from this router's own estimate (no fresh state)."""


class _Pool:
    """The candidates of one (selector, fit) combination and the policy that routes them."""

    __slots__ = ("candidates", "policy")

    def __init__(self, candidates: tuple[Candidate, ...], policy: Policy) -> None:
        self.candidates = candidates
        self.policy = policy


class PickHandle(RecordView):
    """The engine chosen for one request; hold it for the request's life, then release.

    A context manager: leaving the ``with`` block releases it (an exception leaving the
    block reports no outcome; call ``release(failed=True)`` for a failure). ``release()``
    is idempotent and never fails, also after the engine left the table.
    """

    __slots__ = ("_engine", "_released", "_router", "matched_tokens", "policy", "record")

    def __init__(self, router: Router, engine: Candidate, policy: str, matched_tokens: int) -> None:
        self._router = router
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

    def release(self, *, failed: bool = False) -> None:
        """Stop counting this request against its engine; ``failed`` reports a failure.

        Only the first call counts. ``failed=False`` (the default) is a success.
        """
        self._router._release(self, failed)

    def __enter__(self) -> PickHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # An exception in the block may be the caller's own: it says nothing of the engine.
        self._router._release(self, None if exc_type is not None else False)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<PickHandle {self.engine_id} policy={self.policy} {state}>"


class Router:
    """Picks an engine per request from a live RoutingTable (see the module docs).

    ``policy`` is a ``RoutingPolicy`` (or its name) or a ``Policy`` instance;
    ``selector`` restricts every pick to engines carrying those labels; ``statuses`` are
    the record statuses a candidate may have (default ``ready`` only; add ``starting`` for
    a warm-up client, say). For the built-in
    policies: ``load_factor`` is ``c`` of the load bound of the prefix policies (an
    engine takes at most ``ceil(c x`` its capacity-weighted share of the mean in-flight
    load), None for pure affinity; ``load_gap`` the utilisation gap past which
    ``longest_prefix`` load-balances; ``prefix_index_blocks`` the longest-prefix index
    bound per engine. Fencing: ``fence_after`` consecutive failures (None: never fence),
    ``fence_seconds`` / ``fence_max_seconds`` the first and longest fence,
    ``max_fenced_share`` the share of engines that may be fenced at once, ``clock`` the
    time source (seconds). Weight versions: ``weight_version="latest"``,
    ``min_weight_version`` and ``max_version_lag`` (see the module docs; none: versions
    are not looked at). The table must be started (or fed) separately; the router owns
    no thread and needs no closing. ``metrics`` counts picks, failures and fences and
    exports in-flight requests and fenced engines.
    """

    def __init__(
        self,
        table: RoutingTable,
        *,
        policy: RoutingPolicy | str | Policy = RoutingPolicy.AUTO,
        selector: Mapping[str, str] | None = None,
        load_factor: float | None = DEFAULT_LOAD_FACTOR,
        load_gap: float = DEFAULT_LOAD_GAP,
        prefix_index_blocks: int = DEFAULT_INDEX_BLOCKS,
        statuses: Iterable[EngineStatus | str] = (EngineStatus.READY,),
        fence_after: int | None = DEFAULT_FENCE_AFTER,
        fence_seconds: float = DEFAULT_FENCE_SECONDS,
        fence_max_seconds: float = DEFAULT_FENCE_MAX_SECONDS,
        max_fenced_share: float = DEFAULT_MAX_FENCED_SHARE,
        clock: Callable[[], float] = time.monotonic,
        metrics: MetricsHooks | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        states: EngineStates | None = None,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
    ) -> None:
        self._policy = _policy_argument(policy)
        if self._policy is RoutingPolicy.KV_AWARE and states is None:
            raise ValueError("kv_aware routes on what the engines report: give states=")
        self._versions = _Versions.of(weight_version, min_weight_version, max_version_lag)
        # Built eagerly so bad options fail here, not at the first pick.
        self._builtins: dict[RoutingPolicy, Policy] = {
            RoutingPolicy.ROUND_ROBIN: RoundRobinPolicy(),
            RoutingPolicy.LOAD_BALANCED: LoadBalancedPolicy(),
            RoutingPolicy.FIRST_PREFIX_BLOCK: FirstPrefixBlockPolicy(load_factor=load_factor),
            RoutingPolicy.LONGEST_PREFIX: LongestPrefixPolicy(
                load_factor=load_factor,
                load_gap=load_gap,
                prefix_index_blocks=prefix_index_blocks,
            ),
        }
        self._states = states
        self._load_changes = None if states is None else states.load_changes()
        if states is not None:
            states.add_load_source(self.in_flight)  # one load view across routers
            self._builtins[RoutingPolicy.KV_AWARE] = KvAwarePolicy(
                states,
                load_factor=load_factor,
                load_weight=load_weight,
                prefix_index_blocks=prefix_index_blocks,
            )
        self._fences = FenceBook(
            after=fence_after,
            seconds=fence_seconds,
            max_seconds=fence_max_seconds,
            max_share=max_fenced_share,
            clock=clock,
        )
        self._table = table
        self._metrics = metrics or NO_METRICS
        if metrics is not None:
            metrics.observe_router(self)
        self._selector = MappingProxyType(dict(selector or {}))
        self._statuses = frozenset(validate_status(status) for status in statuses)
        self._lock = threading.Lock()
        self._snapshot: RoutingSnapshot | None = None
        self._engines: dict[str, Candidate] = {}
        self._ordered: tuple[Candidate, ...] = ()  # by context_length, longest first
        self._neg_context: list[int] = []  # ascending, for bisect
        self._min_context = 0
        self._pools: dict[tuple[tuple[tuple[str, str], ...], int, _Versions], _Pool] = {}
        self._warned: set[object] = set()

    @property
    def policy(self) -> RoutingPolicy | Policy:
        """The configured policy: a RoutingPolicy name, or your Policy instance."""
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
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
    ) -> PickHandle:
        """Choose an engine for a request of ``prompt_tokens`` generating up to ``max_tokens``.

        ``selector`` adds labels the engine must carry for this call. ``weight_version``
        (``"latest"``), ``min_weight_version`` and ``max_version_lag``, if any is given,
        replace the router's version options for this call. ``block_hashes``: Megatron's
        hashes of the prompt's complete blocks (``discovery.block_hashes``), per block
        size, when you have them already (a frontend keeping each conversation's chain
        hashes only the blocks a turn adds): ``kv_aware`` then hashes nothing; a block
        size it lacks is hashed as usual, the other policies ignore it. Each entry must
        hold one hash per complete block (ValueError otherwise). Returns a held PickHandle;
        raises NoEngineAvailableError when no engine passes the filters.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError("max_tokens must be an integer")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if block_hashes is not None:
            _check_block_hashes(block_hashes, len(prompt_tokens))
        versions = (
            self._versions
            if weight_version is None and min_weight_version is None and max_version_lag is None
            else _Versions.of(weight_version, min_weight_version, max_version_lag)
        )
        with self._lock:
            self._refresh_locked()
            try:
                pool = self._pool_locked(selector, len(prompt_tokens), max_tokens, versions)
            except NoEngineAvailableError:
                self._metrics.no_engine()
                raise
            policy = pool.policy
            choice = policy.choose(
                pool.candidates,
                PickRequest(prompt_tokens, max_tokens, selector or _NO_LABELS, block_hashes),
            )
            if isinstance(choice, Choice):
                engine, credited, matched = choice
                name = credited or policy.name
            else:
                engine, name, matched = choice, policy.name, 0
            if policy is self._policy:  # the user's own: check what it answered
                _check_choice(policy, engine, pool.candidates)
            engine._acquire()
        self._metrics.picked(name)
        return PickHandle(self, engine, name, matched)

    def in_flight(self) -> dict[str, int]:
        """Unreleased handles per engine currently in the table (and the router's selector)."""
        with self._lock:
            self._refresh_locked()
            return {engine_id: e.in_flight for engine_id, e in self._engines.items()}

    def health(self) -> RouterHealth:
        """A point-in-time view: engines, in-flight requests, fenced and failing engines."""
        with self._lock:
            self._refresh_locked()
            now = self._fences.now()
            return RouterHealth(
                policy=self._policy_name,
                engines=len(self._engines),
                in_flight=sum(e.in_flight for e in self._engines.values()),
                fenced=MappingProxyType(
                    {engine_id: end - now for engine_id, end in self._fences.fenced.items()}
                ),
                failing=MappingProxyType(self._fences.failures()),
                fence_limit=self._fences.limit(len(self._engines)),
                kv_fallbacks=getattr(self._builtins.get(RoutingPolicy.KV_AWARE), "fallbacks", 0),
            )

    def __repr__(self) -> str:
        engines = len(self._engines)
        return (
            f"<Router policy={self._policy_name} selector={dict(self._selector)} engines={engines}>"
        )

    @property
    def _policy_name(self) -> str:
        return self._policy.name if isinstance(self._policy, Policy) else self._policy.value

    # -- outcomes ----------------------------------------------------------------------

    def _release(self, handle: PickHandle, failed: bool | None) -> None:
        """Release ``handle`` once; ``failed`` is its outcome (None: unknown)."""
        outcome = ""
        with self._lock:
            if handle._released:
                return
            handle._released = True
            engine = handle._engine
            engine._release()
            # A handle of an engine that left the table holds a detached Candidate.
            if failed is not None and self._engines.get(engine.engine_id) is engine:
                if failed:
                    outcome = self._fences.failed(engine.engine_id, len(self._engines))
                    if outcome == "fenced":
                        self._pools.clear()
                else:
                    self._fences.succeeded(engine.engine_id)
        if failed:
            self._metrics.request_failed(outcome)

    # -- table changes -----------------------------------------------------------------

    def _refresh_locked(self) -> None:
        """Catch up with the table and with fences that ran out."""
        snapshot = self._table.snapshot()
        if snapshot is not self._snapshot:
            self._sync_locked(snapshot)
        if self._fences.expire():
            self._pools.clear()
        changes = self._load_changes
        if changes:  # what other routers hold: only the engines whose figure changed
            while changes:
                engine = self._engines.get(changes.popleft())
                if engine is not None:
                    engine._set_others(self._others(engine.engine_id))

    def _sync_locked(self, snapshot: RoutingSnapshot) -> None:
        """Rebuild the derived state for a new table snapshot."""
        engines: dict[str, Candidate] = {}
        for engine_id, record in snapshot.items():
            if not record.matches(self._selector):
                continue
            engine = self._engines.get(engine_id)
            if engine is None:
                engine = Candidate(record)
                if self._states is not None:
                    engine._set_others(self._others(engine_id))
            elif engine.record is not record:
                if record.endpoint.capabilities.kv_cache_block_size != engine.block_size:
                    self._forget_locked(engine_id)  # its hashes no longer describe its blocks
                engine._update(record)  # keeps its in-flight count
            engines[engine_id] = engine
        for engine_id in self._engines.keys() - engines.keys():
            # Its handles still release, into the now detached Candidate they hold.
            self._forget_locked(engine_id)
            self._fences.forget(engine_id)
        # Engines of other statuses stay known (their in-flight counts) but are no candidates.
        candidates = (e for e in engines.values() if e.record.status in self._statuses)
        ordered = sorted(candidates, key=lambda e: (-e.context_length, e.engine_id))
        self._engines = engines
        self._ordered = tuple(ordered)
        self._neg_context = [-e.context_length for e in ordered]
        self._min_context = ordered[-1].context_length if ordered else 0
        self._pools.clear()
        self._snapshot = snapshot

    def _others(self, engine_id: str) -> int:
        """What other routers hold on the engine (0 without fresh state: ours alone)."""
        assert self._states is not None
        return self._states.others(engine_id) or 0

    def _forget_locked(self, engine_id: str) -> None:
        for policy in self._builtins.values():
            policy.forget(engine_id)
        if isinstance(self._policy, Policy):
            self._policy.forget(engine_id)

    # -- candidates --------------------------------------------------------------------

    def _pool_locked(
        self,
        selector: Mapping[str, str] | None,
        prompt_len: int,
        max_tokens: int,
        versions: _Versions = _NO_VERSIONS,
    ) -> _Pool:
        """The candidates of one pick: every filter runs here (fit, labels, versions, fences)."""
        need = prompt_len + max_tokens
        # Engines are ordered longest context first, so those that fit are a prefix.
        fit = (
            len(self._ordered)
            if need <= self._min_context
            else bisect.bisect_right(self._neg_context, -need)
        )
        key = (tuple(sorted(selector.items())) if selector else (), fit, versions)
        pool = self._pools.get(key)
        if pool is None:
            engines = self._ordered[:fit]
            if selector:
                engines = tuple(e for e in engines if e.record.matches(selector))
            if not engines:
                raise self._no_engine_locked(selector, prompt_len, max_tokens)
            if versions is not _NO_VERSIONS:
                engines = _by_version(engines, versions)
            engines = self._unfenced_locked(engines, key)
            if len(self._pools) >= _MAX_POOLS:
                self._pools.clear()
            pool = self._pools[key] = _Pool(engines, self._resolve_locked(engines))
        return pool

    def _unfenced_locked(
        self, engines: tuple[Candidate, ...], key: object
    ) -> tuple[Candidate, ...]:
        fenced = self._fences.fenced
        if not fenced:
            return engines
        unfenced = tuple(e for e in engines if e.engine_id not in fenced)
        if unfenced and len(engines) - len(unfenced) <= self._fences.limit(len(engines)):
            return unfenced
        self._warn_once(
            (key, frozenset(fenced)),
            "%d of %d candidate engines are fenced, more than max_fenced_share %.2f: "
            "routing over all of them until fences end",
            len(engines) - len(unfenced),
            len(engines),
            self._fences.max_share,
        )
        return engines

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

    def _resolve_locked(self, engines: tuple[Candidate, ...]) -> Policy:
        """The policy a pool is routed with; ``auto`` logs a mix once."""
        if isinstance(self._policy, Policy):
            return self._policy
        if self._policy is not RoutingPolicy.AUTO:
            return self._builtins[self._policy]
        groups: dict[str, int] = {}
        for e in engines:
            name = e.advertised.value
            if e.advertised is not RoutingPolicy.LOAD_BALANCED:
                name += f" ({e.block_size}-token blocks)"
            groups[name] = groups.get(name, 0) + 1
        if len(groups) == 1:
            advertised = engines[0].advertised
            if (
                advertised in _CACHE_AFFINE
                and RoutingPolicy.KV_AWARE in self._builtins
                and all(e.record.state_address for e in engines)
            ):
                # The engines ask for cache affinity and report their caches: the truth
                # serves it better than a guess.
                return self._builtins[RoutingPolicy.KV_AWARE]
            return self._builtins[advertised]
        self._warn_once(
            frozenset(groups),
            "auto: candidate engines advertise different routing (%s); load-balancing across "
            "them instead of mixing hash spaces. Label them apart to route each by its policy.",
            ", ".join(f"{name}: {count} engines" for name, count in sorted(groups.items())),
        )
        return self._builtins[RoutingPolicy.LOAD_BALANCED]

    def _warn_once(self, key: object, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def _by_version(engines: tuple[Candidate, ...], versions: _Versions) -> tuple[Candidate, ...]:
    """The candidates that pass the version filter; NoEngineAvailableError when none does.

    Only the floor (``min_weight_version``) can leave none: the lag is counted from the
    highest version among ``engines``, which always passes it.
    """
    minimum, lag = versions
    top = max((v for e in engines if (v := e.record.weight_version) is not None), default=None)
    floor = minimum
    if lag is not None and top is not None:
        floor = top - lag if floor is None else max(floor, top - lag)
    if floor is None:
        return engines
    kept = tuple(e for e in engines if (v := e.record.weight_version) is not None and v >= floor)
    if not kept:
        raise NoEngineAvailableError(
            f"no engine is on weight_version >= {minimum} (min_weight_version): "
            f"the {len(engines)} candidates (status, labels and fit passed) are on "
            f"{_versions_present(engines)}"
        )
    return kept


def _versions_present(engines: Iterable[Candidate]) -> str:
    """``v7 (3), v8 (1), no version (2)``: the versions of ``engines``, with counts."""
    counts: dict[int | None, int] = {}
    for engine in engines:
        version = engine.record.weight_version
        counts[version] = counts.get(version, 0) + 1
    versions = sorted(v for v in counts if v is not None)
    parts = [f"v{v} ({counts[v]})" for v in versions]
    if None in counts:
        parts.append(f"no version ({counts[None]})")
    return ", ".join(parts)


def _check_block_hashes(block_hashes: Mapping[int, Sequence[int]], prompt_len: int) -> None:
    """One hash per complete block, for each block size given."""
    if not isinstance(block_hashes, Mapping):
        raise TypeError("block_hashes must map a block size to the prompt's block hashes")
    for size, hashes in block_hashes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"block_hashes: {size!r} is no block size (a positive integer)")
        if len(hashes) != prompt_len // size:
            raise ValueError(
                f"block_hashes[{size}] holds {len(hashes)} hashes; a prompt of {prompt_len} "
                f"tokens has {prompt_len // size} complete blocks of {size} tokens"
            )


def _non_negative(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _policy_argument(policy: RoutingPolicy | str | Policy) -> RoutingPolicy | Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        raise TypeError(f"policy must be an instance: pass {policy.__name__}(), not the class")
    try:
        return RoutingPolicy(policy)
    except ValueError:
        names = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(
            f"unknown routing policy {policy!r}; use one of {names} or a Policy instance"
        ) from None


def _check_choice(policy: Policy, engine: object, candidates: tuple[Candidate, ...]) -> None:
    """A policy of the user's must answer with one of the candidates it was given."""
    if not any(engine is c for c in candidates):
        raise TypeError(
            f"policy {policy.name!r} returned {engine!r}, not one of the {len(candidates)} "
            "candidates it was given (return a Candidate, or a Choice of one)"
        )
