"""The router's full path: one pick through every filter, its wait for room, its release.

A pick with no per-call option reads the router's picker (``discovery._routing.picker``);
every other pick, and a pick whose picker is not current, takes this path: the ask's
candidate set (``discovery._routing.pools``), a split's group drawn, exclusions, a pin,
the policy's choice, admission, and the handle held. It also releases handles (their
outcome feeds fencing and loss protection) and serves the picks waiting for room
whenever the router catches up (``_process``: a table batch, a relayed load, a fence end).

**Admission** (``discovery._routing.admission``; off unless the router or the pick gives
``wait`` or the router ``capacity``): an engine at capacity (``max_num_seqs x
logical_data_parallel_size`` by default, on the shared load view, within this router's
share of it when several routers report to its relay) is no candidate. When no candidate
has room the pick waits, highest ``priority`` first then first come, up to ``wait``
seconds in a queue of ``max_waiting``, and raises ``OverloadedError`` past either bound.
``reserve`` keeps the top share of each engine for picks of priority 1 or more.
``apick`` is the same pick for asyncio: it waits without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

from discovery._errors import NoEngineAvailableError, OverloadedError
from discovery._reads.store import Batch
from discovery._routing.admission import Waiter
from discovery._routing.explain import Explainer
from discovery._routing.handles import Listener, PickHandle
from discovery._routing.picker import NO_PICKER
from discovery._routing.policies import Candidate, Choice, PickRequest, Policy
from discovery._routing.pools import MAX_POOLS, Ask
from discovery._routing.split import Rotation, Split
from discovery._routing.view import CHECK_EVERY, resolve_future

__all__ = ["FullPath"]

_PINNED = "pinned"  # the policy a pinned pick is credited to


class TableSink:
    """The router's sink on the table's store: batches, kept in order with their time.

    Called under the store's lock: it only queues, and wakes the router on the store's
    event thread when someone waits on what the batch may say.
    """

    def __init__(self, router: FullPath) -> None:
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


def _process(ref: weakref.ref[FullPath]) -> None:
    router = ref()
    if router is not None:
        router._process()


class FullPath(Explainer):
    """The router's full path of a pick, and its handles' release."""

    _session_policy: Policy  # a session key's policy, whatever the router's
    _rotations: dict[Split, Rotation]  # a split's rotation of its groups

    def _pick_ask(self, ask: Ask, timeout: float) -> PickHandle:
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

    def _pick_now(self, ask: Ask, timeout: float, listener: Listener) -> PickHandle | None:
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

    def _first_try_locked(self, ask: Ask, timeout: float) -> tuple[Ask, PickHandle | None]:
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

    def _grouped_locked(self, ask: Ask) -> Ask:
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
                if len(self._rotations) >= MAX_POOLS:
                    self._rotations.clear()
                rotation = self._rotations[split] = Rotation(split)
            index = rotation.next(available)
        group = split.groups[index][0]
        return ask._replace(selector=ask.selector & group, split=None, group=str(group))

    def _queue_locked(
        self,
        ask: Ask,
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
            wake = min(wake, now + CHECK_EVERY)
        if self._protection.unconfirmed:
            wake = min(wake, now + CHECK_EVERY)
        return max(0.0, wake - now)

    def _picked(self, handle: PickHandle) -> None:
        self._metrics.picked(handle.policy)
        if self._notices:  # rarely: no call per pick
            self._deliver_notices()

    def _try_locked(
        self, ask: Ask, started: float | None, among: tuple[Candidate, ...] | None = None
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
        self, engine: Candidate, ask: Ask, started: float | None
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
                resolve_future(waiter.future, handle)

    def _overloaded_locked(self, ask: Ask, waited: float, why: str) -> OverloadedError:
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

    def _pool_key_locked(self, ask: Ask) -> object:
        return (
            ask.selector,
            self._fit_locked(len(ask.prompt_tokens) + ask.max_tokens),
            ask.versions,
            ask.exclude,
            ask.pin,
            ask.roles,
            ask.only,
        )

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


def _check_choice(policy: Policy, engine: object, candidates: tuple[Candidate, ...]) -> None:
    """A policy of the user's must answer with one of the candidates it was given."""
    if not any(engine is c for c in candidates):
        raise TypeError(
            f"policy {policy.name!r} returned {engine!r}, not one of the {len(candidates)} "
            "candidates it was given (return a Candidate, or a Choice of one)"
        )
