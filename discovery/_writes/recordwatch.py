"""The registrar's eye on its own keys: outside changes are noticed within milliseconds.

An operator may change a live record from outside (``discovery drain`` / ``undrain``
rewrite its status on the same lease; ``discovery deregister`` deletes it; another
registrar takes the id over with ``replace``). A registration must notice, to adopt the
operator's status (and revoke at the drain deadline), or to write its record again.

Why a watch and not only the compare-and-swap of our own writes: a registrar writes
rarely (an update, a re-registration), so a failed compare alone would notice an outside
drain too late to revoke at its deadline, and a re-registration after a lost lease would
bring back the status it knew before the operator's change. The compare stays as the
safety net of every write (``update(..., mod_revision=...)`` never overwrites a change it
has not seen).

One watch per connection: of the one key when the connection serves a single
registration (the one-engine process: etcd sends it nothing about other engines), else of
the namespace prefix (a process holding many registrations, typically through a
``Session``). Events for other keys are dropped unread. It runs on the list-watch loop
both watches share (``_etcd/reflector.py``: resume at the last delivered revision, backoff,
health), started at the owner's own write instead of a listing; a listing after
compaction reports each owned key's current state (a resync). A listing from another
etcd cluster, or behind what was seen (data wiped, a snapshot restored: the reflector's
``reset``), tells each owner ``rebased`` instead: revisions of the old history mean
nothing there, and the owner's session writes its records again.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

from discovery._etcd.port import EtcdPort, KeyValue, WatchResponse
from discovery._etcd.reflector import Reflector

__all__ = ["RecordOwner", "RecordWatch", "record_watch_for"]

_HEARTBEAT = 10.0  # an idle watch asks for progress this often, and is dropped after twice


class RecordOwner(Protocol):
    """A registration, as the watch sees it."""

    key: str

    def observed(self, kv: KeyValue | None, revision: int) -> None:
        """The key changed at ``revision`` (``kv`` None: deleted).

        Called on the watch thread: must not block on etcd.
        """

    def rebased(self, kv: KeyValue | None, revision: int, listing: int) -> None:
        """A listing at ``revision`` came from another cluster or an older history.

        Its data was wiped, or a snapshot restored; ``kv`` is what it holds for the key.
        ``listing`` numbers such listings of this watch (every owner hears of each once).

        Called on the watch thread: must not block on etcd.
        """


class RecordWatch:
    """Watches the keys of one connection's registrations (see the module docs).

    ``key_range`` is one key, or the namespace prefix of a shared connection.
    """

    def __init__(self, connection: EtcdPort, key_range: str) -> None:
        self._owners: dict[bytes, RecordOwner] = {}
        self._lock = threading.Lock()
        self._listings = itertools.count(1)  # listings from another cluster
        self._reflector = Reflector(
            connection,
            key_range,
            self,
            name=f"own records ({key_range})",
            heartbeat=_HEARTBEAT,
            progress_interval=_HEARTBEAT,
        )

    def add(self, owner: RecordOwner, revision: int) -> None:
        """Report changes of ``owner.key`` after ``revision`` (the owner's own write)."""
        with self._lock:
            self._owners[owner.key.encode()] = owner
        if not self._reflector.stopped:
            self._reflector.start(revision, thread_name="discovery-record-watch")

    def remove(self, owner: RecordOwner) -> None:
        """Stop reporting changes of ``owner.key``."""
        with self._lock:
            if self._owners.get(owner.key.encode()) is owner:
                del self._owners[owner.key.encode()]

    def stop(self) -> None:
        """End the watch and its thread."""
        self._reflector.stop(timeout=5.0)

    # -- the reflector's target ----------------------------------------------------------

    def apply(self, response: WatchResponse) -> None:
        """Tell each owner of a changed key."""
        for event in response.events:
            kv = event.kv
            with self._lock:
                owner = self._owners.get(kv.key)
            if owner is not None:
                owner.observed(kv if event.is_put else None, kv.mod_revision)

    def replace(self, pages: Iterator[tuple[int, list[KeyValue]]], *, reset: bool = False) -> int:
        """A resync after compaction: tell every owner its key's current state.

        ``reset``: the listing comes from another cluster (data wiped or restored).
        """
        revision = 0
        current: dict[bytes, KeyValue] = {}
        for revision, kvs in pages:  # noqa: B007 - every page is at the listing's revision
            current.update((kv.key, kv) for kv in kvs)
        with self._lock:
            owners = list(self._owners.items())
        listing = next(self._listings) if reset else 0
        for key, owner in owners:
            kv = current.get(key)
            if reset:
                owner.rebased(kv, revision, listing)
            else:
                owner.observed(kv, kv.mod_revision if kv is not None else revision)
        return revision


_watches: weakref.WeakKeyDictionary[EtcdPort, RecordWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def record_watch_for(connection: EtcdPort, key_range: str) -> RecordWatch:
    """The one record watch of ``connection`` (the first caller chooses its range)."""
    with _watches_lock:
        watch = _watches.get(connection)
        if watch is None:
            watch = _watches[connection] = RecordWatch(connection, key_range)
            connection.on_close(watch.stop)
        return watch
