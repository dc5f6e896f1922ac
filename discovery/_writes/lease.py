"""The lease keeper: one thread and one keepalive stream per connection, for every lease.

Every ``Session`` of a connection (and so every registration: a registration without a
session of its own choosing gets a private one) is kept alive by one ``LeaseKeeper``: a
thread that runs timed turns in deadline order, one LeaseKeepAlive stream shared by all
leases, a small pool for the blocking work (re-registering after a loss, publishing,
revoking at a drain deadline) so that it never delays another lease's keepalive, and one
dispatcher thread for state callbacks.

The keeper knows nothing about records. It runs what is scheduled (``schedule(item,
at)``, the newest time for an item wins), sends keepalives on request, and hands each
answer to the lease's owner (``KeptLease.keepalive_answered``). A keepalive still
unanswered when its stream dies is sent again at once on a new stream (another member).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from discovery._backoff import REPAIR
from discovery._dispatch import Dispatcher
from discovery._etcd.port import EtcdPort, KeepAliveStream, explain

__all__ = ["LeaseKeeper", "keeper_for"]

log = logging.getLogger(__name__)

_STREAM_REOPEN_MIN = 0.2
_POOL_WORKERS = 4


class Timed(Protocol):
    """Something the keeper runs at a time (a session's keepalive, a drain deadline)."""

    def turn(self, keeper: LeaseKeeper) -> None:
        """Run on the keeper thread: never block on etcd here (use ``keeper.submit``)."""


class KeptLease(Timed, Protocol):
    """The owner of a lease the keeper sends keepalives for."""

    def keepalive_answered(self, lease_id: int, ttl: int) -> None:
        """A keepalive of ``lease_id`` was answered: ``ttl`` <= 0 means it is gone."""

    def awaits_answer_on(self, stream: KeepAliveStream) -> bool:
        """Whether a keepalive of this lease is unanswered on ``stream``."""
        ...


class LeaseKeeper:
    """Keeps every lease of one connection alive from one thread and one stream."""

    def __init__(self, connection: EtcdPort) -> None:
        self.connection = connection
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Timed]] = []
        self._seq = itertools.count()
        self._due: dict[Timed, float] = {}
        self._stale = 0  # heap entries superseded or cancelled (dropped when due)
        self._by_lease: dict[int, KeptLease] = {}
        self._stream: KeepAliveStream | None = None
        self._stream_opened = 0.0
        self.last_answer = 0.0
        """When the live stream last answered any keepalive (monotonic)."""
        self._stopped = False
        self._stop_hooks: list[Callable[[], None]] = []
        self.dispatcher = Dispatcher("discovery-registration-events")
        """Runs registration state callbacks, in order, off the keeper's threads."""
        # Re-registering takes blocking RPCs; on the keeper thread they would delay every
        # other lease's keepalive past its TTL after a mass loss (and the losses cascade).
        self._pool = ThreadPoolExecutor(_POOL_WORKERS, "discovery-recover")
        self._thread = threading.Thread(target=self._run, name="discovery-keeper", daemon=True)
        self._thread.start()

    # -- timed turns ---------------------------------------------------------------------

    def schedule(self, item: Timed, at: float, *, sooner_only: bool = False) -> None:
        """Run ``item.turn`` at monotonic time ``at``, replacing its pending turn.

        With ``sooner_only``, a pending turn that comes earlier is kept.
        """
        with self._cond:
            if self._stopped:
                return
            pending = self._due.get(item)
            if sooner_only and pending is not None and pending <= at:
                return
            if pending is not None:
                self._forget_locked()
            self._due[item] = at
            if not self._heap or at < self._heap[0][0]:
                self._cond.notify()  # else the thread wakes early enough anyway
            heapq.heappush(self._heap, (at, next(self._seq), item))

    def cancel(self, item: Timed) -> None:
        """Forget ``item``'s scheduled turn."""
        with self._cond:
            if self._due.pop(item, None) is not None:
                self._forget_locked()

    def _forget_locked(self) -> None:
        # A stale entry keeps its item alive until it is due: when they are the bulk of
        # the heap (many short registrations), drop them.
        self._stale += 1
        if self._stale > 64 and 2 * self._stale > len(self._heap):
            self._heap = [entry for entry in self._heap if self._due.get(entry[2]) == entry[0]]
            heapq.heapify(self._heap)
            self._stale = 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                at, _, item = heapq.heappop(self._heap)
                if self._due.get(item) != at:
                    self._stale = max(0, self._stale - 1)
                    continue  # a newer schedule entry supersedes this one
                del self._due[item]
            self._guarded(item, item.turn)

    def _guarded(self, item: Timed, job: Callable[[LeaseKeeper], None]) -> None:
        """Run one job; a bug in it must not silently end every lease's keepalives."""
        try:
            job(self)
        except Exception:
            log.exception("%r: keeper turn failed; trying again", item)
            self.schedule(item, time.monotonic() + REPAIR.maximum)

    def submit(self, item: Timed, job: Callable[[LeaseKeeper], None]) -> None:
        """Run ``job(keeper)`` on the pool (blocking RPCs); a failure reschedules ``item``."""
        with contextlib.suppress(RuntimeError):  # stopping: nothing to do any more
            self._pool.submit(self._guarded, item, job)

    # -- keepalives ----------------------------------------------------------------------

    def track_lease(self, owner: KeptLease, old: int | None, new: int | None) -> None:
        """Send keepalive answers for ``new`` (no longer ``old``) to ``owner``."""
        with self._cond:
            if old is not None and self._by_lease.get(old) is owner:
                del self._by_lease[old]
            if new is not None:
                self._by_lease[new] = owner

    @property
    def stream(self) -> KeepAliveStream | None:
        """The live keepalive stream, if any."""
        return self._stream

    def send_keepalive(self, lease_id: int) -> KeepAliveStream | None:
        """Send one keepalive on the shared stream, (re)opening it; the stream, or None."""
        stream = self._stream
        if stream is None:
            now = time.monotonic()
            if now - self._stream_opened < _STREAM_REOPEN_MIN:
                return None
            self._stream_opened = now
            try:
                stream = self.connection.open_keepalive()
            except Exception as exc:
                log.warning("cannot open lease keepalive stream: %s", explain(exc))
                return None
            self._stream = stream
            threading.Thread(
                target=self._read, args=(stream,), name="discovery-keepalive-reader", daemon=True
            ).start()
        stream.send_keepalive(lease_id)
        return stream

    def reset_stream(self, stream: KeepAliveStream | None = None) -> None:
        """Drop ``stream`` (a live one that stopped answering), or the live one on stop."""
        if stream is None:
            stream, self._stream = self._stream, None
            if stream is not None:
                stream.cancel()
        elif stream is self._stream:  # only once, whoever notices first
            self._stream = None
            stream.abandon()  # its member stopped answering: use another one

    def reopen_at(self) -> float:
        """The earliest time a new stream may be opened (not in a tight loop on failures)."""
        return max(time.monotonic(), self._stream_opened + _STREAM_REOPEN_MIN)

    def _read(self, stream: KeepAliveStream) -> None:
        try:
            for lease_id, ttl in stream:
                if stream is not self._stream:
                    return  # replaced: its late answers would date renewals wrongly
                self.last_answer = time.monotonic()
                with self._cond:
                    owner = self._by_lease.get(lease_id)
                if owner is not None:
                    owner.keepalive_answered(lease_id, ttl)
        except Exception as exc:
            if not self._stopped:
                log.warning("lease keepalive stream ended: %s", explain(exc))
        finally:
            if self._stream is stream:
                self._stream = None
            self._resend_lost(stream)

    def _resend_lost(self, stream: KeepAliveStream) -> None:
        # Keepalives still unanswered on a dead stream died with it: send them again on a
        # new stream (another member) now, not a TTL/3 later; a leader election after the
        # member's death may still take most of the TTL.
        with self._cond:
            if self._stopped:
                return
            lost = [owner for owner in self._by_lease.values() if owner.awaits_answer_on(stream)]
        at = self.reopen_at()
        for owner in lost:
            self.schedule(owner, at)

    # -- lifecycle -----------------------------------------------------------------------

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the keeper stops (its connection closes)."""
        self._stop_hooks.append(hook)

    def stop(self) -> None:
        """End the thread, the stream, the pool and the dispatcher (connection closing)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        for hook in self._stop_hooks:
            hook()
        self.reset_stream()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.dispatcher.stop()


_keepers: weakref.WeakKeyDictionary[EtcdPort, LeaseKeeper] = weakref.WeakKeyDictionary()
_keepers_lock = threading.Lock()


def keeper_for(connection: EtcdPort) -> LeaseKeeper:
    """The one keeper of ``connection``, started on first use, stopped when it closes."""
    with _keepers_lock:
        keeper = _keepers.get(connection)
        if keeper is None:
            keeper = _keepers[connection] = LeaseKeeper(connection)
            connection.on_close(keeper.stop)
        return keeper
