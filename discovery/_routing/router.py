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

**Candidates.** The router sees the engines of the table its ``selector`` matches
(Kubernetes' label selectors, ``discovery._records.selector``). Each pick then filters them, in
this order and in one place (``_pool_locked``):
fit (``len(prompt_tokens) + max_tokens <= context_length``), the per-call ``selector``
(matched the same way), weight versions (below), and fencing
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

**Policy** (``discovery._routing.policies``): a ``RoutingPolicy`` name, whose built-in policy the
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

**Fencing** (``discovery._routing.fencing``): ``handle.release(failed=True)`` reports a failed
request; ``fence_after`` consecutive failures fence the engine for ``fence_seconds``,
doubled at each repeat without a success in between (up to ``fence_max_seconds``); a
success resets the counts. A fenced engine is no candidate until its fence ends. At most
``max_fenced_share`` of the engines the router sees are fenced at once, and when more than
that share of one pick's candidates (or all of them) are fenced, as can happen under a
narrow per-call selector, that pick ignores fencing (Envoy's panic mode). ``health()``
lists fenced and failing engines.

**Admission** (``discovery._routing.admission``; off unless the router or the pick gives
``wait`` or the router ``capacity``): an engine at capacity (``max_num_seqs x
logical_data_parallel_size`` by default, on the shared load view, within this router's
share of it when several routers report to its relay) is no candidate. When no candidate
has room the pick waits, highest ``priority`` first then first come, up to ``wait``
seconds in a queue of ``max_waiting``, and raises ``OverloadedError`` past either bound.
``reserve`` keeps the top share of each engine for picks of priority 1 or more.
``apick`` is the same pick for asyncio: it waits without blocking the event loop.

**Protection from mass lease loss** (``discovery._routing.protection``): when more than
``protect_threshold`` of the router's ready engines lose their records within
``protect_window`` seconds without saying they were stopping, they stay routable as
``unconfirmed`` (``health().unconfirmed``) until their records come back, one is seen
dead (its relay says goodbye or goes silent, a request on it fails), or
``protect_grace`` seconds pass.

**Retry hooks.** ``pick(..., exclude=ids)`` never picks those engines (a retry). A held
``PickHandle`` learns when its engine stops being a good target: removed, ``stalled``,
``stopping``, fenced, or unconfirmed and then dead. ``handle.lost`` (the reason, or
None), ``handle.on_lost(callback)`` and ``await handle.wait_lost()`` say so within
milliseconds of the table or state change: cancel the request and send it again with
``exclude``. (A draining engine finishes what it has: its handles are told only when its
record goes at the drain deadline.)

**Reasons.** ``explain(engine_id)`` says filter by filter why an engine is or is not a
candidate right now; ``reasons()`` counts the engines per reason (a metric).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

from discovery._errors import NoEngineAvailableError, NotACandidateError, OverloadedError
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._reads.store import Batch, EventType, RoutingSnapshot
from discovery._reads.table import RoutingTable
from discovery._records.handoff import EngineRole, handoff_problem
from discovery._records.record import EngineRecord, EngineStatus, validate_status
from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._routing.admission import DEFAULT_MAX_WAITING, Admission, Capacity, Waiter
from discovery._routing.fencing import (
    DEFAULT_FENCE_AFTER,
    DEFAULT_FENCE_MAX_SECONDS,
    DEFAULT_FENCE_SECONDS,
    DEFAULT_MAX_FENCED_SHARE,
    FenceBook,
)
from discovery._routing.handles import Listener, PickHandle, PickPair, loss_of
from discovery._routing.pairs import (
    DEFAULT_ALONE_BELOW,
    DEFAULT_ALONE_SHARE,
    HandoffKeys,
    Pairing,
    ids,
)
from discovery._routing.picker import (
    NO_PICKER,
    NO_VERSIONS,
    Picker,
    Pool,
    Versions,
    by_version,
    versions_present,
)
from discovery._routing.policies import (
    DEFAULT_INDEX_BLOCKS,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_GAP,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_SESSION_LOAD_FACTOR,
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
    SessionPolicy,
    session_hash,
    tally,
    unknown_policy,
)
from discovery._routing.protection import (
    DEFAULT_GRACE,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW,
    LossProtection,
)
from discovery._routing.split import Rotation, Split, split_of
from discovery._state.blockhash import block_hashes

if TYPE_CHECKING:
    from discovery._state.engine_states import EngineStates

__all__ = ["Explanation", "PickHandle", "PickPair", "Router", "RouterHealth"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_CACHE_AFFINE = (RoutingPolicy.FIRST_PREFIX_BLOCK, RoutingPolicy.LONGEST_PREFIX)

_MAX_POOLS = 256  # cached candidate sets per table version; bounds memory under odd selectors
_NO_AGES: Mapping[str, float] = MappingProxyType({})
_NO_IDS: frozenset[str] = frozenset()
_EVERYTHING = selector_of(None)
_PINNED = "pinned"  # the policy a pinned pick is credited to
ALONE = frozenset({EngineRole.AGGREGATED, EngineRole.PREFILL})
"""The roles that serve a request alone (a Megatron decode engine cannot compute a prompt)."""
PREFILL = frozenset({EngineRole.PREFILL})
DECODE = frozenset({EngineRole.DECODE})
AGGREGATED = frozenset({EngineRole.AGGREGATED})
_LOST_STATUSES = {
    EngineStatus.STALLED: "stalled: its launcher stopped hearing from it",
    EngineStatus.STOPPING: "stopping: its engine exited or it is being deregistered",
}
_CHECK_EVERY = 0.1  # seconds between a pick's look at unconfirmed engines' evidence


class _Ask(NamedTuple):
    """One pick's arguments, checked: what a waiting pick is served with later."""

    prompt_tokens: Sequence[int]
    max_tokens: int
    selector: Selector
    versions: Versions
    block_hashes: Mapping[int, Sequence[int]] | None
    exclude: frozenset[str]
    priority: int
    admit: bool
    """Admission applies: engines without room are no candidates."""
    session: int | None = None
    """The session key, hashed (``session_hash``): it decides the engine."""
    pin: str | None = None
    """The engine the pick must go to (``engine_id=``)."""
    fallback: bool = False
    """A pin that is no candidate falls back to an ordinary pick (else it raises)."""
    roles: frozenset[EngineRole] = frozenset()
    """The roles a candidate may have (``ALONE``, set by ``_ask``; one side of a pair)."""
    only: frozenset[str] | None = None
    """The engines that may take it (a pair's side: those that can hand off); None: any."""
    policy: Policy | None = None
    """The policy that chooses (a pair's side); None: the key's, else the router's."""
    split: Split | None = None
    """Groups to draw one from before choosing (``split=``); None once drawn, or none."""
    group: str | None = None
    """The split's group drawn (its selector's text), added to ``selector``."""
    images: bool = False
    """The request carries images: routed by load alone (``policy``), nothing hashed."""


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
    unconfirmed: Mapping[str, float] = field(default_factory=lambda: _NO_AGES)
    """Engines kept routable after a mass lease loss: id -> seconds since their record went."""
    waiting: int = 0
    """Picks waiting for room (admission)."""


@dataclass(frozen=True)
class Explanation:
    """Why an engine is or is not a candidate right now (``Router.explain``)."""

    engine_id: str
    candidate: bool
    """Whether a pick with these arguments may choose it."""
    reason: str
    """``candidate``, ``unconfirmed`` (a candidate kept after a mass lease loss), or the
    first filter that leaves it out: ``absent``, ``labels``, its status (``starting``,
    ``draining``, ``paused``, ``stalled``, ``stopping``, or ``status`` for one this
    version does not know), ``fit``, ``selector``, ``excluded``, ``version``, ``fenced``,
    ``capacity``."""
    checks: tuple[tuple[str, bool | None, str], ...]
    """Each filter in the order a pick applies them: (name, passed, what it saw); passed
    is None for a filter these arguments do not exercise or that an earlier one skipped."""

    def __str__(self) -> str:
        lines = [f"{self.engine_id}: {self.reason}"]
        for name, passed, detail in self.checks:
            mark = "-" if passed is None else ("ok" if passed else "NO")
            lines.append(f"  {mark:>2} {name}: {detail}")
        return "\n".join(lines)


class _TableSink:
    """The router's sink on the table's store: batches, kept in order with their time.

    Called under the store's lock: it only queues, and wakes the router on the store's
    event thread when someone waits on what the batch may say.
    """

    def __init__(self, router: Router) -> None:
        self._router = weakref.ref(router)

    def deliver(self, batch: Batch) -> None:
        router = self._router()
        if router is None:
            return
        router._batches.append((batch, router._fences.now()))
        if router._watching():
            router._table.store.dispatcher.submit(_process, self._router)

    def close(self) -> None:
        """The store closed: nothing more comes."""


def _process(ref: weakref.ref[Router]) -> None:
    router = ref()
    if router is not None:
        router._process()


class Router:
    """Picks an engine per request from a live RoutingTable (see the module docs).

    ``policy`` is a ``RoutingPolicy`` (or its name) or a ``Policy`` instance;
    ``selector`` (a ``Selector``, its text or labels to equal) restricts every pick to
    the engines it matches; ``statuses`` are the record statuses a candidate may have
    (default ``ready`` only; add ``starting`` for a warm-up client, say). For the built-in
    policies: ``load_factor`` is ``c`` of the load bound of the prefix policies (an
    engine takes at most ``ceil(c x`` its capacity-weighted share of the mean in-flight
    load), None for pure affinity; ``load_gap`` the utilisation gap past which
    ``longest_prefix`` load-balances; ``prefix_index_blocks`` the longest-prefix index
    bound per engine; ``session_load_factor`` the bound of session keys (1.15: a tighter
    one than the prefixes', see ``discovery._routing.policies``). Fencing: ``fence_after``
    consecutive failures (None: never fence),
    ``fence_seconds`` / ``fence_max_seconds`` the first and longest fence,
    ``max_fenced_share`` the share of engines that may be fenced at once, ``clock`` the
    time source (seconds). Weight versions: ``weight_version="latest"``,
    ``min_weight_version`` and ``max_version_lag`` (see the module docs; none: versions
    are not looked at). Admission: ``capacity`` (a number, or a function of the record;
    default the record's), ``wait`` (seconds a pick waits for room), ``max_waiting``,
    ``reserve`` (see ``discovery._routing.admission``); off unless ``capacity`` or ``wait`` is
    given here or ``wait`` per pick. Mass lease loss: ``protect_threshold`` (None: never
    protect), ``protect_window``, ``protect_grace`` (see ``discovery._routing.protection``). The
    table must be started (or fed) separately; the router owns no thread and needs no
    closing. ``metrics`` counts picks, failures and fences and exports in-flight
    requests, fenced and unconfirmed engines, and engines per reason.
    """

    def __init__(
        self,
        table: RoutingTable,
        *,
        policy: RoutingPolicy | str | Policy = RoutingPolicy.AUTO,
        selector: SelectorLike | None = None,
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
        capacity: Capacity | None = None,
        wait: float | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
        reserve: float = 0.0,
        protect_threshold: float | None = DEFAULT_THRESHOLD,
        protect_window: float = DEFAULT_WINDOW,
        protect_grace: float = DEFAULT_GRACE,
        session_load_factor: float | None = DEFAULT_SESSION_LOAD_FACTOR,
        split: Split | Mapping[SelectorLike, float] | None = None,
    ) -> None:
        self._policy = _policy_argument(policy)
        if self._policy is RoutingPolicy.KV_AWARE and states is None:
            raise ValueError("kv_aware routes on what the engines report: give states=")
        self._versions = Versions.of(weight_version, min_weight_version, max_version_lag)
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
            RoutingPolicy.SESSION: SessionPolicy(load_factor=session_load_factor),
        }
        self._session_policy = self._builtins[RoutingPolicy.SESSION]
        self._split = split_of(split)
        self._rotations: dict[Split, Rotation] = {}
        self._admission = Admission(
            capacity=capacity, wait=wait or 0.0, max_waiting=max_waiting, reserve=reserve
        )
        self._admit = capacity is not None or wait is not None
        self._fences = FenceBook(
            after=fence_after,
            seconds=fence_seconds,
            max_seconds=fence_max_seconds,
            max_share=max_fenced_share,
            clock=clock,
        )
        self._protection: LossProtection[Candidate] = LossProtection(
            threshold=protect_threshold, window=protect_window, grace=protect_grace, clock=clock
        )
        self._states = states
        self._handoff_keys = HandoffKeys()  # a pair's sides, by hand-off key (under the lock)
        # Per candidate set (by id, the set held so the id stays its own), as policies keep
        # theirs: picks with and without ``pair_within`` alternate without rebuilding.
        self._pairings: dict[tuple[int, str | None], tuple[tuple[Candidate, ...], Pairing]] = {}
        self._viable: dict[
            tuple[int, int, bool], tuple[tuple[Candidate, ...], Pairing, frozenset[str]]
        ] = {}
        self._load_changes = (
            None if states is None else states.load_changes(notify=self._load_changed)
        )
        if states is not None:
            states.add_load_source(self.in_flight)  # one load view across routers
            self._builtins[RoutingPolicy.KV_AWARE] = KvAwarePolicy(
                states,
                load_factor=load_factor,
                load_weight=load_weight,
                prefix_index_blocks=prefix_index_blocks,
            )
        self._table = table
        self._metrics = metrics or NO_METRICS
        self._counting = metrics is not None  # else no metrics call per pick
        self._selector = selector_of(selector)
        self._statuses = frozenset(validate_status(status) for status in statuses)
        self._lock = threading.Lock()
        self._snapshot: RoutingSnapshot | None = None
        self._engines: dict[str, Candidate] = {}
        self._ordered: tuple[Candidate, ...] = ()  # by context_length, longest first
        self._roles = False  # some candidate is not aggregated (a prefill / decode fleet)
        self._neg_context: list[int] = []  # ascending, for bisect
        self._min_context = 0
        self._pools: dict[tuple[object, ...], Pool] = {}
        self._picker = NO_PICKER  # rebuilt by _refresh_locked (see discovery._routing.picker)
        self._tally = tally(())  # the total load of the picker's candidates, kept
        self._warned: set[object] = set()
        self._held = 0  # unreleased handles, over every engine
        self._losses = 0  # engines that stopped being good targets, counted
        self._next_check = 0.0  # when a pick next looks at unconfirmed engines' evidence
        self._notices: list[tuple[PickHandle, Listener, str]] = []  # told after the lock
        self._batches: collections.deque[tuple[Batch, float]] = collections.deque()
        self._plain: tuple[tuple[Any, ...], float] | None = None  # _plain_ask's, checked once
        weakref.finalize(self, table.store.add_sink(_TableSink(self), replay=False))
        if metrics is not None:
            metrics.observe_router(self)

    @property
    def policy(self) -> RoutingPolicy | Policy:
        """The configured policy: a RoutingPolicy name, or your Policy instance."""
        return self._policy

    @property
    def split(self) -> Split | None:
        """The router's split: groups of engines and their weights (None: no split)."""
        return self._split

    @property
    def selector(self) -> Selector:
        """The selector every picked engine matches."""
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
        exclude: Collection[str] | None = None,
        wait: float | None = None,
        priority: int = 0,
        session_key: str | bytes | int | None = None,
        engine_id: str | None = None,
        fallback: bool = False,
        split: Split | Mapping[SelectorLike, float] | None = None,
        images: bool = False,
    ) -> PickHandle:
        """Choose an engine for a request of ``prompt_tokens`` generating up to ``max_tokens``.

        ``selector`` must match too, for this call. ``weight_version``
        (``"latest"``), ``min_weight_version`` and ``max_version_lag``, if any is given,
        replace the router's version options for this call. ``block_hashes``: Megatron's
        hashes of the prompt's complete blocks (``discovery.block_hashes``), per block
        size, when you have them already (a frontend keeping each conversation's chain
        hashes only the blocks a turn adds): ``kv_aware`` then hashes nothing; a block
        size it lacks is hashed as usual, the other policies ignore it. Each entry must
        hold one hash per complete block (ValueError otherwise). ``exclude``: engine ids
        never to pick (a retry). ``wait``: seconds to wait for room (admission; turns it on
        for this pick; default the router's), ``priority``: higher first (see
        ``discovery._routing.admission``). ``session_key``: a conversation, user or agent run; every
        router sends a key to the same engine among the candidates (rendezvous hashing,
        under the load bound), whatever the router's policy. ``engine_id``: this engine
        only, if it is a candidate; else NotACandidateError says why (``fallback=True``:
        an ordinary pick instead). ``images``: the request carries images, which a Megatron
        engine never prefix-caches (881f489f): it is routed as Megatron's coordinator
        routes it, by load alone (``load_balanced``, under every filter, fencing and
        admission), whatever the router's policy; nothing is hashed, no prefix index
        learns from it, and ``session_key`` and ``block_hashes`` are not used. Returns a
        held PickHandle; raises
        NoEngineAvailableError when no engine passes the filters, OverloadedError when none
        had room in time.
        """
        if (
            selector is None
            and weight_version is None
            and min_weight_version is None
            and max_version_lag is None
            and exclude is None
            and wait is None
            and session_key is None
            and engine_id is None
            and split is None
            and not images
            and not fallback
            and priority == 0
            and type(priority) is int
            and type(max_tokens) is int
            and max_tokens >= 0
        ):  # no per-call option: the picker's, if it is current
            if block_hashes is not None:
                _check_block_hashes(block_hashes, len(prompt_tokens))
            with self._lock:
                picker = self._picker
                handle = (
                    self._choose_locked(
                        picker.policy,
                        picker.candidates,
                        tuple.__new__(  # as _plain_ask: no Python-level __new__ per pick
                            PickRequest,
                            (prompt_tokens, max_tokens, _EVERYTHING, block_hashes, None),
                        ),
                        picker.admit,
                        0,
                    )
                    if picker.snapshot is self._table.snapshot()  # once per pick, as ever
                    and not self._batches
                    and not self._load_changes
                    and len(prompt_tokens) + max_tokens <= picker.fits
                    else None
                )
            if handle is not None:
                if self._counting:
                    self._metrics.picked(handle.policy)
                if self._notices:  # rarely: no call per pick
                    self._deliver_notices()
                return handle
        ask, timeout = self._ask(
            prompt_tokens,
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=block_hashes,
            exclude=exclude,
            wait=wait,
            priority=priority,
            session_key=session_key,
            engine_id=engine_id,
            fallback=fallback,
            split=split,
            images=images,
        )
        return self._pick_ask(ask, timeout)

    def _pick_ask(self, ask: _Ask, timeout: float) -> PickHandle:
        """``pick``'s work once its arguments are checked: at once, or after waiting."""
        with self._lock:
            ask, handle = self._first_try_locked(ask, timeout)
            if handle is None:
                waiter = self._queue_locked(ask, event=threading.Event())
        if handle is not None:
            self._picked(handle)
            return handle
        assert waiter.event is not None
        started = waiter.started
        deadline = started + timeout
        while not waiter.event.wait(self._next_wake(deadline)):
            if time.monotonic() >= deadline:
                break
            self._process()  # a fence ran out, an unconfirmed engine may be dead
        return self._outcome(waiter, started)

    def _pick_now(self, ask: _Ask, timeout: float, listener: Listener) -> PickHandle | None:
        """A pick's first try (``ask`` checked): its handle, or None when it must wait.

        For a caller that drives requests with callbacks (``apick`` only when this says
        wait): ``listener`` is told if the handle is lost, as by ``_listen``.
        """
        with self._lock:
            _, handle = self._first_try_locked(ask, timeout)
            if handle is not None:  # just picked: not lost yet
                self._listen_locked(handle, listener)
        if handle is not None:
            self._picked(handle)
        return handle

    async def apick(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: Mapping[str, str] | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
        exclude: Collection[str] | None = None,
        wait: float | None = None,
        priority: int = 0,
        session_key: str | bytes | int | None = None,
        engine_id: str | None = None,
        fallback: bool = False,
        split: Split | Mapping[SelectorLike, float] | None = None,
        images: bool = False,
    ) -> PickHandle:
        """``pick`` for asyncio: waits for room without blocking the event loop.

        The pick itself takes the router's lock for microseconds, as ``pick`` does;
        cancelling the coroutine gives its place up (and a handle served meanwhile back).
        """
        ask, timeout = self._ask(
            prompt_tokens,
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=block_hashes,
            exclude=exclude,
            wait=wait,
            priority=priority,
            session_key=session_key,
            engine_id=engine_id,
            fallback=fallback,
            split=split,
            images=images,
        )
        with self._lock:
            ask, handle = self._first_try_locked(ask, timeout)
            if handle is None:
                future: asyncio.Future[PickHandle] = asyncio.get_running_loop().create_future()
                waiter = self._queue_locked(ask, future=future)
        if handle is not None:
            self._picked(handle)
            return handle
        started = waiter.started
        deadline = started + timeout
        try:
            while not future.done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait([future], timeout=self._next_wake(deadline))
                if not future.done():
                    self._process()
        except asyncio.CancelledError:
            with self._lock:
                self._admission.remove(waiter)
                served = waiter.handle
            if served is not None:
                served.release()  # no outcome: the caller gave up, the engine did nothing
            raise
        return self._outcome(waiter, started)

    def pick_pair(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: Mapping[str, str] | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
        session_key: str | bytes | int | None = None,
        pair_within: str | None = None,
        require_within: bool = False,
        exclude_prefill: Collection[str] | None = None,
        exclude_decode: Collection[str] | None = None,
        keep_prefill: PickHandle | None = None,
        keep_decode: PickHandle | None = None,
        decode_policy: RoutingPolicy | str | Policy = RoutingPolicy.LOAD_BALANCED,
        allow_aggregated: bool = False,
        alone_below: int = DEFAULT_ALONE_BELOW,
        alone_share: float | None = DEFAULT_ALONE_SHARE,
        wait: float | None = None,
        priority: int = 0,
        images: bool = False,
    ) -> PickPair:
        """Choose a prefill and a decode engine that can hand off, for one request.

        Every filter of ``pick`` applies to each side (``selector``, versions, fit,
        fencing, admission with ``wait`` and ``priority``); the sides are Megatron's roles,
        and only engines whose ``handoff_key`` is equal are paired. The prefill engine is
        chosen by the router's policy (by cached prefix: ``auto`` follows what the prefill
        engines advertise, ``kv_aware`` where they relay their caches), the decode engine
        by ``decode_policy`` (default by load). ``pair_within``: a label (a rack, an NVLink
        domain) both should share: preferred (when the prefill engine's value has no
        partner with room, the prefill side is picked again where one has; see
        ``discovery._routing.pairs``), or required with ``require_within``.
        ``session_key`` keeps a session on the same engines of both sides. A re-pick after
        one side was lost keeps the other: ``keep_prefill`` / ``keep_decode`` (a held
        handle), ``exclude_prefill`` / ``exclude_decode`` (engine ids). With
        ``allow_aggregated``, an aggregated engine serves the request alone (no hand-off)
        when the prompt is shorter than ``alone_below`` tokens or its relayed cache holds at
        least ``alone_share`` of the prompt's blocks, or when no pair can be made (see
        ``discovery._routing.pairs``). Raises NoEngineAvailableError (naming why no pair can be
        made) or OverloadedError as ``pick`` does. ``images``: as for ``pick``, the prefill
        side by load (the decode side by ``decode_policy``, by load by default), and an
        aggregated engine serves it alone by ``alone_below`` only, never by its cache.
        """
        if keep_prefill is not None and keep_decode is not None:
            raise ValueError("keep_prefill and keep_decode: keep at most one side")
        for kept in (keep_prefill, keep_decode):
            if kept is not None and (kept._router is not self or kept.released):
                raise ValueError(f"{kept!r} is no handle held on this router")
        ask, timeout = self._ask(
            prompt_tokens,
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=block_hashes,
            exclude=None,
            wait=wait,
            priority=priority,
            session_key=session_key,
            images=images,
        )
        deadline = time.monotonic() + timeout
        prefill_ask = ask._replace(roles=PREFILL, exclude=frozenset(exclude_prefill or ()))
        decode_ask = ask._replace(
            roles=DECODE,
            exclude=frozenset(exclude_decode or ()),
            policy=self._policy_instance(decode_policy),
        )
        prefill, decode = keep_prefill, keep_decode
        with self._lock:
            self._refresh_locked()
            alone = self._alone_locked(ask, allow_aggregated, alone_below, alone_share)
            if alone is None:
                try:
                    prefill_ask, pairing = self._sides_locked(
                        prefill_ask, decode_ask, pair_within, require_within, keep_decode
                    )
                except NoEngineAvailableError:
                    alone = self._alone_locked(ask, allow_aggregated, None, None)
                    if alone is None:
                        raise
                else:
                    if ask.split is None:  # a split draws each side's group as a pick does
                        prefill, decode = self._pair_now_locked(
                            prefill_ask,
                            decode_ask,
                            pairing,
                            require_within,
                            keep_prefill=keep_prefill,
                            keep_decode=keep_decode,
                        )
        if alone is not None:
            return PickPair(None, self._pick_ask(alone, timeout))
        for handle in (prefill, decode):
            if handle is not None and handle is not keep_prefill and handle is not keep_decode:
                self._picked(handle)
        if prefill is not None and decode is not None:
            return PickPair(prefill, decode)
        # A side waits for room: one after the other, each side as a pick.
        prefill = prefill or self._pick_ask(prefill_ask, timeout)
        try:
            with self._lock:
                self._refresh_locked()
                side = self._side_locked(decode_ask)
                near, every = self._partners_locked(
                    self._pairing_locked(side, pair_within), prefill, require_within
                )
            # The pool's own tuple reaches the policy unfiltered (its caches key on it).
            if decode_ask.exclude or len(every) < len(side):
                decode_ask = decode_ask._replace(only=ids(every))
            decode = keep_decode or self._decode_locked_or_wait(decode_ask, near, every, deadline)
        except BaseException:
            if keep_prefill is None:
                prefill.release()  # no outcome: the engine did nothing
            raise
        return PickPair(prefill, decode)

    def _pair_now_locked(
        self,
        prefill_ask: _Ask,
        decode_ask: _Ask,
        pairing: Pairing,
        required: bool,
        *,
        keep_prefill: PickHandle | None,
        keep_decode: PickHandle | None,
    ) -> tuple[PickHandle | None, PickHandle | None]:
        """Both sides in one pass, each held if it has room now: (prefill, decode).

        A side without room is None (the prefill side's None leaves the decode side None):
        ``pick_pair`` then picks it as ``pick`` does, waiting for room.
        """
        if self._admission.waiters:
            self._serve_locked()  # those waiting come first
        if keep_prefill is None:
            try:
                prefill = self._try_locked(prefill_ask, None)
            except NoEngineAvailableError:
                self._metrics.no_engine()
                raise
            if prefill is None or keep_decode is not None:
                return prefill, keep_decode
        else:
            prefill = keep_prefill
        try:
            near, every = self._partners_locked(pairing, prefill, required)
            if len(near) < len(every):  # preferred: within the label first
                decode = self._try_locked(decode_ask, None, near) if near else None
                if decode is not None:
                    return prefill, decode
                if keep_prefill is None:
                    nearer = self._nearer_locked(prefill_ask, decode_ask, pairing)
                    if nearer is not None:
                        self._unpick_locked(prefill)
                        return nearer
            return prefill, self._try_locked(decode_ask, None, every)
        except BaseException:
            if keep_prefill is None:
                self._unpick_locked(prefill)
            raise

    def _nearer_locked(
        self, prefill_ask: _Ask, decode_ask: _Ask, pairing: Pairing
    ) -> tuple[PickHandle, PickHandle] | None:
        """A pair within one value of the label, the prefill side picked again (preferred).

        For when the prefill engine picked has no partner with room within its own value:
        the prefill side among the engines that have one; None when none with room has one.
        A pair kept together wins over the best prefill engine's cache: the caller asked
        for it, and a hand-off out of the rack moves the whole prompt's KV across it.
        """
        has_room, priority = self._admission.has_room, decode_ask.priority
        roomy = {
            pair: group
            for pair, group in pairing.near.items()
            if not decode_ask.admit or any(has_room(e, priority) for e in group)
        }
        if not roomy:
            return None
        within, keys, only = pairing.within, pairing.keys, prefill_ask.only
        assert within is not None  # near is empty without it
        partners: dict[Candidate, tuple[Candidate, ...]] = {}  # prefill engine -> near ones
        for engine in self._side_locked(prefill_ask):
            if only is None or engine.engine_id in only:
                key, value = keys(engine.record), engine.record.labels.get(within)
                if key is not None and value is not None and (key, value) in roomy:
                    partners[engine] = roomy[key, value]
        prefill = self._try_locked(prefill_ask, None, tuple(partners)) if partners else None
        if prefill is None:
            return None
        decode = self._try_locked(decode_ask, None, partners[prefill._engine])
        assert decode is not None  # one had room, and nothing was taken since
        return prefill, decode

    def _unpick_locked(self, handle: PickHandle) -> None:
        """Take back a handle never given out: no outcome, no notice."""
        handle._released = True
        handle._until = self._losses
        handle._engine._release()
        self._held -= 1
        if self._admission.waiters:
            self._serve_locked()  # its room

    def _decode_locked_or_wait(
        self,
        ask: _Ask,
        near: Sequence[Candidate],
        every: Sequence[Candidate],
        deadline: float,
    ) -> PickHandle:
        """The decode side: a partner within the label first, if one has room now."""
        if near and len(near) < len(every):
            with contextlib.suppress(OverloadedError):
                return self._pick_ask(ask._replace(only=ids(near)), 0.0)
        return self._pick_ask(ask, max(0.0, deadline - time.monotonic()))

    def _policy_instance(self, policy: RoutingPolicy | str | Policy) -> Policy:
        if isinstance(policy, str) and policy in self._builtins:
            return self._builtins[RoutingPolicy(policy)]  # no ABC check: the common case
        chosen = _policy_argument(policy)
        if isinstance(chosen, Policy):
            return chosen
        if chosen not in self._builtins:
            raise ValueError(f"policy {chosen.value!r} cannot choose one side of a pair")
        return self._builtins[chosen]

    def _sides_locked(
        self,
        prefill_ask: _Ask,
        decode_ask: _Ask,
        within: str | None,
        required: bool,
        keep_decode: PickHandle | None,
    ) -> tuple[_Ask, Pairing]:
        """The prefill side's pick, and the decode candidates by hand-off key.

        The prefill side: the prefill engines some decode candidate can take (those of
        ``keep_decode``'s engine when it is kept).
        """
        prefills = self._side_locked(prefill_ask)
        decodes = (
            (keep_decode._engine,) if keep_decode is not None else self._side_locked(decode_ask)
        )
        self._handoff_keys.trim(len(prefills) + len(decodes))
        pairing = self._pairing_locked(decodes, within)
        viable = self._viable_locked(prefills, pairing, required)
        if not viable:
            raise NoEngineAvailableError(
                f"no pair can hand off: none of the {len(prefills)} prefill candidates has a "
                f"compatible decode candidate among {len(decodes)}"
                + (f" with the same {within!r} label" if within and required else "")
                + (f" ({handoff_problem(prefills[0].record, decodes[0].record)})"
                   if prefills and decodes else "")
            )  # fmt: skip
        if len(viable) < len(prefills):  # else no filter: the policy sees the pool's tuple
            prefill_ask = prefill_ask._replace(only=viable)
        return prefill_ask, pairing

    @staticmethod
    def _partners_locked(
        pairing: Pairing, prefill: PickHandle, required: bool
    ) -> tuple[tuple[Candidate, ...], tuple[Candidate, ...]]:
        """The decode candidates ``prefill``'s engine can hand off to: (near, all)."""
        near, every = pairing.partners(prefill._engine, required)
        if not every:
            raise NoEngineAvailableError(
                f"no decode candidate can take {prefill.engine_id}'s hand-off now"
            )
        return near, every

    def _side_locked(self, ask: _Ask) -> tuple[Candidate, ...]:
        """One side's candidates: every filter but capacity (a pick waits for room)."""
        pool = self._pool_locked(
            ask.selector, len(ask.prompt_tokens), ask.max_tokens, ask.versions, ask.roles
        )
        if not ask.exclude:
            return pool.candidates  # the pool's own tuple: the pairing memo knows it
        return tuple(e for e in pool.candidates if e.engine_id not in ask.exclude)

    def _pairing_locked(self, decodes: tuple[Candidate, ...], within: str | None) -> Pairing:
        """``decodes`` grouped by hand-off key: kept while the pool's tuple is the same."""
        kept = self._pairings.get((id(decodes), within))
        if kept is not None and kept[0] is decodes:
            return kept[1]
        if len(self._pairings) >= _MAX_POOLS:
            self._pairings.clear()
        pairing = Pairing.of(decodes, self._handoff_keys, within)
        self._pairings[id(decodes), within] = (decodes, pairing)
        return pairing

    def _viable_locked(
        self, prefills: tuple[Candidate, ...], pairing: Pairing, required: bool
    ) -> frozenset[str]:
        """The ids of ``prefills`` with a partner in ``pairing``: kept as the pairing is."""
        key = (id(prefills), id(pairing), required)
        kept = self._viable.get(key)
        if kept is not None and kept[0] is prefills and kept[1] is pairing:
            return kept[2]
        if len(self._viable) >= _MAX_POOLS:
            self._viable.clear()
        viable = ids([p for p in prefills if pairing.partners(p, required)[1]])
        self._viable[key] = (prefills, pairing, viable)
        return viable

    def _alone_locked(
        self, ask: _Ask, allowed: bool, below: int | None, share: float | None
    ) -> _Ask | None:
        """The ask for one aggregated engine serving the request alone, or None (a pair).

        ``below`` and ``share`` None: alone whenever an aggregated engine is a candidate.
        """
        if not allowed:
            return None
        alone = ask._replace(roles=AGGREGATED)
        try:
            engines = self._side_locked(alone)
        except NoEngineAvailableError:
            return None
        length = len(ask.prompt_tokens)
        if (below is None and share is None) or (below is not None and length < below):
            return alone
        states = self._states
        if share is None or states is None or ask.images:
            return None  # an image request is cached nowhere
        best, held = None, 0.0
        # The prompt hashed once per block size, for every engine here and for the pick.
        known = dict(ask.block_hashes or {})
        for engine in engines:
            blocks = length // engine.block_size
            if not blocks or not engine.record.state_address:
                continue
            hashes = known.get(engine.block_size)
            if hashes is None:
                hashes = known[engine.block_size] = block_hashes(
                    ask.prompt_tokens, engine.block_size
                )
            cached = states.cached_prefix(engine.engine_id, hashes) or 0
            if cached / blocks > held:
                best, held = engine, cached / blocks
        if best is None or held < share:
            return None
        return alone._replace(only=frozenset({best.engine_id}), block_hashes=known)

    def explain(
        self,
        engine_id: str,
        prompt_tokens: Sequence[int] | None = None,
        max_tokens: int = 0,
        *,
        selector: Mapping[str, str] | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        exclude: Collection[str] | None = None,
        priority: int = 0,
    ) -> Explanation:
        """Why ``engine_id`` is or is not a candidate right now, filter by filter.

        With a request (``prompt_tokens`` and ``max_tokens``) the fit filter runs too;
        the other arguments are a pick's. Capacity is judged as the router's admission
        would (when admission is off it is shown but never excludes).
        """
        ask, _ = self._ask(
            prompt_tokens or (),
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=None,
            exclude=exclude,
            wait=None,
            priority=priority,
        )
        with self._lock:
            self._refresh_locked()
            explanation = self._explain_locked(engine_id, ask, prompt_tokens is not None)
        self._deliver_notices()
        return explanation

    def reasons(self) -> dict[str, int]:
        """How many engines the router sees per reason (``Explanation.reason``), no request."""
        ask, _ = self._ask(
            (),
            0,
            selector=None,
            weight_version=None,
            min_weight_version=None,
            max_version_lag=None,
            block_hashes=None,
            exclude=None,
            wait=None,
            priority=0,
        )
        counts: dict[str, int] = {}
        with self._lock:
            self._refresh_locked()
            for engine_id in self._engines:
                reason = self._explain_locked(engine_id, ask, False).reason
                counts[reason] = counts.get(reason, 0) + 1
        self._deliver_notices()
        return counts

    def engines(self) -> dict[str, EngineRecord]:
        """Every engine the router sees, by id: the table's with its labels, and unconfirmed ones.

        An unconfirmed engine (kept after a mass lease loss) shows its last record.
        """
        with self._lock:
            self._refresh_locked()
            records = {engine_id: e.record for engine_id, e in self._engines.items()}
        self._deliver_notices()
        return records

    def in_flight(self) -> dict[str, int]:
        """Unreleased handles per engine currently in the table (and the router's selector)."""
        with self._lock:
            self._refresh_locked()
            counts = {engine_id: e.in_flight for engine_id, e in self._engines.items()}
        self._deliver_notices()
        return counts

    def health(self) -> RouterHealth:
        """A point-in-time view: engines, in-flight requests, fenced, unconfirmed, waiting."""
        with self._lock:
            self._refresh_locked()
            now = self._fences.now()
            health = RouterHealth(
                policy=self._policy_name,
                engines=len(self._engines),
                in_flight=sum(e.in_flight for e in self._engines.values()),
                fenced=MappingProxyType(
                    {engine_id: end - now for engine_id, end in self._fences.fenced.items()}
                ),
                failing=MappingProxyType(self._fences.failures()),
                fence_limit=self._fences.limit(len(self._engines)),
                kv_fallbacks=getattr(self._builtins.get(RoutingPolicy.KV_AWARE), "fallbacks", 0),
                unconfirmed=MappingProxyType(self._protection.ages()),
                waiting=len(self._admission.waiters),
            )
        self._deliver_notices()
        return health

    def __repr__(self) -> str:
        engines = len(self._engines)
        return (
            f"<Router policy={self._policy_name} selector={str(self._selector)!r} "
            f"engines={engines}>"
        )

    @property
    def _policy_name(self) -> str:
        return self._policy.name if isinstance(self._policy, Policy) else self._policy.value

    # -- picking -----------------------------------------------------------------------

    def _plain_ask(self, prompt_tokens: Sequence[int], max_tokens: int) -> tuple[_Ask, float]:
        """``_ask`` with no option (a caller picking per request): the rest checked once."""
        if type(max_tokens) is not int or max_tokens < 0 or self._plain is None:
            ask, timeout = self._ask(
                prompt_tokens,
                max_tokens,
                selector=None,
                weight_version=None,
                min_weight_version=None,
                max_version_lag=None,
                block_hashes=None,
                exclude=None,
                wait=None,
                priority=0,
            )
            self._plain = ask[2:], timeout
            return ask, timeout
        rest, timeout = self._plain
        # Per request: tuple.__new__ skips the NamedTuple's Python-level __new__, and a
        # concatenation is cheaper than unpacking ``rest``.
        return tuple.__new__(_Ask, (prompt_tokens, max_tokens) + rest), timeout  # noqa: RUF005

    def _ask(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: SelectorLike | None,
        weight_version: Literal["latest"] | None,
        min_weight_version: int | None,
        max_version_lag: int | None,
        block_hashes: Mapping[int, Sequence[int]] | None,
        exclude: Collection[str] | None,
        wait: float | None,
        priority: int,
        session_key: str | bytes | int | None = None,
        engine_id: str | None = None,
        fallback: bool = False,
        split: Split | Mapping[SelectorLike, float] | None = None,
        images: bool = False,
    ) -> tuple[_Ask, float]:
        """The pick's arguments, checked, and how long it may wait for room."""
        # type() is: the common case costs one comparison (bool is an int subclass: refused)
        if type(max_tokens) is not int and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
        ):
            raise TypeError("max_tokens must be an integer")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if block_hashes is not None:
            _check_block_hashes(block_hashes, len(prompt_tokens))
        if type(priority) is not int and (
            isinstance(priority, bool) or not isinstance(priority, int)
        ):
            raise TypeError(f"priority must be an integer, not {type(priority).__name__}")
        if not exclude:
            excluded = _NO_IDS
        elif isinstance(exclude, str):
            raise TypeError("exclude must be a collection of engine ids, not a string")
        else:
            excluded = frozenset(exclude)
        versions = (
            self._versions
            if weight_version is None and min_weight_version is None and max_version_lag is None
            else Versions.of(weight_version, min_weight_version, max_version_lag)
        )
        if wait is None:
            admit = self._admit
            timeout = self._admission.wait if admit else 0.0
        elif 0 <= wait < math.inf:
            admit, timeout = True, wait
        else:
            raise ValueError(f"wait must be >= 0 seconds and finite, got {wait!r}")
        session = None if session_key is None or images else session_hash(session_key)
        if images:
            block_hashes = None  # nothing of the prompt is used: no cache will hold it
        if engine_id is not None and not isinstance(engine_id, str):
            raise TypeError(f"engine_id must be a string, not {type(engine_id).__name__}")
        ask = _Ask(
            prompt_tokens,
            max_tokens,
            selector_of(selector),
            versions,
            block_hashes,
            excluded,
            priority,
            admit,
            session,
            engine_id,
            fallback,
            ALONE,
            split=self._split if split is None else split_of(split),
            policy=self._builtins[RoutingPolicy.LOAD_BALANCED] if images else None,
            images=images,
        )
        return ask, timeout

    def _first_try_locked(self, ask: _Ask, timeout: float) -> tuple[_Ask, PickHandle | None]:
        """Pick at once if there is room; else the pick must wait (it may) with its ask.

        A split's group is drawn here: a waiting pick waits for room in its group.
        """
        self._refresh_locked()
        if self._admission.waiters:
            self._serve_locked()  # those waiting come first
        try:
            if ask.split is not None:
                ask = self._grouped_locked(ask)
            handle = self._try_locked(ask, None)
        except NoEngineAvailableError:
            self._metrics.no_engine()
            raise
        if handle is not None:
            return ask, handle
        queued = len(self._admission.waiters)
        if timeout <= 0 or queued >= self._admission.max_waiting:
            self._metrics.overloaded()
            why = "no wait allowed" if timeout <= 0 else f"{queued} picks wait already"
            raise self._overloaded_locked(ask, 0.0, why)
        return ask, None

    def _grouped_locked(self, ask: _Ask) -> _Ask:
        """Draw the split's group (among those with a candidate); the ask within it."""
        split = ask.split
        assert split is not None
        available = []
        for index, (group, _) in enumerate(split.groups):
            try:
                self._side_locked(ask._replace(selector=ask.selector & group))
            except NoEngineAvailableError:
                self._metrics.split_empty(str(group))  # its share goes to the others
                continue
            available.append(index)
        if not available:
            groups = ", ".join(str(group) for group, _ in split.groups)
            raise NoEngineAvailableError(f"no group of the split has a candidate: {groups}")
        if ask.session is not None:
            index = split.rendezvous(ask.session, available)
        else:
            rotation = self._rotations.get(split)
            if rotation is None:
                if len(self._rotations) >= _MAX_POOLS:
                    self._rotations.clear()
                rotation = self._rotations[split] = Rotation(split)
            index = rotation.next(available)
        group = split.groups[index][0]
        return ask._replace(selector=ask.selector & group, split=None, group=str(group))

    def _queue_locked(
        self,
        ask: _Ask,
        *,
        event: threading.Event | None = None,
        future: asyncio.Future[PickHandle] | None = None,
    ) -> Waiter[PickHandle]:
        self._picker = NO_PICKER  # those waiting come first: no pick passes them by
        key = self._pool_key_locked(ask)
        started = time.monotonic()
        waiter = Waiter(ask, key, ask.priority, started, event=event, future=future)
        self._admission.enqueue(waiter)
        return waiter

    def _outcome(self, waiter: Waiter[PickHandle], started: float) -> PickHandle:
        """A waiting pick's end: its handle, or OverloadedError when its wait ran out."""
        with self._lock:
            self._admission.remove(waiter)
            handle = waiter.handle
            if handle is None:
                error = self._overloaded_locked(
                    waiter.ask, time.monotonic() - started, "its wait ran out"
                )
        if handle is None:
            self._metrics.overloaded()
            raise error
        self._picked(handle)
        return handle

    def _next_wake(self, deadline: float) -> float:
        """Seconds a waiting pick sleeps before it looks again (a fence end, its deadline)."""
        now = time.monotonic()
        wake = deadline
        if self._fences.fenced:
            wake = min(wake, now + _CHECK_EVERY)
        if self._protection.unconfirmed:
            wake = min(wake, now + _CHECK_EVERY)
        return max(0.0, wake - now)

    def _picked(self, handle: PickHandle) -> None:
        self._metrics.picked(handle.policy)
        if self._notices:  # rarely: no call per pick
            self._deliver_notices()

    def _try_locked(
        self, ask: _Ask, started: float | None, among: tuple[Candidate, ...] | None = None
    ) -> PickHandle | None:
        """The engine for ``ask`` now, held; None when admission finds no room.

        ``started``: when a waiting pick began to wait (None: it did not). ``among``: the
        candidates, already filtered (a pair's side within a label), instead of ``ask``'s.
        """
        try:
            pool = self._pool_locked(
                ask.selector, len(ask.prompt_tokens), ask.max_tokens, ask.versions, ask.roles
            )
        except NoEngineAvailableError:
            if ask.pin is not None and not ask.fallback:
                raise self._not_a_candidate_locked(ask) from None
            raise
        candidates = pool.candidates if among is None else among
        if among is None and ask.exclude:
            candidates = tuple(e for e in candidates if e.engine_id not in ask.exclude)
            if not candidates:
                raise NoEngineAvailableError(
                    f"every one of the {len(pool.candidates)} candidate engines is excluded "
                    f"({', '.join(sorted(ask.exclude))})"
                )
        if among is None and ask.only is not None:
            candidates = tuple(e for e in candidates if e.engine_id in ask.only)
            if not candidates:
                raise NoEngineAvailableError(
                    f"none of the {len(pool.candidates)} candidate {'/'.join(ask.roles)} "
                    f"engines is among the {len(ask.only)} that can take it"
                )
        if ask.pin is not None:
            pinned = tuple(e for e in candidates if e.engine_id == ask.pin)
            if pinned:
                return self._pinned_locked(pinned[0], ask, started)
            if not ask.fallback:
                raise self._not_a_candidate_locked(ask)
        policy = self._session_policy if ask.session is not None else ask.policy or pool.policy
        request = tuple.__new__(  # as _plain_ask: no Python-level __new__ per pick
            PickRequest,
            (ask.prompt_tokens, ask.max_tokens, ask.selector, ask.block_hashes, ask.session),
        )
        handle = self._choose_locked(
            policy, candidates, request, ask.admit, ask.priority, started=started
        )
        if handle is not None and ask.group is not None:
            handle.group = ask.group
        return handle

    def _choose_locked(
        self,
        policy: Policy,
        candidates: tuple[Candidate, ...],
        request: PickRequest,
        admit: bool,
        priority: int,
        *,
        started: float | None = None,
    ) -> PickHandle | None:
        """``policy``'s engine among ``candidates`` (one with room if ``admit``), held."""
        choice = policy.choose(candidates, request)
        engine = choice.candidate if isinstance(choice, Choice) else choice
        if policy is self._policy:  # the user's own: check what it answered
            _check_choice(policy, engine, candidates)
        if admit and not self._admission.has_room(engine, priority):
            has_room = self._admission.has_room
            candidates = tuple(e for e in candidates if has_room(e, priority))
            if not candidates:
                return None
            choice = policy.choose(candidates, request)
            engine = choice.candidate if isinstance(choice, Choice) else choice
            if policy is self._policy:
                _check_choice(policy, engine, candidates)
        if isinstance(choice, Choice):
            _, credited, matched = choice
            name = credited or policy.name
        else:
            name, matched = policy.name, 0
        engine._acquire()
        self._held += 1
        if started is None:
            return PickHandle(self, engine, name, matched)
        return PickHandle(self, engine, name, matched, time.monotonic() - started)

    def _pinned_locked(
        self, engine: Candidate, ask: _Ask, started: float | None
    ) -> PickHandle | None:
        """A pick pinned to ``engine`` (a candidate): held, or None while it has no room."""
        if ask.admit and not self._admission.has_room(engine, ask.priority):
            return None
        engine._acquire()
        self._held += 1
        waited = 0.0 if started is None else time.monotonic() - started
        handle = PickHandle(self, engine, _PINNED, 0, waited)
        handle.group = ask.group
        return handle

    def _not_a_candidate_locked(self, ask: _Ask) -> NotACandidateError:
        assert ask.pin is not None
        explanation = self._explain_locked(ask.pin, ask, True)
        return NotACandidateError(
            f"engine {ask.pin} is no candidate ({explanation.reason}): "
            + "; ".join(
                f"{name}: {detail}" for name, ok, detail in explanation.checks if ok is False
            ),
            explanation,
        )

    def _serve_locked(self) -> None:
        """Give room to waiting picks, in their order (a set without room is tried once)."""
        full: set[object] = set()
        for waiter in list(self._admission.waiters):
            if waiter.key in full:
                continue
            try:
                handle = self._try_locked(waiter.ask, waiter.started)
            except NoEngineAvailableError:
                handle = None  # its engines went: it waits on (or times out) as it is
            if handle is None:
                full.add(waiter.key)
                continue
            self._admission.remove(waiter)
            waiter.handle = handle
            if waiter.event is not None:
                waiter.event.set()
            elif waiter.future is not None:
                _resolve(waiter.future, handle)

    def _overloaded_locked(self, ask: _Ask, waited: float, why: str) -> OverloadedError:
        try:
            pool = self._pool_locked(
                ask.selector, len(ask.prompt_tokens), ask.max_tokens, ask.versions, ask.roles
            )
            engines = pool.candidates
        except NoEngineAvailableError:
            engines = ()
        capacity = sum(self._admission.limit(e) for e in engines)
        load = sum(e.load for e in engines)
        queued = len(self._admission.waiters)
        return OverloadedError(
            f"no engine has room: the {len(engines)} candidates run {load} requests of their "
            f"capacity {capacity}"
            + (
                f" (priority {ask.priority}, reserve {self._admission.reserve:.0%})"
                if self._admission.reserve and ask.priority <= 0
                else ""
            )
            + f"; waited {waited:.3f} s ({why}), {queued} picks waiting",
            capacity=capacity,
            load=load,
            waited=waited,
            queued=queued,
        )

    def _pool_key_locked(self, ask: _Ask) -> object:
        return (
            ask.selector,
            self._fit_locked(len(ask.prompt_tokens) + ask.max_tokens),
            ask.versions,
            ask.exclude,
            ask.pin,
            ask.roles,
            ask.only,
        )

    # -- outcomes and notices ----------------------------------------------------------

    def _release(self, handle: PickHandle, failed: bool | None) -> None:
        """Release ``handle`` once; ``failed`` is its outcome (None: unknown)."""
        outcome = ""
        with self._lock:
            if handle._released:
                return
            handle._released = True
            handle._until = self._losses
            engine = handle._engine
            engine._release()
            if engine._listening:  # nothing more to tell it
                engine._listening.pop(handle, None)
            self._held -= 1
            # A handle of an engine that left the table holds a detached Candidate.
            if failed is not None and self._engines.get(engine.engine_id) is engine:
                if failed:
                    outcome = self._failed_locked(engine)
                else:
                    self._fences.succeeded(engine.engine_id)
            if self._admission.waiters:
                self._serve_locked()
        if failed:
            self._metrics.request_failed(outcome)
        if self._notices:  # rarely: no call per release
            self._deliver_notices()

    def _failed_locked(self, engine: Candidate) -> str:
        engine_id = engine.engine_id
        if engine_id in self._protection.unconfirmed:
            self._protection.dead(engine_id, "a request on it failed")
            self._evict_locked(engine, "unconfirmed, and a request on it failed")
            return "evicted"
        outcome = self._fences.failed(engine_id, len(self._engines))
        if outcome == "fenced":
            self._clear_pools_locked()
            self._lose_locked(engine, "fenced: too many requests on it failed in a row")
        return outcome

    def _listen(self, handle: PickHandle, listener: Listener) -> bool:
        """Keep ``listener`` for when ``handle`` is lost; False if it is lost already."""
        with self._lock:
            if loss_of(handle) is not None:
                return False
            if not handle._released:  # a released handle hears nothing more
                self._listen_locked(handle, listener)
            return True

    def _listen_locked(self, handle: PickHandle, listener: Listener) -> None:
        listening = handle._engine._listening
        if listening is None:
            handle._engine._listening = {handle: (listener,)}
        else:  # a dict: a handle's release drops its listeners at once (one per request)
            listening[handle] = (*listening.get(handle, ()), listener)

    def _lose_locked(self, engine: Candidate, reason: str) -> None:
        """Handles held on ``engine`` are lost now (their listeners told after the lock)."""
        self._losses += 1
        engine._losses = [*(engine._losses or ()), (self._losses, reason)]
        listening, engine._listening = engine._listening, None
        for handle, listeners in (listening or {}).items():
            for listener in listeners:
                self._notices.append((handle, listener, reason))

    def _deliver_notices(self) -> None:
        """Tell lost handles' listeners, outside the lock (callbacks on the event thread)."""
        if not self._notices:
            return
        with self._lock:
            notices, self._notices = self._notices, []
        dispatcher = self._table.store.dispatcher
        for handle, listener, reason in notices:
            if isinstance(listener, asyncio.Future):
                _resolve(listener, reason)
            else:
                dispatcher.submit(listener, handle)

    def _watching(self) -> bool:
        """Whether a batch must be looked at now, not at the next pick."""
        return bool(self._held or self._admission.waiters or self._protection.unconfirmed)

    def _process(self) -> None:
        """Catch up now (a batch, a relayed load, a fence end): serve waiters, tell handles."""
        with self._lock:
            self._refresh_locked()
            if self._admission.waiters:
                self._serve_locked()
        self._deliver_notices()

    def _load_changed(self) -> None:
        """The states' thread: some engine's relayed load or freshness changed."""
        if self._admission.waiters or self._protection.unconfirmed:
            self._process()

    # -- table changes -----------------------------------------------------------------

    def _refresh_locked(self) -> None:
        """Catch up with the table, fences that ran out and what relays report."""
        snapshot = self._table.snapshot()
        if snapshot is not self._snapshot:
            # A snapshot is published before its batch reaches the sink: synced before its
            # batch is read, a ready engine's removal would skip the loss protection.
            snapshot = self._table.store.settled_snapshot()
        if self._batches:
            self._take_batches_locked(snapshot)
        changes = self._load_changes
        if changes:  # what other routers hold: only the engines whose figure changed
            while changes:
                engine = self._engines.get(changes.popleft())
                if engine is not None:
                    engine._set_others(*self._share(engine.engine_id))
                    if engine.engine_id in self._protection.unconfirmed:
                        self._next_check = 0.0  # its relay spoke (or went silent)
        if self._protection.unconfirmed and self._fences.now() >= self._next_check:
            self._check_unconfirmed_locked()  # before the sync: an eviction rebuilds
        if snapshot is not self._snapshot:
            self._sync_locked(snapshot)
        if self._fences.fenced and self._fences.expire():  # the first: no call per pick
            self._clear_pools_locked()
        if self._picker.snapshot is not snapshot:
            self._picker = self._picker_locked(snapshot)

    def _picker_locked(self, snapshot: RoutingSnapshot) -> Picker:
        """The picker of this state; NO_PICKER while something else decides picks."""
        if (
            self._fences.fenced
            or self._protection.unconfirmed
            or self._admission.waiters
            or self._split is not None
            or self._snapshot is not snapshot
        ):
            return NO_PICKER
        try:
            pool = self._pool_locked(_EVERYTHING, 0, 0, self._versions)
        except NoEngineAvailableError:
            return NO_PICKER  # the full path says why
        if self._tally.candidates is not pool.candidates:
            self._tally.detach()
            self._tally = tally(pool.candidates)
        return Picker(snapshot, pool.candidates, pool.policy, self._min_context, self._admit)

    def _clear_pools_locked(self) -> None:
        """The candidate sets changed (fences, engines): derive them again."""
        self._pools.clear()
        self._picker = NO_PICKER

    def _resync_locked(self) -> None:
        """Rebuild from the table at the next look, though its snapshot is the same."""
        self._snapshot = None
        self._picker = NO_PICKER

    def _take_batches_locked(self, snapshot: RoutingSnapshot) -> None:
        """Read the batches ``snapshot`` includes: removals, returns, statuses that lose."""
        batches = self._batches
        while batches and batches[0][0][0].revision <= snapshot.revision:
            batch, _ = batches.popleft()
            unannounced: list[tuple[str, Candidate]] = []  # ready records that just went
            for event in batch:
                engine_id = event.engine_id
                engine = self._engines.get(engine_id)
                if event.type is not EventType.REMOVED:
                    if self._protection.back(engine_id):
                        self._unhold_locked(engine_id)
                        self._resync_locked()  # an ordinary engine again: rebuild
                    if engine is not None and event.record.status in _LOST_STATUSES:
                        self._lose_locked(engine, _LOST_STATUSES[event.record.status])
                elif engine is not None:  # else never a candidate here (labels), or gone
                    if event.record.status is EngineStatus.READY:
                        unannounced.append((engine_id, engine))
                    else:
                        self._lose_locked(engine, "removed: its record is gone")
            if unannounced:
                self._lost_locked(unannounced, snapshot)

    def _lost_locked(self, engines: list[tuple[str, Candidate]], snapshot: RoutingSnapshot) -> None:
        """Ready engines whose records went unannounced: kept unconfirmed, or evicted."""
        ready = sum(
            r.status is EngineStatus.READY and self._selector.matches(r.labels)
            for r in snapshot.values()
        )
        kept = self._protection.lost(engines, ready)
        if not kept:
            for _, engine in engines:
                self._lose_locked(engine, "removed: its record is gone")
            return
        self._metrics.unconfirmed(len(kept))
        for engine in kept:
            self._hold_locked(engine)
        self._resync_locked()

    def _check_unconfirmed_locked(self) -> None:
        """Evict unconfirmed engines that are dead by their relay, or kept for ``grace``."""
        self._next_check = self._fences.now() + _CHECK_EVERY
        states = self._states
        for engine_id, candidate in list(self._protection.kept()):
            if states is not None and candidate.record.state_address and states.silent(engine_id):
                self._protection.dead(engine_id, "its state relay went silent or said goodbye")
                self._evict_locked(candidate, "unconfirmed, and its state relay went silent")
        for candidate in self._protection.expired():
            self._evict_locked(candidate, "unconfirmed for longer than protect_grace")

    def _evict_locked(self, engine: Candidate, reason: str) -> None:
        """An unconfirmed engine goes: its handles are lost, the candidates rebuilt."""
        self._unhold_locked(engine.engine_id)
        self._lose_locked(engine, reason)
        self._resync_locked()

    def _hold_locked(self, engine: Candidate) -> None:
        if self._states is not None and engine.record.state_address:
            self._states.hold(engine.engine_id, engine.record.state_address)

    def _unhold_locked(self, engine_id: str) -> None:
        if self._states is not None:
            engine = self._engines.get(engine_id)
            if engine is not None and engine.record.state_address:
                self._states.unhold(engine_id)

    def _sync_locked(self, snapshot: RoutingSnapshot) -> None:
        """Rebuild the derived state for a new table snapshot (and the unconfirmed engines)."""
        engines: dict[str, Candidate] = {}
        for engine_id, record in snapshot.items():
            if not self._selector.matches(record.labels):
                continue
            engine = self._engines.get(engine_id)
            if engine is None:
                engine = Candidate(record)
                if self._states is not None:
                    engine._set_others(*self._share(engine_id))
                self._note_policy_locked(record, None)
            elif engine.record is not record:
                if record.endpoint.capabilities.kv_cache_block_size != engine.block_size:
                    self._forget_locked(engine_id)  # its hashes no longer describe its blocks
                self._note_policy_locked(record, engine.record)
                engine._update(record)  # keeps its in-flight count
            engines[engine_id] = engine
        for engine_id, engine in self._protection.kept():
            engines.setdefault(engine_id, engine)
        for engine_id in self._engines.keys() - engines.keys():
            # Its handles still release, into the now detached Candidate they hold.
            self._forget_locked(engine_id)
            self._fences.forget(engine_id)
            self._admission.forget(engine_id)
        # Engines of other statuses stay known (their in-flight counts) but are no candidates.
        candidates = (e for e in engines.values() if e.record.status in self._statuses)
        ordered = sorted(candidates, key=lambda e: (-e.context_length, e.engine_id))
        self._engines = engines
        self._ordered = tuple(ordered)
        self._roles = any(e.record.role is not EngineRole.AGGREGATED for e in ordered)
        self._neg_context = [-e.context_length for e in ordered]
        self._min_context = ordered[-1].context_length if ordered else 0
        self._clear_pools_locked()
        self._snapshot = snapshot

    def _note_policy_locked(self, record: EngineRecord, before: EngineRecord | None) -> None:
        """Log (once per value) and count an engine advertising a policy we do not know."""
        unknown = unknown_policy(record)
        if unknown is None or (before is not None and unknown_policy(before) == unknown):
            return
        self._metrics.unknown_policy()
        self._warn_once(
            ("policy", unknown),
            "engine %s advertises prefix_caching_coordinator_policy %r, which this version "
            "does not know: auto routes it as load_balanced (logged once per value)",
            record.engine_id,
            unknown,
        )

    def _share(self, engine_id: str) -> tuple[int, int, int]:
        """What other routers hold, how many report, our rank (0, 1, 0 without state)."""
        assert self._states is not None
        return self._states.share(engine_id) or (0, 1, 0)

    def _forget_locked(self, engine_id: str) -> None:
        for policy in self._builtins.values():
            policy.forget(engine_id)
        if isinstance(self._policy, Policy):
            self._policy.forget(engine_id)

    # -- candidates --------------------------------------------------------------------

    def _fit_locked(self, need: int) -> int:
        """How many of the ordered candidates fit ``need`` tokens (they are a prefix)."""
        if need <= self._min_context:
            return len(self._ordered)
        return bisect.bisect_right(self._neg_context, -need)

    def _pool_locked(
        self,
        selector: Selector,
        prompt_len: int,
        max_tokens: int,
        versions: Versions = NO_VERSIONS,
        roles: frozenset[EngineRole] = ALONE,
    ) -> Pool:
        """The candidates of one pick: every filter runs here (role, fit, labels, versions...)."""
        need = prompt_len + max_tokens
        # Most requests fit every engine: no call (this runs per pick).
        fit = len(self._ordered) if need <= self._min_context else self._fit_locked(need)
        key = (selector, fit, versions, roles)
        pool = self._pools.get(key)
        if pool is None:
            engines = self._ordered[:fit]
            if roles is not ALONE or self._roles:  # else every engine serves alone
                engines = tuple(e for e in engines if e.record.role in roles)
            if selector:
                engines = tuple(e for e in engines if selector.matches(e.record.labels))
            if not engines:
                raise self._no_engine_locked(selector, prompt_len, max_tokens, roles)
            if versions is not NO_VERSIONS:
                engines = by_version(engines, versions)
            engines = self._unfenced_locked(engines, key)
            if len(self._pools) >= _MAX_POOLS:
                self._clear_pools_locked()
            pool = self._pools[key] = Pool(engines, self._resolve_locked(engines))
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
        self,
        selector: Selector,
        prompt_len: int,
        max_tokens: int,
        roles: frozenset[EngineRole] = ALONE,
    ) -> NoEngineAvailableError:
        total = len(self._snapshot or ())
        if not total and not self._engines:
            return NoEngineAvailableError(
                "the routing table is empty: no engine is registered in its namespace, or "
                "the table has not been started"
            )
        if not self._engines:
            return NoEngineAvailableError(
                f"none of the {total} engines in the table matches the router's selector "
                f"'{self._selector}'"
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
        playing = [e for e in self._ordered if e.record.role in roles]
        if not playing:
            by_role = Counter(str(engine.record.role) for engine in self._ordered)
            wanted = " or ".join(sorted(map(str, roles)))
            return NoEngineAvailableError(
                f"none of the {len(self._ordered)} candidate engines is {wanted} "
                f"({', '.join(f'{n} {role}' for role, n in sorted(by_role.items()))})"
                + ("; a decode engine takes requests only from pick_pair" if roles == ALONE else "")
            )
        matching = [e for e in playing if selector.matches(e.record.labels)]
        if not matching:
            return NoEngineAvailableError(
                f"none of the {len(self._engines)} engines the router sees matches the "
                f"selector '{selector}'"
            )
        return NoEngineAvailableError(
            f"no engine fits {prompt_len + max_tokens} tokens (prompt {prompt_len} + "
            f"max_tokens {max_tokens}): the largest context_length among the "
            f"{len(matching)} matching engines is {matching[0].context_length}"
        )

    def _explain_locked(self, engine_id: str, ask: _Ask, with_request: bool) -> Explanation:
        """Run a pick's filters on one engine, in the pick's order (see ``explain``)."""
        checks: list[tuple[str, bool | None, str]] = []

        def verdict(candidate: bool, reason: str) -> Explanation:
            return Explanation(engine_id, candidate, reason, tuple(checks))

        engine = self._engines.get(engine_id)
        if engine is None:
            record = self._snapshot.get(engine_id) if self._snapshot is not None else None
            if record is None:
                checks.append(("table", False, "not in the routing table"))
                return verdict(False, "absent")
            checks.append(("table", True, "in the routing table"))
            unmet = self._selector.unmet(record.labels)
            checks.append(
                ("labels", False, f"fails '{unmet}' of the router's selector '{self._selector}'")
            )
            return verdict(False, "labels")
        ages = self._protection.ages()
        unconfirmed = ages.get(engine_id)
        checks.append(
            (
                "table",
                True,
                "in the routing table"
                if unconfirmed is None
                else f"unconfirmed: its record went {unconfirmed:.1f} s ago in a mass lease "
                "loss, kept routable until it comes back or the engine is seen dead",
            )
        )
        checks.append(
            (
                "labels",
                True,
                f"matches the router's selector '{self._selector}'"
                if self._selector
                else "the router has no selector",
            )
        )
        status = engine.record.status
        if status not in self._statuses:
            checks.append(
                ("status", False, f"{status}; candidates are {', '.join(sorted(self._statuses))}")
            )
            return verdict(False, status.value if isinstance(status, EngineStatus) else "status")
        checks.append(("status", True, str(status)))
        reason = self._explain_request_locked(engine, ask, with_request, checks)
        if reason is None:
            reason = self._explain_pool_locked(engine, ask, checks)
        if reason is not None:
            return verdict(False, reason)
        return verdict(True, "candidate" if unconfirmed is None else "unconfirmed")

    def _explain_request_locked(
        self,
        engine: Candidate,
        ask: _Ask,
        with_request: bool,
        checks: list[tuple[str, bool | None, str]],
    ) -> str | None:
        """The filters of the request itself: fit, selector, exclude; the failing one."""
        need = len(ask.prompt_tokens) + ask.max_tokens
        if with_request:
            fits = engine.context_length >= need
            checks.append(("fit", fits, f"context_length {engine.context_length}, needs {need}"))
            if not fits:
                return "fit"
        else:
            checks.append(("fit", None, "no request given"))
        if ask.selector:
            unmet = ask.selector.unmet(engine.record.labels)
            checks.append(
                (
                    "selector",
                    unmet is None,
                    f"'{ask.selector}'" + ("" if unmet is None else f": its labels fail '{unmet}'"),
                )
            )
            if unmet is not None:
                return "selector"
        else:
            checks.append(("selector", None, "none given"))
        if engine.engine_id in ask.exclude:
            checks.append(("exclude", False, "excluded by the pick"))
            return "excluded"
        checks.append(("exclude", None if not ask.exclude else True, "not excluded"))
        return None

    def _explain_pool_locked(
        self, engine: Candidate, ask: _Ask, checks: list[tuple[str, bool | None, str]]
    ) -> str | None:
        """The filters over the candidate set: version, fencing, capacity; the failing one."""
        need = len(ask.prompt_tokens) + ask.max_tokens
        engines = tuple(
            e
            for e in self._ordered[: self._fit_locked(need)]
            if ask.selector.matches(e.record.labels)
        )
        if ask.versions is not NO_VERSIONS:
            try:
                engines = by_version(engines, ask.versions)
            except NoEngineAvailableError:
                engines = ()
            kept = engine in engines
            checks.append(
                (
                    "version",
                    kept,
                    f"weight_version {engine.record.weight_version}; the candidates are on "
                    f"{versions_present(self._ordered)}",
                )
            )
            if not kept:
                return "version"
        else:
            checks.append(("version", None, "no version filter"))
        fence = self._fences.fenced.get(engine.engine_id)
        if fence is not None:
            applied = engine not in self._unfenced_locked(engines, ("explain",))
            left = fence - self._fences.now()
            note = "" if applied else " (ignored: too many candidates are fenced)"
            checks.append(("fencing", not applied, f"fenced for {left:.1f} s more{note}"))
            if applied:
                return "fenced"
        else:
            failures = self._fences.failures().get(engine.engine_id, 0)
            checks.append(("fencing", True, f"not fenced ({failures} failures in a row)"))
        detail = f"load {engine.load} of capacity {self._admission.limit(engine)}"
        if engine.routers > 1:
            detail += f", this router's share 1/{engine.routers} ({engine.in_flight} held)"
        if ask.admit:
            room = self._admission.has_room(engine, ask.priority)
            checks.append(("capacity", room, detail))
            if not room:
                return "capacity"
        else:
            checks.append(("capacity", None, f"{detail} (admission off)"))
        states = self._states
        if states is not None and engine.record.state_address:
            fresh = states.share(engine.engine_id) is not None
            checks.append(
                (
                    "state",
                    True,
                    "its relayed state is fresh"
                    if fresh
                    else "its relayed state is stale or unsynced: scored from this "
                    "router's own estimate",
                )
            )
        else:
            checks.append(("state", None, "no state relay"))
        return None

    def _resolve_locked(self, engines: tuple[Candidate, ...]) -> Policy:
        """The policy a pool is routed with; ``auto`` logs a mix once."""
        if isinstance(self._policy, Policy):
            return self._policy
        if self._policy is not RoutingPolicy.AUTO:
            return self._builtins[self._policy]
        groups: dict[str, int] = {}
        for e in engines:
            name = e.advertised.value
            if e.advertised in _CACHE_AFFINE:
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


def _resolve(future: asyncio.Future[T], value: T) -> None:
    """Set ``future``'s result from any thread (its loop may have closed: then nothing)."""

    def settle() -> None:
        if not future.done():
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        future.get_loop().call_soon_threadsafe(settle)


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
