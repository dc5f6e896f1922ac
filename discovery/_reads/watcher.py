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
  (see ``discovery._reads.staleness`` for the default and the bound it gives). When no member
  with a leader answers, the watcher keeps its last table (fail-static) and says so in
  ``health()``, snapshots, ``discovery_watcher_staleness_seconds`` and a WARNING log.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from discovery._dispatch import Dispatcher
from discovery._errors import DiscoveryError, EtcdUnavailableError, RecordDecodeError
from discovery._etcd.port import EtcdPort, KeyValue, WatchResponse
from discovery._etcd.reflector import Reflector, WatcherState
from discovery._etcd.transport import connect, keyspace_for, port_for
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._reads.staleness import Freshness, default_stale_after
from discovery._reads.store import Batch, Change, EndpointEvent, EngineStore, Entry
from discovery._records.codec import KeySpace, decode
from discovery._records.record import EngineRecord, RecordView
from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._settings import Settings, positive_seconds

__all__ = [
    "EndpointWatcher",
    "EngineListing",
    "ListedEngine",
    "WatcherHealth",
    "WatcherState",
    "list_engines",
]

log = logging.getLogger(__name__)


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
    cluster_changes: int = 0
    """Listings that found another etcd cluster (data wiped or restored) and replaced the
    table with what that cluster holds."""


class EndpointWatcher:
    """Streams typed events for the engines of one namespace (see module docs).

    Consume it as a blocking iterator (``for event in watcher``), as an async iterator
    (``async for event in watcher``), or with ``subscribe(callback)``. Each consumer
    first gets the current engines as ``added`` events, then every change. ``start()``
    and ``stop()`` are explicit and idempotent; ``stop()`` ends every iterator and
    leaves no thread or stream behind. The engines themselves live in one store
    (``watcher.store``), which a ``RoutingTable`` reads.

    ``selector`` keeps the engines whose labels it matches: a ``Selector``, its text
    (``"env in (a,b),!canary"``) or labels to equal (``{"model": "m"}``); a malformed one
    raises InvalidSelectorError here. ``progress_interval`` (seconds, default 1) is how
    long the stream may stay quiet before the watcher asks etcd for a progress
    notification; ``stale_after`` (seconds, default ``progress_interval + 3 x
    settings.election_timeout``) is the staleness above which ``health().stale`` is true.
    A stream that answers nothing for two ``heartbeat`` s is dropped and opened again.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        namespace: str | None = None,
        selector: SelectorLike | None = None,
        connection: EtcdPort | None = None,
        heartbeat: float = 5.0,
        progress_interval: float = 1.0,
        stale_after: float | None = None,
        metrics: MetricsHooks | None = None,
    ) -> None:
        for name, value in (("progress_interval", progress_interval), ("stale_after", stale_after)):
            if value is not None:
                positive_seconds(name, value, finite=False)
        self.selector = selector_of(selector)
        """The engines this watcher keeps: those whose labels it matches."""
        keyspace = keyspace_for(settings, connection)
        if namespace is not None:
            keyspace = KeySpace(keyspace.root, namespace)
        self._owns_connection = connection is None
        self._conn: EtcdPort = connect(settings, metrics) if connection is None else connection
        self.prefix = keyspace.prefix
        if stale_after is None:
            stale_after = default_stale_after(progress_interval, self._conn.election_timeout)
        self.freshness = Freshness(self.prefix, stale_after, self._describe)
        """When a member with a leader last answered this watcher."""
        self.store = EngineStore(self.freshness)
        """The engines this watcher sees: the one copy, shared by every RoutingTable on it."""
        self._feed = _Feed(keyspace, self.selector, self.store, self.freshness, metrics)
        self._reflector = Reflector(
            self._conn,
            self.prefix,
            self._feed,
            name=self.prefix,
            heartbeat=heartbeat,
            progress_interval=progress_interval,
            metrics=metrics,
            runner=self.store.dispatcher,  # its threads take turns: loop, callbacks
        )
        (metrics or NO_METRICS).observe_watcher(self)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> EndpointWatcher:
        """Start watching. With ``wait``, return once the first snapshot is in.

        With ``wait``, raises the last error (EtcdUnavailableError, PermissionDeniedError)
        if no snapshot could be read within ``settings.dial_timeout``, and stops.
        """
        deadline = time.monotonic() + self._conn.dial_timeout
        # With wait, the first listing runs on this thread: no hand-off to the watch
        # thread and back; the staleness monitor starts on the watch thread (the view is
        # running, for health and metrics, from now).
        self.freshness.begin()
        self._reflector.start(
            thread_name="discovery-watcher", list_here=wait, starting=self.freshness.start
        )
        if wait and not self._feed.listed.wait(max(0.0, deadline - time.monotonic())):
            cause = self._reflector.last_exception
            self.stop()
            if isinstance(cause, DiscoveryError):
                raise cause
            raise EtcdUnavailableError(f"no snapshot of {self.prefix} from etcd in time") from cause
        return self

    def stop(self) -> None:
        """Stop watching, end every iterator and join the watcher's threads. Idempotent."""
        self._reflector.stop()
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

    def subscribe(
        self, callback: Callable[[EndpointEvent], None], *, inline: bool = False
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for the current engines, then for every change.

        Callbacks run in order, one at a time, on a background thread (never the one
        reading the stream), outside any lock; a slow or failing callback never stalls the
        watch. With ``inline``, the callback runs on the watch thread itself as each batch
        is applied (no hand-off; the watch waits for it, so it must be quick and must not
        block; what it raises is logged). Returns an unsubscribe function.
        """
        dispatcher = None if inline else self.store.dispatcher
        return self.store.add_sink(_CallbackSink(callback, dispatcher))

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
        loop = self._reflector.health()
        return WatcherHealth(
            state=loop.state,
            revision=self.store.revision,
            last_error=loop.last_error,
            last_success=loop.last_success,
            reconnects=loop.reconnects,
            relists=loop.relists,
            cluster_changes=loop.cluster_changes,
            skipped=self._feed.skipped,
            engines=len(self.store),
            staleness=staleness,
            stale=staleness > self.freshness.stale_after,
            stale_after=self.freshness.stale_after,
        )

    def _describe(self) -> str:
        """What the watcher serves, and why it is not current: for the stale warning."""
        error = self._reflector.health().last_error or "none"
        return f"{len(self.store)} engines at revision {self.store.revision}, last error: {error}"


class _CollectorPause:
    """The cyclic garbage collector paused while any listing decodes (a counter of them).

    A 50,000-record listing allocates a few objects per record, all kept: the collections
    they trigger find nothing to free and cost ~11% of its CPU. Re-enabled after the last
    listing only if it was enabled before the first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listings = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._listings:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._listings += 1
        try:
            yield
        finally:
            with self._lock:
                self._listings -= 1
                if not self._listings and self._was_enabled:
                    gc.enable()


_collector_paused = _CollectorPause()


class _Feed:
    """The reflector's target: decodes and selects what etcd says, and hands it to the store."""

    def __init__(
        self,
        keyspace: KeySpace,
        selector: Selector,
        store: EngineStore,
        freshness: Freshness,
        metrics: MetricsHooks | None,
    ) -> None:
        self._keyspace = keyspace
        self._prefix = keyspace.prefix
        self._selector = selector
        self._store = store
        self._freshness = freshness
        self._metrics = metrics or NO_METRICS
        self._lock = threading.Lock()
        self.skipped = 0
        """Values under the prefix that could not be decoded."""
        self.listed = threading.Event()
        """Set once the first listing is in the store."""

    def replace(self, pages: Iterator[tuple[int, list[KeyValue]]], *, reset: bool = False) -> int:
        """Decode and select each page as it arrives; hand the store the whole listing.

        ``reset``: a listing from another cluster, which replaces everything held.
        """
        revision = 0
        entries: dict[str, Entry] = {}
        engine_id, selector, entry = self._keyspace.engine_id, self._selector, tuple.__new__
        selecting = bool(selector)  # constant: not asked per record
        # The loop of _decode (KeySpace.decode's too), inlined: it runs once per engine
        # (50,000 at start-up).
        with _collector_paused():
            for revision, kvs in pages:  # noqa: B007 - every page is at the listing's revision
                for kv in kvs:
                    key = kv.key.decode("utf-8", "backslashreplace")
                    try:
                        record = decode(key, kv.value, engine_id(key))
                    except RecordDecodeError as exc:
                        self._skip(exc)
                        continue
                    if not selecting or record.matches(selector):
                        # Entry(key, record, revision), without its Python-level __new__.
                        entries[record.engine_id] = entry(Entry, (key, record, kv.mod_revision))
        kinds = self._store.replace(entries, revision, reset=reset)
        self.listed.set()
        self._metrics.events_applied(self._prefix, (kind.value for kind in kinds), 0.0)
        self._freshness.proved()  # a linearizable read: its member had a leader
        return revision

    def apply(self, response: WatchResponse) -> None:
        """Hand one response's changes to the store (decoded here, outside its lock)."""
        if response.events:
            started = time.perf_counter()
            skip = len(self._prefix)
            changes = []
            for event in response.events:
                kv = event.kv
                key = kv.key.decode("utf-8", "backslashreplace")
                record = self._decode(key, kv.value) if event.is_put else None
                changes.append(Change(key, key[skip:], kv.mod_revision, record))
            applied = self._store.apply(changes)
            if self._metrics is not NO_METRICS:  # no metric call per response without metrics
                self._metrics.events_applied(
                    self._prefix, (kind.value for kind in applied), time.perf_counter() - started
                )
        self._freshness.proved()  # after the store took the batch (see _reads/store.py)

    def _decode(self, key: str, value: bytes) -> EngineRecord | None:
        """The record at ``key`` if valid and selected; None (counted if invalid) otherwise."""
        try:
            record = self._keyspace.decode(key, value)
        except RecordDecodeError as exc:
            self._skip(exc)
            return None
        return record if self._selector.matches(record.labels) else None

    def _skip(self, exc: RecordDecodeError) -> None:
        """Count and report a value that does not decode."""
        with self._lock:
            self.skipped += 1
        self._metrics.malformed_value(self._prefix)
        log.warning("skipping malformed value: %s", exc)


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
    selector: SelectorLike | None = None,
    connection: EtcdPort | None = None,
    lease_ttls: bool = False,
) -> EngineListing:
    """Read the engines of a namespace once, at one revision (a paged, linearizable read).

    ``selector`` keeps the engines it matches (a ``Selector``, its text, or labels to
    equal); ``lease_ttls`` also asks etcd for
    each lease's remaining TTL (one request per engine). Bad values are skipped and
    returned in ``skipped``. Uses ``connection`` if given, else one built from
    ``settings`` (default: ``Settings.from_env()``) and closed before returning.
    """
    keyspace = keyspace_for(settings, connection)
    selected = selector_of(selector)
    with port_for(connection, settings) as conn:
        revision, kvs = conn.list_prefix(keyspace.prefix)
        engines = []
        skipped = []
        for kv in kvs:
            try:
                record = keyspace.decode(kv.key, kv.value)
            except RecordDecodeError as exc:
                skipped.append(exc)
                continue
            if not selected.matches(record.labels):
                continue
            ttl = None
            if lease_ttls and kv.lease:
                ttl = conn.call(partial(conn.lease_info, kv.lease)).ttl
            engines.append(ListedEngine(record, kv.key.decode(), kv.mod_revision, kv.lease, ttl))
        return EngineListing(revision, tuple(engines), tuple(skipped))


class _CallbackSink:
    """A subscriber's callback, on the dispatcher's thread, or inline when it has none."""

    def __init__(
        self, callback: Callable[[EndpointEvent], None], dispatcher: Dispatcher | None
    ) -> None:
        self._callback = callback
        self._dispatcher = dispatcher

    def deliver(self, batch: Batch) -> None:
        if self._dispatcher is None:
            self._run(batch)
        else:
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
