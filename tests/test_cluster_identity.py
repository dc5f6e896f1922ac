"""A replaced etcd cluster (issue 43, item 1): its data wiped and the member started again
(a disaster rebuild: revision back to 1, the same cluster id or a new one), or an older
snapshot restored. Every watcher and registrar notices and starts over: the table is
replaced by what the new cluster holds (no ghosts, nothing lost), every live registration
writes its record again, each says so once. Real etcd members, really wiped."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    Connection,
    EndpointWatcher,
    EngineStatus,
    Metrics,
    Registration,
    RegistrationState,
    RoutingTable,
    Session,
    Settings,
    register_engine,
    watch_table,
)
from discovery._etcd.port import KeyValue, WatchResponse
from discovery._etcd.reflector import Reflector
from discovery._reads.store import Batch, EngineStore, Entry, EventType
from discovery._records.codec import encode
from discovery._records.record import EngineRecord
from discovery.testing.embedded import EtcdCluster
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .helpers import Registrar, make_endpoint, raw_call, run_cli, wait_for

# The table follows the new cluster within this: the watcher's stream notices the wipe
# when it reconnects (its member was down), then lists once.
_FOLLOWS_WITHIN = 15.0


def _value(engine_id: str, index: int = 0) -> bytes:
    return encode(EngineRecord(engine_id=engine_id, endpoint=make_endpoint(index)))


def _entry(engine_id: str, index: int, *, mod_revision: int) -> Entry:
    record = EngineRecord(engine_id=engine_id, endpoint=make_endpoint(index))
    return Entry(f"/k/{engine_id}", record, mod_revision)


class _Collect:
    """A store sink that keeps every event."""

    def __init__(self, events: list) -> None:
        self._events = events

    def deliver(self, batch: Batch) -> None:
        self._events.extend(batch)

    def close(self) -> None:
        pass


def _put(conn: Connection, settings: Settings, engine_id: str, index: int = 0) -> None:
    key, value = settings.keyspace.key(engine_id), _value(engine_id, index)
    raw_call(conn, lambda c: c.put(key, value))


def _etcd_ids(conn: Connection, settings: Settings) -> set[str]:
    """The engine ids etcd holds under the namespace now."""
    prefix = settings.keyspace.prefix
    return {kv.key.decode()[len(prefix) :] for kv in conn.list_prefix(prefix)[1]}


def _relists(registry: CollectorRegistry, prefix: str, cause: str) -> float:
    value = registry.get_sample_value(
        "discovery_watcher_relists_total", {"prefix": prefix, "cause": cause}
    )
    return value or 0.0


@pytest.mark.parametrize("new_id", [False, True], ids=["same-cluster-id", "new-cluster-id"])
def test_a_watcher_holds_what_a_wiped_cluster_holds(
    etcd: EtcdCluster, new_id: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """a, b, c watched; the member's data wiped; c2 and p written on the new cluster: the
    table is {c2, p}, as etcd's, the ghosts a, b, c removed. Restarted as before the member
    keeps its cluster id (etcd derives it from the peer URLs and the token): the revision
    going back is what tells; under a new token the id does."""
    settings = Settings(endpoints=etcd.endpoints, namespace="wiped", dial_timeout=10)
    prefix = settings.keyspace.prefix
    registry = CollectorRegistry()
    with (
        Connection(settings) as conn,
        EndpointWatcher(settings, heartbeat=1.0, metrics=Metrics(registry)) as watcher,
        RoutingTable(watcher) as table,
    ):
        for index, name in enumerate("abc"):
            _put(conn, settings, name, index)
        for index in range(10):  # the old history runs well ahead of the new one
            _put(conn, settings, "c", index)
        table.wait_until(lambda snap: set(snap) == {"a", "b", "c"}, timeout=10)
        old_revision = watcher.revision
        caplog.set_level(logging.INFO, logger="discovery")
        caplog.clear()

        etcd.wipe(new_id=new_id)
        _put(conn, settings, "c2", 3)
        _put(conn, settings, "p", 4)
        assert raw_call(conn, lambda c: c.get_response(prefix + "p")).header.revision < (
            old_revision
        ), "the new cluster is not behind the old one"

        table.wait_until(lambda snap: set(snap) == {"c2", "p"}, timeout=_FOLLOWS_WITHIN)
        assert set(table.snapshot()) == _etcd_ids(conn, settings), "ghosts or lost engines"
        health = watcher.health()
        assert health.cluster_changes == 1
        assert health.relists == 1
        assert health.last_error is not None and "applied)" in health.last_error
        assert watcher.revision < old_revision  # the new cluster's, not the old one's
        assert _relists(registry, prefix, "cluster_replaced") == 1
        assert _relists(registry, prefix, "compaction") == 0
        said = "wiped or restored"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and said in r.message]
        assert len(warnings) == 1, [r.message for r in caplog.records]

        # The watch goes on from the new cluster's revision: a later change arrives.
        _put(conn, settings, "later", 5)
        table.wait_until(lambda snap: "later" in snap, timeout=10)
        wait_for(lambda: watcher.health().cluster_changes == 1, message="no second change")


def _tables_hold(tables: list[RoutingTable], expected: dict[str, str]) -> bool:
    """Whether every table holds exactly ``expected`` (engine id -> status)."""
    return all(
        {engine_id: record.status.value for engine_id, record in table.snapshot().items()}
        == expected
        for table in tables
    )


def _etcd_statuses(conn: Connection, settings: Settings) -> dict[str, str]:
    prefix = settings.keyspace.prefix
    return {
        kv.key.decode()[len(prefix) :]: json.loads(kv.value)["status"]
        for kv in conn.list_prefix(prefix)[1]
    }


@pytest.mark.parametrize("new_id", [False, True], ids=["same-cluster-id", "new-cluster-id"])
def test_watchers_and_registrations_start_over_on_a_wiped_cluster(
    etcd: EtcdCluster, new_id: bool
) -> None:
    """The issue's test: 3 watchers, 4 registrations (one drained, one SIGKILLed, one
    live, one replaced by a new record). After the wipe every live registration writes
    its record again (the drained one still draining, the replaced id with the new
    record), the killed one does not come back, and every table equals etcd within the
    deadline: 0 ghosts, 0 lost. The registrar's own record watch follows the new cluster:
    `discovery drain` after the wipe is adopted, and a close after it is seen."""
    settings = Settings(endpoints=etcd.endpoints, namespace="rebuilt", dial_timeout=10)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    with contextlib.ExitStack() as stack:
        conn = stack.enter_context(Connection(settings))
        tables = []
        for _ in range(3):
            watcher = stack.enter_context(EndpointWatcher(settings, heartbeat=1.0))
            tables.append(stack.enter_context(RoutingTable(watcher)))

        def register(engine_id: str, index: int, **kwargs: Any) -> Registration:
            registration = register_engine(
                make_endpoint(index), engine_id=engine_id, ttl=3, settings=settings, **kwargs
            )
            stack.callback(registration.close)
            return registration

        drained = register("drained", 0, metrics=metrics)
        drained.set_status("draining")
        live = register("live", 1, metrics=metrics)
        replaced = register("replaced", 2)
        replacer = register("replaced", 3, replace=True, metrics=metrics)
        wait_for(lambda: replaced.state is RegistrationState.LOST, message="the takeover seen")
        replaced.close()
        killed = Registrar(settings, "killed")
        stack.callback(killed.stop)
        before = {"drained": "draining", "live": "ready", "replaced": "ready", "killed": "ready"}
        wait_for(lambda: _tables_hold(tables, before), timeout=15, message="the tables")
        for index in range(10):  # the old history runs well ahead of the new one
            _put(conn, settings, "filler", index)
        raw_call(conn, lambda c: c.delete(_RACED.keyspace.key("filler")))
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait(10)

        etcd.wipe(new_id=new_id)
        after = {"drained": "draining", "live": "ready", "replaced": "ready"}
        wait_for(lambda: _tables_hold(tables, after), timeout=_FOLLOWS_WITHIN, message="tables")
        assert _etcd_statuses(conn, settings) == after, "etcd holds what the tables hold"
        endpoint = tables[0].snapshot()["replaced"].endpoint
        assert endpoint == make_endpoint(3), "the replaced id came back with the new record"
        for registration in (drained, live, replacer):
            health = registration.health()
            assert health.state is RegistrationState.REGISTERED, health
            assert health.losses == 1, health  # once: lease gone, or another cluster
        assert registry.get_sample_value("discovery_reregistrations_total") == 3

        # The record watches follow the new cluster: an operator's drain is adopted...
        result = run_cli(settings, "drain", "live")
        assert result.returncode == 0, result.stderr
        wait_for(lambda: live.status is EngineStatus.DRAINING, message="the drain adopted")
        # ...and a write of the registrar's own is a compare on the new cluster's revision.
        live.update(labels={"after": "wipe"})
        wait_for(
            lambda: all(t.snapshot()["live"].labels.get("after") == "wipe" for t in tables),
            message="the update seen",
        )
        drained.close()
        after = {"live": "draining", "replaced": "ready"}
        wait_for(lambda: _tables_hold(tables, after), timeout=10, message="the close seen")
        assert _etcd_statuses(conn, settings) == after


def test_an_older_snapshot_restored_is_followed_by_watchers_and_registrars(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """`etcdctl snapshot save`, changes, then `etcdutl snapshot restore` of that older
    snapshot: etcd's revision goes back and its leases and keys are the snapshot's, under a
    new cluster id. Each registrar writes its record again on a fresh lease (the draining
    status it had since, not the snapshot's); a session member closed since, whom the
    snapshot brought back on the session's live lease, goes with that lease; a key written
    since is gone from the tables as from etcd."""
    settings = Settings(endpoints=etcd.endpoints, namespace="restored", dial_timeout=10)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    with contextlib.ExitStack() as stack:
        conn = stack.enter_context(Connection(settings))
        watcher = stack.enter_context(EndpointWatcher(settings, heartbeat=1.0))
        table = stack.enter_context(RoutingTable(watcher))
        session = stack.enter_context(Session(ttl=3, settings=settings, metrics=metrics))
        live = register_engine(
            make_endpoint(0), engine_id="live", ttl=3, settings=settings, metrics=metrics
        )
        stack.callback(live.close)
        members = {
            name: register_engine(make_endpoint(i), engine_id=name, session=session)
            for i, name in enumerate(("s1", "s2"), start=1)
        }
        for registration in members.values():
            stack.callback(registration.close)
        table.wait_until(lambda snap: set(snap) == {"live", "s1", "s2"}, timeout=10)
        snapshot = tmp_path / "etcd.db"
        saved = etcd.etcdctl("snapshot", "save", str(snapshot))
        assert saved.returncode == 0, saved.stderr

        # Since the snapshot: a drain, a member closed, a key written by hand.
        live.set_status("draining")
        members["s2"].close()
        _put(conn, settings, "since", 5)
        expected = {"live": "draining", "s1": "ready", "since": "ready"}
        wait_for(lambda: _tables_hold([table], expected), timeout=10, message="the changes")

        etcd.restore(snapshot)
        expected = {"live": "draining", "s1": "ready"}
        wait_for(lambda: _tables_hold([table], expected), timeout=_FOLLOWS_WITHIN, message="table")
        wait_for(
            lambda: _etcd_statuses(conn, settings) == expected, message="etcd after the repair"
        )
        assert _tables_hold([table], expected), "ghosts or lost engines"
        assert watcher.health().cluster_changes >= 1
        for registration in (live, members["s1"]):
            health = registration.health()
            assert health.state is RegistrationState.REGISTERED, health
            assert health.cluster_changes == 1, health
        assert registry.get_sample_value("discovery_registrar_cluster_changes_total") == 2
        # The registrars' watches follow the restored history: an outside drain is adopted.
        assert run_cli(settings, "drain", "s1").returncode == 0
        wait_for(lambda: members["s1"].status is EngineStatus.DRAINING, message="drain adopted")


# -- in memory (the quick tier): the same on MemoryEtcd.wipe(), and the loop's own cases ---


@pytest.fixture
def ports(memory_etcd: MemoryEtcd) -> Iterator[Callable[[], MemoryPort]]:
    """Clients of the test's MemoryEtcd, closed after the test (their keepers with them)."""
    made: list[MemoryPort] = []

    def port() -> MemoryPort:
        made.append(MemoryPort(memory_etcd))
        return made[-1]

    yield port
    for each in made:
        each.close()


@pytest.mark.parametrize("new_id", [False, True], ids=["same-cluster-id", "new-cluster-id"])
def test_in_memory_a_table_and_a_registration_start_over_on_a_wiped_etcd(
    memory_etcd: MemoryEtcd, ports: Callable[[], MemoryPort], new_id: bool
) -> None:
    settings = Settings(endpoints=["memory"], namespace="wiped", dial_timeout=10)
    key = settings.keyspace.key
    port = ports()
    with (
        watch_table(settings, connection=ports(), heartbeat=1.0) as table,
        register_engine(
            make_endpoint(9), engine_id="live", ttl=3, settings=settings, connection=port
        ) as live,
    ):
        for index, name in enumerate("abc"):
            port.replace(key(name), _value(name, index), 0)
        for index in range(10):
            port.replace(key("c"), _value("c", index), 0)
        table.wait_until(lambda snap: set(snap) == {"a", "b", "c", "live"}, timeout=10)
        before = memory_etcd.cluster_id

        memory_etcd.wipe(new_id=new_id)
        assert (memory_etcd.cluster_id != before) is new_id
        port.replace(key("c2"), _value("c2", 3), 0)
        table.wait_until(lambda snap: set(snap) == {"c2", "live"}, timeout=_FOLLOWS_WITHIN)
        assert table.watcher is not None
        health = table.watcher.health()
        assert health.cluster_changes == 1 and health.relists == 1, health
        wait_for(lambda: live.state is RegistrationState.REGISTERED, message="written again")
        assert port.get(key("live")) is not None


class _Deliveries:
    """A reflector's target that keeps what it was handed."""

    def __init__(self) -> None:
        self.listings: list[tuple[set[bytes], bool]] = []
        self.events: list[bytes] = []

    def replace(self, pages: Iterator[tuple[int, list[KeyValue]]], *, reset: bool = False) -> int:
        revision, keys = 0, set()
        for revision, kvs in pages:  # noqa: B007 (the last page's revision is the listing's)
            keys |= {kv.key for kv in kvs}
        self.listings.append((keys, reset))
        return revision

    def apply(self, response: WatchResponse) -> None:
        self.events.extend(event.kv.key for event in response.events)


class _BehindOnce:
    """A port whose second watch first answers from a member behind the others: its
    "created" response at a revision below the one asked for, the same cluster id."""

    def __init__(self, port: MemoryPort) -> None:
        self._port = port
        self.watches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)

    def open_watch(self, prefix: str, revision: int, **options: Any) -> Any:
        self.watches += 1
        stream = self._port.open_watch(prefix, revision, **options)
        if self.watches != 2:
            return stream
        behind = WatchResponse(revision - 1, (), self._port.etcd.cluster_id)
        return _Prefixed(behind, stream)


class _Prefixed:
    def __init__(self, first: WatchResponse, stream: Any) -> None:
        self._first, self._stream = first, stream

    def __iter__(self) -> Iterator[WatchResponse]:
        yield self._first
        yield from self._stream

    def close(self) -> None:
        self._stream.close()


def test_a_watch_answer_from_a_member_behind_lists_to_check_and_resumes(
    memory_etcd: MemoryEtcd, ports: Callable[[], MemoryPort]
) -> None:
    """An answer below the applied revision from the same cluster may be a member that is
    only behind: the check's listing is at the applied revision or later, so nothing is
    replaced, the watch resumes where it was, and no change is lost or delivered twice."""
    port = ports()
    port.replace("/k/a", b"1", 0)
    target = _Deliveries()
    port_behind = _BehindOnce(port)
    reflector = Reflector(
        port_behind,  # type: ignore[arg-type]
        "/k/",
        target,
        name="test",
        heartbeat=10,
        progress_interval=10,
    )
    reflector.start(thread_name="test-reflector")
    try:
        wait_for(lambda: target.listings == [({b"/k/a"}, False)], message="the listing")
        port.replace("/k/b", b"2", 0)
        wait_for(lambda: target.events == [b"/k/b"], message="the first watch")
        with memory_etcd.outage():  # the stream ends; the next watch meets the member behind
            wait_for(lambda: reflector.health().reconnects == 1, message="the stream's end")
        port.replace("/k/c", b"3", 0)
        wait_for(lambda: target.events == [b"/k/b", b"/k/c"], message="the watch resumed")
        assert port_behind.watches == 3  # the one behind, then the resumed one
        assert target.listings == [({b"/k/a"}, False)], "nothing replaced"
        health = reflector.health()
        assert health.cluster_changes == 0 and health.relists == 0, health
    finally:
        reflector.stop()


def test_a_reset_listing_replaces_records_whatever_their_revisions() -> None:
    """From another cluster the mod revisions are not comparable: a record written at the
    same mod revision with other content is ``updated``, and the store's revision goes back
    to the listing's."""
    store = EngineStore()
    old = {name: _entry(name, 0, mod_revision=5) for name in ("a", "b")}
    store.replace(old, 20)
    new = {"a": _entry("a", 7, mod_revision=5), "c": _entry("c", 1, mod_revision=3)}
    events = []
    store.add_sink(_Collect(events), replay=False)
    kinds = store.replace(new, 6, reset=True)
    assert sorted(kinds) == sorted([EventType.REMOVED, EventType.UPDATED, EventType.ADDED])
    assert {(e.type, e.engine_id) for e in events} == {
        (EventType.REMOVED, "b"),
        (EventType.UPDATED, "a"),
        (EventType.ADDED, "c"),
    }
    assert store.revision == 6
    assert store.replace(new, 7) == []  # the same listing again: nothing changed


_RACED = Settings(endpoints=["memory"], namespace="raced", dial_timeout=10)


def _register_x(port: Any, registry: CollectorRegistry) -> Registration:
    """Engine ``x`` on a private session over ``port``, its metrics in ``registry``."""
    return register_engine(
        make_endpoint(0),
        engine_id="x",
        ttl=3,
        settings=_RACED,
        connection=port,
        metrics=Metrics(registry),
    )


def test_a_registration_on_a_wiped_etcd_takes_one_new_lease(
    memory_etcd: MemoryEtcd, ports: Callable[[], MemoryPort]
) -> None:
    """After a wipe the keepalive finds the lease gone and the session writes the record
    again on a new lease, while the record watch lists the new cluster: before the write
    (the record absent) or after. Either way one new lease, no flap: a lease every key of
    which was written since that listing is the new cluster's and is kept."""
    port, registry = ports(), CollectorRegistry()
    key = _RACED.keyspace.key("x")
    with _register_x(port, registry) as registration:
        watch = registration._watch
        assert watch is not None
        for wipes in range(1, 4):
            for index in range(5):  # the old history runs ahead of the new one
                port.replace(_RACED.keyspace.key("filler"), _value("filler", index), 0)
            wait_for(lambda: watch._reflector.revision == memory_etcd.revision, message="seen")
            before = registration.lease_id
            memory_etcd.wipe()
            wait_for(
                lambda before=before, wipes=wipes: (  # type: ignore[misc]
                    watch._reflector.health().cluster_changes == wipes
                    and registration.state is RegistrationState.REGISTERED
                    and registration.lease_id != before
                    and (kv := port.get(key)) is not None
                    and kv.lease == registration.lease_id
                    # The listing's replace() runs the repair: done once the watch is past it
                    # (else the next wipe falls before its watch, and goes unseen as it may).
                    and watch._reflector.revision == memory_etcd.revision
                ),
                timeout=_FOLLOWS_WITHIN,
                message="the wipe seen, the record written again on a new lease",
            )
            assert registry.get_sample_value("discovery_lease_grants_total") == 1 + wipes


class _Held:
    """A port whose batched creates (a session's repair) wait while ``writes`` is clear,
    and whose new watches wait while ``watches`` is."""

    def __init__(self, port: MemoryPort) -> None:
        self._port = port
        self.writes, self.watches = threading.Event(), threading.Event()
        self.writes.set()
        self.watches.set()
        self.writing = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)

    def create_many(self, items: Any, lease_id: int) -> Any:
        self.writing.set()
        self.writes.wait(30)
        return self._port.create_many(items, lease_id)

    def open_watch(self, prefix: str, revision: int, **options: Any) -> Any:
        self.watches.wait(30)
        return self._port.open_watch(prefix, revision, **options)


class _FailedCompareThen:
    """A port whose next failed compare-and-swap (a publish meeting a record it has not
    seen) answers only once ``then()`` has returned."""

    def __init__(self, port: Any) -> None:
        self._port = port
        self.then: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)

    def update(self, key: str, value: bytes, lease_id: int, *, mod_revision: int) -> Any:
        result = self._port.update(key, value, lease_id, mod_revision=mod_revision)
        then, self.then = self.then, None
        if then is not None and not result.succeeded:
            then()
        return result


def test_a_publish_that_meets_a_restored_snapshot_adopts_nothing_of_it(
    memory_etcd: MemoryEtcd, ports: Callable[[], MemoryPort]
) -> None:
    """A change published as etcd comes back from an older snapshot: its compare fails on
    the snapshot's record (on our lease, which the snapshot brought back), and the record
    watch's listing of the restored cluster rebases the registration before that answer is
    read. The snapshot's record is no outside change to adopt: the record is written again
    with the status set since the snapshot, and the new change."""
    held = _Held(ports())
    port = _FailedCompareThen(held)
    key = _RACED.keyspace.key("x")
    with _register_x(port, CollectorRegistry()) as registration:
        watch = registration._watch
        assert watch is not None
        snapshot = memory_etcd.snapshot()
        registration.set_status("draining")
        wait_for(lambda: json.loads(port.get(key).value)["status"] == "draining")
        held.watches.clear()  # the record watch's next stream waits
        memory_etcd.restore_snapshot(snapshot)

        def rebased() -> None:
            held.watches.set()
            wait_for(lambda: registration.health().cluster_changes == 1, message="the rebase")

        port.then = rebased
        registration.update(labels={"zone": "b"})
        assert port.then is None, "the publish met the snapshot's record"

        def written() -> dict[str, Any] | None:
            kv = port.get(key)
            if kv is None or kv.lease != registration.lease_id:
                return None
            value: dict[str, Any] = json.loads(kv.value)
            return value if value.get("labels", {}).get("zone") == "b" else None

        value = wait_for(written, timeout=_FOLLOWS_WITHIN, message="the record written again")
        assert value["status"] == "draining", "the snapshot's status came back"
        assert registration.status is EngineStatus.DRAINING
        assert registration.state is RegistrationState.REGISTERED


def test_a_listing_that_raced_the_repair_keeps_the_new_clusters_lease(
    memory_etcd: MemoryEtcd, ports: Callable[[], MemoryPort]
) -> None:
    """After a wipe the keepalive finds the lease gone and the repair grants one on the
    new cluster; the record watch lists that cluster before the repair's write lands (the
    record absent) and asks for a fresh lease. The lease the repair wrote every key on
    since is the new cluster's: kept, no third grant, no record deleted and written again."""
    port, registry = _Held(ports()), CollectorRegistry()
    key = _RACED.keyspace.key("x")
    with _register_x(port, registry) as registration:
        watch = registration._watch
        assert watch is not None
        for index in range(5):  # the old history runs ahead of the new one
            port.replace(_RACED.keyspace.key("filler"), _value("filler", index), 0)
        port.writes.clear()
        port.watches.clear()
        memory_etcd.wipe()
        assert port.writing.wait(10)  # the repair granted a lease and writes on it: held
        assert registration.state is RegistrationState.LOST
        port.watches.set()  # the record watch lists the new cluster: the record absent
        wait_for(lambda: registration.health().cluster_changes == 1, message="the listing")
        port.writes.set()
        wait_for(
            lambda: (
                registration.state is RegistrationState.REGISTERED
                and (kv := port.get(key)) is not None
                and kv.lease == registration.lease_id
                and not registration._session._repairing
            ),
            message="registered, its record on its lease",
        )
        lease = registration.lease_id
        wait_for(lambda: registration._session._state.value == "alive", message="alive")
        assert registration.lease_id == lease
        assert registry.get_sample_value("discovery_lease_grants_total") == 2
