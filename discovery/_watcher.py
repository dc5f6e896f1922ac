"""List-then-watch of one namespace's engine keys into ordered, typed events.

The informer pattern, adapted to etcd. What a consumer may rely on:

* **Snapshot first.** The prefix is read at one revision R (paged, every page at R) and
  each valid record is delivered as ``added`` in one batch; the watch then starts at R
  (R's own changes, already listed, are skipped), so nothing written between the read
  and the watch is lost.
* **Order.** Batches arrive in revision order. A batch holds the events of one etcd
  revision (or of one snapshot) and is applied to a RoutingTable atomically.
  ``event.revision`` is the revision of the change, or R for events of a snapshot.
* **Exactly once across reconnects.** After a stream error, an etcd restart, a member
  failover or a stream that went silent (a watchdog asks etcd for progress and cancels a
  quiet stream), the watch resumes at the last applied revision with jittered
  exponential backoff; its changes come again and are skipped. Nothing is missed and
  nothing is delivered twice: a change not newer than the one held is ignored. (Not
  from the next revision: etcd before 3.5.16 drops the tombstone of a delete made at
  exactly the compaction revision, etcd-io/etcd#18089, and a watch resumed there would
  never see that delete; from the applied revision, such a compaction means a relist.)
* **Compaction.** If the resume revision has been compacted, the prefix is listed again
  and exactly the difference from the cache is delivered (``added`` / ``updated`` /
  ``removed``, including deletions that happened while disconnected).
* **Bad values.** A value that does not decode is skipped with a warning naming the key
  and counted in ``health().skipped``. If its key was live, that engine is ``removed``
  (its record can no longer be trusted); if the key later holds a valid record it is
  ``added``; deleting a never-valid key delivers nothing. The same holds for records
  that stop (or start) matching the label selector.
* **Removed events** carry the last known record.
* **Partitions.** The watch stream is leader-required: a member cut off from the rest of
  the cluster refuses it, or ends it within a few election timeouts of losing its leader,
  and the watch resumes at once on another member, at the last applied revision.
  List reads are linearizable (they fail on a member without a leader).
* **Bounded staleness.** ``health().staleness`` is the time since a member with a leader
  last answered (an event, or the answer to a progress request sent after
  ``progress_interval`` of quiet); ``health().stale`` says it exceeds ``stale_after``
  (see ``discovery._staleness`` for the default and the bound it gives). When no member
  with a leader answers, the watcher keeps its last table (fail-static) and says so in
  ``health()``, snapshots, ``discovery_watcher_staleness_seconds`` and a WARNING log.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from types import MappingProxyType

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential_jitter

from ._codec import EngineRecord, KeySpace, RecordView
from ._connection import Connection, connection_for
from ._dispatch import Dispatcher
from ._errors import (
    ClosedError,
    DiscoveryError,
    EtcdUnavailableError,
    RecordDecodeError,
)
from ._metrics import NO_METRICS, MetricsHooks
from ._port import (
    Compacted,
    EtcdPort,
    NoLeaderError,
    StreamSilentError,
    WatchEvent,
    WatchStream,
    explain,
)
from ._settings import Settings, positive_seconds
from ._staleness import Freshness, default_stale_after
from ._store import Batch, Change, EndpointEvent, EngineStore, Entry

__all__ = [
    "EndpointWatcher",
    "EngineListing",
    "ListedEngine",
    "WatcherHealth",
    "WatcherState",
    "list_engines",
]

log = logging.getLogger(__name__)

_HEALTHY_AFTER = 10.0  # a stream that lived this long restarts the backoff from scratch


class WatcherState(enum.StrEnum):
    """Connection state of a watcher."""

    STARTING = "starting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    STOPPED = "stopped"


@dataclass(frozen=True)
class WatcherHealth:
    """A point-in-time view of a watcher, for health endpoints."""

    state: WatcherState
    revision: int
    """The etcd revision the delivered events reflect."""
    last_error: str | None
    last_success: datetime | None
    """When a response last arrived from etcd."""
    reconnects: int
    relists: int
    skipped: int
    """Values under the prefix that could not be decoded."""
    engines: int
    staleness: float = 0.0
    """Seconds since an etcd member with a leader last answered (see ``stale_after``)."""
    stale: bool = False
    """Whether ``staleness`` exceeds ``stale_after``: the table may miss changes."""
    stale_after: float = 0.0
    """The staleness threshold in seconds."""


class _Resume(Exception):
    """Internal: a healthy stream ended; reconnect with a fresh backoff."""


class EndpointWatcher:
    """Streams typed events for the engines of one namespace (see module docs).

    Consume it as a blocking iterator (``for event in watcher``), as an async iterator
    (``async for event in watcher``), or with ``subscribe(callback)``. Each consumer
    first gets the current engines as ``added`` events, then every change. ``start()``
    and ``stop()`` are explicit and idempotent; ``stop()`` ends every iterator and
    leaves no thread or stream behind. The engines themselves live in one store
    (``watcher.store``), which a ``RoutingTable`` reads.

    ``progress_interval`` (seconds, default 1) is how long the stream may stay quiet
    before the watcher asks etcd for a progress notification; ``stale_after`` (seconds,
    default ``progress_interval + 3 x settings.election_timeout``) is the staleness
    above which ``health().stale`` is true. A stream that answers nothing for two
    ``heartbeat`` s is dropped and opened again.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        namespace: str | None = None,
        selector: Mapping[str, str] | None = None,
        connection: Connection | None = None,
        heartbeat: float = 5.0,
        progress_interval: float = 1.0,
        stale_after: float | None = None,
        metrics: MetricsHooks | None = None,
    ) -> None:
        for name, value in (("progress_interval", progress_interval), ("stale_after", stale_after)):
            if value is not None:
                positive_seconds(name, value, finite=False)
        self._metrics = metrics or NO_METRICS
        self._owns_connection = connection is None
        if connection is None:
            settings = settings if settings is not None else Settings.from_env()
            if namespace is not None:
                settings = settings.with_namespace(namespace)
            connection = Connection(settings)
        self._conn: EtcdPort = connection
        self._keyspace = (
            connection.settings.keyspace
            if namespace is None
            else KeySpace(connection.settings.root, namespace)
        )
        self.prefix = self._keyspace.prefix
        self.selector = MappingProxyType(dict(selector or {}))
        if stale_after is None:
            stale_after = default_stale_after(
                progress_interval, connection.settings.election_timeout
            )
        self.freshness = Freshness(self.prefix, stale_after, self._describe)
        """When a member with a leader last answered this watcher."""
        self.store = EngineStore(self.freshness)
        """The engines this watcher sees: the one copy, shared by every RoutingTable on it."""
        self._heartbeat = heartbeat
        self._progress_interval = progress_interval
        self._lock = threading.Lock()
        self._newest = 0  # newest etcd revision seen in any response: lag = newest - applied
        self._listed = threading.Event()
        self._needs_list = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: WatchStream | None = None
        self._state = WatcherState.STARTING
        self._last_error: str | None = None
        self._last_exc: BaseException | None = None
        self._last_success = 0.0  # time.time() of the last response; 0: none yet
        self._reconnects = 0
        self._relists = 0
        self._skipped = 0
        self._metrics.observe_watcher(self)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> EndpointWatcher:
        """Start watching. With ``wait``, return once the first snapshot is in.

        With ``wait``, raises the last error (EtcdUnavailableError, PermissionDeniedError)
        if no snapshot could be read within ``settings.dial_timeout``, and stops.
        """
        with self._lock:
            if self._stop.is_set():
                raise ClosedError("watcher is stopped")
            if self._thread is None:
                self.freshness.start()
                self._thread = threading.Thread(
                    target=self._run, name="discovery-watcher", daemon=True
                )
                self._thread.start()
        if wait and not self._listed.wait(self._conn.settings.dial_timeout):
            cause = self._last_exc
            self.stop()
            if isinstance(cause, DiscoveryError):
                raise cause
            raise EtcdUnavailableError(f"no snapshot of {self.prefix} from etcd in time") from cause
        return self

    def stop(self) -> None:
        """Stop watching, end every iterator and join the watcher's threads. Idempotent."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        with self._lock:
            self._state = WatcherState.STOPPED
        self.store.close()
        self.freshness.stop()
        if self._owns_connection:
            self._conn.close()

    def __enter__(self) -> EndpointWatcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> EndpointWatcher:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

    # -- consumers ---------------------------------------------------------------------

    def subscribe(self, callback: Callable[[EndpointEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for the current engines, then for every change.

        Callbacks run in order on one background thread, outside any lock; a slow or
        failing callback never stalls the watch. Returns an unsubscribe function.
        """
        return self.store.add_sink(_CallbackSink(callback, self.store.dispatcher))

    def __iter__(self) -> Iterator[EndpointEvent]:
        """Block for events; ends when the watcher stops."""
        sink = _QueueSink()
        remove = self.store.add_sink(sink)
        try:
            while (batch := sink.queue.get()) is not None:
                yield from batch
        finally:
            remove()

    async def __aiter__(self) -> AsyncIterator[EndpointEvent]:
        """Await events without blocking the event loop; ends when the watcher stops."""
        sink = _AsyncSink(asyncio.get_running_loop())
        remove = self.store.add_sink(sink)
        try:
            while (batch := await sink.queue.get()) is not None:
                for event in batch:
                    yield event
        finally:
            remove()

    # -- views -------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The etcd revision that the delivered events reflect."""
        return self.store.revision

    def health(self) -> WatcherHealth:
        """Connection state, last error, revision, counters and staleness."""
        staleness = self.freshness.age()
        with self._lock:
            return WatcherHealth(
                state=self._state,
                revision=self.store.revision,
                last_error=self._last_error,
                last_success=(
                    datetime.fromtimestamp(self._last_success, UTC) if self._last_success else None
                ),
                reconnects=self._reconnects,
                relists=self._relists,
                skipped=self._skipped,
                engines=len(self.store),
                staleness=staleness,
                stale=staleness > self.freshness.stale_after,
                stale_after=self.freshness.stale_after,
            )

    def _describe(self) -> str:
        """What the watcher serves, and why it is not current: for the stale warning."""
        with self._lock:
            error = self._last_error or "none"
        return f"{len(self.store)} engines at revision {self.store.revision}, last error: {error}"

    # -- the list-watch loop -----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            retrying = Retrying(
                retry=retry_if_exception(self._should_retry),
                wait=self._backoff,
                sleep=self._pause,
                before_sleep=self._before_retry,
                reraise=True,
            )
            try:
                retrying(self._session)
            except _Resume:
                continue
            except Exception as exc:
                if not self._stop.is_set():  # a bug of ours: keep the evidence, keep going
                    log.exception("watcher loop failed; restarting")
                    self._on_retry(exc)
                    self._stop.wait(1.0)

    _exponential = wait_exponential_jitter(multiplier=0.05, max=3.0, jitter=0.2)

    def _backoff(self, state: RetryCallState) -> float:
        delay: float = self._exponential(state)
        if state.outcome is not None and isinstance(state.outcome.exception(), NoLeaderError):
            # A partition or an election: another member (or this one, once it has a
            # leader again) answers soon, and a refusal costs etcd next to nothing.
            return min(delay, self._conn.settings.election_timeout / 4)
        return delay

    def _pause(self, seconds: float) -> None:
        self._stop.wait(seconds)  # a stop ends the backoff at once

    def _should_retry(self, exc: BaseException) -> bool:
        return not self._stop.is_set() and not isinstance(exc, _Resume)

    def _before_retry(self, state: RetryCallState) -> None:
        if state.outcome is not None and (exc := state.outcome.exception()) is not None:
            self._on_retry(exc)

    def _on_retry(self, exc: BaseException) -> None:
        reason = explain(exc)
        with self._lock:
            if self._state is not WatcherState.STOPPED:
                self._state = WatcherState.RECONNECTING
            self._last_error = reason
            self._last_exc = exc
            self._reconnects += 1
        self._metrics.watcher_connected(self.prefix, False)
        self._metrics.watcher_reconnect(self.prefix, _cause(exc))
        log.warning("watch of %s interrupted (%s); reconnecting", self.prefix, reason)

    def _session(self) -> None:
        if self._needs_list:
            self._relist()
        stream = self._conn.open_watch(
            self.prefix,
            self.store.revision,  # inclusive: see "Exactly once" in the module docs
            heartbeat=self._heartbeat,
            progress_interval=self._progress_interval,
        )
        self._stream = stream
        if self._stop.is_set():
            stream.close()
            return
        opened = time.monotonic()
        try:
            for response in stream:
                self._mark_connected()
                self._newest = max(self._newest, response.revision)
                if response.events:
                    self._apply(response.events)
                self.freshness.proved()  # after the store took the batch (see _store.py)
                self._metrics.watcher_revision(self.prefix, self.store.revision, self._newest)
        except Compacted as exc:
            log.warning("watch of %s fell behind compaction (%s); listing again", self.prefix, exc)
            self._needs_list = True
            raise
        except Exception as exc:
            if self._stop.is_set():
                return
            if time.monotonic() - opened >= _HEALTHY_AFTER:
                self._on_retry(exc)
                raise _Resume() from exc
            raise
        finally:
            self._stream = None
            stream.close()

    def _mark_connected(self) -> None:
        # Runs for every response: lock-free unless the state changes.
        self._last_success = time.time()
        if self._state is WatcherState.CONNECTED:
            return
        with self._lock:
            if self._state is WatcherState.STOPPED:
                return
            self._state = WatcherState.CONNECTED
        self._metrics.watcher_connected(self.prefix, True)

    def _relist(self) -> None:
        # One attempt per page: this loop's own backoff retries, and reports, failures
        # (a revision compacted between pages too). A page decodes while the next is read.
        revision = 0
        entries: dict[str, Entry] = {}
        for revision, kvs in self._conn.list_pages(self.prefix, timeout=0):  # noqa: B007
            for kv in kvs:
                key = kv.key.decode("utf-8", "backslashreplace")
                record = self._decode(key, kv.value)
                if record is not None:
                    entries[record.engine_id] = Entry(key, record, kv.mod_revision)
        batch = self.store.replace(entries, revision)
        if self._listed.is_set():
            self._relists += 1
            self._metrics.watcher_relist(self.prefix, "compaction")
        self._needs_list = False
        self._listed.set()
        self._newest = max(self._newest, revision)
        self._metrics.events_applied(self.prefix, (e.type.value for e in batch), 0.0)
        self._metrics.watcher_revision(self.prefix, revision, self._newest)
        self.freshness.proved()  # a linearizable read: its member had a leader
        self._mark_connected()

    def _decode(self, key: str, value: bytes) -> EngineRecord | None:
        """The record at ``key`` if valid and selected; None (counted if invalid) otherwise."""
        try:
            record = self._keyspace.decode(key, value)
        except RecordDecodeError as exc:
            with self._lock:
                self._skipped += 1
            self._metrics.malformed_value(self.prefix)
            log.warning("skipping malformed value: %s", exc)
            return None
        return record if record.matches(self.selector) else None

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        """Hand one response's changes to the store (decoded here, outside its lock)."""
        started = time.perf_counter()
        skip = len(self.prefix)
        held = self.store.revision  # the watch starts there: its changes come again
        changes = []
        for event in events:
            if event.kv.mod_revision <= held:
                continue
            key = event.kv.key.decode("utf-8", "backslashreplace")
            record = self._decode(key, event.kv.value) if event.is_put else None
            changes.append(Change(key, key[skip:], event.kv.mod_revision, record))
        applied = self.store.apply(changes)
        self._metrics.events_applied(
            self.prefix, (kind.value for kind in applied), time.perf_counter() - started
        )


@dataclass(frozen=True)
class ListedEngine(RecordView):
    """One engine as ``list_engines`` read it."""

    record: EngineRecord
    key: str
    mod_revision: int
    lease_id: int
    """The lease the key is bound to; 0 for a key without a lease."""
    ttl: int | None
    """Seconds left on the lease when read (with ``lease_ttls``); else None."""


@dataclass(frozen=True)
class EngineListing:
    """The engines of a namespace at one etcd revision."""

    revision: int
    engines: tuple[ListedEngine, ...]
    skipped: tuple[RecordDecodeError, ...]
    """Values under the prefix that did not decode (each names its key and the reason)."""


def list_engines(
    settings: Settings | None = None,
    *,
    selector: Mapping[str, str] | None = None,
    connection: Connection | None = None,
    lease_ttls: bool = False,
) -> EngineListing:
    """Read the engines of a namespace once, at one revision (a paged, linearizable read).

    ``selector`` keeps engines carrying those labels; ``lease_ttls`` also asks etcd for
    each lease's remaining TTL (one request per engine). Bad values are skipped and
    returned in ``skipped``. Uses ``connection`` if given, else one built from
    ``settings`` (default: ``Settings.from_env()``) and closed before returning.
    """
    with connection_for(connection, settings) as conn:
        keyspace = conn.settings.keyspace
        revision, kvs = conn.list_prefix(keyspace.prefix)
        engines = []
        skipped = []
        for kv in kvs:
            try:
                record = keyspace.decode(kv.key, kv.value)
            except RecordDecodeError as exc:
                skipped.append(exc)
                continue
            if not record.matches(selector):
                continue
            ttl = None
            if lease_ttls and kv.lease:
                ttl = conn.call(partial(conn.lease_info, kv.lease)).ttl
            engines.append(ListedEngine(record, kv.key.decode(), kv.mod_revision, kv.lease, ttl))
        return EngineListing(revision, tuple(engines), tuple(skipped))


def _cause(exc: BaseException) -> str:
    """The reconnect cause a metric is labelled with."""
    if isinstance(exc, Compacted):
        return "compaction"
    if isinstance(exc, StreamSilentError):
        return "timeout"
    if isinstance(exc, NoLeaderError):
        return "no_leader"
    return "stream_error"


class _CallbackSink:
    def __init__(self, callback: Callable[[EndpointEvent], None], dispatcher: Dispatcher) -> None:
        self._callback = callback
        self._dispatcher = dispatcher

    def deliver(self, batch: Batch) -> None:
        self._dispatcher.submit(self._run, batch)

    def _run(self, batch: Batch) -> None:
        for event in batch:
            try:
                self._callback(event)
            except Exception:
                log.exception("watch callback %r failed on %s", self._callback, event)

    def close(self) -> None:
        pass


class _QueueSink:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()

    def deliver(self, batch: Batch) -> None:
        self.queue.put(batch)

    def close(self) -> None:
        self.queue.put(None)


class _AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[Batch | None] = asyncio.Queue()

    def deliver(self, batch: Batch | None) -> None:
        # RuntimeError: the loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.queue.put_nowait, batch)

    def close(self) -> None:
        self.deliver(None)
