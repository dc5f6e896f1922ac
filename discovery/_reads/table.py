"""The live routing table: engine id -> record, as the watch sees it; and its factory.

A ``RoutingTable`` reads the one store its watcher feeds (``_store.EngineStore``): reads
never touch etcd, each etcd revision is applied at once, and two tables on one watcher
share one copy of the records. ``watch_table(...)`` is the one place that wires a
connection, a watcher and a table together.
"""

from __future__ import annotations

from collections.abc import Callable

from discovery._dispatch import Listeners, run_inline
from discovery._etcd.port import EtcdPort
from discovery._metrics import MetricsHooks
from discovery._reads.store import Batch, EngineStore, RoutingSnapshot
from discovery._reads.watcher import EndpointWatcher
from discovery._records.record import EngineRecord
from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._settings import Settings

__all__ = ["RoutingTable", "watch_table"]

TableListener = Callable[[Batch, RoutingSnapshot], None]


class RoutingTable:
    """A live, thread-safe mapping of engine id -> EngineRecord.

    ``RoutingTable(watcher)`` reads the engines ``watcher`` sees; ``start()`` / ``stop()``
    drive the watcher only when the table owns it (``own_watcher``, as ``watch_table``
    builds it). Given a bare store instead of a watcher, the table is fed by hand
    (simulations, tests). ``metrics`` exports the table's size.
    """

    def __init__(
        self,
        watcher: EndpointWatcher | EngineStore,
        *,
        own_watcher: bool = False,
        metrics: MetricsHooks | None = None,
    ) -> None:
        if isinstance(watcher, EngineStore):
            self.watcher: EndpointWatcher | None = None
            self.store = watcher
        else:
            self.watcher = watcher
            self.store = watcher.store
        self._owns_watcher = own_watcher and self.watcher is not None
        self._listeners: Listeners[TableListener] = Listeners()
        self._inline: Listeners[TableListener] = Listeners()
        self._remove_sink: Callable[[], None] | None = None
        if metrics is not None:
            metrics.observe_table(self)

    @property
    def selector(self) -> Selector:
        """The selector every engine in the table matches (its watcher's)."""
        return self.watcher.selector if self.watcher is not None else selector_of(None)

    def start(self, *, wait: bool = True) -> RoutingTable:
        """Start calling listeners (and the watcher, if the table owns it)."""
        if self._remove_sink is None:
            self._remove_sink = self.store.add_sink(self, replay=False)
        if self._owns_watcher and self.watcher is not None:
            self.watcher.start(wait=wait)
        return self

    def stop(self) -> None:
        """Stop calling listeners (and stop the watcher, if the table owns it). Idempotent."""
        if self._remove_sink is not None:
            self._remove_sink()
        if self._owns_watcher and self.watcher is not None:
            self.watcher.stop()

    def __enter__(self) -> RoutingTable:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the store's sink protocol: listeners ------------------------------------------

    def deliver(self, batch: Batch) -> None:
        """Hand a batch the store just applied to the listeners (on the store's thread)."""
        # Each set read once (lock-free, copy on write): both hold this batch's listeners.
        inline, listeners = self._inline.current(), self._listeners.current()
        if inline or listeners:
            snapshot = self.store.snapshot()
            for listener in inline:
                run_inline(listener, batch, snapshot)
            if listeners:
                submit = self.store.dispatcher.submit
                for listener in listeners:
                    submit(listener, batch, snapshot)

    def wants(self) -> bool:
        """Whether ``deliver`` would use a batch now: with listeners, or when overridden."""
        return (
            bool(self._listeners)
            or bool(self._inline)
            or type(self).deliver is not RoutingTable.deliver
        )

    def close(self) -> None:
        """The store closed: nothing more to deliver."""

    def subscribe(self, listener: TableListener, *, inline: bool = False) -> Callable[[], None]:
        """Call ``listener(events, snapshot)`` after each applied batch; returns unsubscribe.

        Listeners run in order on a background thread, outside the table's lock. With
        ``inline``, the listener runs on the watch thread itself as the batch is applied,
        before the others: no hand-off, but the watch waits for it, so it must be quick and
        must not block (update an index, set an event); what it raises is logged.
        """
        return (self._inline if inline else self._listeners).add(listener)

    # -- reads -------------------------------------------------------------------------

    def snapshot(self) -> RoutingSnapshot:
        """An immutable view of every engine and the revision it is current at."""
        return self.store.snapshot()

    def get(self, engine_id: str) -> EngineRecord | None:
        """The record of ``engine_id``, or None."""
        return self.store.get(engine_id)

    def __len__(self) -> int:
        return len(self.store)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.store

    @property
    def revision(self) -> int:
        """The etcd revision the table is current at."""
        return self.store.revision

    def wait_until(
        self, predicate: Callable[[RoutingSnapshot], bool], timeout: float | None = None
    ) -> RoutingSnapshot:
        """Block until ``predicate(snapshot)`` holds; return that snapshot.

        Raises TimeoutError when it does not hold within ``timeout`` seconds.
        """
        return self.store.wait_until(predicate, timeout)


def watch_table(
    settings: Settings | None = None,
    *,
    namespace: str | None = None,
    selector: SelectorLike | None = None,
    connection: EtcdPort | None = None,
    heartbeat: float = 5.0,
    progress_interval: float = 1.0,
    stale_after: float | None = None,
    metrics: MetricsHooks | None = None,
) -> RoutingTable:
    """A routing table on a watcher of its own; ``start()`` it (or use ``with``).

    The watcher uses ``connection`` if given, else one of its own built from ``settings``
    (default ``Settings.from_env()``), closed when the table stops. ``namespace`` and
    ``selector`` choose the engines; ``progress_interval`` and ``stale_after`` are the
    watcher's (see ``EndpointWatcher``); ``metrics`` exports the table's and watcher's
    figures.
    """
    watcher = EndpointWatcher(
        settings,
        namespace=namespace,
        selector=selector,
        connection=connection,
        heartbeat=heartbeat,
        progress_interval=progress_interval,
        stale_after=stale_after,
        metrics=metrics,
    )
    return RoutingTable(watcher, own_watcher=True, metrics=metrics)
