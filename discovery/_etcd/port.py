"""What discovery needs from etcd, said in types of its own: the etcd port.

Registration, the watch loop and the one-shot helpers talk to etcd only through
``EtcdPort``, and are typed against it. Its implementations: the python3-etcd3 adapter
``Connection`` (``_etcd/connection.py``), the only module that knows about etcd3, gRPC or
protobuf (it translates every client error into discovery's exceptions, at one boundary,
and guards the client's defects), built by the one factory ``_transport.connect``; and
``discovery.testing.memory.MemoryPort``, an etcd in memory for tests. Both pass the same
conformance tests (``tests/test_port_conformance.py``). Swapping the client (say for an
asyncio one) means writing another adapter and changing the factory, not touching
registration or the watcher. The port knows how to reach etcd, not the key layout: the
API resolves that (``_transport.keyspace_for``) and hands it to each component.

Every port method makes one attempt. A transient failure (a member down, an election, a
dropped stream) is an ``EtcdUnavailableError``; ``call`` retries such failures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from discovery._errors import DiscoveryError, EtcdError, EtcdUnavailableError

__all__ = [
    "Compacted",
    "EtcdPort",
    "KeepAliveStream",
    "KeyValue",
    "LeaseGone",
    "LeaseInfo",
    "NoLeaderError",
    "Page",
    "PutResult",
    "StreamSilentError",
    "WatchEvent",
    "WatchResponse",
    "WatchStream",
    "explain",
    "is_transient",
]

T = TypeVar("T")

PAGE_SIZE = 1000
"""Keys per page when listing a prefix (all pages are read at one revision)."""

MAX_BATCH = 100
"""Keys per ``create_many`` or ``update_many`` call (etcd allows 128 operations per txn)."""

REQUEST_OVERHEAD = 1024
"""Bytes a request may take besides its keys and values (its envelope, etcd's raft header)."""


def write_bytes(key: str, value: bytes) -> int:
    """At most what one key's compare-and-put adds to a transaction (the key goes thrice)."""
    return 3 * len(key.encode()) + len(value) + 64


def batches(items: Sequence[T], size: Callable[[T], int], limit: int) -> Iterator[Sequence[T]]:
    """``items`` in order, in runs of at most ``MAX_BATCH`` and ``limit`` request bytes.

    ``size`` is what one item adds to the request (``write_bytes``); an item that does not
    fit even alone goes in a run of its own, for etcd to refuse that one only.
    """
    budget = limit - REQUEST_OVERHEAD
    run: list[T] = []
    used = 0
    for item in items:
        cost = size(item)
        if run and (len(run) == MAX_BATCH or used + cost > budget):
            yield run
            run, used = [], 0
        run.append(item)
        used += cost
    if run:
        yield run


class KeyValue(NamedTuple):
    """One key as etcd stores it. ``lease`` is 0 for a key without a lease.

    A tuple: a third of a frozen dataclass's build cost, paid once per key listed.
    """

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of one key. A delete carries the key and its revision, no value."""

    kv: KeyValue
    is_put: bool


@dataclass(frozen=True, slots=True)
class WatchResponse:
    """What one watch response said: etcd's revision when it was sent, and its events.

    All events of one etcd revision arrive in one response. A response without events is
    a progress notification: nothing changed up to ``revision``.
    """

    revision: int
    events: tuple[WatchEvent, ...]
    cluster_id: int = field(default=0, compare=False)
    """The id of the etcd cluster that sent it (0: unknown, as from a port in memory)."""


class Page(tuple[int, list[KeyValue]]):
    """One page of a listing: ``(revision, keys)``, a tuple unpacked and compared like one.

    ``cluster_id``: the id of the etcd cluster that answered (0: unknown).
    """

    cluster_id: int

    def __new__(cls, revision: int, kvs: list[KeyValue], cluster_id: int = 0) -> Page:
        page = super().__new__(cls, (revision, kvs))
        page.cluster_id = cluster_id
        return page


@dataclass(frozen=True, slots=True)
class PutResult:
    """The outcome of a conditional put.

    On success, ``revision`` is the write's revision and ``previous`` the key as it was
    before (None when absent). On failure, ``previous`` is the key as it is now (None
    when it no longer exists) and ``revision`` etcd's revision at that read.
    """

    succeeded: bool
    revision: int
    previous: KeyValue | None


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A lease as etcd sees it: remaining TTL (<= 0 when gone) and the keys bound to it."""

    ttl: int
    keys: tuple[bytes, ...]


class Compacted(EtcdError):
    """The revision asked for has been compacted away: list again."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest available: {compact_revision})")
        self.compact_revision = compact_revision


class LeaseGone(EtcdUnavailableError):
    """A write named a lease that no longer exists (expired or revoked).

    Transient for whoever owns the lease: it grants a new one and the write goes again.
    """


class StreamSilentError(EtcdUnavailableError):
    """A watch stream stopped answering progress requests and was dropped."""


class NoLeaderError(EtcdUnavailableError):
    """etcd refused or ended a leader-required stream: its member has no leader.

    The member is cut off from the rest of the cluster, or an election is under way; the
    adapter avoids it for a moment, so the next stream goes to another member.
    """


def is_transient(exc: BaseException) -> bool:
    """Whether the same call may succeed when tried again later."""
    return isinstance(exc, EtcdUnavailableError)


def explain(exc: BaseException) -> str:
    """The cause to show in health and logs: short, secret-free."""
    if isinstance(exc, EtcdUnavailableError) and exc.reason:
        return exc.reason
    if isinstance(exc, DiscoveryError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


class WatchStream(Protocol):
    """One watch of a key prefix: iterate for responses; a dead stream raises, never hangs.

    Iteration raises ``Compacted`` when the start revision is gone, and a DiscoveryError
    (``EtcdUnavailableError`` when transient, ``NoLeaderError`` when its member has no
    leader) when the stream ends for any other reason. Every response comes from a member
    that had a leader when it was sent, give or take how long etcd takes to end the
    streams of a member that lost it (2-3 election timeouts).
    """

    def __iter__(self) -> Iterator[WatchResponse]: ...

    def close(self) -> None:
        """End the stream from any thread; an iterating reader gets an error."""


class KeepAliveStream(Protocol):
    """One lease keepalive stream that serves any number of leases.

    Like a watch stream, it is refused or ended by a member without a leader.
    """

    def send_keepalive(self, lease_id: int) -> None:
        """Ask etcd to renew ``lease_id``; the answer arrives through iteration."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(lease id, remaining TTL) per answer; a TTL <= 0 means the lease is gone."""
        ...

    def cancel(self) -> None:
        """End the stream."""

    def abandon(self) -> None:
        """End a stream that stopped answering, and avoid its member for a moment."""


class CloseHooks:
    """What every port does the same way on close: run the ``on_close`` hooks, once.

    An implementation calls ``_close_hooks_run()`` first in ``close()``: False means it
    was closed already.
    """

    def __init__(self) -> None:
        self._hooks_lock = threading.Lock()
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the port closes, before its streams end."""
        with self._hooks_lock:
            self._close_hooks.append(hook)

    def _close_hooks_run(self) -> bool:
        with self._hooks_lock:
            if self._closed:
                return False
            self._closed = True
            hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()
        return True


class EtcdPort(Protocol):
    """The etcd operations discovery uses (see the module docs)."""

    @property
    def dial_timeout(self) -> float:
        """Seconds ``call`` retries by default, and a watcher waits for its first listing."""
        ...

    @property
    def election_timeout(self) -> float:
        """Etcd's election timeout in seconds: how soon a partitioned member is left."""
        ...

    @property
    def max_request_bytes(self) -> int:
        """The members' ``--max-request-bytes``: batched writes stay under it (``batches``)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        ...

    def call(self, op: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``op`` (port calls), retrying transient failures for up to ``timeout`` s.

        The default is ``dial_timeout``; 0 means one attempt.
        """
        ...

    def list_prefix(
        self, prefix: str, *, page_size: int = PAGE_SIZE, timeout: float | None = None
    ) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` at one revision, read in pages: (revision, keys)."""
        ...

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
        ...

    def get(self, key: str) -> KeyValue | None:
        """The key, or None."""
        ...

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        ...

    def lease_info(self, lease_id: int) -> LeaseInfo:
        """The lease's remaining TTL (<= 0 when gone) and the keys bound to it."""
        ...

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; a lease that is gone counts as revoked."""

    def create(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` only if ``key`` does not exist."""
        ...

    def replace(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` whatever the key holds (always succeeds)."""
        ...

    def update(self, key: str, value: bytes, lease_id: int, *, mod_revision: int) -> PutResult:
        """Put ``value`` only if the key was last written at ``mod_revision`` (by us)."""
        ...

    def create_many(self, items: Sequence[tuple[str, bytes]], lease_id: int) -> list[PutResult]:
        """``create`` of each (key, value) on ``lease_id``, all in one transaction.

        Each key is created only if absent, independently of the others; one result per
        item, in order. At most ``MAX_BATCH`` items.
        """
        ...

    def update_many(
        self, items: Sequence[tuple[str, bytes, int]], lease_id: int
    ) -> list[PutResult]:
        """``update`` of each (key, value, mod_revision) on ``lease_id``, in one transaction.

        Each key is written only if still at its mod revision (0: absent), independently
        of the others; one result per item, in order. At most ``MAX_BATCH`` items.
        """
        ...

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        ...

    def delete_owned(self, key: str, lease_id: int) -> bool:
        """Delete ``key`` only if it is bound to ``lease_id``; whether it was."""
        ...

    def open_watch(
        self, prefix: str, start_revision: int, *, heartbeat: float, progress_interval: float
    ) -> WatchStream:
        """Watch ``prefix`` from ``start_revision`` (inclusive), on a member with a leader.

        A stream quiet for ``progress_interval`` seconds is asked for progress (each answer
        is a response without events), and dropped after two silent ``heartbeat`` s.
        """
        ...

    def open_keepalive(self) -> KeepAliveStream:
        """Open one keepalive stream for any number of leases, on a member with a leader."""
        ...

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the port closes, before its streams end."""

    def close(self) -> None:
        """Close every channel; open streams end with an error."""
