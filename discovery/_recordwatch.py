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
``Session``). Events for other keys are dropped unread. The watch resumes after an error
from the last revision it delivered, whose events come again and change nothing (an owner
ignores a revision it has seen). Not from the next one: etcd before 3.5.16 drops the
tombstone of a delete made at exactly the compaction revision (etcd-io/etcd#18089), as
``_watcher.py`` explains. If the resume revision was compacted, it reads the range once
and reports each owned key's current state (a resync), then watches again.
"""

from __future__ import annotations

import logging
import random
import threading
import weakref
from typing import Protocol

from ._errors import DiscoveryError
from ._port import Compacted, EtcdPort, KeyValue, WatchStream, explain

__all__ = ["RecordOwner", "RecordWatch", "record_watch_for"]

log = logging.getLogger(__name__)

_HEARTBEAT = 10.0  # an idle watch asks for progress this often, and is dropped after twice
_BACKOFF_MIN = 0.1
_BACKOFF_MAX = 3.0


class RecordOwner(Protocol):
    """A registration, as the watch sees it."""

    key: str

    def observed(self, kv: KeyValue | None, revision: int) -> None:
        """The key changed at ``revision`` (``kv`` None: deleted).

        Called on the watch thread: must not block on etcd.
        """


class RecordWatch:
    """Watches the keys of one connection's registrations (see the module docs)."""

    def __init__(self, connection: EtcdPort, *, single_key: str | None) -> None:
        self._conn = connection
        self._range = single_key or connection.settings.keyspace.prefix
        self._owners: dict[bytes, RecordOwner] = {}
        self._lock = threading.Lock()
        self._revision = 0  # every event up to here was delivered
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._fresh = False  # a response arrived since the last error

    def add(self, owner: RecordOwner, revision: int) -> None:
        """Report changes of ``owner.key`` after ``revision`` (the owner's own write)."""
        with self._lock:
            self._owners[owner.key.encode()] = owner
            if self._thread is None and not self._stop.is_set():
                self._revision = revision
                self._thread = threading.Thread(
                    target=self._run, name="discovery-record-watch", daemon=True
                )
                self._thread.start()

    def remove(self, owner: RecordOwner) -> None:
        """Stop reporting changes of ``owner.key``."""
        with self._lock:
            if self._owners.get(owner.key.encode()) is owner:
                del self._owners[owner.key.encode()]

    def stop(self) -> None:
        """End the watch and its thread."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _run(self) -> None:
        delay = _BACKOFF_MIN
        while not self._stop.is_set():
            try:
                self._watch()
            except Compacted:
                log.info("watch of own records fell behind compaction; reading them again")
                try:
                    self._resync()
                    continue
                except DiscoveryError as exc:
                    log.warning("cannot read own records again: %s", explain(exc))
            except DiscoveryError as exc:
                if self._stop.is_set():
                    return
                log.warning("watch of own records interrupted: %s", explain(exc))
            except Exception:  # a bug of ours: keep the evidence, keep watching
                log.exception("watch of own records failed")
            if self._fresh:  # the stream worked for a while: start the backoff again
                self._fresh, delay = False, _BACKOFF_MIN
            self._stop.wait(random.uniform(delay / 2, delay))
            delay = min(_BACKOFF_MAX, delay * 2)

    def _watch(self) -> None:
        """Watch from the last delivered revision until the stream ends (it raises)."""
        stream = self._conn.open_watch(
            self._range, self._revision, heartbeat=_HEARTBEAT, progress_interval=_HEARTBEAT
        )
        self._stream = stream
        try:
            if self._stop.is_set():
                return
            for response in stream:
                self._fresh = True
                for event in response.events:
                    kv = event.kv
                    with self._lock:
                        owner = self._owners.get(kv.key)
                    if owner is not None:
                        owner.observed(kv if event.is_put else None, kv.mod_revision)
                    self._revision = max(self._revision, kv.mod_revision)
        finally:
            self._stream = None
            stream.close()

    def _resync(self) -> None:
        revision, kvs = self._conn.list_prefix(self._range, timeout=0)
        current = {kv.key: kv for kv in kvs}
        with self._lock:
            owners = list(self._owners.items())
        for key, owner in owners:
            kv = current.get(key)
            owner.observed(kv, kv.mod_revision if kv is not None else revision)
        self._revision = revision


_watches: weakref.WeakKeyDictionary[EtcdPort, RecordWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def record_watch_for(connection: EtcdPort, single_key: str | None) -> RecordWatch:
    """The one record watch of ``connection`` (the first caller chooses its range)."""
    with _watches_lock:
        watch = _watches.get(connection)
        if watch is None:
            watch = _watches[connection] = RecordWatch(connection, single_key=single_key)
            connection.on_close(watch.stop)
        return watch
