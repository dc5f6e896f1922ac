"""The store: the one copy of the engines a watch sees, and the events it derives.

client-go's reflector -> store split. The watch loop (``_reads/watcher.py``) reads etcd and
hands the store either a whole listing (``replace``) or the changes of a watch response
(``apply``); the store compares them with what it holds, computes ``added`` /
``updated`` / ``removed`` once for both paths, applies each etcd revision atomically and
fans the resulting batch out to its sinks (iterators, callbacks, routing-table listeners).

The records live in a persistent map (``immutables.Map``): a batch costs O(changes x
log N) and a snapshot is the map itself, so neither copies the table (50,000 engines
included). A reader never sees half a revision.

A snapshot carries the watch's proof of being current (``_staleness.Freshness``):
``snapshot.staleness`` is read when asked, so a snapshot kept for long grows stale, and a
table that a partition cut off from every member with a leader keeps serving its last
content (fail-static) while its snapshots say ``stale``.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple, Protocol

import immutables

from discovery._dispatch import Dispatcher
from discovery._reads.staleness import Freshness
from discovery._records.record import EngineRecord, RecordView

__all__ = ["EndpointEvent", "EventType", "RoutingSnapshot"]


class EventType(enum.StrEnum):
    """What happened to an engine."""

    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class EndpointEvent(RecordView):
    """One change to the set of live engines."""

    type: EventType
    key: str
    revision: int
    record: EngineRecord
    """The new record; for ``removed``, the last known one."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines form: type, engine_id, key, revision, endpoint, metadata.

        The metadata is every field the record declares (``labels``, ``status``, ...;
        null where unset).
        """
        return {
            "type": self.type.value,
            "engine_id": self.engine_id,
            "key": self.key,
            "revision": self.revision,
            "endpoint": self.endpoint.to_dict(),
            **self.record.metadata(),
        }


Batch = tuple[EndpointEvent, ...]

# Each field's slot, set directly: the store builds an event per engine of a listing.
_set_type, _set_key, _set_revision, _set_record = (
    EndpointEvent.__dict__[name].__set__ for name in ("type", "key", "revision", "record")
)


def _event(kind: EventType, key: str, revision: int, record: EngineRecord) -> EndpointEvent:
    """``EndpointEvent(kind, key, revision, record)`` at half the dataclass's cost."""
    event = object.__new__(EndpointEvent)
    _set_type(event, kind)
    _set_key(event, key)
    _set_revision(event, revision)
    _set_record(event, record)
    return event


class Entry(NamedTuple):
    """What the store keeps per engine: its key, record and the revision that wrote it.

    A tuple: built once per engine listed, at a third of a frozen dataclass's cost.
    """

    key: str
    record: EngineRecord
    mod_revision: int


class Change(NamedTuple):
    """One key at one revision, as the watch loop saw it.

    ``record`` is None for a delete, a value that does not decode, or a record the
    watch's selector does not select: for the store, all three mean "not live".
    """

    key: str
    engine_id: str
    revision: int
    record: EngineRecord | None


class RoutingSnapshot(Mapping[str, EngineRecord]):
    """An immutable view of the table: engine id -> record, at ``revision``.

    ``staleness`` and ``stale`` say how current it is, at the time you ask: the store's
    snapshot shares its watcher's proof of being current until the store changes, and
    keeps the last such proof from then on. A snapshot of a store fed by hand has no
    proof: its staleness is 0.
    """

    __slots__ = ("_entries", "_freshness", "_proven_until", "revision")

    def __init__(
        self,
        entries: immutables.Map[str, Entry],
        revision: int,
        freshness: Freshness | None = None,
    ) -> None:
        self._entries = entries
        self.revision = revision
        """The etcd revision this view is current at."""
        self._freshness = freshness
        self._proven_until: float | None = None

    def _supersede(self) -> None:
        """The store moved on: later proofs no longer cover this content."""
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
        return self._entries[engine_id].record

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<RoutingSnapshot revision={self.revision} engines={sorted(self._entries)}>"


class Sink(Protocol):
    """Where the store delivers batches (called under the store's lock: never block).

    A sink may also say whether it would use a batch now (``wants()``, else it always
    does): a first listing's batch is built only for one that would.
    """

    def deliver(self, batch: Batch) -> None:
        """Take one batch (one etcd revision, or one listing's difference)."""

    def close(self) -> None:
        """The store closed: no batch follows."""


class EngineStore:
    """The engines of one watch, keyed by engine id; thread-safe (see the module docs).

    ``freshness`` is the watch's proof of being current, which snapshots carry.
    """

    def __init__(self, freshness: Freshness | None = None) -> None:
        self._freshness = freshness
        self._cond = threading.Condition()
        self._entries: immutables.Map[str, Entry] = immutables.Map()
        self._revision = 0
        self._snapshot = RoutingSnapshot(self._entries, 0, freshness)
        self._sinks: list[Sink] = []
        self._closed = False
        self.dispatcher = Dispatcher("discovery-events")
        """The one thread that runs subscribers' callbacks, in order."""

    # -- fed by the watch loop ---------------------------------------------------------

    def replace(
        self, entries: Mapping[str, Entry], revision: int, *, reset: bool = False
    ) -> list[EventType]:
        """Take a whole listing read at ``revision``: deliver exactly the difference.

        Engines missing from ``entries`` are ``removed``, new ones ``added``, ones
        written since (another mod revision) ``updated``. The store is then current at
        ``revision``, also when the listing is empty. Returns the types of the events.

        ``reset``: the listing comes from another etcd cluster (or history): its revisions
        are not comparable with the ones held, so an engine whose record differs is
        ``updated`` whatever its mod revision, and the store's revision becomes
        ``revision``, also when lower.
        """
        with self._cond:
            old = self._entries
            self._entries = immutables.Map(entries)
            if reset:
                self._revision = revision
            if not old:
                # A first listing: every engine is added. Its events (50,000 objects at
                # start-up) are built only if a sink wants them (a table without listeners
                # does not).
                wanted = any(getattr(sink, "wants", _always)() for sink in self._sinks)
                batch = _as_added(entries.values(), revision) if wanted else ()
                self._commit_locked(batch, revision)
                return [EventType.ADDED] * len(entries)
            changed = [
                _event(EventType.REMOVED, entry.key, revision, entry.record)
                for engine_id, entry in old.items()
                if engine_id not in entries
            ]
            for engine_id, entry in entries.items():
                before = old.get(engine_id)
                if before is None:
                    changed.append(_event(EventType.ADDED, entry.key, revision, entry.record))
                elif before.mod_revision != entry.mod_revision or (
                    reset and before.record != entry.record
                ):
                    changed.append(_event(EventType.UPDATED, entry.key, revision, entry.record))
            self._commit_locked(tuple(changed), revision)
            return [event.type for event in changed]

    def apply(self, changes: Sequence[Change]) -> list[EventType]:
        """Apply watched changes, in revision order: one atomic batch per revision.

        A change not newer than what the store holds for that engine is ignored (never
        delivered twice). Returns the types of the events delivered.
        """
        applied: list[EventType] = []
        with self._cond:
            for revision, group in itertools.groupby(changes, key=attrgetter("revision")):
                entries = self._entries.mutate()
                batch = []
                for change in group:
                    event = _change_locked(entries, change)
                    if event is not None:
                        batch.append(event)
                        applied.append(event.type)
                self._entries = entries.finish()
                self._commit_locked(tuple(batch), revision)
        return applied

    def _commit_locked(self, batch: Batch, revision: int) -> None:
        self._revision = max(self._revision, revision)
        # The watch records its proof of this batch after handing it over, so the proof
        # time now is the last one that covered the old content.
        self._snapshot._supersede()
        # Published before the sinks run: a reader (a pick) sees the batch from here on,
        # without waiting for the lock (see snapshot()).
        self._snapshot = RoutingSnapshot(self._entries, self._revision, self._freshness)
        if batch:
            for sink in self._sinks:
                sink.deliver(batch)
        self._cond.notify_all()

    def close(self) -> None:
        """No more batches: end every sink and wake every waiter."""
        with self._cond:
            self._closed = True
            sinks, self._sinks = self._sinks, []
            self._cond.notify_all()
        for sink in sinks:
            sink.close()
        self.dispatcher.stop()

    # -- consumers ---------------------------------------------------------------------

    def add_sink(self, sink: Sink, *, replay: bool = True) -> Callable[[], None]:
        """Deliver every later batch to ``sink``; returns the function that removes it.

        With ``replay``, the engines held now come first, as one batch of ``added``.
        """
        with self._cond:
            if self._closed:
                sink.close()
                return lambda: None
            if replay and self._entries:
                sink.deliver(_as_added(self._entries.values(), self._revision))
            self._sinks.append(sink)

        def remove() -> None:
            with self._cond:
                if sink in self._sinks:
                    self._sinks.remove(sink)

        return remove

    # -- reads -------------------------------------------------------------------------

    def snapshot(self) -> RoutingSnapshot:
        """An immutable view of every engine and the revision it is current at."""
        # Lock-free: each batch publishes its snapshot in one assignment.
        return self._snapshot

    def settled_snapshot(self) -> RoutingSnapshot:
        """The snapshot once every sink has its batch (waits out a delivery under way).

        A reader that also takes batches (a router) sees no change in it whose batch it
        could still miss.
        """
        with self._cond:
            return self._snapshot

    def get(self, engine_id: str) -> EngineRecord | None:
        """The record of ``engine_id``, or None."""
        entry = self._entries.get(engine_id)
        return None if entry is None else entry.record

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._entries

    @property
    def revision(self) -> int:
        """The etcd revision the store is current at."""
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


def _change_locked(
    entries: immutables.MapMutation[str, Entry], change: Change
) -> EndpointEvent | None:
    old = entries.get(change.engine_id)
    if old is not None and change.revision <= old.mod_revision:
        return None  # already applied: never deliver twice
    if change.record is None:
        if old is None:
            return None
        del entries[change.engine_id]
        return _event(EventType.REMOVED, change.key, change.revision, old.record)
    entries[change.engine_id] = Entry(change.key, change.record, change.revision)
    kind = EventType.ADDED if old is None else EventType.UPDATED
    return _event(kind, change.key, change.revision, change.record)


def _always() -> bool:
    return True


def _as_added(entries: Iterable[Entry], revision: int) -> Batch:
    """The engines ``entries`` as ``added`` events at ``revision``."""
    return tuple(_event(EventType.ADDED, e.key, revision, e.record) for e in entries)
