"""The live routing table: engine id -> record, fed by an EndpointWatcher.

Reads never touch etcd. Each watcher batch (one etcd revision, or one snapshot diff) is
applied under the table's lock at once, so a reader never sees half a revision. The
records live in a persistent map (``immutables.Map``): a batch costs O(changes x log N)
and a snapshot is the map itself, so neither copies the table (50,000 engines included).

A snapshot carries the watcher's proof of being current: ``snapshot.staleness`` (read at
the time you ask, so a snapshot held for long grows stale) and ``snapshot.stale``. During
a partition that leaves the watcher without a member that has a leader, the table keeps
serving its last content (fail-static) and its snapshots say ``stale``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping

import immutables

from ._codec import EngineRecord
from ._connection import Connection
from ._dispatch import Dispatcher, Listeners
from ._metrics import Metrics
from ._settings import Settings
from ._staleness import Freshness
from ._watcher import EndpointEvent, EndpointWatcher, EventType

__all__ = ["RoutingSnapshot", "RoutingTable"]


class RoutingSnapshot(Mapping[str, EngineRecord]):
    """An immutable view of the table: engine id -> record, at ``revision``.

    ``staleness`` and ``stale`` say how current it is, at the time you ask: the table's
    snapshot shares its watcher's proof of being current until the table changes, and
    keeps the last such proof from then on. A snapshot built by hand has no proof: its
    staleness is 0.
    """

    __slots__ = ("_freshness", "_proven_until", "_records", "revision")

    def __init__(
        self,
        records: Mapping[str, EngineRecord],
        revision: int,
        *,
        freshness: Freshness | None = None,
    ) -> None:
        self._records = records if isinstance(records, immutables.Map) else immutables.Map(records)
        self.revision = revision
        self._freshness = freshness
        self._proven_until: float | None = None

    def _supersede(self) -> None:
        """The table moved on: later proofs no longer cover this content."""
        if self._freshness is not None:
            self._proven_until = self._freshness.proven_at

    @property
    def proven_at(self) -> float | None:
        """``time.monotonic()`` when etcd last proved this content current (None: no proof)."""
        if self._proven_until is not None or self._freshness is None:
            return self._proven_until
        return self._freshness.proven_at

    @property
    def staleness(self) -> float:
        """Seconds, now, since etcd last proved this content current (0 without a proof)."""
        proven_at = self.proven_at
        return 0.0 if proven_at is None else max(0.0, time.monotonic() - proven_at)

    @property
    def stale(self) -> bool:
        """Whether ``staleness`` exceeds the watcher's ``stale_after``: etcd may hold more."""
        return self._freshness is not None and self.staleness > self._freshness.stale_after

    def __getitem__(self, engine_id: str) -> EngineRecord:
        return self._records[engine_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"<RoutingSnapshot revision={self.revision} engines={sorted(self._records)}>"


TableListener = Callable[[tuple[EndpointEvent, ...], RoutingSnapshot], None]


class RoutingTable:
    """A live, thread-safe mapping of engine id -> EngineRecord.

    Give it a watcher to share one, or let it build its own from ``settings`` /
    ``namespace`` / ``selector`` / ``connection`` (then ``start()``/``stop()`` drive it).
    ``metrics`` exports the table's size (and its own watcher's metrics).
    """

    def __init__(
        self,
        watcher: EndpointWatcher | None = None,
        *,
        settings: Settings | None = None,
        namespace: str | None = None,
        selector: Mapping[str, str] | None = None,
        connection: Connection | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._owns_watcher = watcher is None
        self.watcher = watcher or EndpointWatcher(
            settings, namespace=namespace, selector=selector, connection=connection, metrics=metrics
        )
        if metrics is not None:
            metrics.observe_table(self)
        self._cond = threading.Condition()
        self._records: immutables.Map[str, EngineRecord] = immutables.Map()
        self._revision = 0
        self._snapshot: RoutingSnapshot | None = None
        self._listeners: Listeners[TableListener] = Listeners()
        self._dispatcher = Dispatcher("discovery-table-events")
        self._remove_sink: Callable[[], None] | None = None

    def start(self, *, wait: bool = True) -> RoutingTable:
        """Attach to the watcher (starting it if the table owns it)."""
        if self._remove_sink is None:
            self._remove_sink = self.watcher.add_sink(self)
        if self._owns_watcher:
            self.watcher.start(wait=wait)
        return self

    def stop(self) -> None:
        """Detach from the watcher (stopping it if the table owns it). Idempotent."""
        if self._remove_sink is not None:
            self._remove_sink()
        if self._owns_watcher:
            self.watcher.stop()
        self._dispatcher.stop()

    def __enter__(self) -> RoutingTable:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- fed by the watcher (its sink protocol) ----------------------------------------

    def deliver(self, batch: tuple[EndpointEvent, ...]) -> None:
        """Apply one batch atomically, then notify waiters and listeners."""
        with self._cond:
            with self._records.mutate() as records:
                for event in batch:
                    if event.type is EventType.REMOVED:
                        records.pop(event.engine_id, None)
                    else:
                        records[event.engine_id] = event.record
                self._records = records.finish()
            self._revision = max(self._revision, batch[-1].revision)
            if self._snapshot is not None:
                # Delivered before the watcher records its proof of this batch, so the
                # proof time now is the last one that covered the old content.
                self._snapshot._supersede()
            self._snapshot = None
            self._cond.notify_all()
        if self._listeners:
            snapshot = self.snapshot()
            for listener in self._listeners:
                self._dispatcher.submit(listener, batch, snapshot)

    def close(self) -> None:
        """The watcher stopped: wake every waiter."""
        with self._cond:
            self._cond.notify_all()

    # -- reads -------------------------------------------------------------------------

    def snapshot(self) -> RoutingSnapshot:
        """An immutable view of every engine and the revision it reflects (and staleness)."""
        with self._cond:
            if self._snapshot is None:
                self._snapshot = RoutingSnapshot(
                    self._records, self._revision, freshness=self.watcher.freshness
                )
            return self._snapshot

    def get(self, engine_id: str) -> EngineRecord | None:
        """The record of ``engine_id``, or None."""
        with self._cond:
            return self._records.get(engine_id)

    def __len__(self) -> int:
        with self._cond:
            return len(self._records)

    def __contains__(self, engine_id: object) -> bool:
        with self._cond:
            return engine_id in self._records

    @property
    def revision(self) -> int:
        """The etcd revision the table reflects."""
        return self._revision

    def wait_until(
        self, predicate: Callable[[RoutingSnapshot], bool], timeout: float | None = None
    ) -> RoutingSnapshot:
        """Block until ``predicate(snapshot)`` holds; return that snapshot.

        Raises TimeoutError when it does not hold within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                snapshot = self.snapshot()
                if predicate(snapshot):
                    return snapshot
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"routing table condition not met within {timeout} s")
                self._cond.wait(remaining)

    def subscribe(self, listener: TableListener) -> Callable[[], None]:
        """Call ``listener(events, snapshot)`` after each applied batch; returns unsubscribe.

        Listeners run in order on a background thread, outside the table's lock.
        """
        return self._listeners.add(listener)
