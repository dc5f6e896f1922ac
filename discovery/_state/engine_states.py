"""A router's view of what its engines report: cached blocks and load, relayed live.

``EngineStates(table)`` follows a ``RoutingTable``: for every engine whose record carries
a ``state_address`` (its launcher's state relay, ``_state/relay.py``) it keeps a subscription
and the engine's current block set and load. What a policy may rely on:

* **Never a ghost.** An engine's state goes when the table removes the engine (or its
  record stops advertising a relay): in the same step, under the table's own lock, so no
  snapshot without the engine is ever read beside its state; its subscription closes
  soon after.
* **Exact or marked unsynced.** A snapshot replaces the state; each increment must carry
  the next sequence number of the same epoch. A gap (a frame dropped on the way, a
  subscriber that fell behind), a new epoch (the launcher restarted) or a tick ahead of
  what was received marks the state unsynced and asks for a snapshot. ``cached_prefix``
  answers None for an engine whose state is unsynced or older than ``stale_after``
  (default 3 heartbeats): the caller falls back to its own estimate. ``fresh_view()``
  maps every engine whose state is synced and fresh to its block set, in one call (what
  ``kv_aware`` reads per pick): the same mapping object until an engine turns synced,
  unsynced, stale or fresh again, or the engines change.
* **Age.** ``state(engine_id).age`` is the time since its relay last said anything (it
  ticks every second); health and metrics carry it.
* **Shared load.** With ``load=`` (this router's requests in flight per engine), each
  engine's relay gets this router's count when it changes (at most every
  ``report_interval``, 50 ms) and every heartbeat; the relay sums every router's report.
  ``others(engine_id)`` is what the other routers hold there (the engine's own count, when
  it reports one, minus ours): a router adds it to its own handles for one load view
  across routers. ``load_changes()`` names the engines whose ``others`` changed, so a
  router updates only those (and its ``notify`` wakes the router's waiting picks).
* **Goodbye.** A relay whose launcher stops (its engine exited) says ``bye``: the state
  is stale at once, without waiting for ``stale_after``. ``silent(engine_id)`` says
  whether a followed engine's relay said goodbye or has been quiet past ``stale_after``.
* **Held engines.** A router keeping an engine routable after its record went (an
  ``unconfirmed`` engine, ``_routing/protection.py``) asks ``hold(engine_id, address)``: its relay
  is followed although the table no longer holds it, until ``unhold``. Its silence is
  the router's evidence that the engine is dead.

One thread (``discovery-engine-states``) owns every socket; reads (``cached_prefix``,
``fresh_view``, ``state``) take no lock: each engine's block set is swapped whole on a
snapshot and changed by single set operations, which CPython applies atomically. Usable
from threads and from asyncio (reads never block; ``await_synced`` waits without blocking
the loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from discovery._errors import ClosedError
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._reads.store import Batch, EventType
from discovery._state.kvstate import Holders, unpack_hashes
from discovery._state.relay import HEARTBEAT, LOAD_INTERVAL

if TYPE_CHECKING:
    import zmq

    from discovery._reads.table import RoutingTable

__all__ = ["EngineState", "EngineStates", "EngineStatesHealth"]

log = logging.getLogger(__name__)

REPORT_INTERVAL = LOAD_INTERVAL / 2  # this router's count, when it changed, to each relay
_MAX_FRAME = 64 << 20  # a snapshot of 8 million blocks; beyond that a relay is broken
_NO_LOAD: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class EngineState:
    """What one engine reports, as this router last heard it."""

    engine_id: str
    address: str
    """Its launcher's state relay."""
    synced: bool
    """Whether the state holds a snapshot and every increment since (else it is resyncing)."""
    age: float
    """Seconds since the relay last said anything (it ticks every second)."""
    epoch: int
    seq: int
    blocks: frozenset[int]
    """The block hashes the engine caches (Megatron's hash; see ``_state/blockhash.py``)."""
    load: Mapping[str, Any]
    """``in_flight`` (summed over the routers that report), ``routers``, ``engine``."""
    gone: bool = False
    """The relay said goodbye: its launcher stopped (the engine exited)."""


@dataclass(frozen=True)
class EngineStatesHealth:
    """A point-in-time view of an ``EngineStates``."""

    engines: int
    """Engines with a state relay in the table."""
    synced: int
    """Of those, the ones whose state is synced and fresh."""
    resyncs: Mapping[str, int]
    """Snapshots asked for, by reason: ``start``, ``gap``, ``epoch``."""
    oldest: float
    """The largest age among the engines' states, seconds (0 when none)."""
    blocks: int
    """Block hashes held, over every engine."""


def _unsent(message: Any) -> bytes:
    """The packer of a state fed by hand: it has no relay to send requests to."""
    return b""


class _Sink:
    """The store's sink that hands each batch to the follower (see ``_store.Sink``)."""

    def __init__(self, follow: Callable[[Batch], None]) -> None:
        self.deliver = follow

    def close(self) -> None:
        """The store closed: its engines' states stay until ``stop()``."""


@dataclass(eq=False)
class _Follow:
    """One engine's subscription and state (changed on the follower's thread only)."""

    engine_id: str
    address: str
    blocks: set[int] = field(default_factory=set)
    load: Mapping[str, Any] = field(default_factory=lambda: _NO_LOAD)
    others: int = 0  # what the other routers (or the engine's own count) add to ours
    routers: int = 1  # routers reporting to the relay, ours included
    rank: int = 0  # our place among them (the relay's order)
    reported: int = -1  # the count last reported to the relay (-1: none yet)
    fresh: bool = False  # synced and heard from within stale_after, as last told
    epoch: int = 0
    seq: int = 0
    synced: bool = False
    heard: float = field(default_factory=time.monotonic)
    asked: float = 0.0  # when a snapshot was last asked for
    gone: bool = False  # the relay said goodbye (its launcher stopped)
    socket: Any = None


class EngineStates:
    """Follows ``table``'s engines' state relays (see the module docs).

    ``load`` (and every ``Router`` built with ``states=`` this object, which adds its own
    ``in_flight``) gives this process's in-flight requests per engine id: read every
    ``report_interval`` (so it must be cheap) and reported to each engine's relay, which
    sums the reports of every router. ``metrics`` exports ages, resyncs and blocks.
    ``start()`` (or ``with``) begins following; ``stop()`` closes every subscription.
    """

    def __init__(
        self,
        table: RoutingTable,
        *,
        stale_after: float = 3 * HEARTBEAT,
        heartbeat: float = HEARTBEAT,
        load: Callable[[], Mapping[str, int]] | None = None,
        report_interval: float = REPORT_INTERVAL,
        metrics: MetricsHooks | None = None,
    ) -> None:
        self._table = table
        self.stale_after = stale_after
        """Seconds without a word from a relay after which its engine's state is stale."""
        self._heartbeat = heartbeat
        self._load_sources: list[Callable[[], Callable[[], Mapping[str, int]] | None]] = []
        if load is not None:
            self._load_sources.append(lambda: load)
        self._report_interval = report_interval
        self._watchers: list[collections.deque[str]] = []  # load_changes() subscribers
        self._notifiers: list[Callable[[], None]] = []  # their wake-ups
        self._held: dict[str, int] = {}  # engine id -> holds (routers keeping it unconfirmed)
        self._metrics = metrics or NO_METRICS
        self._lock = threading.Lock()
        self._follows: dict[str, _Follow] = {}  # replaced whole under the lock: reads free
        # fresh_view(): bumped after any change of which engines are synced and fresh (or of
        # a block set's identity); the view kept is (version, stale_after, deadline, view).
        self._version = 0
        self._view: tuple[int, float, float, Mapping[str, Container[int]]] | None = None
        self._holders = Holders()  # who holds the first blocks picks asked about
        self._resyncs: dict[str, int] = {"start": 0, "gap": 0, "epoch": 0}
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._stopping = False
        self._unsubscribe: Callable[[], None] | None = None
        self._changed = threading.Condition(self._lock)
        self._metrics.observe_engine_states(self)

    # -- reads (any thread) ------------------------------------------------------------------

    def add_load_source(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Report ``source()``'s in-flight counts too (a bound method is held weakly).

        ``Router(table, states=...)`` adds its own ``in_flight``.
        """
        if inspect.ismethod(source):
            self._load_sources.append(weakref.WeakMethod(source))
        else:
            self._load_sources.append(lambda: source)

    def _loads(self) -> dict[str, int] | None:
        """The in-flight counts of every load source, summed; None without a source."""
        if not self._load_sources:
            return None
        total: dict[str, int] = {}
        for reference in self._load_sources:
            source = reference()
            if source is not None:
                for engine_id, count in source().items():
                    total[engine_id] = total.get(engine_id, 0) + count
        return total

    def _fresh(self, engine_id: str) -> _Follow | None:
        """The engine's follow if its state is synced and heard from within stale_after."""
        follow = self._follows.get(engine_id)
        if follow is None or not follow.synced:
            return None
        if time.monotonic() - follow.heard > self.stale_after:
            return None
        return follow

    def cached_prefix(self, engine_id: str, hashes: Iterable[int]) -> int | None:
        """How many of ``hashes`` (a prompt's leading blocks) the engine caches, in a row.

        None when its state is unknown, unsynced or stale: use your own estimate.
        """
        blocks = self.fresh_blocks(engine_id)
        if blocks is None:
            return None
        count = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            count += 1
        return count

    def fresh_blocks(self, engine_id: str) -> Container[int] | None:
        """The engine's cached block hashes if its state is synced and fresh, else None.

        The live set, shared: read it, never change it.
        """
        follow = self._fresh(engine_id)
        return None if follow is None else follow.blocks

    def fresh_view(self) -> Mapping[str, Container[int]]:
        """Every engine whose state is synced and fresh: engine id -> its cached block hashes.

        One call per pick instead of ``fresh_blocks`` per engine: the mapping is built once
        and the same object returned until some engine turns synced, unsynced, stale or
        fresh again, or the engines change. The sets are live and shared: read them, never
        change them.
        """
        now = time.monotonic()
        kept = self._view
        stale_after = self.stale_after
        if (
            kept is not None
            and (kept[0], kept[1]) == (self._version, stale_after)
            and now <= kept[2]
        ):
            return kept[3]
        version = self._version  # read first: a change while building bumps it again
        view: dict[str, Container[int]] = {}
        deadline = math.inf
        for engine_id, follow in self._follows.items():
            if follow.synced and now - follow.heard <= stale_after:
                view[engine_id] = follow.blocks
                # The earliest time one of them may turn stale (later messages only delay it).
                deadline = min(deadline, follow.heard + stale_after)
        fresh = MappingProxyType(view)
        self._view = (version, stale_after, deadline, fresh)
        return fresh

    def holders(self, block_hash: int) -> frozenset[str]:
        """The engines followed whose cached blocks include ``block_hash`` (fresh or not).

        Kept as KV events arrive from the first call for that block on (a prompt's first
        block: kv_aware asks per pick), so a pick does not ask every engine's set.
        """
        return self._holders.of(block_hash, self._sets)

    def _sets(self) -> Iterable[tuple[str, Container[int]]]:
        return [(engine_id, follow.blocks) for engine_id, follow in self._follows.items()]

    def fresh(self, engine_id: str) -> Mapping[str, Any] | None:
        """The engine's load view if its state is synced and fresh, else None."""
        follow = self._fresh(engine_id)
        return None if follow is None else follow.load

    def others(self, engine_id: str) -> int | None:
        """Requests the other routers (or the engine, as it reports) hold on the engine.

        None when its state is not synced and fresh: count only your own handles then.
        """
        follow = self._fresh(engine_id)
        return None if follow is None else follow.others

    def share(self, engine_id: str) -> tuple[int, int, int] | None:
        """``(others, routers, rank)``: the other routers' load, how many report, our place.

        The rank is this router's place in the relay's order (the same for every router).
        None when the engine's state is not synced and fresh (see ``others``).
        """
        follow = self._fresh(engine_id)
        return None if follow is None else (follow.others, follow.routers, follow.rank)

    def load_changes(self, notify: Callable[[], None] | None = None) -> collections.deque[str]:
        """A queue of engine ids whose ``others`` changed; the caller pops from it.

        The follower appends on a new load view, and when a state turns stale or synced.
        ``notify`` (if given) is called after each append, on the follower's thread: it
        must be quick and must not call back into this object's waits.
        """
        queue: collections.deque[str] = collections.deque(maxlen=1 << 16)
        with self._lock:
            self._watchers.append(queue)
            if notify is not None:
                self._notifiers.append(notify)
        return queue

    def silent(self, engine_id: str) -> bool:
        """Whether the engine's relay said goodbye or was quiet past ``stale_after``.

        False for an engine not followed (it has no relay to be silent).
        """
        follow = self._follows.get(engine_id)
        if follow is None:
            return False
        return follow.gone or time.monotonic() - follow.heard > self.stale_after

    def hold(self, engine_id: str, address: str) -> None:
        """Follow the engine's relay at ``address`` even while the table lacks the engine.

        For a router keeping it routable (unconfirmed); each ``hold`` needs an ``unhold``.
        """
        with self._lock:
            if self._stopping:
                return
            self._held[engine_id] = self._held.get(engine_id, 0) + 1
            kept = self._follows.get(engine_id)
            if kept is not None and kept.address == address:
                return
            self._follows = {**self._follows, engine_id: _Follow(engine_id, address)}
            self._version += 1
        self._poke()

    def unhold(self, engine_id: str) -> None:
        """Undo one ``hold``: once none is left, follow the engine only if the table has it."""
        with self._lock:
            holds = self._held.get(engine_id, 0) - 1
            if holds > 0:
                self._held[engine_id] = holds
                return
            self._held.pop(engine_id, None)
            record = self._table.get(engine_id)
            kept = self._follows.get(engine_id)
            if kept is None or (record is not None and record.state_address == kept.address):
                return
            self._follows = {k: f for k, f in self._follows.items() if k != engine_id}
            self._version += 1
        self._poke()

    def state(self, engine_id: str) -> EngineState | None:
        """The engine's state as last heard (a copy), or None if it has no relay."""
        follow = self._follows.get(engine_id)
        if follow is None:
            return None
        return EngineState(
            engine_id=engine_id,
            address=follow.address,
            synced=follow.synced,
            age=time.monotonic() - follow.heard,
            epoch=follow.epoch,
            seq=follow.seq,
            blocks=frozenset(follow.blocks),
            load=follow.load,
            gone=follow.gone,
        )

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._follows

    def __len__(self) -> int:
        return len(self._follows)

    def ages(self) -> dict[str, float]:
        """Seconds since each followed engine's relay last said anything."""
        now = time.monotonic()
        return {engine_id: now - f.heard for engine_id, f in self._follows.items()}

    def health(self) -> EngineStatesHealth:
        """Engines followed, how many are synced and fresh, resyncs, the oldest state."""
        now = time.monotonic()
        follows = list(self._follows.values())
        with self._lock:
            resyncs = dict(self._resyncs)
        return EngineStatesHealth(
            engines=len(follows),
            synced=sum(f.synced and now - f.heard <= self.stale_after for f in follows),
            resyncs=MappingProxyType(resyncs),
            oldest=max((now - f.heard for f in follows), default=0.0),
            blocks=sum(len(f.blocks) for f in follows),
        )

    def wait_synced(
        self, engine_ids: Sequence[str] | None = None, timeout: float | None = None
    ) -> None:
        """Block until every engine in ``engine_ids`` (default: all followed) is synced.

        Raises TimeoutError after ``timeout`` seconds.
        """

        def done() -> bool:
            wanted = self._follows.keys() if engine_ids is None else engine_ids
            return all((f := self._follows.get(e)) is not None and f.synced for e in wanted)

        with self._changed:
            if not self._changed.wait_for(done, timeout):
                raise TimeoutError(f"engine states not synced within {timeout} s")

    async def await_synced(
        self, engine_ids: Sequence[str] | None = None, timeout: float | None = None
    ) -> None:
        """``wait_synced`` without blocking the event loop."""
        await asyncio.to_thread(self.wait_synced, engine_ids, timeout)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, *, connect: bool = True) -> EngineStates:
        """Follow the table's engines from now on. Idempotent.

        ``connect=False`` opens no socket and starts no thread: the engines' states then
        come only through ``feed`` (a simulation, a transport of your own).
        """
        with self._lock:
            if self._stopping:
                raise ClosedError("engine states are stopped")
            if self._unsubscribe is not None:
                return self
            if connect:
                self._wake = os.pipe()
                os.set_blocking(self._wake[1], False)
                self._thread = threading.Thread(
                    target=self._run, name="discovery-engine-states", daemon=True
                )
                self._thread.start()
        # A sink of the table's store: each batch is seen as the store applies it (and the
        # engines held now first, as one batch), never later than a reader of the table.
        self._unsubscribe = self._table.store.add_sink(_Sink(self._follow))
        return self

    def feed(self, engine_id: str, message: list[Any]) -> None:
        """Apply one relay message to the engine's state, as if its relay had sent it.

        ``message`` is ``_state/relay.py``'s protocol, msgpack-decoded; an engine not followed
        ignores it. For simulations and transports of your own (``start(connect=False)``):
        a request the state would send its relay (a snapshot after a gap) goes nowhere,
        so feed a ``hello`` then.
        """
        follow = self._follows.get(engine_id)
        if follow is not None:
            self._apply(follow, message, _unsent)

    def stop(self) -> None:
        """Stop following: every subscription closes, every state goes. Idempotent."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._lock:
            self._stopping = True
            self._follows = {}
            self._version += 1
            thread, wake = self._thread, self._wake
        self._poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        if wake is not None:
            for fd in wake:
                os.close(fd)
            self._wake = None

    def __enter__(self) -> EngineStates:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> EngineStates:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

    # -- the table's side ------------------------------------------------------------------

    def _follow(self, batch: Batch) -> None:
        """Follow the relays the batch's engines advertise now (under the store's lock)."""
        with self._lock:
            if self._stopping:
                return
            follows = self._follows
            changed = False
            for event in batch:
                engine_id = event.engine_id
                address = None if event.type is EventType.REMOVED else event.record.state_address
                kept = follows.get(engine_id)
                if kept is not None and kept.address == address:
                    continue
                if address is None and engine_id in self._held:
                    continue  # a router keeps it routable: its relay is the evidence
                if not changed:
                    follows, changed = dict(follows), True  # readers keep the old dict
                if address is None:
                    follows.pop(engine_id, None)  # its state goes now: no ghost
                else:
                    follows[engine_id] = _Follow(engine_id, address)
            if not changed:
                return
            self._follows = follows
            self._version += 1
            self._changed.notify_all()
        self._poke()

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(wake[1], b"\0")

    # -- the follower's thread ------------------------------------------------------------

    def _run(self) -> None:
        import msgpack  # noqa: PLC0415
        import zmq  # noqa: PLC0415

        context = zmq.Context()
        poller = zmq.Poller()
        assert self._wake is not None
        wake = self._wake[0]
        poller.register(wake, zmq.POLLIN)
        sockets: dict[Any, _Follow] = {}  # socket -> the follow it serves
        pack = msgpack.Packer(use_bin_type=True).pack
        next_beat = next_report = 0.0
        try:
            while not self._stopping:
                due = min(next_beat, next_report) if self._load_sources else next_beat
                ready = dict(poller.poll(int(max(0.0, due - time.monotonic()) * 1000)))
                if ready.pop(wake, None) is not None:  # the table changed, or a stop
                    os.read(wake, 65536)
                    self._sync_sockets(context, poller, sockets, pack)
                for sock in ready:
                    follow = sockets.get(sock)
                    if follow is not None:
                        self._receive(sock, follow, pack, msgpack)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat(sockets, pack, now)
                    next_beat, next_report = now + self._heartbeat, now + self._report_interval
                elif self._load_sources and now >= next_report:
                    self._report(sockets, pack, changed_only=True)
                    next_report = now + self._report_interval
        except Exception:
            log.exception("engine states: the follower failed; routers fall back to estimates")
        finally:
            for sock in sockets:
                sock.close()
            context.term()

    def _sync_sockets(
        self,
        context: zmq.Context[Any],
        poller: zmq.Poller,
        sockets: dict[Any, _Follow],
        pack: Callable[[Any], bytes],
    ) -> None:
        """Open a subscription for every new follow; close the ones no longer followed."""
        import zmq  # noqa: PLC0415

        follows = self._follows
        for sock, follow in list(sockets.items()):
            if follows.get(follow.engine_id) is not follow:
                poller.unregister(sock)
                sock.close()
                del sockets[sock]
        for follow in follows.values():
            if follow.socket is None:
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
                sock.connect(follow.address)
                follow.socket = sock
                sockets[sock] = follow
                poller.register(sock, zmq.POLLIN)
                self._ask(follow, "start", pack, time.monotonic())

    def _receive(
        self, sock: zmq.Socket[Any], follow: _Follow, pack: Callable[[Any], bytes], msgpack: Any
    ) -> None:
        import zmq  # noqa: PLC0415

        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = msgpack.unpackb(frame, raw=False)
                self._apply(follow, message, pack)
            except Exception as exc:  # a broken relay: its state is no longer known
                log.warning("engine states: bad frame from %s (%s)", follow.engine_id, exc)
                follow.synced = False
                self._version += 1

    def _apply(self, follow: _Follow, message: Any, pack: Callable[[Any], bytes]) -> None:
        verb, epoch, *rest = message
        heard, now = follow.heard, time.monotonic()
        follow.heard = now
        if now - heard > self.stale_after:
            self._version += 1  # stale until now: fresh_view() takes it in again
        if verb == "hello":
            seq, blocks, load = rest
            follow.blocks = set(unpack_hashes(blocks))
            self._holders.replaced(follow.engine_id, follow.blocks)
            follow.epoch, follow.seq, follow.gone = epoch, seq, False
            self._new_load(follow, load)
            synced, follow.synced = follow.synced, True
            self._version += 1  # a new set (and maybe newly synced)
            if not synced:
                with self._changed:
                    self._changed.notify_all()
            self._freshness(follow, now)
            return
        if verb == "bye":  # its launcher stopped: the state is gone now, not when stale
            follow.gone, follow.synced, follow.heard = True, False, -math.inf
            self._version += 1
            follow.fresh = False
            self._announce(follow.engine_id)
            return
        if epoch != follow.epoch:
            if follow.synced or now - follow.asked > self._heartbeat:
                self._ask(follow, "epoch", pack, now)
            return
        if verb == "kv":
            seq, kind, blocks = rest
            if seq <= follow.seq:
                return  # in the snapshot already
            if seq != follow.seq + 1 or not follow.synced:
                if follow.synced or now - follow.asked > self._heartbeat:
                    self._ask(follow, "gap", pack, now)
                return
            follow.seq = seq
            if kind == "stored":
                hashes = unpack_hashes(blocks)
                follow.blocks.update(hashes)
                self._holders.stored(follow.engine_id, hashes)
            elif kind == "removed":
                hashes = unpack_hashes(blocks)
                follow.blocks.difference_update(hashes)
                self._holders.removed(follow.engine_id, hashes)
            else:
                follow.blocks.clear()
                self._holders.removed(follow.engine_id)
        elif verb == "tick":
            (seq,) = rest
            if seq > follow.seq and (follow.synced or now - follow.asked > self._heartbeat):
                self._ask(follow, "gap", pack, now)  # increments were lost on the way
        elif verb == "load":
            (load,) = rest
            self._new_load(follow, load)

    def _new_load(self, follow: _Follow, load: Mapping[str, Any]) -> None:
        """Take a load view: what the other routers (or the engine) hold besides us."""
        follow.load = MappingProxyType(dict(load))
        engine = load.get("engine")
        total = load.get("in_flight", 0)
        if isinstance(engine, Mapping) and "active_request_count" in engine:
            total = engine["active_request_count"] + engine.get("waiting_request_count", 0)
        others = max(0, int(total) - int(load.get("yours", 0)))
        routers = int(load.get("routers", 1))
        if not load.get("counted", True):
            routers += 1  # our own first report is still on its way
        rank = int(load.get("rank", 0))
        if (others, routers, rank) != (follow.others, follow.routers, follow.rank):
            follow.others, follow.routers, follow.rank = others, routers, rank
            self._announce(follow.engine_id)

    def _freshness(self, follow: _Follow, now: float) -> None:
        """Announce an engine whose state became usable or unusable for ``others``."""
        fresh = follow.synced and now - follow.heard <= self.stale_after
        if fresh != follow.fresh:
            follow.fresh = fresh
            self._announce(follow.engine_id)

    def _announce(self, engine_id: str) -> None:
        for queue in self._watchers:
            queue.append(engine_id)
        for notify in self._notifiers:
            notify()

    def _ask(self, follow: _Follow, reason: str, pack: Callable[[Any], bytes], now: float) -> None:
        """Mark ``follow`` unsynced and ask its relay for a snapshot."""
        import zmq  # noqa: PLC0415

        follow.synced = False
        self._version += 1
        follow.asked = now
        self._freshness(follow, now)
        with self._lock:
            self._resyncs[reason] += 1
        self._metrics.engine_state_resync(reason)
        if follow.socket is not None:  # None: fed by hand (``feed``)
            with contextlib.suppress(zmq.Again):
                follow.socket.send(pack(["snapshot"]), zmq.NOBLOCK)

    def _beat(self, sockets: dict[Any, _Follow], pack: Callable[[Any], bytes], now: float) -> None:
        """Every heartbeat: subscribe again (with this router's load); re-ask if unsynced."""
        for follow in sockets.values():
            if not follow.synced and now - follow.asked > self._heartbeat:
                self._ask(follow, "gap", pack, now)
            self._freshness(follow, now)
            if follow.engine_id in self._held and now - follow.heard > self.stale_after:
                self._announce(follow.engine_id)  # silent: evidence for the router holding it
        self._report(sockets, pack, changed_only=False)

    def _report(
        self, sockets: dict[Any, _Follow], pack: Callable[[Any], bytes], *, changed_only: bool
    ) -> None:
        """Send each relay this router's count on its engine (or a bare ``sub``)."""
        import zmq  # noqa: PLC0415

        loads = self._loads()
        for sock, follow in sockets.items():
            if loads is None:
                message: list[Any] = ["sub"]
            else:
                count = loads.get(follow.engine_id, 0)
                if changed_only and count == follow.reported:
                    continue
                follow.reported = count
                message = ["load", count]
            with contextlib.suppress(zmq.Again):
                sock.send(pack(message), zmq.NOBLOCK)
