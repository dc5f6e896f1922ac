"""Client-side routing over the live table: pick one engine per request (``Router``).

``Router`` is the facade: its options, ``pick`` and ``apick``, and its public reads
(``engines``, ``in_flight``, ``health``). A pick with no per-call option reads the
picker of the current table state (``discovery._routing.picker``) right here, in
``Router.pick``; every other pick takes the full path. The router is built in layers,
each in its own module and each above the one it builds on:

- ``discovery._routing.pools``: a pick's ask and its candidate sets, every filter in one
  place (status, fit, labels, weight versions, fencing) and the policy that routes them;
- ``discovery._routing.view``: the engines the router sees, kept current with its table
  (mass lease loss protection), and handles told when their engine is lost;
- ``discovery._routing.explain``: why an engine is or is not a candidate (``explain``,
  ``reasons``);
- ``discovery._routing.full_path``: one pick through every option, waiting for room
  (admission), and the handles' release;
- ``discovery._routing.pairs``: prefill/decode pairs (``pick_pair``).

Each module's docstring says what its layer decides.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._reads.table import RoutingTable
from discovery._records.record import EngineRecord, EngineStatus, validate_status
from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._routing.admission import DEFAULT_MAX_WAITING, Admission, Capacity
from discovery._routing.explain import Explanation
from discovery._routing.fencing import (
    DEFAULT_FENCE_AFTER,
    DEFAULT_FENCE_MAX_SECONDS,
    DEFAULT_FENCE_SECONDS,
    DEFAULT_MAX_FENCED_SHARE,
    FenceBook,
)
from discovery._routing.full_path import TableSink
from discovery._routing.handles import PickHandle, PickPair
from discovery._routing.pairs import HandoffKeys, PairPicker
from discovery._routing.picker import NO_PICKER, Versions
from discovery._routing.policies import (
    DEFAULT_INDEX_BLOCKS,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_GAP,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_SESSION_LOAD_FACTOR,
    FirstPrefixBlockPolicy,
    KvAwarePolicy,
    LoadBalancedPolicy,
    LongestPrefixPolicy,
    PickRequest,
    Policy,
    RoundRobinPolicy,
    RoutingPolicy,
    SessionPolicy,
    tally,
)
from discovery._routing.pools import EVERYTHING, check_block_hashes, policy_argument
from discovery._routing.protection import (
    DEFAULT_GRACE,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW,
    LossProtection,
)
from discovery._routing.split import Split, split_of

if TYPE_CHECKING:
    from discovery._state.engine_states import EngineStates

__all__ = ["Explanation", "PickHandle", "PickPair", "Router", "RouterHealth"]

_NO_AGES: Mapping[str, float] = MappingProxyType({})


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


class Router(PairPicker):
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
        self._policy = policy_argument(policy)
        if self._policy is RoutingPolicy.KV_AWARE and states is None:
            raise ValueError("kv_aware routes on what the engines report: give states=")
        self._versions = Versions.of(weight_version, min_weight_version, max_version_lag)
        self._builtins = {
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
        self._rotations = {}
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
        self._protection = LossProtection(
            threshold=protect_threshold, window=protect_window, grace=protect_grace, clock=clock
        )
        self._states = states
        self._handoff_keys = HandoffKeys()
        self._pairings = {}
        self._viable = {}
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
        self._counting = metrics is not None
        self._selector = selector_of(selector)
        self._statuses = frozenset(validate_status(status) for status in statuses)
        self._lock = threading.Lock()
        self._snapshot = None
        self._engines = {}
        self._ordered = ()
        self._roles = False
        self._neg_context = []
        self._min_context = 0
        self._pools = {}
        self._picker = NO_PICKER
        self._tally = tally(())
        self._warned = set()
        self._held = 0
        self._losses = 0
        self._next_check = 0.0
        self._notices = []
        self._batches = collections.deque()
        self._plain = None
        weakref.finalize(self, table.store.add_sink(TableSink(self), replay=False))
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
                check_block_hashes(block_hashes, len(prompt_tokens))
            with self._lock:
                picker = self._picker
                handle = (
                    self._choose_locked(
                        picker.policy,
                        picker.candidates,
                        tuple.__new__(  # as _plain_ask: no Python-level __new__ per pick
                            PickRequest,
                            (prompt_tokens, max_tokens, EVERYTHING, block_hashes, None),
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
