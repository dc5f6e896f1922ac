"""One engine's record in etcd: its registration state machine, status and drain.

A ``Registration`` writes its record on the lease of a ``Session`` (a private one unless
the caller shares one) and keeps it there: the session keeps the lease alive and, when
the lease is lost, writes every member's record again; the registration's own watch
(``_writes/recordwatch.py``) notices outside changes of its key.

Registration states (``RegistrationState``), as the transition table ``_TRANSITIONS``
below says and nothing else::

    registering ──written──▶ registered ──lease lost / record lost──▶ lost
         │                       ▲                                    │
         │                       └──────────── written again ◀────────┘
         └─ any state ──close (or a drain's deadline)──▶ closed

Draining and pausing are not states of the registration but the ``status`` of its record
(``EngineStatus``: starting / ready / draining / paused): it is what routers read, it
survives a lost and regained lease (the record is written again with the status it had),
and an operator can change it from outside (``discovery drain`` / ``undrain`` / ``pause``
/ ``resume``). The same holds for the record's ``weight_version``, which a status change
can set in the same write. The registrar adopts such a change and never writes it back
on its own; only the engine's own explicit ``set_status`` / ``pause`` / ``resume`` /
``drain`` / ``update`` calls write them, and each write is a compare on the revision the
registrar last saw, so an outside change it has not seen is never overwritten (it is
read, adopted, and the fields the caller set explicitly applied on top). A
``weight_version`` is never lowered without ``force``: the check runs against the stored
value the compare is made on, so an outside write of a higher version that the registrar
had not seen refuses the engine's lower one (``InvalidRecordError``; the stored record is
adopted).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from discovery._dispatch import Listeners
from discovery._errors import (
    ClosedError,
    ConfigurationError,
    DiscoveryError,
    EngineConflictError,
    EtcdNoSpaceError,
    InvalidRecordError,
    RecordDecodeError,
    RequestTooLargeError,
)
from discovery._etcd.port import (
    REQUEST_OVERHEAD,
    EtcdPort,
    KeyValue,
    LeaseGone,
    PutResult,
    write_bytes,
)
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._records.codec import KeySpace, encode
from discovery._records.endpoint import DynamicEngineLike, InferenceEngineEndpoint
from discovery._records.handoff import EngineRole, KvLayout, KvTransferBackend, validate_role
from discovery._records.record import (
    EndpointLike,
    EngineRecord,
    EngineStatus,
    check_version_order,
    drain_deadline_after,
    endpoint_parts,
    validate_engine_id,
    validate_status,
    validate_weight_version,
)
from discovery._settings import Settings
from discovery._writes.lease import LeaseKeeper
from discovery._writes.recordwatch import RecordWatch, record_watch_for
from discovery._writes.session import Session, check_ttl

__all__ = [
    "Registration",
    "RegistrationHealth",
    "RegistrationState",
    "aregister_engine",
    "default_engine_id",
    "register_dynamic_engine",
    "register_engine",
]

log = logging.getLogger(__name__)

_DEFAULT_TTL = 10.0
_PUBLISH_ATTEMPTS = 8  # outside changes racing one publish: give up (and retry later)
_NOTHING: Mapping[str, Any] = MappingProxyType({})
_SHORTEN = "shorten the record's labels and extra fields, or raise the members' limit"


class RegistrationState(enum.StrEnum):
    """Where a Registration is in its lifecycle."""

    REGISTERING = "registering"
    REGISTERED = "registered"
    LOST = "lost"
    CLOSED = "closed"


class _Event(enum.Enum):
    """What happens to a registration; ``_TRANSITIONS`` says what each one does."""

    WRITTEN = "record written on a live lease"
    LEASE_LOST = "lease expired, revoked or unanswered past its TTL"
    RECORD_LOST = "record deleted or taken over while the lease lives"
    CLOSE = "closed (or its drain deadline passed)"


_R = RegistrationState
_TRANSITIONS: Mapping[tuple[RegistrationState, _Event], RegistrationState] = {
    (_R.REGISTERING, _Event.WRITTEN): _R.REGISTERED,
    (_R.REGISTERING, _Event.CLOSE): _R.CLOSED,
    (_R.REGISTERED, _Event.LEASE_LOST): _R.LOST,
    (_R.REGISTERED, _Event.RECORD_LOST): _R.LOST,
    (_R.REGISTERED, _Event.CLOSE): _R.CLOSED,
    (_R.LOST, _Event.WRITTEN): _R.REGISTERED,
    (_R.LOST, _Event.CLOSE): _R.CLOSED,
}
"""(state, event) -> next state. A pair not listed changes nothing: a second loss while
lost is not counted, nothing leaves ``closed``."""


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
    status: EngineStatus = EngineStatus.READY
    """The record's status (the registrar's view: its own writes and adopted changes)."""
    weight_version: int | None = None
    """The record's weight version (the same view), None when none was set."""
    cluster_changes: int = 0
    """Times another etcd cluster (data wiped, a snapshot restored) made the record be
    written again on a fresh lease."""


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


class Registration:
    """One engine's record in etcd, kept on a lease until close().

    Create it with :func:`register_engine`. Thread-safe. Use as a context manager (sync
    or async) to deregister on exit. State changes go to ``subscribe()`` callbacks on a
    background thread: ``LOST`` when the lease or the record is gone, ``REGISTERED`` when
    the record is written again, ``CLOSED`` when closed (also at a drain's deadline).
    """

    def __init__(
        self,
        record: EngineRecord,
        *,
        session: Session,
        private: bool,
        metrics: MetricsHooks | None = None,
    ) -> None:
        self._record = record
        self._accepted = record  # the record as etcd holds it: kept when etcd refuses ours
        self._session = session
        self._private = private  # the session is ours alone: closing us closes it
        self._conn: EtcdPort = session.connection
        self._keyspace: KeySpace = session.keyspace
        self._metrics = metrics or NO_METRICS
        self.key = self._keyspace.key(record.engine_id)
        self._watch: RecordWatch | None = None  # our key's watch, once written
        self.ttl = session.ttl
        self._lock = threading.Lock()
        self._state = RegistrationState.REGISTERING
        self._state_changed = threading.Condition(self._lock)
        self._lease_id: int | None = None  # the lease our record is on
        self._mod_revision = 0  # the revision of the record as we last wrote or saw it
        self._dirty = False  # a change not yet published
        # ...and the owned-from-outside fields (status, drain_deadline, weight_version) the
        # engine's code set explicitly in it: they go on top of an outside change.
        self._pending: Mapping[str, Any] = _NOTHING
        self._forced = False  # the pending weight_version may lower the stored one
        self._changes = 0  # _change calls so far; the pending ones are _pending_from and on
        self._pending_from = 0
        self._refused: tuple[int, int, InvalidRecordError] | None = None
        self._prepared_from: EngineRecord | None = None  # what _prepare_write last stamped
        self._retry_at = 0.0  # a conflicting id is tried again at this time
        self._listeners: Listeners[Callable[[RegistrationState], None]] = Listeners()
        self._registrations = 0
        self._losses = 0
        self._cluster_changes = 0
        self._last_error: str | None = None
        self._keeper: LeaseKeeper = session._keeper
        self._closed = threading.Event()  # set once close() has removed the record

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
    def status(self) -> EngineStatus:
        """The record's status (``EngineStatus``), also when set from outside."""
        return self._record.status

    @property
    def weight_version(self) -> int | None:
        """The record's weight version (also when set from outside); None when unset."""
        return self._record.weight_version

    @property
    def session(self) -> Session:
        """The session whose lease holds the record (a private one unless shared)."""
        return self._session

    @property
    def lease_id(self) -> int | None:
        """The lease the record is on, or None while there is none."""
        return self._lease_id

    @property
    def state(self) -> RegistrationState:
        """The current state."""
        return self._state

    def health(self) -> RegistrationHealth:
        """State, lease, status, counters and the last error, for a health endpoint."""
        with self._lock:
            return RegistrationHealth(
                engine_id=self.engine_id,
                key=self.key,
                state=self._state,
                lease_id=self._lease_id,
                registrations=self._registrations,
                losses=self._losses,
                last_error=self._last_error,
                last_keepalive=self._session.last_keepalive,
                status=self._record.status,
                weight_version=self._record.weight_version,
                cluster_changes=self._cluster_changes,
            )

    def subscribe(self, callback: Callable[[RegistrationState], None]) -> Callable[[], None]:
        """Call ``callback(new_state)`` on every state change; returns an unsubscribe."""
        return self._listeners.add(callback)

    def wait_for_state(self, state: RegistrationState, timeout: float | None = None) -> bool:
        """Block until the state is ``state``; False on timeout.

        ``CLOSED`` is reached when the close has finished: the key is deleted (or the
        close gave up on an unreachable etcd), not merely begun.
        """
        if state is RegistrationState.CLOSED:
            return self._closed.wait(timeout)  # set only after the state became CLOSED
        with self._state_changed:
            return self._state_changed.wait_for(lambda: self._state == state, timeout)

    def __repr__(self) -> str:
        lease = f"{self._lease_id:016x}" if self._lease_id else None
        return (
            f"<Registration {self.engine_id!r} {self._state} {self._record.status} "
            f"lease={lease} key={self.key!r}>"
        )

    # -- changes -----------------------------------------------------------------------

    def update(
        self,
        *,
        endpoint: InferenceEngineEndpoint | EndpointLike | None = None,
        labels: Mapping[str, str] | None = None,
        role: EngineRole | str | None = None,
    ) -> None:
        """Publish a changed endpoint, labels and/or role atomically under the same lease.

        ``endpoint`` may be Megatron-Core's own record (any object with its ``to_dict()``);
        keys of it this version does not know are stored too. Keys of the stored value
        this version does not know stay as they are. Raises EtcdUnavailableError when etcd
        cannot be reached in time, EtcdNoSpaceError when its space quota is full: the
        change is kept and published as soon as etcd takes it. Raises RequestTooLargeError
        when the record is over the members' request limit: the change is dropped, and the
        last record etcd accepted stays (kept alive, written again after a lost lease).
        """
        parts = None if endpoint is None else endpoint_parts(endpoint)
        role = None if role is None else validate_role(role)

        def change(record: EngineRecord) -> EngineRecord:
            record = replace(
                record,
                labels=record.labels if labels is None else labels,
                role=record.role if role is None else role,
            )
            if parts is None:
                return record
            new, extra, extra_capabilities = parts
            return replace(
                record,
                endpoint=new,
                extra={**record.extra, **extra},
                extra_capabilities=extra_capabilities or record.extra_capabilities,
            )

        self._change(change)

    def set_status(
        self,
        status: EngineStatus | str,
        *,
        weight_version: int | None = None,
        force: bool = False,
    ) -> None:
        """Publish a new status and, if given, a new ``weight_version``, in one atomic write.

        ``status``: ``starting``, ``ready``, ``paused``, or ``draining`` without deadline.
        An explicit call of the engine's code: it overrides an operator's earlier change.
        Leaving ``draining`` cancels a pending drain deadline. ``weight_version`` None
        keeps the record's version. A version lower than the stored one (or than one an
        outside writer stored meanwhile) raises InvalidRecordError naming both, unless
        ``force``. Raises like ``update()`` otherwise.
        """
        own: dict[str, Any] = {"status": validate_status(status), "drain_deadline": None}
        if weight_version is not None:
            own["weight_version"] = validate_weight_version(weight_version)
        self._change(lambda record: replace(record, **own), own=own, force=force)

    def pause(self) -> None:
        """Mark the record ``paused``: routers stop picking the engine, which keeps its lease.

        For a weight update or memory suspended for training; requests already picked
        keep their engine. ``resume()`` makes it ``ready`` again. Raises like ``update()``.
        """
        self.set_status(EngineStatus.PAUSED)

    def resume(self, weight_version: int | None = None, *, force: bool = False) -> None:
        """Mark the record ``ready`` again, on ``weight_version`` if given, in one write.

        A refit is ``pause()``, the new weights loaded, then ``resume(new_version)``: no
        reader ever sees the engine ready with the old version after the new one was
        announced. Raises like ``set_status()``.
        """
        self.set_status(EngineStatus.READY, weight_version=weight_version, force=force)

    def switch_status(self, before: EngineStatus, after: EngineStatus) -> bool:
        """Publish ``after`` only if the status is ``before``; whether it was.

        Unlike ``set_status``, it yields to an outside change it meets (an operator's
        drain made meanwhile stays). Raises like ``update()``.
        """
        switched = False

        def change(record: EngineRecord) -> EngineRecord:
            nonlocal switched
            switched = record.status is before
            return replace(record, status=after) if switched else record

        self._change(change)  # no field of its own: an outside change met wins
        return switched

    def drain(self, timeout: float) -> None:
        """Mark the record ``draining`` now, and close when ``timeout`` seconds have passed.

        Routers stop picking the engine as soon as they see the change; requests already
        picked keep their engine. The lease is revoked (the key goes) at the deadline, or
        at ``close()`` if that comes first. ``timeout`` 0 closes at once. Raises like
        ``update()``; the deadline holds either way.
        """
        own: dict[str, Any] = {
            "status": EngineStatus.DRAINING,
            "drain_deadline": drain_deadline_after(timeout),
        }
        try:
            self._change(lambda record: replace(record, **own), own=own)
        finally:
            if not timeout:
                self.close()

    def _change(
        self,
        change: Callable[[EngineRecord], EngineRecord],
        *,
        own: Mapping[str, Any] = _NOTHING,
        force: bool = False,
    ) -> None:
        """Apply ``change`` and publish it; ``own``: the owned fields it sets explicitly."""
        with self._lock:
            if self._state is RegistrationState.CLOSED:
                raise ClosedError(f"registration {self.engine_id!r} is closed")
            record = change(self._record)
            if record is self._record:
                return  # nothing to change
            if "weight_version" in own:
                check_version_order(self._record.weight_version, record.weight_version, force=force)
            value = encode(record)  # refuses a bad or oversized record before any change
            self._check_request(value)
            self._record = record
            self._dirty = True
            self._changes += 1
            mine = self._changes
            if own:
                if not self._pending:
                    self._pending_from = mine
                self._pending = MappingProxyType({**self._pending, **own})
                self._forced = self._forced or force
            registered = self._state is RegistrationState.REGISTERED
        # A drain deadline is armed once this write is done: one already due (drain(0))
        # closed the registration on a pool thread under the write, whose call then failed
        # on the closed connection ("Channel closed!"). A cancel goes first, as before.
        arm_after = registered and record.drain_deadline is not None
        if not arm_after:
            self._status_changed()
        if not registered:
            return
        try:
            self._conn.call(self._publish)
        except DiscoveryError as exc:
            if not isinstance(exc, RequestTooLargeError):
                self._session._publish_later(self)
            self._write_refused(exc)
            raise
        finally:
            if arm_after:
                self._status_changed()
        with self._lock:
            refused = self._refused
        if refused is not None and refused[0] <= mine <= refused[1]:
            raise refused[2]

    def _published(self) -> None:
        """What was pending is in etcd now (call under the lock)."""
        self._dirty = False
        self._pending = _NOTHING
        self._forced = False
        self._last_error = None  # a refusal (NOSPACE, too large) is over

    # -- lifecycle ---------------------------------------------------------------------

    def _start(self, value: bytes, *, replace: bool) -> None:
        """Write the record (``value``: its encoding) then watch its key.

        Retries until settings.dial_timeout.
        """
        try:
            self._conn.call(lambda: self._write_first(value, replace=replace))
        except BaseException:
            self._session._leave(self)
            self._fire(_Event.CLOSE)
            self._closed.set()
            raise
        # A connection of our own serves this one key: watch only it (etcd then sends us
        # nothing about other engines); a shared connection watches the namespace.
        alone = self._private and self._session._owns_connection
        self._watch = record_watch_for(self._conn, self.key if alone else self._keyspace.prefix)
        self._watch.add(self, self._mod_revision)
        self._status_changed()

    def _write_first(self, value: bytes, *, replace: bool) -> None:
        lease_id = self._session._join(self)
        try:
            revision = self._put(lease_id, value, replace=replace)
        except LeaseGone:
            self._session._lease_gone(lease_id)
            raise
        with self._lock:
            self._lease_id = lease_id
            self._mod_revision = revision
            self._accepted = self._record
            self._published()
            self._registrations += 1
        self._fire(_Event.WRITTEN)

    def close(self, timeout: float | None = None) -> None:
        """Remove the record and stop keeping it. Idempotent.

        Revokes a private lease (on a shared session: deletes this key only). Returns
        once etcd has deleted the key, or after ``timeout`` (default
        settings.dial_timeout) when etcd cannot be reached: the key then expires within
        the TTL (on a shared session, when the session ends).
        """
        deadline = time.monotonic() + (self._conn.dial_timeout if timeout is None else timeout)
        with self._lock:
            lease_id = self._lease_id
        mark = self._stopping_mark()  # while the state still says whether the record is ours
        if not self._fire(_Event.CLOSE):
            self._closed.wait(timeout)  # another thread (a drain deadline) is closing it
            return
        try:
            if mark is not None and lease_id is not None:
                self._session.mark_stopping([mark], lease_id, deadline)
            self._remove(max(0.0, deadline - time.monotonic()))
        finally:
            self._closed.set()

    def _stopping_mark(self) -> tuple[str, bytes, int] | None:
        """The ``stopping`` mark to write before a ready record goes: (key, value, revision).

        None when there is nothing to announce: the record is not in etcd on our lease, or
        it says already that the engine takes nothing (draining, paused, ...).
        """
        with self._lock:
            record = self._record
            if (
                self._state is not RegistrationState.REGISTERED
                or self._lease_id is None
                or record.status is not EngineStatus.READY
            ):
                return None
            value = encode(replace(record, status=EngineStatus.STOPPING))
            return self.key, value, self._mod_revision

    def _remove(self, timeout: float) -> None:
        self._keeper.cancel(self)
        if self._watch is not None:
            self._watch.remove(self)
        if self._private:
            self._session.close(timeout)
            log.info("deregistered %s", self.engine_id)
            return
        with self._session._op_lock:  # a repair writing our record finishes first
            self._session._leave(self)
            lease_id = self._lease_id
        if lease_id is None:
            return
        try:
            started = time.monotonic()
            self._conn.call(lambda: self._conn.delete_owned(self.key, lease_id), timeout=timeout)
            self._metrics.revoked(time.monotonic() - started)
            log.info(
                "deregistered %s (key deleted; lease %016x is shared)", self.engine_id, lease_id
            )
        except DiscoveryError as exc:
            log.warning(
                "could not delete the key of %s (%s); it goes when its session ends",
                self.engine_id,
                exc,
            )

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

    # -- the state machine ---------------------------------------------------------------

    def _fire(self, event: _Event, reason: str | None = None) -> bool:
        """Apply ``event`` by the transition table; whether the state changed."""
        with self._lock:
            old = self._state
            new = _TRANSITIONS.get((old, event))
            if new is None:
                return False
            self._state = new
            if new is RegistrationState.LOST:
                self._losses += 1
                self._last_error = reason
            elif new is RegistrationState.REGISTERED:
                self._last_error = None
            self._state_changed.notify_all()
        self._metrics.registration_state(self.engine_id, new.value)
        level = logging.WARNING if new is RegistrationState.LOST else logging.INFO
        log.log(level, "%s: %s -> %s%s", self.engine_id, old, new, f" ({reason})" if reason else "")
        for listener in self._listeners:
            self._keeper.dispatcher.submit(listener, new)
        return True

    def _status_changed(self) -> None:
        """Export the status, and (re)arm or cancel the drain deadline it carries."""
        record = self._record
        self._metrics.registration_status(self.engine_id, record.status.value)
        if record.drain_deadline is None:
            self._keeper.cancel(self)
        else:
            left = (record.drain_deadline - datetime.now(UTC)).total_seconds()
            self._keeper.schedule(self, time.monotonic() + max(0.0, left))

    def turn(self, keeper: LeaseKeeper) -> None:
        """The drain deadline passed: close (revoking) on a pool thread."""
        keeper.submit(self, lambda _: self.close())

    # -- writes ------------------------------------------------------------------------

    def _put(self, lease_id: int, value: bytes, *, replace: bool) -> int:
        """Write ``value`` on ``lease_id`` unless another live lease holds the key.

        Returns the revision of the write. The key counts as ours when it is on this
        lease or on our previous one (which may still be expiring after an outage).
        """
        conn = self._conn
        result = (conn.replace if replace else conn.create)(self.key, value, lease_id)
        if not result.succeeded:
            found = result.previous
            if found is None:  # deleted since: try again
                return self._put(lease_id, value, replace=replace)
            holder = found.lease
            if not holder or holder not in (lease_id, self._lease_id):
                raise self._conflict(holder)
            result = conn.update(self.key, value, lease_id, mod_revision=found.mod_revision)
            if not result.succeeded:  # changed between the two transactions: look again
                return self._put(lease_id, value, replace=replace)
        holder = result.previous.lease if result.previous is not None else 0
        if holder and holder != lease_id and not conn.lease_info(holder).keys:
            # The previous holder (someone we replaced, or our own expiring lease) goes, so
            # its keepalive learns at once; a lease other engines share is left alone (its
            # registrar sees the takeover on its own watch).
            conn.revoke(holder)
        if holder and holder not in (lease_id, self._lease_id):
            log.warning("%s: replaced the record held by lease %016x", self.engine_id, holder)
        return result.revision

    def _conflict(self, holder: int) -> EngineConflictError:
        """The error for our key held by lease ``holder`` (0: a key without a lease)."""
        remaining = self._conn.lease_info(holder).ttl if holder else -1
        return EngineConflictError(self.engine_id, self.key, holder, remaining)

    def _publish(self) -> None:
        """Write the current record over our own key (compare on the revision we know)."""
        for _ in range(_PUBLISH_ATTEMPTS):
            with self._lock:
                record, lease_id, mod = self._record, self._lease_id, self._mod_revision
                if self._state is not RegistrationState.REGISTERED or lease_id is None:
                    return  # written with the record when it is registered again
            result = self._conn.update(self.key, encode(record), lease_id, mod_revision=mod)
            if result.succeeded:
                with self._lock:
                    self._mod_revision = max(self._mod_revision, result.revision)
                    self._accepted = record
                    # Equal, not identical: our record watch may have adopted this very
                    # write (a copy of it) before its answer came back.
                    if self._record == record:
                        self._published()
                return
            found = result.previous
            if found is None or found.lease != lease_id:
                self._record_lost("the key was deleted or taken over by someone else")
                return
            if found.mod_revision < mod:
                # Older than our own write: etcd's history went back (a snapshot restored
                # brought our lease back too). No outside change: the record watch's
                # listing says so, and the session writes our record again (rebased()).
                break
            self._adopt(found)  # an outside change we had not seen: ours goes on top
        self._session._publish_later(self)

    def _publish_now(self) -> None:
        """Publish a change that etcd could not take earlier (on a pool thread)."""
        try:
            self._conn.call(self._publish, timeout=0)
        except DiscoveryError as exc:
            if not self._write_refused(exc):
                log.warning("%s: publishing a change failed: %s", self.engine_id, exc)
            if not isinstance(exc, RequestTooLargeError):
                self._session._publish_later(self)

    def _write_refused(self, exc: DiscoveryError) -> bool:
        """Whether etcd refused our write for good (NOSPACE, too large): then say so once.

        The lease and the record etcd holds stay. Under NOSPACE the change is published
        once etcd takes writes again; a change too large is dropped: the record goes back
        to the last one etcd accepted, which is kept alive (and written again after a
        lease loss) instead.
        """
        if not isinstance(exc, (EtcdNoSpaceError, RequestTooLargeError)):
            return False
        too_large = isinstance(exc, RequestTooLargeError)
        reason = str(exc)
        with self._lock:
            first = self._last_error != reason
            self._last_error = reason
            if too_large:
                self._record = self._accepted
                self._dirty = False
                self._pending = _NOTHING
                self._forced = False
        if too_large:
            self._session._unpublished_done(self)
            self._status_changed()
        if first:
            kept = "the last accepted record is kept" if too_large else "a change is kept"
            log.warning("%s: %s, etcd refused a write: %s", self.engine_id, kept, reason)
        return True

    def _check_request(self, value: bytes) -> None:
        """Refuse a record whose write would be over the members' request limit."""
        size = write_bytes(self.key, value) + REQUEST_OVERHEAD
        limit = self._conn.max_request_bytes
        if size > limit:
            raise RequestTooLargeError(size, limit, _SHORTEN, "not sent: etcd would refuse it")

    # -- called by the session and the record watch -----------------------------------

    def _prepare_write(self) -> tuple[EngineRecord, bytes] | None:
        """The stamped record and its value to write again; None once closed."""
        with self._lock:
            if self._state is RegistrationState.CLOSED:
                return None
            self._prepared_from = self._record
            record = _stamped(self._record)
        return record, encode(record)

    def _written(self, lease_id: int, record: EngineRecord, result: PutResult) -> bool:
        """Take the outcome of a create-if-absent of ``record``; whether the key is ours."""
        found = result.previous
        if not result.succeeded:
            if found is None:
                return False  # deleted between the compare and the read: next turn
            if found.lease not in (lease_id, self._lease_id):
                conflict = self._conflict(found.lease)
                with self._lock:
                    self._last_error = str(conflict)
                    self._retry_at = time.monotonic() + self.ttl / 3  # no need to hurry
                log.warning("%s: cannot register again: %s", self.engine_id, conflict)
                return False
            if found.lease != lease_id:  # our old lease, not yet gone: take the key over
                # keeping what an outside writer changed on it meanwhile (an operator's
                # pause, a trainer's version), as any outside change
                self._adopt(found)
                prepared = self._prepare_write()
                if prepared is None:
                    return False
                record, value = prepared
                taken = self._conn.update(
                    self.key, value, lease_id, mod_revision=found.mod_revision
                )
                if not taken.succeeded:
                    return False
                found = None
                result = taken
        with self._lock:
            new_lease = lease_id != self._lease_id
            self._lease_id = lease_id
            self._retry_at = 0.0
            if found is None:  # written: the record is ours as we wrote it
                self._mod_revision = result.revision
                self._accepted = record
                if self._record is self._prepared_from:
                    self._record = record
                    self._published()
                else:  # changed since it was prepared: published next (below)
                    self._record = replace(self._record, registered_at=record.registered_at)
            if new_lease:
                self._registrations += 1
        if found is not None and self._adopt(found):  # it was there all along
            self._session._publish_later(self)
        if self._fire(_Event.WRITTEN):
            self._metrics.reregistered()
        if self._dirty:  # a change made while lost: the repair publishes it next
            self._session._publish_later(self)
        return True

    def _lease_lost(self, reason: str) -> None:
        self._fire(_Event.LEASE_LOST, reason)

    def _record_lost(self, reason: str) -> None:
        if self._fire(_Event.RECORD_LOST, reason):
            self._session._rewrite(self)

    def _session_closed(self) -> None:
        if self._fire(_Event.CLOSE):
            self._keeper.cancel(self)
            if self._watch is not None:
                self._watch.remove(self)
            self._closed.set()  # the session's revoke removes the record

    def observed(self, kv: KeyValue | None, revision: int) -> None:
        """The record watch saw our key change at ``revision`` (``kv`` None: deleted)."""
        with self._lock:
            if (
                self._state is not RegistrationState.REGISTERED
                or revision <= self._mod_revision
                or self._lease_id is None
            ):
                return  # our own write, an older one, or not ours to judge now
            ours = kv is not None and kv.lease == self._lease_id
        if not ours:
            self._record_lost("the key was deleted or taken over by someone else")
        elif kv is not None and self._adopt(kv):
            self._session._publish_later(self)

    def rebased(self, kv: KeyValue | None, revision: int, listing: int) -> None:
        """The record watch listed another etcd cluster, or an older history.

        Its data was wiped, or a snapshot restored: ``kv`` is what it holds for our key.

        Our record as we wrote it there (the session already wrote it again, after its
        lease was found gone), or changed since on our lease, is kept as a watched change
        would be, and the session checks its lease holds no other key; anything else
        (absent, restored from the past, on another lease) and the session writes every
        record again on a fresh lease.
        """
        with self._lock:
            if self._state is RegistrationState.CLOSED:
                return
            kept = (
                self._state is RegistrationState.REGISTERED
                and kv is not None
                and kv.lease == self._lease_id
                and kv.mod_revision >= self._mod_revision
            )
        held = f"revision {kv.mod_revision}" if kv is not None else "absent"
        reason = (
            f"etcd's data was replaced (a wiped or restored cluster at revision {revision}: "
            f"{self.engine_id}'s record {held})"
        )
        if kept and kv is not None:
            self.observed(kv, kv.mod_revision)
            self._session._check_lease_keys(reason, revision, listing)
        else:
            self._session._cluster_changed(reason, revision, listing)

    def _rebase(self, reason: str) -> None:
        """The session writes our record again on a fresh lease.

        The old history's revision means nothing on the new one.
        """
        with self._lock:
            self._mod_revision = 0
            self._cluster_changes += 1
        self._fire(_Event.LEASE_LOST, reason)

    def _written_since(self, revision: int, lease_id: int) -> bool:
        """Whether our record is registered on ``lease_id``, written after ``revision``."""
        with self._lock:
            return (
                self._state is RegistrationState.REGISTERED
                and self._lease_id == lease_id
                and self._mod_revision > revision
            )

    def _adopt(self, kv: KeyValue) -> bool:
        """Take an outside change of our key; whether ours must be written over it.

        Takes its revision, the keys this version does not know, and the fields outside
        writers own (status, drain deadline, weight version), except those the engine's
        code has just set itself (they go on top). A pending weight version lower than
        the one found is refused (unless forced): the engine's whole pending status
        change is dropped and what was found is kept.
        """
        try:
            found = self._keyspace.decode(kv.key, kv.value)
        except RecordDecodeError as exc:
            log.warning(
                "%s: an outside write broke the record (%s); writing ours", self.engine_id, exc
            )
            found = None
        refused = None
        with self._lock:
            if kv.mod_revision <= self._mod_revision:
                return False
            self._mod_revision = kv.mod_revision
            if found is None:
                self._dirty = True
                return True
            self._accepted = self._accepted.adopting(found)
            before, pending = self._record, self._pending
            if "weight_version" in pending and not self._forced:
                try:
                    check_version_order(
                        found.weight_version, pending["weight_version"], force=False
                    )
                except InvalidRecordError as exc:
                    refused = exc
                    self._refused = (self._pending_from, self._changes, exc)
                    pending = self._pending = _NOTHING
                    self._forced = False
            self._record = replace(self._record.adopting(found), **pending)
            if pending:
                self._dirty = True
        if refused is not None:
            log.warning("%s: its own status change is refused: %s", self.engine_id, refused)
        changed = [
            f"{name} {old} -> {new}"
            for name, old, new in (
                ("status", before.status, self._record.status),
                ("weight_version", before.weight_version, self._record.weight_version),
            )
            if old != new and name not in pending
        ]
        if changed:
            deadline = self._record.drain_deadline
            log.info(
                "%s: %s, changed from outside%s",
                self.engine_id,
                ", ".join(changed),
                f" (until {deadline:%H:%M:%S} UTC)" if deadline else "",
            )
        self._status_changed()
        return bool(pending)


def _stamped(record: EngineRecord) -> EngineRecord:
    """The record stamped with the current time as its registration time."""
    return replace(record, registered_at=datetime.now(UTC))


def register_engine(
    endpoint: InferenceEngineEndpoint | EndpointLike,
    *,
    engine_id: str | None = None,
    ttl: float | None = None,
    labels: Mapping[str, str] | None = None,
    status: EngineStatus | str = EngineStatus.READY,
    weight_version: int | None = None,
    role: EngineRole | str = EngineRole.AGGREGATED,
    kv_transfer_backend: KvTransferBackend | str | None = None,
    kv_layout: KvLayout | None = None,
    settings: Settings | None = None,
    connection: EtcdPort | None = None,
    session: Session | None = None,
    replace: bool = False,
    metrics: MetricsHooks | None = None,
) -> Registration:
    """Register ``endpoint`` in etcd under a lease and keep it alive until closed.

    ``endpoint`` is our ``InferenceEngineEndpoint`` or Megatron-Core's own (any object
    with its ``to_dict()``; keys of it this version does not know are stored too).
    Everything is validated before anything is written. ``status`` is what routers see
    (``starting`` until the engine takes requests, then ``set_status("ready")``);
    ``weight_version`` the version of the weights it serves (a non-negative integer, see
    ``Registration.resume``). ``role``, ``kv_transfer_backend`` and ``kv_layout`` say which
    engines it can hand a request's KV to or take it from (see ``handoff_problem``).
    ``ttl`` (default 10 s) sizes the registration's own lease; with ``session`` the
    record goes on that shared lease instead (``ttl``, ``settings`` and ``connection``
    are the session's). Raises EngineConflictError when another live lease holds
    ``engine_id`` (unless ``replace``), EtcdUnavailableError when no member answers within
    ``settings.dial_timeout``, PermissionDeniedError on auth problems. ``connection``
    shares one client among many registrations and watchers; otherwise one is built from
    ``settings`` (default: ``Settings.from_env()``). ``metrics`` exports this
    registration's state, status and keepalives (see ``Metrics``).
    """
    endpoint, extra, extra_capabilities = endpoint_parts(endpoint)
    record = EngineRecord(
        engine_id=default_engine_id() if engine_id is None else validate_engine_id(engine_id),
        endpoint=endpoint,
        extra=extra,
        extra_capabilities=extra_capabilities,
        labels=labels or {},
        status=validate_status(status),
        weight_version=validate_weight_version(weight_version),
        role=role,
        kv_transfer_backend=kv_transfer_backend,
        kv_layout=kv_layout,
    )
    return register_record(
        record,
        ttl=ttl,
        settings=settings,
        connection=connection,
        session=session,
        replace=replace,
        metrics=metrics,
    )


def register_record(
    record: EngineRecord,
    *,
    ttl: float | None = None,
    settings: Settings | None = None,
    connection: EtcdPort | None = None,
    session: Session | None = None,
    replace: bool = False,
    metrics: MetricsHooks | None = None,
) -> Registration:
    """``register_engine`` of a whole record (the engine-event receiver's way in)."""
    record = _stamped(record)
    value = encode(record)  # refuses an oversized record before anything is written
    private = session is None
    if session is None:
        session = Session(
            ttl=_DEFAULT_TTL if ttl is None else check_ttl(ttl),
            settings=settings,
            connection=connection,
            metrics=metrics,
        )
    elif ttl is not None or settings is not None or connection is not None:
        raise ConfigurationError(
            "ttl, settings and connection belong to the session: give them to Session()"
        )
    registration = Registration(record, session=session, private=private, metrics=metrics)
    try:
        registration._start(value, replace=replace)
    except BaseException:
        if private:
            session.close(timeout=0)
        raise
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


async def aregister_engine(
    endpoint: InferenceEngineEndpoint | EndpointLike, **kwargs: Any
) -> Registration:
    """:func:`register_engine` without blocking the event loop."""
    return await asyncio.to_thread(register_engine, endpoint, **kwargs)
