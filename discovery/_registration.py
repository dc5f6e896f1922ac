"""Lease-backed registration of one engine, and the keeper that keeps leases alive.

State machine of a Registration::

    registering ──ok──▶ registered ──lease gone / keepalives unanswered past TTL──▶ lost
                            ▲                                                       │
                            └────── etcd answers again: same or new lease, record ◀─┘
    any state ──close()──▶ closed (lease revoked, key gone)

Every Registration of a Connection is served by one ``_Keeper`` thread and one
LeaseKeepAlive stream, so a process can hold thousands of registrations. Keepalives go
out every TTL/3. A keepalive answered with TTL <= 0 means the lease is gone (expired in
an outage, revoked by an operator); the keeper then writes the record again, on the old
lease when it survived (a leader change renews leases) or on a new one, and never
overwrites a record that another live lease holds.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import heapq
import itertools
import logging
import math
import os
import random
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from ._codec import EngineRecord, encode, validate_engine_id
from ._connection import Connection
from ._dispatch import Dispatcher, Listeners
from ._endpoint import DynamicEngineLike, InferenceEngineEndpoint
from ._errors import (
    ClosedError,
    DiscoveryError,
    EngineConflictError,
    EtcdUnavailableError,
    InvalidRecordError,
)
from ._metrics import NO_METRICS, MetricsHooks
from ._port import EtcdPort, KeepAliveStream, explain
from ._settings import Settings

__all__ = [
    "Registration",
    "RegistrationHealth",
    "RegistrationState",
    "aregister_engine",
    "default_engine_id",
    "deregister",
    "register_dynamic_engine",
    "register_engine",
]

log = logging.getLogger(__name__)

_RETRY_MIN = 0.1
_RETRY_MAX = 0.5  # while lost, try often: the record must be back within ~2 s of etcd
_STREAM_REOPEN_MIN = 0.2
_EXIT_TIMEOUT = 2.0  # at interpreter exit, do not hang on an unreachable etcd
_RECOVERY_WORKERS = 4


class RegistrationState(enum.StrEnum):
    """Where a Registration is in its lifecycle."""

    REGISTERING = "registering"
    REGISTERED = "registered"
    LOST = "lost"
    CLOSED = "closed"


@dataclass(frozen=True)
class RegistrationHealth:
    """A point-in-time view of a Registration, for health endpoints."""

    engine_id: str
    key: str
    state: RegistrationState
    lease_id: int | None
    registrations: int
    """How many times the record was written on a new lease (1 = never lost)."""
    losses: int
    last_error: str | None
    last_keepalive: datetime | None


_process_nonce = f"{random.getrandbits(24):06x}"
_default_ids = itertools.count(1)


def default_engine_id() -> str:
    """``{hostname}-{pid}-{nonce}`` (``-{n}`` from the second call on), key-safe.

    The nonce is random per process, so a restarted engine with the same hostname and pid
    (pid 1 in a container) never collides with its predecessor's record that is still
    waiting for its TTL.
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:80].strip(".") or "engine"
    n = next(_default_ids)
    suffix = "" if n == 1 else f"-{n}"
    return f"{host}-{os.getpid()}-{_process_nonce}{suffix}"


def validate_ttl(ttl: object) -> float:
    """Return ``ttl`` if it is a positive number of seconds, else raise InvalidRecordError."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise InvalidRecordError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return ttl


class _Keeper:
    """Keeps every lease of one Connection alive from one thread and one stream."""

    def __init__(self, connection: EtcdPort) -> None:
        self._conn = connection
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Registration]] = []
        self._seq = itertools.count()
        self._by_lease: dict[int, Registration] = {}
        self._stream: KeepAliveStream | None = None
        self._stream_opened = 0.0
        self._stopped = False
        self.dispatcher = Dispatcher("discovery-registration-events")
        # Re-registering takes blocking RPCs; on the keeper thread they would delay every
        # other lease's keepalive past its TTL after a mass loss (and the losses cascade).
        self._recoveries = ThreadPoolExecutor(_RECOVERY_WORKERS, "discovery-recover")
        self._thread = threading.Thread(target=self._run, name="discovery-keeper", daemon=True)
        self._thread.start()

    def schedule(self, reg: Registration, at: float) -> None:
        with self._cond:
            reg._next_at = at
            heapq.heappush(self._heap, (at, next(self._seq), reg))
            self._cond.notify()

    def track_lease(self, reg: Registration, old: int | None, new: int | None) -> None:
        with self._cond:
            if old is not None and self._by_lease.get(old) is reg:
                del self._by_lease[old]
            if new is not None:
                self._by_lease[new] = reg

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                at, _, reg = heapq.heappop(self._heap)
            if reg._next_at == at:  # else a newer schedule entry supersedes this one
                self._guarded(reg._step, reg)

    def _guarded(self, turn: Callable[[_Keeper], None], reg: Registration) -> None:
        """Run one turn; a bug in it must not silently end every lease's keepalives."""
        try:
            turn(self)
        except Exception:
            log.exception("%s: keeper turn failed; trying again", reg.engine_id)
            self.schedule(reg, time.monotonic() + _RETRY_MAX)

    def recover(self, reg: Registration) -> None:
        """Re-register ``reg`` on a recovery thread."""
        with contextlib.suppress(RuntimeError):  # stopping: nothing to recover any more
            self._recoveries.submit(self._guarded, reg._recover_job, reg)

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
                stream = self._conn.open_keepalive()
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

    def _read(self, stream: KeepAliveStream) -> None:
        try:
            for lease_id, ttl in stream:
                if stream is not self._stream:
                    return  # replaced: its late answers would date renewals wrongly
                with self._cond:
                    reg = self._by_lease.get(lease_id)
                if reg is not None:
                    reg._keepalive_answered(self, lease_id, ttl)
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
            lost = [
                reg
                for reg in self._by_lease.values()
                if reg._awaiting is not None and reg._awaiting_on is stream
            ]
        at = self.reopen_at()
        for reg in lost:
            self.schedule(reg, at)

    def reopen_at(self) -> float:
        """The earliest time a new stream may be opened (not in a tight loop on failures)."""
        return max(time.monotonic(), self._stream_opened + _STREAM_REOPEN_MIN)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self.reset_stream()
        self._recoveries.shutdown(wait=False, cancel_futures=True)
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.dispatcher.stop()


_keepers: weakref.WeakKeyDictionary[EtcdPort, _Keeper] = weakref.WeakKeyDictionary()
_keepers_lock = threading.Lock()


def _keeper_for(connection: EtcdPort) -> _Keeper:
    with _keepers_lock:
        keeper = _keepers.get(connection)
        if keeper is None:
            keeper = _keepers[connection] = _Keeper(connection)
            connection.on_close(keeper.stop)
        return keeper


class Registration:
    """One engine's record in etcd, kept alive on a lease until close().

    Create it with :func:`register_engine`. Thread-safe. Use as a context manager (sync
    or async) to deregister on exit. State changes go to ``subscribe()`` callbacks on a
    background thread: ``LOST`` when the lease is gone or unreachable past its TTL,
    ``REGISTERED`` when the record is written again.
    """

    def __init__(
        self,
        record: EngineRecord,
        *,
        ttl: float,
        connection: EtcdPort,
        owns_connection: bool,
        metrics: MetricsHooks | None = None,
    ) -> None:
        validate_ttl(ttl)
        self._record = record
        self._conn = connection
        self._owns_connection = owns_connection
        self._metrics = metrics or NO_METRICS
        self.key = connection.settings.keyspace.key(record.engine_id)
        self.ttl = max(1, math.ceil(ttl))  # etcd leases are whole seconds
        self._interval = self.ttl / 3
        self._lock = threading.Lock()
        # Held by the keeper for a whole turn and by close(), so close() never races a
        # re-registration that would leave a fresh lease behind.
        self._op_lock = threading.Lock()
        self._state = RegistrationState.REGISTERING
        self._state_changed = threading.Condition(self._lock)
        self._lease_id: int | None = None
        self._mod_revision = 0
        self._deadline = 0.0
        self._awaiting: float | None = None  # when the unanswered keepalive went out
        self._awaiting_on: KeepAliveStream | None = None  # ...and on which stream
        self._dirty = False
        self._next_at = 0.0
        self._retry_delay = _RETRY_MIN
        self._listeners: Listeners[Callable[[RegistrationState], None]] = Listeners()
        self._registrations = 0
        self._losses = 0
        self._last_error: str | None = None
        self._last_keepalive: datetime | None = None
        self._keeper: _Keeper | None = None
        # Leases of attempts whose outcome is unknown (no answer, revoke failed too): a
        # record found on one of them was written by us.
        self._unsure_leases: set[int] = set()

    # -- public view ------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        """The engine id; the last segment of the key."""
        return self._record.engine_id

    @property
    def record(self) -> EngineRecord:
        """The record as last published (or to be published)."""
        return self._record

    @property
    def endpoint(self) -> InferenceEngineEndpoint:
        """The registered endpoint."""
        return self._record.endpoint

    @property
    def lease_id(self) -> int | None:
        """The current lease, or None while there is none."""
        return self._lease_id

    @property
    def state(self) -> RegistrationState:
        """The current state."""
        return self._state

    def health(self) -> RegistrationHealth:
        """State, lease, counters and the last error, for a health endpoint."""
        with self._lock:
            return RegistrationHealth(
                engine_id=self.engine_id,
                key=self.key,
                state=self._state,
                lease_id=self._lease_id,
                registrations=self._registrations,
                losses=self._losses,
                last_error=self._last_error,
                last_keepalive=self._last_keepalive,
            )

    def subscribe(self, callback: Callable[[RegistrationState], None]) -> Callable[[], None]:
        """Call ``callback(new_state)`` on every state change; returns an unsubscribe."""
        return self._listeners.add(callback)

    def wait_for_state(self, state: RegistrationState, timeout: float | None = None) -> bool:
        """Block until the state is ``state``; False on timeout."""
        with self._state_changed:
            return self._state_changed.wait_for(lambda: self._state == state, timeout)

    def __repr__(self) -> str:
        lease = f"{self._lease_id:016x}" if self._lease_id else None
        return f"<Registration {self.engine_id!r} {self._state} lease={lease} key={self.key!r}>"

    # -- lifecycle ---------------------------------------------------------------------

    def _start(self, *, replace: bool) -> None:
        """Write the record (retrying until settings.dial_timeout), then hand it to the keeper."""
        try:
            self._conn.call(lambda: self._write(replace=replace))
        except BaseException:
            self._set_state(RegistrationState.CLOSED)
            if self._owns_connection:
                self._conn.close()
            raise
        self._keeper = _keeper_for(self._conn)
        self._keeper.track_lease(self, None, self._lease_id)
        self._set_state(RegistrationState.REGISTERED)
        self._keeper.schedule(self, time.monotonic() + self._interval)
        _live_registrations.add(self)

    def update(
        self,
        *,
        endpoint: InferenceEngineEndpoint | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """Publish a changed endpoint and/or labels atomically under the same lease.

        Raises EtcdUnavailableError when etcd cannot be reached in time; the change is
        kept and published as soon as etcd answers again.
        """
        record = replace(
            self._record,
            endpoint=self._record.endpoint if endpoint is None else endpoint,
            labels=self._record.labels if labels is None else labels,
        )
        encode(record)  # refuses a bad or oversized record before anything changes
        with self._lock:
            if self._state is RegistrationState.CLOSED:
                raise ClosedError(f"registration {self.engine_id!r} is closed")
            self._record = record
            self._dirty = True
            registered = self._state is RegistrationState.REGISTERED
        if registered:
            self._conn.call(self._publish)

    def close(self, timeout: float | None = None) -> None:
        """Revoke the lease (deleting the key) and stop keeping it. Idempotent.

        Returns once etcd has deleted the key, or after ``timeout`` (default
        settings.dial_timeout) when etcd cannot be reached: the key then expires within
        the TTL.
        """
        with self._lock:
            if self._state is RegistrationState.CLOSED:
                return
        self._set_state(RegistrationState.CLOSED)
        _live_registrations.discard(self)
        with self._op_lock:
            lease_id = self._lease_id
        if self._keeper is not None:
            self._keeper.track_lease(self, lease_id, None)
        try:
            if lease_id is not None:
                started = time.monotonic()
                self._conn.call(lambda: self._conn.revoke(lease_id), timeout=timeout)
                self._metrics.revoked(time.monotonic() - started)
                log.info("deregistered %s (lease %016x revoked)", self.engine_id, lease_id)
        except DiscoveryError as exc:
            log.warning(
                "could not revoke lease of %s (%s); its key expires within %d s",
                self.engine_id,
                exc,
                self.ttl,
            )
        finally:
            if self._owns_connection:
                self._conn.close()

    async def aclose(self) -> None:
        """close() without blocking the event loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Registration:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- state -------------------------------------------------------------------------

    def _set_state(self, state: RegistrationState, error: str | None = None) -> None:
        with self._lock:
            old = self._state
            if old is RegistrationState.CLOSED or old is state:
                return
            self._state = state
            if state is RegistrationState.LOST:
                self._losses += 1
                self._last_error = error
            self._state_changed.notify_all()
        self._metrics.registration_state(self.engine_id, state.value)
        level = logging.WARNING if state is RegistrationState.LOST else logging.INFO
        log.log(level, "%s: %s -> %s%s", self.engine_id, old, state, f" ({error})" if error else "")
        if self._keeper is not None:
            for listener in self._listeners:
                self._keeper.dispatcher.submit(listener, state)

    # -- etcd operations (run on the caller's thread at start, then on the keeper) -----

    def _write(self, *, replace: bool) -> None:
        """Put the record on a live lease: the current one if it survived, else a new one.

        When the lease survived and the key is still on it, nothing was lost in etcd:
        the record is left alone (watchers see no ``updated`` churn after a stall).
        """
        conn = self._conn
        previous = self._lease_id
        remaining = conn.lease_ttl(previous) if previous is not None else 0
        started = time.monotonic()
        if remaining > 0 and not self._dirty:
            current = conn.get(self.key)
            if current is not None and current.lease == previous:
                with self._lock:
                    self._deadline = started + remaining
                    self._awaiting = None
                return
        lease_id = previous if previous is not None and remaining > 0 else conn.grant(self.ttl)
        record = _stamped(self._record)
        try:
            revision = self._put(lease_id, encode(record), replace=replace)
        except BaseException:
            if lease_id != previous:
                try:
                    conn.revoke(lease_id)
                except DiscoveryError:
                    # The write may have landed all the same (a member cut off from the
                    # cluster after replicating it never answers): it would be ours.
                    self._unsure_leases.add(lease_id)
            raise
        self._unsure_leases.clear()  # a later write cannot land any more: ours is in
        with self._lock:
            self._lease_id = lease_id
            self._record = record
            self._mod_revision = revision
            self._dirty = False
            self._deadline = started + (remaining if lease_id == previous else self.ttl)
            self._awaiting = None
            if lease_id != previous:
                self._registrations += 1
        if lease_id != previous:
            self._metrics.lease_granted()
        if self._keeper is not None and previous != lease_id:
            self._keeper.track_lease(self, previous, lease_id)

    def _put(self, lease_id: int, value: bytes, *, replace: bool) -> int:
        """Write ``value`` on ``lease_id`` unless another live lease holds the key.

        Returns the revision of the write. The key counts as ours when it is on this
        lease, on our previous one (which may still be expiring after an outage) or on
        the lease of an attempt whose answer never came.
        """
        conn = self._conn
        result = (conn.replace if replace else conn.create)(self.key, value, lease_id)
        if not result.succeeded:
            found = result.previous
            if found is None:  # deleted since: try again
                return self._put(lease_id, value, replace=replace)
            holder = found.lease
            if not holder or holder not in (lease_id, self._lease_id, *self._unsure_leases):
                remaining = conn.lease_ttl(holder) if holder else -1
                raise EngineConflictError(self.engine_id, self.key, holder, remaining)
            result = conn.update(self.key, value, lease_id, mod_revision=found.mod_revision)
            if not result.succeeded:  # changed between the two transactions: look again
                return self._put(lease_id, value, replace=replace)
        holder = result.previous.lease if result.previous is not None else 0
        if holder and holder != lease_id:
            # The previous holder (someone we replaced, or our own expiring lease) goes.
            conn.revoke(holder)
            if holder != self._lease_id and holder not in self._unsure_leases:
                log.warning("%s: replaced the record held by lease %016x", self.engine_id, holder)
        return result.revision

    def _publish(self) -> None:
        """Write the current record over our own key only (mod revision unchanged)."""
        with self._lock:
            record, lease_id, mod = self._record, self._lease_id, self._mod_revision
        if lease_id is None:
            return
        result = self._conn.update(self.key, encode(record), lease_id, mod_revision=mod)
        if not result.succeeded:
            self._lose("the key was changed or deleted by someone else")
            return
        with self._lock:
            self._mod_revision = result.revision
            if self._record is record:
                self._dirty = False

    def _lose(self, reason: str) -> None:
        self._set_state(RegistrationState.LOST, reason)
        if self._keeper is not None:
            self._keeper.schedule(self, time.monotonic())

    # -- keeper callbacks --------------------------------------------------------------

    def _step(self, keeper: _Keeper) -> None:
        """One scheduled turn: keep the lease alive, or try to register again."""
        with self._op_lock:
            if self._state is not RegistrationState.CLOSED:
                self._step_locked(keeper)

    def _step_locked(self, keeper: _Keeper) -> None:
        state = self._state
        now = time.monotonic()
        if state is RegistrationState.REGISTERED and now >= self._deadline:
            self._set_state(RegistrationState.LOST, "no keepalive answered within the TTL")
            state = RegistrationState.LOST
        if state is RegistrationState.REGISTERED:
            self._keepalive(keeper, now)
        else:
            keeper.recover(self)

    def _keepalive(self, keeper: _Keeper, now: float) -> None:
        if self._awaiting is not None and (
            self._awaiting_on is not keeper.stream or now - self._awaiting >= self._interval
        ):
            # The stream it went out on ended (the request died with it), or it is unanswered
            # for TTL/3 on the live stream, which is then dead. Either way: send again.
            self._metrics.keepalive_failed()
            keeper.reset_stream(self._awaiting_on)
            self._awaiting = None
        lease_id = self._lease_id
        stream = keeper.send_keepalive(lease_id) if lease_id is not None else None
        if stream is not None:
            if self._awaiting is None:
                self._awaiting, self._awaiting_on = now, stream
            at = now + self._interval
            if keeper.stream is not stream:
                # It died before _awaiting_on named it (a refused connection fails at
                # once), so the keeper's resend missed this lease: send again soon.
                at = keeper.reopen_at()
        else:
            self._metrics.keepalive_failed()
            at = now + _RETRY_MAX
        if self._dirty:
            try:
                self._publish()
            except DiscoveryError as exc:
                log.warning("%s: publishing update failed: %s", self.engine_id, explain(exc))
        keeper.schedule(self, min(at, max(now, self._deadline)))

    def _keepalive_answered(self, keeper: _Keeper, lease_id: int, ttl: int) -> None:
        with self._lock:
            if lease_id != self._lease_id or self._state is not RegistrationState.REGISTERED:
                return
            alive = ttl > 0
            if alive:
                sent = self._awaiting if self._awaiting is not None else time.monotonic()
                self._deadline = sent + ttl
                self._awaiting = None
                self._last_keepalive = datetime.now(UTC)
        if alive:
            self._metrics.keepalive_ok(self.engine_id)
        else:
            self._lose(f"lease {lease_id:016x} no longer exists (expired or revoked)")

    def _recover_job(self, keeper: _Keeper) -> None:
        with self._op_lock:
            if self._state is not RegistrationState.CLOSED:
                self._recover(keeper)

    def _recover(self, keeper: _Keeper) -> None:
        try:
            self._write(replace=False)
        except DiscoveryError as exc:
            reason = explain(exc)
            with self._lock:
                self._last_error = reason
                delay = self._retry_delay
                self._retry_delay = min(_RETRY_MAX, delay * 2)
            if isinstance(exc, EngineConflictError):
                delay = self._interval  # someone else holds the id: no need to hurry
            if not isinstance(exc, EtcdUnavailableError):
                log.warning("%s: cannot register again: %s", self.engine_id, reason)
            keeper.schedule(self, time.monotonic() + random.uniform(delay / 2, delay))
            return
        with self._lock:
            self._retry_delay = _RETRY_MIN
            self._last_error = None
        self._metrics.reregistered()
        self._set_state(RegistrationState.REGISTERED)
        # A surviving lease may be close to its end: renew it at once.
        keeper.schedule(self, time.monotonic())


def _stamped(record: EngineRecord) -> EngineRecord:
    """The record stamped with the current time as its registration time."""
    return replace(record, registered_at=datetime.now(UTC))


_live_registrations: weakref.WeakSet[Registration] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # Normal interpreter exit revokes leases; SIGTERM needs deregister_on_signals().
    for registration in list(_live_registrations):
        registration.close(timeout=_EXIT_TIMEOUT)


def register_engine(
    endpoint: InferenceEngineEndpoint,
    *,
    engine_id: str | None = None,
    ttl: float = 10.0,
    labels: Mapping[str, str] | None = None,
    settings: Settings | None = None,
    connection: Connection | None = None,
    replace: bool = False,
    metrics: MetricsHooks | None = None,
) -> Registration:
    """Register ``endpoint`` in etcd under a lease and keep it alive until closed.

    Everything is validated before anything is written. Raises EngineConflictError when
    another live lease holds ``engine_id`` (unless ``replace``), EtcdUnavailableError when
    no member answers within ``settings.dial_timeout``, PermissionDeniedError on auth
    problems. ``connection`` shares one client among many registrations and watchers;
    otherwise one is built from ``settings`` (default: ``Settings.from_env()``).
    ``metrics`` exports this registration's state and keepalives (see ``Metrics``).
    """
    record = EngineRecord(
        engine_id=default_engine_id() if engine_id is None else validate_engine_id(engine_id),
        endpoint=endpoint,
        labels=labels or {},
    )
    encode(record)  # size limit
    owns = connection is None
    conn = Connection(settings) if connection is None else connection
    try:
        registration = Registration(
            record, ttl=ttl, connection=conn, owns_connection=owns, metrics=metrics
        )
    except BaseException:
        if owns:
            conn.close()
        raise
    registration._start(replace=replace)
    return registration


def register_dynamic_engine(
    engine: DynamicEngineLike,
    coordinator_address: str,
    *,
    logical_data_parallel_size: int = 1,
    **kwargs: Any,
) -> Registration:
    """Register a running Megatron ``DynamicInferenceEngine``: call it once it is ready.

    The endpoint is built with ``InferenceEngineEndpoint.from_engine``; the other keyword
    arguments are those of :func:`register_engine`.
    """
    endpoint = InferenceEngineEndpoint.from_engine(
        coordinator_address, engine, logical_data_parallel_size=logical_data_parallel_size
    )
    return register_engine(endpoint, **kwargs)


def deregister(
    engine_id: str,
    settings: Settings | None = None,
    *,
    connection: Connection | None = None,
) -> int | None:
    """Remove an engine's record from outside its process (an operator's action).

    Revokes the lease the record is bound to (deleting it and every other key on that
    lease), or deletes the key when it has no lease. Returns the revoked lease id, 0 when
    the key had no lease, or None when no such engine is registered. A live registrar
    writes its record again (that is its self-healing): stop the engine to remove it for
    good. Uses ``connection`` if given, else one built from ``settings``.
    """
    conn = connection if connection is not None else Connection(settings)
    key = conn.settings.keyspace.key(engine_id)
    try:
        found = conn.call(lambda: conn.get(key))
        if found is None:
            return None
        if found.lease:
            conn.call(lambda: conn.revoke(found.lease))
        else:
            conn.call(lambda: conn.delete(key))
        return found.lease
    finally:
        if connection is None:
            conn.close()


async def aregister_engine(endpoint: InferenceEngineEndpoint, **kwargs: Any) -> Registration:
    """:func:`register_engine` without blocking the event loop."""
    return await asyncio.to_thread(register_engine, endpoint, **kwargs)
