"""Sessions: one lease, kept alive, for any number of registrations of one process.

etcd's ``concurrency.Session`` idea. A ``Session`` owns one lease and its keepalive (a
turn every TTL/3 on the connection's ``LeaseKeeper``), reports the lease lost, and
repairs: it grants one new lease and writes every member's record again in batches of
nested create-if-absent transactions (``MAX_BATCH`` keys per request, and no more bytes
than the members take: ``Settings.max_request_bytes``, so a session of any size comes
back). So keepalive cost does not grow with the number of registrations, and a mass loss
costs one grant plus N / ``MAX_BATCH`` writes instead of N grants and N writes.

Per-registration leases stay the default: ``register_engine`` without ``session=`` gives
the registration a private session (its lease holds exactly one key). Pass a shared
``Session`` when one process registers many engines.

Session states::

    alive ──lease gone / keepalives unanswered past TTL──▶ lost
      ▲                                                     │
      └──── the lease survived, or a new one was granted ◀──┘
    any state ──close()──▶ closed (lease revoked: every member's key is gone)

What a shared lease changes (see docs/registration.md): a member's ``close()`` deletes its own key
only (compare on the lease), ``deregister`` of one member deletes that key only (the
session writes it again, as a private registrar would), and duplicate-id protection is
per key as before, also between two registrations of one session.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Protocol

from discovery._backoff import REPAIR
from discovery._errors import (
    ClosedError,
    DiscoveryError,
    EngineConflictError,
    EtcdUnavailableError,
    InvalidRecordError,
    RequestTooLargeError,
)
from discovery._etcd.port import (
    EtcdPort,
    KeepAliveStream,
    LeaseGone,
    LeaseInfo,
    PutResult,
    batches,
    explain,
    write_bytes,
)
from discovery._etcd.transport import connect, keyspace_for
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._records.codec import KeySpace
from discovery._records.record import EngineRecord
from discovery._settings import Settings
from discovery._writes.lease import LeaseKeeper, keeper_for

__all__ = ["Session"]

log = logging.getLogger(__name__)

_EXIT_TIMEOUT = 2.0  # at interpreter exit, do not hang on an unreachable etcd


class _State(enum.Enum):
    ALIVE = "alive"
    LOST = "lost"
    CLOSED = "closed"


class _Member(Protocol):
    """A registration, as its session sees it (``_registration.Registration``)."""

    key: str
    _retry_at: float

    @property
    def engine_id(self) -> str: ...

    def _prepare_write(self) -> tuple[EngineRecord, bytes] | None: ...

    def _written(self, lease_id: int, record: EngineRecord, result: PutResult) -> bool: ...

    def _lease_lost(self, reason: str) -> None: ...

    def _session_closed(self) -> None: ...

    def _publish_now(self) -> None: ...

    def _write_refused(self, exc: DiscoveryError) -> bool: ...

    def _stopping_mark(self) -> tuple[str, bytes, int] | None: ...

    def _rebase(self, reason: str) -> None: ...

    def _written_since(self, revision: int, lease_id: int) -> bool: ...


def check_ttl(ttl: object) -> int:
    """A lease TTL in whole seconds (etcd's unit), or InvalidRecordError."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise InvalidRecordError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return max(1, math.ceil(ttl))


class Session:
    """One lease kept alive for many registrations of this process (etcd's Session).

    ``Session(ttl=10, settings=...)`` grants the lease at once (retrying until
    ``settings.dial_timeout``); pass it as ``register_engine(..., session=session)``.
    Thread-safe; a context manager. ``close()`` revokes the lease, which removes every
    member's record at once. ``connection`` shares a client; otherwise one is built from
    ``settings`` (default ``Settings.from_env()``) and closed with the session.
    """

    def __init__(
        self,
        *,
        ttl: float = 10.0,
        settings: Settings | None = None,
        connection: EtcdPort | None = None,
        metrics: MetricsHooks | None = None,
    ) -> None:
        self.ttl = check_ttl(ttl)
        """The lease TTL in whole seconds."""
        self._interval = self.ttl / 3
        self._owns_connection = connection is None
        self.keyspace: KeySpace = keyspace_for(settings, connection)
        """The key layout of the session's records."""
        self._metrics = metrics or NO_METRICS
        self._conn: EtcdPort = connect(settings, metrics) if connection is None else connection
        self._lock = threading.Lock()
        # Held by a repair (grant + writes) and by close(), so that close() never races a
        # repair that would leave a fresh lease or record behind.
        self._op_lock = threading.Lock()
        self._state = _State.ALIVE
        self._lease_id: int | None = None
        self._deadline = 0.0
        self._awaiting: float | None = None  # when the unanswered keepalive went out
        self._awaiting_on: KeepAliveStream | None = None  # ...and on which stream
        self._members: dict[str, _Member] = {}
        self._unwritten: set[_Member] = set()  # records to write again
        self._unpublished: set[_Member] = set()  # changes to publish when etcd answers
        self._repairing = False
        self._repair_attempts = 0  # failed repairs in a row: the REPAIR backoff's attempt
        self._losses = 0
        self._last_error: str | None = None
        self._last_keepalive: datetime | None = None
        self._fresh = False  # another cluster: the next repair revokes and grants afresh
        self._rebased_at = 0  # the revision of the last listing that found one
        self._rebased_listing = 0  # ...its number (the record watch's)
        self._checked_listing = 0  # ...and of the last one that checked the lease's keys
        started = time.monotonic()
        try:
            self._lease_id = self._conn.call(lambda: self._conn.grant(self.ttl))
        except BaseException:
            self._state = _State.CLOSED
            if self._owns_connection:
                self._conn.close()
            raise
        self._metrics.lease_granted()
        self._deadline = started + self.ttl
        self._keeper: LeaseKeeper = keeper_for(self._conn)
        self._keeper.track_lease(self, None, self._lease_id)
        self._keeper.schedule(self, time.monotonic() + self._interval)
        _live_sessions.add(self)

    # -- public view ---------------------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        """The current lease, or None once closed."""
        return self._lease_id

    @property
    def alive(self) -> bool:
        """Whether the lease is held (False while lost and repairing, or once closed)."""
        return self._state is _State.ALIVE

    @property
    def connection(self) -> EtcdPort:
        """The connection the session (and its registrations) use."""
        return self._conn

    @property
    def last_keepalive(self) -> datetime | None:
        """When etcd last answered a keepalive of the lease."""
        return self._last_keepalive

    def close(self, timeout: float | None = None) -> None:
        """Revoke the lease (every member's key goes) and close every member. Idempotent.

        Waits up to ``timeout`` (default settings.dial_timeout) for etcd; when it cannot
        be reached the keys expire within the TTL.
        """
        deadline = time.monotonic() + (self._conn.dial_timeout if timeout is None else timeout)
        with self._lock:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSED
            members = list(self._members.values())
            # Not waiting for a repair in flight (it may be stuck on an unreachable etcd
            # for request timeouts): from now on it cannot take a lease (_take_lease sees
            # CLOSED and revokes what it granted), so this is the last lease to revoke.
            lease_id, self._lease_id = self._lease_id, None
        _live_sessions.discard(self)
        self._keeper.cancel(self)
        marks = [mark for m in members if (mark := m._stopping_mark()) is not None]
        for member in members:
            member._session_closed()
        self._keeper.track_lease(self, lease_id, None)
        try:
            if lease_id is not None:
                self.mark_stopping(marks, lease_id, deadline)
                started = time.monotonic()
                remaining = max(0.0, deadline - time.monotonic())
                self._conn.call(lambda: self._conn.revoke(lease_id), timeout=remaining)
                self._metrics.revoked(time.monotonic() - started)
                log.info("lease %016x revoked (%d registrations)", lease_id, len(members))
        except DiscoveryError as exc:
            log.warning(
                "could not revoke lease %016x (%s); its keys expire within %d s",
                lease_id,
                exc,
                self.ttl,
            )
        finally:
            if self._owns_connection:
                self._conn.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        lease = f"{self._lease_id:016x}" if self._lease_id else None
        return (
            f"<Session lease={lease} ttl={self.ttl} {self._state.value} "
            f"registrations={len(self._members)}>"
        )

    # -- members (called by Registration) -------------------------------------------------

    def _join(self, member: _Member) -> int:
        """Reserve ``member.key`` in the session; the lease to write it on.

        Raises EngineConflictError when another live member holds the key, ClosedError
        when the session is closed, and a transient EtcdUnavailableError while the lease is
        lost (``call`` retries: the repair grants a new one meanwhile).
        """
        with self._lock:
            if self._state is _State.CLOSED:
                raise ClosedError("session is closed")
            holder = self._members.get(member.key)
            if holder is not None and holder is not member:
                raise EngineConflictError(
                    member.engine_id, member.key, self._lease_id or 0, self.ttl
                )
            self._members[member.key] = member
            if self._state is _State.LOST or self._lease_id is None:
                raise EtcdUnavailableError("the session's lease is lost; repairing", "lease lost")
            return self._lease_id

    def _leave(self, member: _Member) -> None:
        with self._lock:
            if self._members.get(member.key) is member:
                del self._members[member.key]
            self._unwritten.discard(member)
            self._unpublished.discard(member)

    def _lease_gone(self, lease_id: int) -> None:
        """A write found ``lease_id`` gone: lose it now rather than at the next keepalive."""
        if lease_id == self._lease_id:
            self._lose(f"lease {lease_id:016x} no longer exists (expired or revoked)")

    def _rewrite(self, member: _Member) -> None:
        """Write ``member``'s record again (it was deleted or taken while the lease lives)."""
        with self._lock:
            if self._state is _State.CLOSED or member.key not in self._members:
                return
            self._unwritten.add(member)
        self._start_repair()

    def _unpublished_done(self, member: _Member) -> None:
        """``member`` has no change to publish any more (etcd refused it for good)."""
        with self._lock:
            self._unpublished.discard(member)

    def _cluster_changed(self, reason: str, revision: int, listing: int) -> None:
        """Another etcd cluster, or an older history of it, holds our keys.

        Its data was wiped or a snapshot restored (the record watch's ``listing`` was at
        ``revision``): revoke the lease (the keys a snapshot brought back on it go) and
        write every member's record again on a fresh one. Once per listing, however many
        members noticed.
        """
        with self._lock:
            if self._state is _State.CLOSED or self._rebased_listing == listing:
                return
            self._rebased_at, self._rebased_listing = revision, listing
            self._fresh = True
            members = self._lost_locked(reason)
        log.warning(
            "lease %016x: %s; writing %d registrations again on a fresh lease",
            self._lease_id or 0,
            reason,
            len(members),
        )
        self._metrics.cluster_replaced()
        for member in members:
            member._rebase(reason)
        self._start_repair()

    def _check_lease_keys(self, reason: str, revision: int, listing: int) -> None:
        """A member's record held in a replaced cluster's listing (at ``revision``).

        If the lease also holds a key no member owns (a snapshot brought back a member
        closed since), the cluster changed for the whole session. Once per listing, on a
        pool thread (the caller is the record watch's).
        """
        with self._lock:
            if self._state is _State.CLOSED or listing in (
                self._rebased_listing,
                self._checked_listing,
            ):
                return
            self._checked_listing, lease_id = listing, self._lease_id
        if lease_id is not None:
            check = partial(self._stray_keys, lease_id, reason, revision, listing)
            self._keeper.submit(self, lambda _: check())

    def _stray_keys(self, lease_id: int, reason: str, revision: int, listing: int) -> None:
        held = self._conn.call(partial(self._conn.lease_info, lease_id)).keys
        with self._lock:
            owned = {key.encode() for key in self._members}
        stray = [key.decode(errors="replace") for key in held if key not in owned]
        if stray:
            reason = f"{reason}; on its lease, keys of no member: {stray}"
            self._cluster_changed(reason, revision, listing)

    def _publish_later(self, member: _Member) -> None:
        """Publish ``member``'s change once etcd answers again."""
        with self._lock:
            if self._state is not _State.CLOSED:
                self._unpublished.add(member)

    # -- keeper callbacks ---------------------------------------------------------------

    def turn(self, keeper: LeaseKeeper) -> None:
        """One scheduled turn: keep the lease alive, start a repair, schedule the next."""
        now = time.monotonic()
        with self._lock:
            state = self._state
            if state is _State.CLOSED:
                return
            expired = state is _State.ALIVE and now >= self._deadline
            owed = bool(self._unwritten or self._unpublished)
        if expired:
            self._lose("no keepalive answered within the TTL")
            return
        if state is _State.LOST or owed:
            self._start_repair()
        at = self._keepalive(keeper, now) if state is _State.ALIVE else now + REPAIR.maximum
        keeper.schedule(self, at, sooner_only=True)  # a repair may have asked for sooner

    def _keepalive(self, keeper: LeaseKeeper, now: float) -> float:
        """Send one keepalive; when to run the next turn."""
        if self._awaiting is not None:
            ended = self._awaiting_on is not keeper.stream
            if ended or now - self._awaiting >= self._interval:
                self._metrics.keepalive_failed()
                if ended:  # the request died with its stream: send afresh
                    self._awaiting = None
                elif keeper.last_answer < self._awaiting:
                    # Unanswered for TTL/3 on a stream that answered nothing since: it is
                    # dead. (A stream that answers others is only slow, as under load:
                    # dropping it would lose every keepalive in flight on it.)
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
            at = now + REPAIR.maximum
        return min(at, max(now, self._deadline))

    def keepalive_answered(self, lease_id: int, ttl: int) -> None:
        """A keepalive was answered: renew the deadline, or lose the lease (TTL <= 0)."""
        with self._lock:
            if lease_id != self._lease_id or self._state is not _State.ALIVE:
                return
            alive = ttl > 0
            if alive:
                sent = self._awaiting if self._awaiting is not None else time.monotonic()
                self._deadline = sent + ttl
                self._awaiting = None
                self._last_keepalive = datetime.now(UTC)
                members = list(self._members.values())
        if not alive:
            self._lose(f"lease {lease_id:016x} no longer exists (expired or revoked)")
            return
        for member in members:
            self._metrics.keepalive_ok(member.engine_id)

    def awaits_answer_on(self, stream: KeepAliveStream) -> bool:
        """Whether this lease's unanswered keepalive went out on ``stream``."""
        return self._awaiting is not None and self._awaiting_on is stream

    # -- loss and repair ----------------------------------------------------------------

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._state is not _State.ALIVE:
                return
            members = self._lost_locked(reason)
        log.warning(
            "lease %016x lost (%s): %d registrations to write again",
            self._lease_id or 0,
            reason,
            len(members),
        )
        for member in members:
            member._lease_lost(reason)
        self._start_repair()

    def _lost_locked(self, reason: str) -> list[_Member]:
        """Lost: every member to write again (under the lock); the members."""
        self._state = _State.LOST
        self._losses += 1
        self._last_error = reason
        members = list(self._members.values())
        self._unwritten.update(members)
        return members

    def _start_repair(self) -> None:
        with self._lock:
            if self._repairing or self._state is _State.CLOSED:
                return
            self._repairing = True
        self._keeper.submit(self, self._repair)

    def _repair(self, keeper: LeaseKeeper) -> None:
        """On a pool thread: a live lease (the old one if it survived), then the records."""
        with self._op_lock:
            with self._lock:
                self._repairing = False  # a loss from now on needs another repair
                if self._state is _State.CLOSED:
                    return
            try:
                lease_id = self._live_lease()
                if lease_id is not None:
                    self._write_records(lease_id)
                    self._publish_pending()
            except DiscoveryError as exc:
                reason = explain(exc)
                with self._lock:
                    self._last_error = reason
                    delay = REPAIR.delay(self._repair_attempts)
                    self._repair_attempts += 1
                if isinstance(exc, LeaseGone) and self._lease_id is not None:
                    self._lease_gone(self._lease_id)
                elif not isinstance(exc, EtcdUnavailableError):
                    log.warning("cannot repair lease %016x: %s", self._lease_id or 0, reason)
                at = time.monotonic() + delay
                keeper.schedule(self, at, sooner_only=True)  # never later than a keepalive
                return
            with self._lock:
                self._repair_attempts = 0  # failed repairs in a row: the REPAIR backoff's attempt
                retry_at = min((m._retry_at for m in self._unwritten), default=math.inf)
            if retry_at < math.inf:  # a conflict: try that one again later
                keeper.schedule(self, retry_at, sooner_only=True)

    def _live_lease(self) -> int | None:
        """The lease to write on: kept if it survived, else a new one (None: closed)."""
        with self._lock:
            if self._state is not _State.LOST:
                return self._lease_id
            old, fresh, self._fresh = self._lease_id, self._fresh, False
        started = time.monotonic()
        info = self._conn.lease_info(old) if old is not None else None
        if fresh and old is not None and info is not None and self._rewritten_on(old, info):
            fresh = False  # granted on the new cluster: a repair wrote every key on it since
        if old is not None and info is not None and info.ttl > 0 and not fresh:
            # It survived (a leader change renews leases): nothing was deleted.
            lease_id, deadline, next_turn = old, started + info.ttl, time.monotonic()
        else:
            if old is not None and info is not None and info.keys:
                # Expired, waiting for etcd's next sweep: its keys go now, so the new
                # records do not meet our own old ones.
                with contextlib.suppress(DiscoveryError):
                    self._conn.revoke(old)
            started = time.monotonic()
            lease_id = self._conn.grant(self.ttl)
            self._metrics.lease_granted()
            deadline, next_turn = started + self.ttl, started + self._interval
        if not self._take_lease(lease_id, deadline):
            if lease_id != old:
                with contextlib.suppress(DiscoveryError):
                    self._conn.revoke(lease_id)
            return None
        if lease_id != old:
            self._keeper.track_lease(self, old, lease_id)
            log.info("lease %016x granted (was %016x)", lease_id, old or 0)
        self._keeper.schedule(self, next_turn)  # a surviving lease may be near its end
        return lease_id

    def _rewritten_on(self, lease_id: int, info: LeaseInfo) -> bool:
        """Whether every key on ``lease_id`` is a member's, written since the listing.

        The listing that found another cluster raced a repair on the new cluster's lease:
        that lease holds nothing of the old history, and is kept.
        """
        with self._lock:
            members, since = dict(self._members), self._rebased_at
        return bool(info.keys) and all(
            (member := members.get(key.decode(errors="replace"))) is not None
            and member._written_since(since, lease_id)
            for key in info.keys
        )

    def _take_lease(self, lease_id: int, deadline: float) -> bool:
        """Hold ``lease_id`` from now on (every member to write if it is new).

        False if the session was closed meanwhile.
        """
        with self._lock:
            if self._state is _State.CLOSED or self._fresh:
                return False  # closed, or another cluster meanwhile: its repair follows
            if lease_id != self._lease_id:
                self._unwritten.update(self._members.values())
            self._state = _State.ALIVE
            self._lease_id = lease_id
            self._deadline = deadline
            self._awaiting = None
            return True

    def _write_records(self, lease_id: int) -> None:
        """Write every unwritten member's record on ``lease_id``, batch by batch.

        Batches of MAX_BATCH keys at most, and of the members' request limit
        (``max_request_bytes``).
        """
        now = time.monotonic()
        with self._lock:
            todo = sorted((m for m in self._unwritten if m._retry_at <= now), key=lambda m: m.key)
        prepared = []
        for member in todo:
            found = member._prepare_write()
            if found is not None:
                prepared.append((member, *found))
        limit = self._conn.max_request_bytes
        for chunk in batches(prepared, lambda p: write_bytes(p[0].key, p[2]), limit):
            self._create(chunk, lease_id)

    def _create(self, chunk: Sequence[tuple[_Member, EngineRecord, bytes]], lease_id: int) -> None:
        """Create one batch of records; halves it while etcd refuses it as too large.

        (The members' ``--max-request-bytes`` below the settings' one.) A record refused
        alone stays unwritten, its registration says why, the others are written.
        """
        try:
            results: Sequence[PutResult] = self._conn.create_many(
                [(member.key, value) for member, _, value in chunk], lease_id
            )
        except RequestTooLargeError as exc:
            if len(chunk) == 1:
                chunk[0][0]._write_refused(exc)
                return
            half = len(chunk) // 2
            self._create(chunk[:half], lease_id)
            self._create(chunk[half:], lease_id)
            return
        for (member, record, _), result in zip(chunk, results, strict=True):
            if member._written(lease_id, record, result):
                with self._lock:
                    self._unwritten.discard(member)

    def mark_stopping(
        self, marks: Sequence[tuple[str, bytes, int]], lease_id: int, deadline: float
    ) -> None:
        """Write each ``stopping`` mark (key, value, mod revision) before the records go.

        Routers tell a removal announced so from an expired lease (``EngineStatus.STOPPING``).
        Best effort until ``deadline``: a record changed meanwhile, or an etcd that does not
        answer, only leaves the removal unannounced.
        """
        limit = self._conn.max_request_bytes
        for chunk in batches(marks, lambda mark: write_bytes(mark[0], mark[1]), limit):
            try:
                self._conn.call(
                    partial(self._conn.update_many, chunk, lease_id),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            except DiscoveryError as exc:
                log.warning("could not mark %d records stopping: %s", len(chunk), exc)
                return

    def _publish_pending(self) -> None:
        with self._lock:
            pending = list(self._unpublished)
            self._unpublished.clear()
        for member in pending:
            member._publish_now()


_live_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # Normal interpreter exit revokes leases; SIGTERM needs deregister_on_signals().
    for session in list(_live_sessions):
        session.close(timeout=_EXIT_TIMEOUT)
