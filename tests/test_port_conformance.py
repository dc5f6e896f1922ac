"""One contract, two implementations: the in-memory port and the etcd adapter.

Every test runs against ``discovery.testing.memory.MemoryPort`` and against ``Connection`` on the
real etcd of the fixtures (keys under the test's own prefix; the compaction tests compact
that shared etcd, which only ends watches and listings from older revisions). What the
memory port promises is what these tests pin down of the adapter.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from discovery import (
    ClosedError,
    Connection,
    DiscoveryError,
    EtcdError,
    EtcdUnavailableError,
    Settings,
)
from discovery._etcd.port import (
    MAX_BATCH,
    Compacted,
    EtcdPort,
    KeyValue,
    LeaseGone,
    WatchResponse,
    is_transient,
)
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .conftest import STORES
from .helpers import raw_call

QUIET = 30.0  # heartbeat / progress interval of watches that must not see progress


class Backend:
    """One cluster under test: ports on it, its compaction, this test's keys."""

    def __init__(
        self,
        name: str,
        connect: Callable[[], EtcdPort],
        compact: Callable[[EtcdPort, int], None],
        prefix: str,
        ttl: int,
    ) -> None:
        self.name = name
        self._connect = connect
        self._compact = compact
        self.prefix = prefix
        self.ttl = ttl
        """A short lease TTL the cluster accepts as such."""
        self._ports: list[EtcdPort] = []
        self.port = self.connect()

    def connect(self) -> EtcdPort:
        """Another client of the same cluster (closed after the test)."""
        port = self._connect()
        self._ports.append(port)
        return port

    def key(self, name: str) -> str:
        return self.prefix + name

    def revision(self) -> int:
        return self.port.list_prefix("/no-such-prefix/")[0]

    def compact(self, revision: int) -> None:
        self._compact(self.port, revision)

    def close(self) -> None:
        for port in self._ports:
            port.close()


@pytest.fixture(params=STORES)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        with MemoryEtcd() as etcd:
            # No minimum TTL in memory (etcd's is 1.5 election timeouts: 2 s here).
            memory = Backend(
                "memory",
                lambda: MemoryPort(etcd, dial_timeout=2),
                lambda _, revision: etcd.compact(revision),
                "/conformance/",
                ttl=1,
            )
            yield memory
            memory.close()
        return
    settings = request.getfixturevalue("settings")

    def compact(port: Any, revision: int) -> None:
        raw_call(port, lambda client: client.compact(revision, physical=True))

    real = Backend(
        "etcd", lambda: Connection(settings), compact, f"/conformance/{settings.namespace}/", 2
    )
    yield real
    real.close()


class Reader:
    """Iterates a stream on a thread of its own; the test takes items with a deadline."""

    def __init__(self, stream: Iterable[Any]) -> None:
        self._items: queue.Queue[Any] = queue.Queue()
        self._stream = stream
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for item in self._stream:
                self._items.put(item)
        except Exception as exc:
            self._items.put(exc)

    def _take(self, timeout: float) -> Any:
        try:
            return self._items.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise AssertionError(f"nothing from the stream within {timeout:.1f} s") from None

    def next(self, timeout: float = 5.0) -> Any:
        item = self._take(timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def error(self, timeout: float = 5.0) -> Exception:
        """The exception the stream ends with (what it yields before is skipped)."""
        deadline = time.monotonic() + timeout
        while not isinstance(item := self._take(deadline - time.monotonic()), Exception):
            pass
        return item

    def until(self, revision: int, timeout: float = 5.0) -> list[WatchResponse]:
        """Responses up to the one with an event at ``revision``."""
        found = []
        deadline = time.monotonic() + timeout
        while not any(e.kv.mod_revision >= revision for r in found for e in r.events):
            found.append(self.next(deadline - time.monotonic()))
        return found


def _one_response_per_revision(responses: list[WatchResponse]) -> dict[int, WatchResponse]:
    """revision -> the one response holding its events (failing if they are split)."""
    holder: dict[int, WatchResponse] = {}
    last = 0
    for response in responses:
        for event in response.events:
            revision = event.kv.mod_revision
            assert revision >= last, "events out of order"
            assert holder.setdefault(revision, response) is response, f"{revision} split"
            assert response.revision >= revision
            last = revision
    return holder


# -- revisions and reads --------------------------------------------------------------


def test_each_write_transaction_is_one_revision(backend: Backend) -> None:
    port, key = backend.port, backend.key
    start = backend.revision()
    assert port.create(key("a"), b"1", 0).revision == start + 1
    assert port.replace(key("a"), b"2", 0).revision == start + 2
    results = port.create_many([(key("b"), b"1"), (key("c"), b"1")], 0)
    assert [r.revision for r in results] == [start + 3, start + 3]
    assert port.delete(key("b"))
    assert backend.revision() == start + 4
    # Nothing written, no revision: a failed create, a missing key's delete, an empty lease.
    assert not port.create(key("a"), b"3", 0).succeeded
    assert not port.delete(key("missing"))
    port.revoke(port.grant(30))
    assert backend.revision() == start + 4
    lease = port.grant(30)
    port.create_many([(key("d"), b"1"), (key("e"), b"1")], lease)
    port.revoke(lease)  # two keys, one revision
    assert backend.revision() == start + 6


def test_get_and_list_prefix(backend: Backend) -> None:
    port, key = backend.port, backend.key
    lease = port.grant(30)
    written = port.create(key("b"), b"vb", lease).revision
    port.create(key("a"), b"va", 0)
    port.replace(key("a"), b"va2", 0)
    port.create(backend.prefix.rstrip("/") + "-sibling", b"x", 0)  # not under the prefix
    assert port.get(key("b")) == KeyValue(key("b").encode(), b"vb", written, written, lease)
    assert port.get(key("missing")) is None
    revision, kvs = port.list_prefix(backend.prefix)
    assert revision == backend.revision()
    assert [(kv.key, kv.value) for kv in kvs] == [
        (key("a").encode(), b"va2"),
        (key("b").encode(), b"vb"),
    ]
    a = kvs[0]
    assert a.mod_revision == a.create_revision + 1 and a.lease == 0


def test_list_pages_reads_every_page_at_the_first_ones_revision(backend: Backend) -> None:
    port, key = backend.port, backend.key
    for name in "abcde":
        port.create(key(name), name.encode(), 0)
    pages = port.list_pages(backend.prefix, page_size=2)
    revision, first = next(pages)
    port.create(key("f"), b"late", 0)  # after the listing's revision: not in it
    rest = list(pages)
    assert [len(kvs) for _, kvs in [(revision, first), *rest]] == [2, 2, 1]
    assert {r for r, _ in rest} == {revision}
    values = [kv.value for _, kvs in [(revision, first), *rest] for kv in kvs]
    assert values == [name.encode() for name in "abcde"]
    # No empty page after a full last one; one empty page for an empty prefix.
    assert [len(kvs) for _, kvs in port.list_pages(backend.prefix, page_size=3)] == [3, 3]
    assert list(port.list_pages(key("nothing/"))) == [(backend.revision(), [])]


# -- conditional writes ---------------------------------------------------------------


def test_create_writes_only_an_absent_key(backend: Backend) -> None:
    port, key = backend.port, backend.key
    created = port.create(key("k"), b"1", 0)
    assert created.succeeded and created.previous is None
    current = port.get(key("k"))
    assert current is not None and current.mod_revision == created.revision
    port.create(key("other"), b"x", 0)
    failed = port.create(key("k"), b"2", 0)
    # On failure: the key as it is now, and etcd's revision at that read.
    assert not failed.succeeded
    assert failed.previous == current
    assert failed.revision == backend.revision() == created.revision + 1
    assert port.get(key("k")) == current


def test_replace_writes_whatever_the_key_holds(backend: Backend) -> None:
    port, key = backend.port, backend.key
    first = port.replace(key("k"), b"1", 0)
    assert first.succeeded and first.previous is None
    old = port.get(key("k"))
    lease = port.grant(30)
    second = port.replace(key("k"), b"2", lease)
    assert second.succeeded and second.previous == old
    assert port.get(key("k")) == KeyValue(
        key("k").encode(), b"2", second.revision, first.revision, lease
    )


def test_update_compares_the_mod_revision(backend: Backend) -> None:
    port, key = backend.port, backend.key
    written = port.create(key("k"), b"1", 0).revision
    old = port.get(key("k"))
    updated = port.update(key("k"), b"2", 0, mod_revision=written)
    assert updated.succeeded and updated.previous == old
    current = port.get(key("k"))
    stale = port.update(key("k"), b"3", 0, mod_revision=written)
    assert not stale.succeeded
    assert stale.previous == current and stale.revision == backend.revision()
    assert port.get(key("k")) == current
    # A missing key: the compare fails, nothing to report; the adapter (python3-etcd3
    # takes the revision from the key it read) says revision 0 then.
    missing = port.update(key("missing"), b"1", 0, mod_revision=written)
    assert (missing.succeeded, missing.revision, missing.previous) == (False, 0, None)
    # etcd compares a missing key's mod revision as 0.
    assert port.update(key("missing"), b"1", 0, mod_revision=0).succeeded


def test_create_many_creates_each_absent_key_independently(backend: Backend) -> None:
    port, key = backend.port, backend.key
    port.create(key("a"), b"old", 0)
    port.create(key("c"), b"old", 0)
    a, c = port.get(key("a")), port.get(key("c"))
    before = backend.revision()
    lease = port.grant(30)
    results = port.create_many(
        [(key("a"), b"1"), (key("b"), b"1"), (key("c"), b"1"), (key("d"), b"1")], lease
    )
    written = before + 1
    # A failure's read is inside the transaction: after one of its puts, at its revision.
    assert [(r.succeeded, r.revision, r.previous) for r in results] == [
        (False, before, a),
        (True, written, None),
        (False, written, c),
        (True, written, None),
    ]
    assert port.get(key("b")) == KeyValue(key("b").encode(), b"1", written, written, lease)
    assert port.get(key("a")) == a
    assert sorted(port.lease_info(lease).keys) == [key("b").encode(), key("d").encode()]
    # Every key present: nothing written.
    assert not any(r.succeeded for r in port.create_many([(key("a"), b"2")], lease))
    assert backend.revision() == written


def test_update_many_writes_each_key_still_at_its_revision(backend: Backend) -> None:
    port, key = backend.port, backend.key
    port.create(key("a"), b"old", 0)
    port.create(key("b"), b"old", 0)
    a, b = port.get(key("a")), port.get(key("b"))
    assert a is not None and b is not None
    before = backend.revision()
    lease = port.grant(30)
    results = port.update_many(
        [
            (key("a"), b"new", a.mod_revision),  # still there: written
            (key("b"), b"new", a.mod_revision),  # changed since: left alone
            (key("c"), b"new", 0),  # absent, as expected: created
            (key("d"), b"new", 5),  # absent, not as expected: left alone
        ],
        lease,
    )
    written = before + 1
    assert [(r.succeeded, r.revision, r.previous) for r in results] == [
        (True, written, None),
        (False, written, b),
        (True, written, None),
        (False, written, None),
    ]
    assert port.get(key("a")) == KeyValue(
        key("a").encode(), b"new", written, a.create_revision, lease
    )
    assert port.get(key("b")) == b
    assert port.get(key("d")) is None
    assert sorted(port.lease_info(lease).keys) == [key("a").encode(), key("c").encode()]
    with pytest.raises(ValueError, match="at most"):
        port.update_many([(key(f"k{i}"), b"1", 0) for i in range(MAX_BATCH + 1)], lease)


def test_create_many_refuses_too_many_or_repeated_keys(backend: Backend) -> None:
    port, key = backend.port, backend.key
    many = [(key(f"k{i:03}"), b"1") for i in range(MAX_BATCH + 1)]
    with pytest.raises(ValueError, match="at most"):
        port.create_many(many, 0)
    with pytest.raises(EtcdError, match="duplicate key") as refused:
        port.create_many([(key("x"), b"1"), (key("x"), b"2")], 0)
    assert not is_transient(refused.value)
    assert port.list_prefix(backend.prefix)[1] == []
    assert all(r.succeeded for r in port.create_many(many[:MAX_BATCH], 0))


def test_delete_and_delete_owned(backend: Backend) -> None:
    port, key = backend.port, backend.key
    lease, other = port.grant(30), port.grant(30)
    port.create(key("k"), b"1", lease)
    assert not port.delete_owned(key("k"), other)
    assert port.get(key("k")) is not None
    assert port.delete_owned(key("k"), lease)
    assert port.get(key("k")) is None
    assert port.lease_info(lease).keys == ()
    assert not port.delete_owned(key("k"), lease)  # missing: not on the lease
    assert port.delete_owned(key("k"), 0)  # etcd compares a missing key's lease as 0
    port.create(key("k"), b"1", 0)
    assert port.delete(key("k"))
    assert not port.delete(key("k"))


# -- leases ---------------------------------------------------------------------------


def test_grant_lease_info_and_revoke_in_one_revision(backend: Backend) -> None:
    port, key = backend.port, backend.key
    lease = port.grant(30)
    info = port.lease_info(lease)
    assert 28 <= info.ttl <= 30 and info.keys == ()
    port.create(key("a"), b"1", lease)
    port.create_many([(key("b"), b"1"), (key("c"), b"1")], lease)
    port.replace(key("c"), b"2", 0)  # moved off the lease
    assert sorted(port.lease_info(lease).keys) == [key("a").encode(), key("b").encode()]
    start = backend.revision()
    watch = Reader(
        backend.connect().open_watch(
            backend.prefix, start + 1, heartbeat=QUIET, progress_interval=QUIET
        )
    )
    port.revoke(lease)
    assert backend.revision() == start + 1
    (response,) = [r for r in watch.until(start + 1) if r.events]
    assert [(e.kv.key, e.is_put) for e in response.events] == [
        (key("a").encode(), False),
        (key("b").encode(), False),
    ]
    assert port.list_prefix(backend.prefix)[1] == [port.get(key("c"))]
    gone = port.lease_info(lease)
    assert gone.ttl <= 0 and gone.keys == ()
    port.revoke(lease)  # a gone lease counts as revoked


def test_a_write_on_a_gone_lease_raises_lease_gone(backend: Backend) -> None:
    port, key = backend.port, backend.key
    port.create(key("present"), b"1", 0)
    present = port.get(key("present"))
    assert present is not None
    lease = port.grant(30)
    port.revoke(lease)
    before = backend.revision()
    for write in (
        lambda: port.create(key("k"), b"1", lease),
        lambda: port.replace(key("present"), b"1", lease),
        lambda: port.update(key("present"), b"1", lease, mod_revision=present.mod_revision),
        lambda: port.create_many([(key("present"), b"1"), (key("k"), b"1")], lease),
    ):
        with pytest.raises(LeaseGone) as caught:
            write()
        assert is_transient(caught.value)
    # A put the compare rules out names no lease: a plain failure.
    assert not port.create(key("present"), b"1", lease).succeeded
    assert not port.create_many([(key("present"), b"1")], lease)[0].succeeded
    assert backend.revision() == before


def test_a_lease_expires_without_keepalives_and_lives_on_with_them(backend: Backend) -> None:
    port, key, ttl = backend.port, backend.key, backend.ttl
    start = backend.revision()
    watch = Reader(
        backend.connect().open_watch(
            backend.prefix, start + 1, heartbeat=QUIET, progress_interval=QUIET
        )
    )
    granted = time.monotonic()
    kept, left = port.grant(ttl), port.grant(ttl)
    port.create(key("kept"), b"1", kept)
    port.create_many([(key("left-1"), b"1"), (key("left-2"), b"1")], left)
    stream = port.open_keepalive()
    answers = Reader(stream)
    # Keep one lease alive (a keepalive every TTL / 4) until the other has expired and
    # 1.5 TTL have passed.
    expired_after = None
    while expired_after is None or time.monotonic() < granted + 1.5 * ttl:
        assert time.monotonic() < granted + ttl + 3.0, "the unkept lease did not expire"
        stream.send_keepalive(kept)
        assert answers.next() == (kept, ttl)
        if expired_after is None and port.get(key("left-1")) is None:
            expired_after = time.monotonic() - granted
        time.sleep(ttl / 4)  # the keepalive pace, not a wait for a condition
    assert expired_after >= ttl * 0.9, f"expired after {expired_after:.2f} s, before its TTL"
    assert port.get(key("left-2")) is None and port.lease_info(left).ttl <= 0
    # Alive (its key is on it); etcd truncates the remaining TTL to whole seconds.
    assert port.lease_info(kept).keys == (key("kept").encode(),)
    # The expiry deleted both keys in one revision.
    deletes = [r for r in watch.until(start + 3) if r.events][-1]
    assert [(e.kv.key, e.is_put) for e in deletes.events] == [
        (key("left-1").encode(), False),
        (key("left-2").encode(), False),
    ]
    stream.cancel()


def test_a_keepalive_of_a_gone_lease_answers_no_ttl(backend: Backend) -> None:
    port = backend.port
    live, gone = port.grant(30), port.grant(30)
    port.revoke(gone)
    stream = port.open_keepalive()
    answers = Reader(stream)
    stream.send_keepalive(gone)
    stream.send_keepalive(live)
    first, second = answers.next(), answers.next()
    assert first[0] == gone and first[1] <= 0
    assert second == (live, 30)
    stream.cancel()
    assert isinstance(answers.error(), DiscoveryError)


# -- watches --------------------------------------------------------------------------


def test_a_watch_starts_at_its_revision_with_each_revisions_events_together(
    backend: Backend,
) -> None:
    port, key = backend.port, backend.key
    lease = port.grant(30)
    port.create(key("before"), b"0", 0)
    first = port.create(key("a"), b"1", lease).revision
    port.create_many([(key("b"), b"2"), (key("c"), b"3")], 0)
    port.replace(backend.prefix.rstrip("/") + "-sibling", b"x", 0)  # another prefix
    deleted = port.create(key("d"), b"4", 0).revision + 1
    port.delete(key("a"))
    now = backend.revision()
    watcher = backend.connect()
    stream = watcher.open_watch(backend.prefix, first, heartbeat=QUIET, progress_interval=QUIET)
    reader = Reader(stream)
    # etcd's first answer ("created") says where it is: no events, the current revision.
    assert reader.next() == WatchResponse(now, ())
    responses = reader.until(deleted)
    port.create_many([(key("e"), b"5"), (key("f"), b"6")], 0)  # a live revision
    responses += reader.until(now + 1)
    holder = _one_response_per_revision(responses)
    assert sorted(holder) == [first, first + 1, first + 3, deleted, now + 1]
    events = [e for r in responses for e in r.events]
    assert [(e.kv, e.is_put) for e in events] == [
        (KeyValue(key("a").encode(), b"1", first, first, lease), True),
        (KeyValue(key("b").encode(), b"2", first + 1, first + 1, 0), True),
        (KeyValue(key("c").encode(), b"3", first + 1, first + 1, 0), True),
        (KeyValue(key("d").encode(), b"4", first + 3, first + 3, 0), True),
        # a delete carries the key and its revision, nothing else
        (KeyValue(key("a").encode(), b"", deleted, 0, 0), False),
        (KeyValue(key("e").encode(), b"5", now + 1, now + 1, 0), True),
        (KeyValue(key("f").encode(), b"6", now + 1, now + 1, 0), True),
    ]
    assert holder[now + 1].revision == now + 1
    stream.close()


def test_a_quiet_watch_answers_progress(backend: Backend) -> None:
    port, key = backend.port, backend.key
    start = port.create(key("k"), b"1", 0).revision
    stream = port.open_watch(backend.prefix, start + 1, heartbeat=5.0, progress_interval=0.2)
    reader = Reader(stream)
    assert reader.next().events == ()  # created
    quiet = time.monotonic()
    progress = reader.next(timeout=3.0)
    waited = time.monotonic() - quiet
    assert progress == WatchResponse(start, ())
    assert 0.15 <= waited < 2.0, f"progress after {waited:.2f} s of quiet"
    written = port.replace(key("k"), b"2", 0).revision
    (change,) = [r for r in reader.until(written) if r.events]
    assert change.revision == written and change.events[0].kv.value == b"2"
    stream.close()


def test_every_page_and_watch_response_names_the_cluster(backend: Backend) -> None:
    """etcd's response headers carry the cluster id: the reflector compares it to notice
    another cluster (data wiped or restored) on the same addresses."""
    port, key = backend.port, backend.key
    start = port.create(key("a"), b"1", 0).revision
    port.create(key("b"), b"2", 0)
    pages = list(port.list_pages(backend.prefix, page_size=1))
    ids = {page.cluster_id for page in pages}
    assert len(pages) == 2 and len(ids) == 1 and 0 not in ids
    stream = port.open_watch(backend.prefix, start, heartbeat=QUIET, progress_interval=QUIET)
    reader = Reader(stream)
    responses = [reader.next(), *reader.until(start + 1)]
    assert {response.cluster_id for response in responses} == ids
    stream.close()


def test_a_watch_from_a_compacted_revision_raises_compacted(backend: Backend) -> None:
    port, key = backend.port, backend.key
    old = port.create(key("k"), b"1", 0).revision
    kept = port.create(key("j"), b"2", 0).revision
    backend.compact(kept)
    stream = port.open_watch(backend.prefix, old, heartbeat=QUIET, progress_interval=QUIET)
    error = Reader(stream).error()
    assert isinstance(error, Compacted) and error.compact_revision == kept
    # From the compaction revision itself: its put is still there.
    stream = port.open_watch(backend.prefix, kept, heartbeat=QUIET, progress_interval=QUIET)
    responses = Reader(stream).until(kept)
    assert [e.kv.key for r in responses for e in r.events] == [key("j").encode()]
    stream.close()


def test_list_pages_raises_compacted_when_compacted_midway(backend: Backend) -> None:
    port, key = backend.port, backend.key
    for name in "abcd":
        port.create(key(name), b"1", 0)
    pages = port.list_pages(backend.prefix, page_size=1)
    revision, _ = next(pages)
    backend.compact(port.create(key("later"), b"1", 0).revision)
    # The adapter has the next page in flight already: one more may come, at `revision`.
    with pytest.raises(Compacted):
        for page_revision, _ in pages:
            assert page_revision == revision
    # A listing from now on is at a revision etcd still has.
    assert len(port.list_prefix(backend.prefix, page_size=1)[1]) == 5


def test_closing_a_stream_ends_its_iteration_with_an_error(backend: Backend) -> None:
    port = backend.port
    start = backend.revision() + 1  # revision 1 of the shared etcd may be compacted
    watch = port.open_watch(backend.prefix, start, heartbeat=QUIET, progress_interval=QUIET)
    watching = Reader(watch)
    watching.next()  # created: the reader now waits for more
    watch.close()
    assert isinstance(watching.error(), DiscoveryError)
    keepalive = port.open_keepalive()
    keeping = Reader(keepalive)
    keepalive.cancel()
    assert isinstance(keeping.error(), DiscoveryError)


def test_closing_the_port_runs_its_hooks_then_ends_its_streams(backend: Backend) -> None:
    port = backend.connect()
    other = backend.connect()
    lease = port.grant(30)
    keepalive = port.open_keepalive()
    answers = Reader(keepalive)
    start = backend.revision() + 1
    watch = Reader(port.open_watch(backend.prefix, start, heartbeat=QUIET, progress_interval=QUIET))
    watch.next()  # created
    others = Reader(
        other.open_watch(backend.prefix, start, heartbeat=QUIET, progress_interval=QUIET)
    )
    others.next()
    in_hook: list[object] = []

    def hook() -> None:  # its streams still work
        keepalive.send_keepalive(lease)
        in_hook.append(answers.next())

    port.on_close(hook)
    port.close()
    assert in_hook == [(lease, 30)]
    assert isinstance(answers.error(), DiscoveryError)
    assert isinstance(watch.error(), DiscoveryError)
    assert port.closed
    with pytest.raises(ClosedError):
        port.get(backend.key("k"))
    port.close()  # idempotent
    # Another client's stream lives on.
    written = other.create(backend.key("k"), b"1", 0).revision
    assert others.until(written)[-1].events[0].kv.mod_revision == written


# -- retries --------------------------------------------------------------------------


Outage = tuple[EtcdPort, Callable[[], object], Callable[[], object]]


@pytest.fixture(params=STORES)
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    """A port, and how to take its etcd down and bring it back."""
    if request.param == "memory":
        with MemoryEtcd() as etcd, MemoryPort(etcd) as port:
            yield port, etcd.outage, etcd.restore
        return
    cluster = request.getfixturevalue("etcd")  # a private member this test may stop
    member = cluster.members[0]
    with Connection(Settings(endpoints=cluster.endpoints, dial_timeout=10)) as port:
        yield port, lambda: member.stop(kill=True), member.start


def test_call_retries_a_transient_failure(outage: Outage) -> None:
    port, down, up = outage
    written = port.replace("/k", b"1", 0).revision
    watch = Reader(port.open_watch("/", written, heartbeat=QUIET, progress_interval=QUIET))
    watch.next()
    down()
    assert isinstance(watch.error(), EtcdUnavailableError)  # open streams end
    with pytest.raises(EtcdUnavailableError):
        port.call(lambda: port.get("/k"), timeout=0)  # one attempt
    threading.Timer(0.3, up).start()
    started = time.monotonic()
    kv = port.call(lambda: port.get("/k"), timeout=10)
    assert kv is not None and kv.value == b"1"
    assert time.monotonic() - started >= 0.25
