"""The engines a router sees, kept current with its table; handles told when theirs is lost.

A ``Router`` reads ``RoutingTable.snapshot()`` on every pick (a cached immutable view,
rebuilt only when the table changed) and rebuilds its own derived state when that view
changes (``TableView._refresh_locked``). So a pick that starts after the table applied a
batch sees that batch: an engine the table dropped is never picked again, by any policy.
Picks never touch etcd and never block on I/O; ``pick()`` and ``release()`` are
thread-safe (one lock) and cheap enough to call from an asyncio event loop. The batches
themselves are read too, in order (``_take_batches_locked``): they say which engines were
removed, came back or turned to a status that loses their handles.

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
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

from discovery._errors import NoEngineAvailableError
from discovery._reads.store import EventType, RoutingSnapshot
from discovery._records.handoff import EngineRole
from discovery._records.record import EngineRecord, EngineStatus
from discovery._routing.handles import Listener, PickHandle, loss_of
from discovery._routing.picker import NO_PICKER, Picker
from discovery._routing.policies import Candidate, Policy, tally, unknown_policy
from discovery._routing.pools import EVERYTHING, Pools

__all__ = ["CHECK_EVERY", "TableView", "resolve_future"]

T = TypeVar("T")

_LOST_STATUSES = {
    EngineStatus.STALLED: "stalled: its launcher stopped hearing from it",
    EngineStatus.STOPPING: "stopping: its engine exited or it is being deregistered",
}
CHECK_EVERY = 0.1  # seconds between a pick's look at unconfirmed engines' evidence


class TableView(Pools):
    """The router following its table: derived state, unconfirmed engines, lost handles."""

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
            pool = self._pool_locked(EVERYTHING, 0, 0, self._versions)
        except NoEngineAvailableError:
            return NO_PICKER  # the full path says why
        if self._tally.candidates is not pool.candidates:
            self._tally.detach()
            self._tally = tally(pool.candidates)
        return Picker(snapshot, pool.candidates, pool.policy, self._min_context, self._admit)

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
        self._next_check = self._fences.now() + CHECK_EVERY
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
                resolve_future(listener, reason)
            else:
                dispatcher.submit(listener, handle)


def resolve_future(future: asyncio.Future[T], value: T) -> None:
    """Set ``future``'s result from any thread (its loop may have closed: then nothing)."""

    def settle() -> None:
        if not future.done():
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        future.get_loop().call_soon_threadsafe(settle)
