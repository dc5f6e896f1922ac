"""An etcd in memory: the etcd port without an etcd process, for tests.

``MemoryEtcd`` is the cluster's state (revisions, keys, the history of changes, leases
that expire in real time); ``MemoryPort`` is one client of it and implements
``EtcdPort`` with the observable semantics of the python3-etcd3 adapter (both pass
``tests/test_port_conformance.py``). Several ports may share one ``MemoryEtcd``, like
several processes sharing a cluster::

    etcd = MemoryEtcd()
    registration = register_engine(endpoint, connection=MemoryPort(etcd), settings=...)
    table = watch_table(settings, connection=MemoryPort(etcd))

Faults for tests: ``etcd.outage()`` (every call of every port fails with a transient
``EtcdUnavailableError`` and every open stream ends with one; leases keep expiring
meanwhile, as they do on a cluster the clients cannot reach) until ``etcd.restore()``
or the end of a ``with etcd.outage():`` block; ``outage(no_leader=True)`` ends and
refuses streams with ``NoLeaderError`` instead; ``etcd.compact(revision)``;
``etcd.wipe()`` (its data lost and the member restarted: every stream ends, revision back
to 1, keys and leases gone; ``new_id``: under another cluster id, which every listing page
and watch response carries, as etcd's response headers do).

Like etcd: a write transaction is one revision; a lease's expiry or revoke deletes all
its keys in one revision; a new watch first answers with an empty response at the
current revision (etcd's "created" response, which the adapter passes on), then every
change from its start revision (inclusive) that is still in the history, in one response,
then each new revision in a response of its own; a quiet watch answers a progress
response (no events) every ``progress_interval``. The history is kept until
``compact()``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Generic, TypeVar

from discovery._backoff import CALL
from discovery._errors import ClosedError, DiscoveryError, EtcdError, EtcdUnavailableError
from discovery._etcd.port import (
    MAX_BATCH,
    PAGE_SIZE,
    CloseHooks,
    Compacted,
    KeepAliveStream,
    KeyValue,
    LeaseGone,
    LeaseInfo,
    NoLeaderError,
    Page,
    PutResult,
    WatchEvent,
    WatchResponse,
    WatchStream,
)
from discovery._settings import ETCD_MAX_REQUEST_BYTES

__all__ = ["MemoryEtcd", "MemoryPort", "MemorySnapshot"]

T = TypeVar("T")


@dataclass(slots=True)
class _Lease:
    ttl: int
    deadline: float  # time.monotonic() at which it expires
    keys: set[bytes] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """A ``MemoryEtcd``'s state at one revision (``MemoryEtcd.snapshot``)."""

    revision: int
    compacted: int
    keys: dict[bytes, KeyValue]
    history: list[tuple[int, tuple[WatchEvent, ...]]]
    leases: dict[int, tuple[int, set[bytes]]]  # id: (TTL, keys)


_EMPTY = MemorySnapshot(1, 0, {}, [], {})  # a new etcd is at revision 1


class MemoryEtcd:
    """The shared state of an in-memory etcd cluster (see the module docs).

    Thread-safe: one lock guards everything, and nothing runs user code under it (watch
    responses are queued for each stream's reader). ``close()`` stops the lease sweeper
    thread (started by the first grant) and ends every open stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()  # the one lock; the sweeper waits on it
        self.cluster_id = _new_cluster_id()
        """The cluster id in every answer's header (etcd's, from its members and token)."""
        self._revision = 1  # a new etcd is at revision 1
        self._compacted = 0
        self._keys: dict[bytes, KeyValue] = {}
        self._history: list[tuple[int, tuple[WatchEvent, ...]]] = []  # (revision, events)
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._streams: dict[_Stream[Any], MemoryPort] = {}  # open streams, by their port
        self._down = False
        self._no_leader = False
        self._closed = False
        self._sweeper: threading.Thread | None = None

    # -- for tests ------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The current revision."""
        with self._lock:
            return self._revision

    def compact(self, revision: int) -> None:
        """Forget the history before ``revision``, like etcd's compaction.

        Watches and listings from an older revision then raise ``Compacted``.
        """
        with self._lock:
            if revision > self._revision:
                raise ValueError(f"revision {revision} is in the future ({self._revision})")
            if revision > self._compacted:
                self._compacted = revision
                del self._history[: bisect.bisect_left(self._history, revision, key=itemgetter(0))]

    def wipe(self, *, new_id: bool = False) -> None:
        """Lose every key, lease and revision, as a member restarted on an empty data dir.

        Open streams end (the member went down); the revision is 1 again. The cluster id
        stays (etcd derives it from the members and the token) unless ``new_id``.
        """
        self._replace(_EMPTY, "wiped", new_id=new_id)

    def snapshot(self) -> MemorySnapshot:
        """What ``etcdctl snapshot save`` keeps: every key, lease and revision."""
        with self._lock:
            return MemorySnapshot(
                self._revision,
                self._compacted,
                dict(self._keys),
                list(self._history),
                {id_: (lease.ttl, set(lease.keys)) for id_, lease in self._leases.items()},
            )

    def restore_snapshot(self, snapshot: MemorySnapshot) -> None:
        """Go back to ``snapshot``, as ``etcdutl snapshot restore`` on every member.

        Open streams end (the members went down); the keys, leases and revision are the
        snapshot's, each lease's TTL in full again, under a new cluster id.
        """
        self._replace(snapshot, "restored", new_id=True)

    def _replace(self, snapshot: MemorySnapshot, cause: str, *, new_id: bool) -> None:
        """Hold ``snapshot``'s state from now on; open streams end with ``cause``."""
        with self._lock:
            self._end_streams(lambda: EtcdUnavailableError(f"etcd restarted ({cause})", cause))
            self._revision, self._compacted = snapshot.revision, snapshot.compacted
            self._keys = dict(snapshot.keys)
            self._history = list(snapshot.history)
            now = time.monotonic()
            self._leases = {
                lease_id: _Lease(ttl, now + ttl, set(keys))
                for lease_id, (ttl, keys) in snapshot.leases.items()
            }
            if new_id:
                self.cluster_id = _new_cluster_id()
            self._lock.notify_all()  # the sweeper: new deadlines

    def outage(self, *, no_leader: bool = False) -> contextlib.ExitStack:
        """Make etcd unreachable until ``restore()`` (or the end of a ``with`` block).

        Every call fails with a transient ``EtcdUnavailableError``; open streams end, and
        new ones are refused, with one (``NoLeaderError`` with ``no_leader``).
        """
        with self._lock:
            self._down, self._no_leader = True, no_leader
            self._end_streams(lambda: self._unavailable(stream=True))
        restoring = contextlib.ExitStack()  # starts now; a with block only restores
        restoring.callback(self.restore)
        return restoring

    def restore(self) -> None:
        """End an outage: calls and new streams work again."""
        with self._lock:
            self._down = self._no_leader = False

    def close(self) -> None:
        """Stop the lease sweeper and end every open stream. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            self._end_streams(lambda: ClosedError("MemoryEtcd is closed"))
            sweeper = self._sweeper
        if sweeper is not None:
            sweeper.join()

    def __enter__(self) -> MemoryEtcd:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- under the lock ------------------------------------------------------------------

    def _check_up(self, *, stream: bool = False) -> None:
        if self._closed:
            raise ClosedError("MemoryEtcd is closed")
        if self._down:
            raise self._unavailable(stream=stream)

    def _unavailable(self, *, stream: bool) -> EtcdUnavailableError:
        if stream and self._no_leader:
            return NoLeaderError("etcd has no leader (MemoryEtcd outage)", "no leader")
        return EtcdUnavailableError("etcd unavailable (MemoryEtcd outage)", "outage")

    def _check_lease(self, lease_id: int) -> None:
        if lease_id and lease_id not in self._leases:
            raise LeaseGone(
                f"etcd refused the write: lease {lease_id:016x} not found", "lease not found"
            )

    def _write(
        self, puts: Sequence[tuple[bytes, bytes, int]] = (), deletes: Sequence[bytes] = ()
    ) -> int:
        """One write transaction: the next revision, its events kept and sent to watches."""
        self._revision += 1
        revision = self._revision
        events = []
        for key, value, lease_id in puts:
            old = self._keys.get(key)
            self._unbind(old)
            created = old.create_revision if old is not None else revision
            kv = self._keys[key] = KeyValue(key, value, revision, created, lease_id)
            if lease_id:
                self._leases[lease_id].keys.add(key)
            events.append(WatchEvent(kv, is_put=True))
        for key in deletes:
            self._unbind(self._keys.pop(key))
            # etcd's tombstone: the key and the revision of its deletion, nothing else
            events.append(WatchEvent(KeyValue(key, b"", revision, 0, 0), is_put=False))
        batch = tuple(events)
        self._history.append((revision, batch))
        for stream in self._streams:
            if isinstance(stream, _Watch):
                stream._offer(revision, batch)
        return revision

    def _unbind(self, kv: KeyValue | None) -> None:
        """Take ``kv`` (overwritten or deleted) off its lease."""
        if kv is not None and kv.lease in self._leases:
            self._leases[kv.lease].keys.discard(kv.key)

    def _revoke_locked(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.keys:
            self._write(deletes=sorted(lease.keys))  # etcd deletes them in key order

    def _end_streams(
        self, error: Callable[[], DiscoveryError], port: MemoryPort | None = None
    ) -> None:
        for stream, owner in list(self._streams.items()):
            if port is None or owner is port:
                del self._streams[stream]
                stream._end(error())

    def _sweep(self) -> None:
        """The sweeper thread: revoke each lease when its deadline passes."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
                    self._revoke_locked(lease_id)
                due = min((lease.deadline for lease in self._leases.values()), default=None)
                self._lock.wait(None if due is None else due - now)

    # -- what ports call -----------------------------------------------------------------

    def _range(self, prefix: bytes) -> Page:
        with self._lock:
            self._check_up()
            found = sorted(kv for key, kv in self._keys.items() if key.startswith(prefix))
            return Page(self._revision, found, self.cluster_id)

    def _readable(self, revision: int) -> None:
        """Raise unless ``revision`` can still be read (not compacted)."""
        with self._lock:
            self._check_up()
            if revision < self._compacted:
                raise Compacted(self._compacted)

    def _get(self, key: bytes) -> KeyValue | None:
        with self._lock:
            self._check_up()
            return self._keys.get(key)

    def _put(
        self, key: bytes, value: bytes, lease_id: int, allowed: Callable[[KeyValue | None], bool]
    ) -> PutResult:
        with self._lock:
            self._check_up()
            current = self._keys.get(key)
            if not allowed(current):
                # As the adapter reports it: the revision comes with the key read (0: none).
                return PutResult(False, self._revision if current is not None else 0, current)
            self._check_lease(lease_id)  # etcd checks the lease of a put it makes only
            return PutResult(True, self._write(puts=[(key, value, lease_id)]), current)

    def _update_many(
        self, items: Sequence[tuple[bytes, bytes, int]], lease_id: int
    ) -> list[PutResult]:
        with self._lock:
            self._check_up()
            if len({key for key, _, _ in items}) != len(items):
                raise EtcdError("etcd request failed: duplicate key given in txn request")

            def at(key: bytes, mod_revision: int) -> bool:
                current = self._keys.get(key)  # etcd compares a missing key's as 0
                return (current.mod_revision if current is not None else 0) == mod_revision

            puts = [(key, value, lease_id) for key, value, rev in items if at(key, rev)]
            if puts:
                self._check_lease(lease_id)
            results = []
            wrote = False
            for key, _, mod_revision in items:
                current = self._keys.get(key)
                if at(key, mod_revision):
                    wrote = True
                    results.append(PutResult(True, self._revision + 1, None))
                else:
                    # etcd reads inside the transaction: after one of its puts, at its revision
                    read_at = self._revision + 1 if wrote else self._revision
                    results.append(PutResult(False, read_at, current))
            if puts:
                self._write(puts=puts)
            return results

    def _delete(self, key: bytes) -> bool:
        with self._lock:
            self._check_up()
            if key not in self._keys:
                return False
            self._write(deletes=[key])
            return True

    def _delete_owned(self, key: bytes, lease_id: int) -> bool:
        with self._lock:
            self._check_up()
            current = self._keys.get(key)
            # etcd compares a missing key's lease as 0: that compare holds, deleting nothing
            if (current.lease if current is not None else 0) != lease_id:
                return False
            if current is not None:
                self._write(deletes=[key])
            return True

    def _grant(self, ttl: int) -> int:
        with self._lock:
            self._check_up()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _Lease(ttl, time.monotonic() + ttl)
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep, name="discovery-memory-leases", daemon=True
                )
                self._sweeper.start()
            self._lock.notify_all()  # it may expire before the sweeper's next wake-up
            return lease_id

    def _lease_info(self, lease_id: int) -> LeaseInfo:
        with self._lock:
            self._check_up()
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseInfo(-1, ())
            # etcd truncates the remaining time to whole seconds
            return LeaseInfo(int(lease.deadline - time.monotonic()), tuple(sorted(lease.keys)))

    def _revoke(self, lease_id: int) -> None:
        with self._lock:
            self._check_up()
            self._revoke_locked(lease_id)

    def _renew(self, stream: _KeepAlive, lease_id: int) -> None:
        """Answer one keepalive on ``stream``: the lease's TTL, or 0 if it is gone."""
        with self._lock:
            if stream not in self._streams:
                return  # sent on an ended stream: lost, as on a dead gRPC stream
            lease = self._leases.get(lease_id)
            now = time.monotonic()
            if lease is None or lease.deadline <= now:  # etcd renews no expired lease
                stream._deliver((lease_id, 0))
                return
            lease.deadline = now + lease.ttl
            stream._deliver((lease_id, lease.ttl))

    def _open_watch(
        self, port: MemoryPort, prefix: bytes, start_revision: int, every: float
    ) -> _Watch:
        with self._lock:
            self._check_up(stream=True)
            watch = _Watch(self, prefix, start_revision, every)
            created = WatchResponse(self._revision, (), self.cluster_id)
            watch._deliver(created)  # etcd's "created" response
            if start_revision < self._compacted:
                watch._deliver(Compacted(self._compacted))
                return watch
            start = bisect.bisect_left(self._history, start_revision, key=itemgetter(0))
            past = [e for _, events in self._history[start:] for e in events if watch._wants(e)]
            if past:
                watch._deliver(WatchResponse(self._revision, tuple(past), self.cluster_id))
            self._streams[watch] = port
            return watch

    def _open_keepalive(self, port: MemoryPort) -> _KeepAlive:
        with self._lock:
            self._check_up(stream=True)
            stream = _KeepAlive(self)
            self._streams[stream] = port
            return stream

    def _end_stream(self, stream: _Stream[Any], error: DiscoveryError) -> None:
        with self._lock:
            self._streams.pop(stream, None)
            stream._end(error)

    def _progress(self, watch: _Watch) -> WatchResponse | None:
        """A progress response at the current revision, unless a response is in flight."""
        with self._lock:
            if watch._pending():
                return None
            return WatchResponse(self._revision, (), self.cluster_id)

    def _disconnect(self, port: MemoryPort) -> None:
        """End the streams of ``port`` (it closed)."""
        with self._lock:
            self._end_streams(lambda: EtcdUnavailableError("connection closed", "closed"), port)


def _new_cluster_id() -> int:
    """A random non-zero 64-bit id, as etcd's (0 means unknown to the reflector)."""
    return random.getrandbits(64) or 1


class _Stream(Generic[T]):
    """What etcd sends one stream, queued for its reader; it ends with an error."""

    def __init__(self, etcd: MemoryEtcd) -> None:
        self._etcd = etcd
        self._queue: queue.SimpleQueue[T | DiscoveryError] = queue.SimpleQueue()
        self._error: DiscoveryError | None = None

    def _deliver(self, item: T | DiscoveryError) -> None:
        self._queue.put(item)

    def _pending(self) -> bool:
        return not self._queue.empty()

    def _end(self, error: DiscoveryError) -> None:
        if self._error is None:
            self._error = error
            self._queue.put(error)  # wakes a blocked reader

    def _next(self, timeout: float | None = None) -> T:
        """The next item (raises ``queue.Empty`` after ``timeout`` s), or the stream's end."""
        if self._error is not None:  # an ended stream raises at once, queued items or not
            raise self._error
        item = self._queue.get(timeout=timeout)
        if isinstance(item, DiscoveryError):
            raise item
        return item


class _Watch(_Stream[WatchResponse]):
    """A watch of a key prefix (``MemoryPort.open_watch``)."""

    def __init__(self, etcd: MemoryEtcd, prefix: bytes, start_revision: int, every: float) -> None:
        super().__init__(etcd)
        self._prefix = prefix
        self._start = start_revision
        self._every = every

    def _wants(self, event: WatchEvent) -> bool:
        return event.kv.key.startswith(self._prefix)

    def _offer(self, revision: int, events: tuple[WatchEvent, ...]) -> None:
        """A new revision (under the etcd lock): queue the events of our prefix."""
        mine = tuple(e for e in events if self._wants(e))
        if mine and revision >= self._start:
            self._deliver(WatchResponse(revision, mine, self._etcd.cluster_id))

    def __iter__(self) -> Iterator[WatchResponse]:
        """Yield responses; raise Compacted, or the stream's error when it ends."""
        try:
            while True:
                try:
                    response = self._next(self._every)
                except queue.Empty:
                    # Quiet for a while: etcd answers the adapter's progress request.
                    progress = self._etcd._progress(self)
                    if progress is None:
                        continue  # a response arrived meanwhile: that one first
                    response = progress
                yield response
        finally:
            self.close()

    def close(self) -> None:
        """End the stream from any thread; an iterating reader gets an error."""
        self._etcd._end_stream(self, EtcdUnavailableError("watch stream closed", "stream closed"))


class _KeepAlive(_Stream[tuple[int, int]]):
    """A keepalive stream for any number of leases (``MemoryPort.open_keepalive``)."""

    def send_keepalive(self, lease_id: int) -> None:
        """Renew ``lease_id``; the answer arrives through iteration."""
        self._etcd._renew(self, lease_id)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(lease id, TTL) per answer; a TTL of 0 means the lease is gone."""
        try:
            while True:
                yield self._next()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """End the stream."""
        self._etcd._end_stream(
            self, EtcdUnavailableError("keepalive stream cancelled", "stream cancelled")
        )

    def abandon(self) -> None:
        """End the stream (there is no member to avoid)."""
        self.cancel()


class MemoryPort(CloseHooks):
    """One client of a ``MemoryEtcd``: the etcd port in memory (see the module docs).

    ``etcd`` is the cluster to share with other ports; without it the port has one of
    its own, closed with it. ``dial_timeout`` and ``election_timeout`` are what the
    port reports, and ``max_request_bytes`` (the defaults are ``Settings``'s). Thread-safe;
    a context manager.
    """

    def __init__(
        self,
        etcd: MemoryEtcd | None = None,
        *,
        dial_timeout: float = 5.0,
        election_timeout: float = 1.0,
        max_request_bytes: int = ETCD_MAX_REQUEST_BYTES,
    ) -> None:
        self._owns_etcd = etcd is None
        self.etcd = etcd if etcd is not None else MemoryEtcd()
        """The cluster this port is a client of."""
        self._dial_timeout = dial_timeout
        self._election_timeout = election_timeout
        self._max_request_bytes = max_request_bytes
        self._lock = threading.Lock()
        super().__init__()

    @property
    def dial_timeout(self) -> float:
        """Seconds ``call`` retries by default."""
        return self._dial_timeout

    @property
    def election_timeout(self) -> float:
        """The election timeout this port reports, in seconds."""
        return self._election_timeout

    @property
    def max_request_bytes(self) -> int:
        """The request limit this port reports (it refuses none)."""
        return self._max_request_bytes

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def _cluster(self) -> MemoryEtcd:
        if self._closed:
            raise ClosedError("connection is closed")
        return self.etcd

    def call(self, op: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``op``, retrying transient failures with the ``CALL`` backoff for ``timeout`` s.

        The default timeout is ``dial_timeout``; 0 means one attempt.
        """
        limit = self._dial_timeout if timeout is None else timeout
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return op()
            except EtcdUnavailableError:
                if self._closed or time.monotonic() - started >= limit:
                    raise
            time.sleep(CALL.delay(attempt))
            attempt += 1

    def list_prefix(
        self, prefix: str, *, page_size: int = PAGE_SIZE, timeout: float | None = None
    ) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` at one revision: (revision, keys)."""
        # One read is at one revision already: no pages, nothing to compact midway.
        return self.call(lambda: self._cluster()._range(prefix.encode()), timeout=timeout)

    def list_pages(
        self,
        prefix: str,
        *,
        page_size: int = PAGE_SIZE,
        first_page: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[Page]:
        """(revision, keys) per page of ``prefix``, every page at the first's revision.

        The first page holds ``first_page`` keys (default ``page_size``). Raises
        ``Compacted`` when that revision is compacted before the last page.
        """
        listing = self.call(lambda: self._cluster()._range(prefix.encode()), timeout=timeout)
        (revision, found), cluster_id = listing, listing.cluster_id
        first = first_page or page_size
        yield Page(revision, found[:first], cluster_id)
        for start in range(first, len(found), page_size):
            # A later page: etcd reads it at the listing's revision.
            self.call(lambda: self._cluster()._readable(revision), timeout=timeout)
            yield Page(revision, found[start : start + page_size], cluster_id)

    def get(self, key: str) -> KeyValue | None:
        """The key, or None."""
        return self._cluster()._get(key.encode())

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return self._cluster()._grant(ttl)

    def lease_info(self, lease_id: int) -> LeaseInfo:
        """The lease's remaining TTL (-1 when gone) and the keys bound to it."""
        return self._cluster()._lease_info(lease_id)

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys in one revision; a gone lease is revoked."""
        self._cluster()._revoke(lease_id)

    def create(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` only if ``key`` does not exist."""
        return self._cluster()._put(key.encode(), value, lease_id, lambda kv: kv is None)

    def replace(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` whatever the key holds."""
        return self._cluster()._put(key.encode(), value, lease_id, lambda kv: True)

    def update(self, key: str, value: bytes, lease_id: int, *, mod_revision: int) -> PutResult:
        """Put ``value`` only if the key was last written at ``mod_revision``."""

        def at_revision(kv: KeyValue | None) -> bool:
            return (kv.mod_revision if kv is not None else 0) == mod_revision  # etcd's compare

        return self._cluster()._put(key.encode(), value, lease_id, at_revision)

    def create_many(self, items: Sequence[tuple[str, bytes]], lease_id: int) -> list[PutResult]:
        """``create`` of each (key, value) on ``lease_id``, all in one transaction."""
        return self.update_many([(key, value, 0) for key, value in items], lease_id)

    def update_many(
        self, items: Sequence[tuple[str, bytes, int]], lease_id: int
    ) -> list[PutResult]:
        """``update`` of each (key, value, mod_revision) on ``lease_id``, in one transaction."""
        if len(items) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} keys per batch, got {len(items)}")
        encoded = [(key.encode(), value, revision) for key, value, revision in items]
        return self._cluster()._update_many(encoded, lease_id)

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return self._cluster()._delete(key.encode())

    def delete_owned(self, key: str, lease_id: int) -> bool:
        """Delete ``key`` only if it is bound to ``lease_id``; whether it was."""
        return self._cluster()._delete_owned(key.encode(), lease_id)

    def open_watch(
        self, prefix: str, start_revision: int, *, heartbeat: float, progress_interval: float
    ) -> WatchStream:
        """Watch ``prefix`` from ``start_revision`` (inclusive).

        A stream quiet for ``progress_interval`` (or ``heartbeat``, if shorter) seconds
        answers a progress response; in memory a stream is never silent.
        """
        every = min(progress_interval, heartbeat)
        return self._cluster()._open_watch(self, prefix.encode(), start_revision, every)

    def open_keepalive(self) -> KeepAliveStream:
        """Open one keepalive stream for any number of leases."""
        return self._cluster()._open_keepalive(self)

    def close(self) -> None:
        """Run the on_close hooks, then end this port's streams with an error. Idempotent."""
        if not self._close_hooks_run():
            return
        self.etcd._disconnect(self)
        if self._owns_etcd:
            self.etcd.close()

    def __enter__(self) -> MemoryPort:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
