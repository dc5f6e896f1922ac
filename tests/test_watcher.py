"""Watcher and routing table (issue 4): events, snapshots, malformed values and selectors
on the memory port and on real etcd (``store``); restarts, failover, compaction of a real
cluster, a frozen member and quorum loss on real etcd."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import etcd3
import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    ConfigurationError,
    Connection,
    EndpointEvent,
    EndpointWatcher,
    EtcdPort,
    EtcdUnavailableError,
    EventType,
    InvalidSelectorError,
    Metrics,
    RoutingTable,
    Selector,
    Settings,
    WatcherHealth,
    WatcherState,
    list_engines,
    watch_table,
)
from discovery._backoff import Backoff
from discovery._etcd.port import KeyValue, WatchResponse
from discovery._etcd.reflector import Reflector
from discovery._reads.watcher import _CollectorPause
from discovery._records.codec import encode
from discovery._records.record import EngineRecord

from .conftest import Store
from .containers import both_etcds
from .helpers import etcdctl, make_endpoint, raw_call, wait_for


def _value(index: int, engine_id: str | None = None, **labels: str) -> bytes:
    record = EngineRecord(
        engine_id=engine_id or f"e{index}", endpoint=make_endpoint(index), labels=labels
    )
    return encode(record)


def _raw(settings: Settings) -> etcd3.MultiEndpointEtcd3Client:
    return Connection(settings)._current()


class Recorder:
    """Collects a watcher's events from a callback, thread-safely."""

    def __init__(self) -> None:
        self.events: list[EndpointEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: EndpointEvent) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, engine_id: str) -> list[EventType]:
        with self._lock:
            return [e.type for e in self.events if e.engine_id == engine_id]

    def check_order(self) -> None:
        """Revisions never go back, and no (key, revision) pair is delivered twice."""
        with self._lock:
            revisions = [e.revision for e in self.events]
            pairs = Counter((e.key, e.revision) for e in self.events)
        assert revisions == sorted(revisions)
        assert max(pairs.values(), default=1) == 1, [p for p, n in pairs.items() if n > 1]


def _etcd_state(port: EtcdPort, settings: Settings) -> dict[str, bytes]:
    _, kvs = port.list_prefix(settings.keyspace.prefix)
    return {kv.key.decode().rsplit("/", 1)[1]: kv.value for kv in kvs}


def _table_state(table: RoutingTable) -> dict[str, bytes]:
    return {engine_id: encode(record) for engine_id, record in table.snapshot().items()}


def _wait_table_equals_etcd(
    table: RoutingTable, port: EtcdPort, settings: Settings, timeout: float = 20
) -> None:
    try:
        wait_for(
            lambda: _table_state(table) == _etcd_state(port, settings), timeout, "table == etcd"
        )
    except AssertionError:
        ours, theirs = _table_state(table), _etcd_state(port, settings)
        differ = sorted(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
        raise AssertionError(
            f"table != etcd: missing {sorted(theirs.keys() - ours.keys())[:5]}, extra "
            f"{sorted(ours.keys() - theirs.keys())[:5]}, differ {differ[:5]}; "
            f"{table.watcher.health()}"
        ) from None


def test_events_added_updated_removed_with_last_known_record(store: Store) -> None:
    client = store.port
    key = store.settings.keyspace.key("e1")
    client.replace(key, _value(1), 0)
    recorder = Recorder()
    with EndpointWatcher(**store.using()) as watcher:
        watcher.subscribe(recorder)
        wait_for(lambda: recorder.of("e1") == [EventType.ADDED], message="snapshot")
        listed_revision = recorder.events[0].revision
        assert listed_revision == watcher.revision
        client.replace(key, _value(1, zone="b"), 0)
        client.delete(key)
        wait_for(lambda: len(recorder.events) == 3, message="update and delete")
        added, updated, removed = recorder.events
        assert updated.type is EventType.UPDATED and updated.labels == {"zone": "b"}
        assert removed.type is EventType.REMOVED
        assert removed.record == updated.record  # the last known endpoint
        assert added.revision < updated.revision < removed.revision
        assert removed.to_dict()["endpoint"] == make_endpoint(1).to_dict()
        assert set(removed.to_dict()) == {
            "type",
            "engine_id",
            "key",
            "revision",
            "endpoint",
            "labels",
            "registered_at",
            "status",
            "drain_deadline",
            "weight_version",
            "state_address",
            "role",
            "kv_transfer_backend",
            "kv_layout",
        }


def test_snapshot_then_watch_has_no_gap(store: Store) -> None:
    """Records written while the watcher starts all arrive exactly once."""
    client = store.client()
    total = 300
    started = threading.Event()

    def writer() -> None:
        for i in range(total):
            client.replace(store.settings.keyspace.key(f"e{i}"), _value(i), 0)
            if i == 20:
                started.set()

    thread = threading.Thread(target=writer)
    thread.start()
    started.wait(10)
    recorder = Recorder()
    with EndpointWatcher(**store.using()) as watcher, RoutingTable(watcher) as table:
        watcher.subscribe(recorder)
        thread.join()
        table.wait_until(lambda snap: len(snap) == total, timeout=10)
        wait_for(lambda: len(recorder.events) == total, message="all events")
        assert Counter(e.engine_id for e in recorder.events) == Counter(
            f"e{i}" for i in range(total)
        )
        assert {e.type for e in recorder.events} == {EventType.ADDED}
        recorder.check_order()
        assert _table_state(table) == _etcd_state(store.port, store.settings)


def test_malformed_values_are_skipped_counted_and_never_break_the_table(store: Store) -> None:
    k = store.settings.keyspace.key

    def put(key: str, value: bytes) -> None:
        store.port.replace(key, value, 0)

    put(k("good"), _value(1, "good"))
    put(k("garbage"), b"\x00not json")
    put(k("latin1"), b"\xff\xfe\xfa")
    bad_policy = json.loads(_value(2))
    bad_policy["capabilities"]["prefix_caching_coordinator_policy"] = 7  # a string is kept
    bad_policy["engine_id"] = "policy"
    put(k("policy"), json.dumps(bad_policy).encode())
    put(store.settings.keyspace.prefix + "not/an/id", _value(3, "id"))
    recorder = Recorder()
    with EndpointWatcher(**store.using()) as watcher, RoutingTable(watcher) as table:
        watcher.subscribe(recorder)
        wait_for(lambda: recorder.of("good") == [EventType.ADDED], message="snapshot")
        assert watcher.health().skipped == 4
        assert set(table.snapshot()) == {"good"}
        # A live engine whose value turns bad is removed; fixing it adds it back.
        put(k("good"), b"{}")
        wait_for(
            lambda: recorder.of("good") == [EventType.ADDED, EventType.REMOVED], message="removal"
        )
        put(k("garbage"), _value(4, "garbage"))
        wait_for(lambda: recorder.of("garbage") == [EventType.ADDED], message="garbage fixed")
        store.port.delete(k("latin1"))  # never valid: nothing to report
        put(k("good"), _value(1, "good"))
        wait_for(lambda: recorder.of("good")[-1] is EventType.ADDED, message="good again")
        assert recorder.of("latin1") == []
        assert watcher.health().skipped == 5
        assert set(table.snapshot()) == {"good", "garbage"}
        recorder.check_order()


def test_a_record_over_the_size_limit_or_its_bounds_is_skipped_on_real_etcd(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43 item 3: values put by hand with the raw client, as a buggy or hostile writer
    would. A 1 MB record and one advertising 10**400 KV blocks are skipped like malformed
    ones (one WARNING each, counted); a good record and a newer writer's are listed."""
    k = settings.keyspace.key
    huge = json.loads(_value(1, "huge"))
    huge["padding"] = "x" * 1_000_000  # a valid record, but 1 MB
    liar = json.loads(_value(2, "liar"))
    liar["capabilities"]["total_kv_blocks"] = 10**400
    future = json.loads(_value(3, "future"))
    future["capabilities"]["a_newer_capability"] = 2**70  # unknown: kept, never bounded
    caplog.set_level(logging.WARNING, logger="discovery")
    client = _raw(settings)
    try:
        client.put(k("huge"), json.dumps(huge))
        client.put(k("liar"), json.dumps(liar))
        client.put(k("good"), _value(4, "good"))
        client.put(k("future"), json.dumps(future))
        with EndpointWatcher(settings) as watcher, RoutingTable(watcher) as table:
            table.wait_until(lambda snap: {"good", "future"} <= set(snap), timeout=10)
            assert set(table.snapshot()) == {"good", "future"}
            assert table.snapshot()["future"].extra_capabilities == {"a_newer_capability": 2**70}
            assert watcher.health().skipped == 2
            # Through the watch: a listed engine whose record starts to lie is removed.
            lying = json.loads(_value(4, "good"))
            lying["capabilities"]["context_length"] = 2**41
            client.put(k("good"), json.dumps(lying))
            table.wait_until(lambda snap: "good" not in snap, timeout=10)
            assert watcher.health().skipped == 3
        listing = list_engines(settings)
    finally:
        client.close()
    assert [e.engine_id for e in listing.engines] == ["future"]
    reasons = {error.key.rsplit("/", 1)[1]: error.reason for error in listing.skipped}
    assert reasons["huge"].endswith("bytes, over the 16384-byte limit of a record")
    assert int(reasons["huge"].split()[0]) > 1_000_000
    assert reasons["liar"] == (
        "capabilities total_kv_blocks is about 10**400, over the bound of 2**40 "
        "(1099511627776) no real engine exceeds"
    )
    assert reasons["good"].startswith(f"capabilities context_length is {2**41}, over")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    skipped = [m for m in warnings if m.startswith("skipping malformed value")]
    assert len(skipped) == 3, warnings  # one each, from the watcher
    assert all(len(m) < 500 for m in skipped)  # the 1 MB value is not in the log


def test_label_selector(store: Store) -> None:
    client = store.port
    k = store.settings.keyspace.key
    client.replace(k("e1"), _value(1, model="llama", role="decode"), 0)
    client.replace(k("e2"), _value(2, model="mistral", role="decode"), 0)
    with watch_table(selector={"model": "llama"}, **store.using()) as table:
        assert set(table.snapshot()) == {"e1"}
        client.replace(k("e2"), _value(2, model="llama"), 0)
        table.wait_until(lambda snap: set(snap) == {"e1", "e2"}, timeout=5)
        client.replace(k("e1"), _value(1, model="other"), 0)
        table.wait_until(lambda snap: set(snap) == {"e2"}, timeout=5)


def test_set_based_selector_of_the_watch_and_of_a_listing(store: Store) -> None:
    client = store.port
    k = store.settings.keyspace.key
    client.replace(k("e1"), _value(1, model="llama", tier="web"), 0)
    client.replace(k("e2"), _value(2, model="llama", tier="batch"), 0)
    client.replace(k("e3"), _value(3, model="llama"), 0)
    client.replace(k("e4"), _value(4, model="qwen"), 0)
    selector = "model in (llama, mistral), tier notin (batch)"
    with watch_table(selector=selector, **store.using()) as table:
        assert table.selector == Selector.parse(selector)
        assert set(table.snapshot()) == {"e1", "e3"}  # e3: no tier, so not batch
        client.replace(k("e2"), _value(2, model="llama", tier="web"), 0)  # leaves batch: in
        table.wait_until(lambda snap: set(snap) == {"e1", "e2", "e3"}, timeout=5)
        client.replace(k("e3"), _value(3, model="llama", tier="batch"), 0)  # out
        client.replace(k("e4"), _value(4, model="mistral"), 0)  # in
        table.wait_until(lambda snap: set(snap) == {"e1", "e2", "e4"}, timeout=5)
    listing = list_engines(selector="!tier", **store.using())
    assert [e.engine_id for e in listing.engines] == ["e4"]
    listing = list_engines(selector=Selector.parse("tier,model"), **store.using())
    assert sorted(e.engine_id for e in listing.engines) == ["e1", "e2", "e3"]
    with pytest.raises(InvalidSelectorError, match="column 12: found 'x', expected '\\('"):
        EndpointWatcher(selector="tier notin x", **store.using())


def test_iterators_and_stop_leave_nothing_behind(store: Store) -> None:
    client = store.port
    client.replace(store.settings.keyspace.key("e1"), _value(1), 0)
    before = {t.ident for t in threading.enumerate()}
    watcher = EndpointWatcher(**store.using()).start()
    received: list[EndpointEvent] = []

    def consume() -> None:
        received.extend(watcher)  # ends when the watcher stops

    consumer = threading.Thread(target=consume)
    consumer.start()
    wait_for(lambda: len(received) == 1, message="snapshot through the iterator")

    async def consume_async() -> list[EventType]:
        seen = []
        async for event in watcher:
            seen.append(event.type)
            if len(seen) == 2:
                break
        return seen

    client.replace(store.settings.keyspace.key("e2"), _value(2), 0)
    assert asyncio.run(consume_async()) == [EventType.ADDED, EventType.ADDED]
    watcher.stop()
    watcher.stop()  # idempotent
    consumer.join(5)
    assert not consumer.is_alive()
    assert [e.engine_id for e in received] == ["e1", "e2"]
    assert watcher.health().state is WatcherState.STOPPED
    leftover = [
        t for t in threading.enumerate() if t.ident not in before and t.name.startswith("discovery")
    ]
    assert wait_for(lambda: not [t for t in leftover if t.is_alive()], timeout=5, message="threads")


def test_async_context_manager_and_health(store: Store) -> None:
    async def main() -> None:
        async with EndpointWatcher(**store.using()) as watcher:
            health = watcher.health()
            assert health.state is WatcherState.CONNECTED
            assert health.revision > 0 and health.last_error is None

    asyncio.run(main())


def _writer(settings: Settings, stop: threading.Event, written: dict[str, int]) -> threading.Thread:
    """Puts new keys until stopped, remembering the revision of every acknowledged put."""

    def run() -> None:
        with Connection(settings) as conn:
            i = 0
            while not stop.is_set():
                key = settings.keyspace.key(f"w{i}")
                try:
                    result = conn.replace(key, _value(i, f"w{i}"), 0)
                    written[f"w{i}"] = result.revision
                except Exception:
                    stop.wait(0.05)  # etcd is down on purpose: pace the retries
                i += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _check_nothing_lost(recorder: Recorder, written: dict[str, int]) -> None:
    recorder.check_order()
    seen = {(e.engine_id, e.revision) for e in recorder.events if e.type is EventType.ADDED}
    missing = {(k, r) for k, r in written.items() if (k, r) not in seen}
    assert not missing, (
        f"{len(missing)} acknowledged puts never arrived, e.g. {sorted(missing)[:3]}"
    )


def _writes_survive(settings: Settings, fault: Callable[[], Callable[[], None]]) -> WatcherHealth:
    """Write continuously, inject ``fault`` (it returns its repair), check nothing is lost."""
    stop, written = threading.Event(), {}
    recorder = Recorder()
    with (
        EndpointWatcher(settings, heartbeat=1.0) as watcher,
        RoutingTable(watcher) as table,
        Connection(settings) as conn,
    ):
        watcher.subscribe(recorder)
        thread = _writer(settings, stop, written)
        wait_for(lambda: len(written) > 50, message="writes before the fault")
        repair = fault()
        count = len(written)
        wait_for(lambda: len(written) > count + 50, timeout=15, message="writes after the fault")
        repair()
        stop.set()
        thread.join(10)
        _wait_table_equals_etcd(table, conn, settings)
        health = watcher.health()
    _check_nothing_lost(recorder, written)
    return health


@both_etcds
def test_etcd_restart_during_writes_loses_nothing(etcd) -> None:
    settings = Settings(endpoints=etcd.endpoints, namespace="restart", dial_timeout=10)

    def restart() -> Callable[[], None]:
        etcd.restart(etcd.members[0], kill=True)
        return lambda: None

    health = _writes_survive(settings, restart)
    assert health.reconnects >= 1
    assert health.state is WatcherState.CONNECTED


def test_leader_kill_on_three_members_loses_nothing(etcd3) -> None:
    settings = Settings(endpoints=etcd3.endpoints, namespace="leader", dial_timeout=10)

    def kill_leader() -> Callable[[], None]:
        leader = etcd3.leader()
        leader.stop(kill=True)

        def repair() -> None:
            leader.start()
            etcd3.wait_healthy(members=[leader])

        return repair

    _writes_survive(settings, kill_leader)


def test_compaction_while_disconnected_relists_the_exact_diff(etcd3) -> None:
    """The watcher talks to one member; while it is down the others change and compact."""
    member = etcd3.members[0]
    lonely = Settings(endpoints=[member.client_url], namespace="compact", dial_timeout=10)
    others = Settings(
        endpoints=[m.client_url for m in etcd3.members[1:]], namespace="compact", dial_timeout=15
    )
    conn = Connection(others)  # retries through the election if the leader was killed
    k = others.keyspace.key
    for i in range(4):
        raw_call(conn, lambda c, i=i: c.put(k(f"e{i}"), _value(i)))
    recorder = Recorder()
    with EndpointWatcher(lonely, heartbeat=1.0) as watcher, RoutingTable(watcher) as table:
        watcher.subscribe(recorder)
        wait_for(lambda: len(recorder.events) == 4, message="snapshot")
        member.stop(kill=True)
        wait_for(lambda: watcher.health().state is WatcherState.RECONNECTING, message="disconnect")
        raw_call(conn, lambda c: c.delete(k("e0")))  # removed while away: must be reported
        raw_call(conn, lambda c: c.put(k("e1"), _value(1, zone="new")))  # updated
        raw_call(conn, lambda c: c.put(k("e4"), _value(4)))  # added
        raw_call(conn, lambda c: c.put(k("e5"), _value(5)))
        raw_call(conn, lambda c: c.delete(k("e5")))  # came and went while away: nothing to report
        revision = raw_call(conn, lambda c: c.get_response(k("e4"))).header.revision
        raw_call(conn, lambda c: c.compact(revision, physical=True))
        member.start()
        etcd3.wait_healthy(members=[member])
        wait_for(lambda: watcher.health().relists == 1, timeout=15, message="relist")
        wait_for(lambda: len(recorder.events) == 7, message="diff events")
        diff = {(e.type, e.engine_id) for e in recorder.events[4:]}
        assert diff == {
            (EventType.REMOVED, "e0"),
            (EventType.UPDATED, "e1"),
            (EventType.ADDED, "e4"),
        }
        assert len({e.revision for e in recorder.events[4:]}) == 1  # one atomic batch
        assert set(table.snapshot()) == {"e1", "e2", "e3", "e4"}
        recorder.check_order()
    conn.close()


def test_a_delete_at_the_compaction_revision_is_not_lost(etcd3) -> None:
    """etcd before 3.5.16 drops the tombstone of a delete made at exactly the compaction
    revision (etcd-io/etcd#18089): a watch resumed from that revision never sees the delete.
    The watcher resumes from its last applied revision, so such a compaction sends it to
    list again instead."""
    member = etcd3.members[0]
    lonely = Settings(endpoints=[member.client_url], namespace="tombstone", dial_timeout=10)
    others = Settings(
        endpoints=[m.client_url for m in etcd3.members[1:]], namespace="tombstone", dial_timeout=15
    )
    conn = Connection(others)
    k = others.keyspace.key
    for i in range(2):
        raw_call(conn, lambda c, i=i: c.put(k(f"e{i}"), _value(i)))
    with EndpointWatcher(lonely, heartbeat=1.0) as watcher, RoutingTable(watcher) as table:
        table.wait_until(lambda snap: set(snap) == {"e0", "e1"}, timeout=10)
        applied = watcher.revision
        member.stop(kill=True)
        wait_for(lambda: watcher.health().state is WatcherState.RECONNECTING, message="disconnect")
        deleted = raw_call(conn, lambda c: c.delete(k("e0"), return_response=True))
        revision = deleted.header.revision
        assert revision == applied + 1, "the delete is not the watcher's next revision"
        raw_call(conn, lambda c: c.compact(revision, physical=True))
        member.start()
        etcd3.wait_healthy(members=[member])
        table.wait_until(lambda snap: set(snap) == {"e1"}, timeout=15)
    conn.close()


class _Listings:
    """A reflector's target that keeps each listing's keys."""

    def __init__(self) -> None:
        self.listings: list[set[bytes]] = []

    def replace(self, pages: Iterator[tuple[int, list[KeyValue]]], *, reset: bool = False) -> int:
        revision, keys = 0, set()
        for revision, kvs in pages:  # noqa: B007 (the last page's revision is the listing's)
            keys |= {kv.key for kv in kvs}
        self.listings.append(keys)
        return revision

    def apply(self, response: WatchResponse) -> None:
        pass


def test_a_watch_that_finds_its_revision_compacted_lists_at_once(settings: Settings) -> None:
    """A compaction answer is etcd answering, not a failure: the list comes without the
    backoff a failure waits (here a minute), so a registrar's record watch resumed past a
    compaction learns at once what happened to its key."""
    conn = Connection(settings)
    key = settings.keyspace.key("e0")
    try:
        put = raw_call(conn, lambda c: c.put(key, _value(0)))
        newer = raw_call(conn, lambda c: c.put(key, _value(1)))
        raw_call(conn, lambda c: c.compact(newer.header.revision, physical=True))
        target = _Listings()
        slow = Backoff(initial=60.0, maximum=60.0)
        reflector = Reflector(
            conn, key, target, name="test", heartbeat=10, progress_interval=10, backoff=slow
        )
        # Started at a compacted revision, as a record watch is at its owner's write.
        reflector.start(put.header.revision, thread_name="test-reflector")
        try:
            wait_for(lambda: target.listings, timeout=10, message="a listing, without backoff")
            assert target.listings == [{key.encode()}]
        finally:
            reflector.stop()
    finally:
        conn.close()


def test_frozen_etcd_is_detected_by_the_watchdog(etcd) -> None:
    """SIGSTOP keeps TCP open but silent: only the watchdog can notice."""
    settings = Settings(endpoints=etcd.endpoints, namespace="frozen", dial_timeout=10)
    client = _raw(settings)
    process = etcd.members[0].process
    with EndpointWatcher(settings, heartbeat=0.5) as watcher, RoutingTable(watcher) as table:
        process.send_signal(signal.SIGSTOP)
        try:
            wait_for(
                lambda: watcher.health().state is WatcherState.RECONNECTING,
                timeout=5,
                message="the watchdog to give up on the silent stream",
            )
            assert "silent" in watcher.health().last_error
        finally:
            process.send_signal(signal.SIGCONT)
        client.put(settings.keyspace.key("e1"), _value(1))
        table.wait_until(lambda snap: "e1" in snap, timeout=10)
        assert watcher.health().state is WatcherState.CONNECTED
    client.close()


def test_start_fails_clearly_without_etcd() -> None:
    settings = Settings(endpoints=["http://127.0.0.1:9"], dial_timeout=1)
    watcher = EndpointWatcher(settings)
    with pytest.raises(EtcdUnavailableError, match=r"127\.0\.0\.1:9"):
        watcher.start()
    assert watcher.health().state is WatcherState.STOPPED


def test_table_listeners_get_each_batch_with_its_snapshot(store: Store) -> None:
    seen: list[tuple[list[str], int]] = []
    with watch_table(**store.using()) as table:
        table.subscribe(
            lambda events, snap: seen.append(([e.engine_id for e in events], len(snap)))
        )
        three = [(store.settings.keyspace.key(f"e{i}"), _value(i)) for i in range(3)]
        assert all(r.succeeded for r in store.port.create_many(three, 0))  # one transaction
        wait_for(lambda: seen, message="one batch")
        assert seen == [(["e0", "e1", "e2"], 3)]  # one revision, applied atomically
        assert table.get("e1").endpoint == make_endpoint(1)
        assert "e2" in table and len(table) == 3
        with pytest.raises(TimeoutError):
            table.wait_until(lambda snap: "e9" in snap, timeout=0.2)


def test_a_slow_listener_never_stalls_the_table(store: Store) -> None:
    """A listener blocked on its first batch: the table still takes every later change,
    and the listener then gets every batch, in order (issue 31: listeners run where a batch
    was applied, once another thread reads the stream)."""
    blocked, seen = threading.Event(), []

    def listener(events, _snapshot) -> None:
        seen.append([e.engine_id for e in events])
        blocked.wait(30)

    with watch_table(**store.using()) as table:
        table.subscribe(listener)
        for i in range(5):
            store.port.replace(store.settings.keyspace.key(f"e{i}"), _value(i), 0)
            if i == 0:
                wait_for(lambda: seen, message="the listener blocked in the first batch")
        table.wait_until(lambda snap: len(snap) == 5, timeout=10)
        assert seen == [["e0"]]  # still blocked in the first batch
        blocked.set()
        wait_for(lambda: len(seen) == 5, message="every batch")
        assert seen == [[f"e{i}"] for i in range(5)]


def test_an_inline_listener_runs_on_the_watch_thread_before_the_others(store: Store) -> None:
    """``inline``: no hand-off (issue 44 item 4). The inline listener runs where the batch is
    applied, before the dispatched ones; one that raises is logged and the watch goes on."""
    order: list[tuple[str, bool, list[str]]] = []
    leading = lambda: table.store.dispatcher.leading()  # noqa: E731 - on the watch loop's thread

    def inline(events, _snapshot) -> None:
        order.append(("inline", leading(), [e.engine_id for e in events]))
        if events[0].engine_id == "e0":
            raise RuntimeError("a failing inline listener")

    def later(events, _snapshot) -> None:
        order.append(("later", leading(), [e.engine_id for e in events]))

    callbacks: list[tuple[str, bool]] = []
    with watch_table(**store.using()) as table:
        table.subscribe(later)
        table.subscribe(inline, inline=True)
        assert table.watcher is not None
        table.watcher.subscribe(
            lambda event: callbacks.append((event.engine_id, leading())),
            inline=True,
        )
        for i in range(2):
            store.port.replace(store.settings.keyspace.key(f"e{i}"), _value(i), 0)
        wait_for(lambda: len(order) == 4, message="both listeners, both batches")
        inline_seen = [entry for entry in order if entry[0] == "inline"]
        assert [ids for _, _, ids in inline_seen] == [["e0"], ["e1"]]  # the raise ended nothing
        for index in range(2):  # each batch reached the inline listener first
            assert order.index(inline_seen[index]) < order.index(
                next(e for e in order if e[0] == "later" and e[2] == inline_seen[index][2])
            )
        assert all(on_loop for _, on_loop, _ in inline_seen)
        assert not any(on_loop for name, on_loop, _ in order if name == "later")
        assert callbacks == [("e0", True), ("e1", True)]


def _etcd_revision(endpoints: list[str]) -> int:
    """etcd's current revision, read with etcdctl (not with the package under test)."""
    result = etcdctl(endpoints, "get", "/", "--keys-only", "-w", "json")
    assert result.returncode == 0, result.stderr
    return int(json.loads(result.stdout)["header"]["revision"])


def test_an_empty_table_is_current_at_the_revision_of_its_listing(
    etcd, private_settings: Settings
) -> None:
    """A snapshot without engines still names the revision it is current at (issue 18)."""
    assert etcdctl(etcd.endpoints, "put", "/elsewhere", "moves the revision").returncode == 0
    before = _etcd_revision(etcd.endpoints)  # a private etcd: nothing else writes
    with EndpointWatcher(private_settings) as watcher:
        table = RoutingTable(watcher).start()
        snapshot = table.snapshot()
        assert _etcd_revision(etcd.endpoints) == before > 1  # so the listing ran at `before`
        assert len(snapshot) == 0
        assert snapshot.revision == watcher.health().revision == table.revision == before
        table.stop()


def test_without_a_leader_the_watcher_serves_its_last_table_and_says_it_is_stale(
    etcd3, caplog: pytest.LogCaptureFixture
) -> None:
    """Quorum lost (two of three members killed): fail-static, and stale in every view.

    tests/test_partitions.py shows the same for a member cut off by a real partition.
    """
    caplog.set_level(logging.INFO, logger="discovery")
    survivor, *others = etcd3.members
    settings = Settings(  # it knows only that member (member sync would follow the others)
        endpoints=[survivor.client_url], namespace="quorum", dial_timeout=10, member_sync=False
    )
    prefix = settings.keyspace.prefix
    registry = CollectorRegistry()
    client = _raw(settings)
    for i in range(2):
        client.put(settings.keyspace.key(f"e{i}"), _value(i))
    with (
        EndpointWatcher(settings, metrics=Metrics(registry)) as watcher,
        RoutingTable(watcher) as table,
    ):
        before = table.wait_until(lambda snap: len(snap) == 2, timeout=10)
        assert not before.stale and before.staleness < watcher.health().stale_after
        assert registry.get_sample_value("discovery_watcher_stale", {"prefix": prefix}) == 0
        for member in others:
            member.stop(kill=True)
        wait_for(
            lambda: watcher.health().stale and "is stale" in caplog.text,
            timeout=20,
            message="the watcher to call itself stale, and log it",
        )
        health = watcher.health()
        assert health.staleness > health.stale_after
        assert "no leader" in (health.last_error or "")
        reconnects = {"prefix": prefix, "cause": "no_leader"}
        assert registry.get_sample_value("discovery_watcher_reconnects_total", reconnects) >= 1
        assert registry.get_sample_value("discovery_watcher_stale", {"prefix": prefix}) == 1
        snapshot = table.snapshot()
        assert snapshot.stale and dict(snapshot) == dict(before)  # the last table, kept
        assert before.stale  # a snapshot held from before the loss grew stale too
        for member in others:
            member.start()
        etcd3.wait_healthy()
        # health is current at the first proof; the monitor logs it at its next tick
        wait_for(
            lambda: not watcher.health().stale and "is current again" in caplog.text,
            timeout=15,
            message="current again, and logged",
        )
        assert not table.snapshot().stale
    client.close()


def test_a_quiet_watch_stays_current_through_progress_requests(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing changes under the prefix: answered progress requests keep the proof fresh."""
    caplog.set_level(logging.INFO, logger="discovery")
    with (
        EndpointWatcher(settings, progress_interval=0.3, stale_after=2.0) as watcher,
        RoutingTable(watcher) as table,
    ):
        first = table.snapshot()
        started, worst = time.monotonic(), 0.0

        def watched_long_enough() -> bool:
            nonlocal worst
            worst = max(worst, watcher.health().staleness)
            return time.monotonic() - started > 2.5 * 2.0

        wait_for(watched_long_enough, timeout=30, message="a quiet spell of 2.5 thresholds")
        assert worst < 2.0 and not watcher.health().stale
        # Proofs do not make new snapshots: a router re-indexes only when the content changes.
        assert table.snapshot() is first and first.staleness < 2.0
    assert "is stale" not in caplog.text


@pytest.mark.parametrize("name", ["progress_interval", "stale_after"])
@pytest.mark.parametrize("bad", [0, -1, "1", True, float("nan")], ids=repr)
def test_bad_staleness_settings_are_refused(name: str, bad: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{name} must be a positive number of seconds"):
        EndpointWatcher(Settings(), **{name: bad})


def test_the_collector_is_paused_while_any_listing_decodes_and_restored_after_the_last() -> None:
    pause, was = _CollectorPause(), gc.isenabled()
    try:
        gc.enable()
        with pause():
            with pause():  # a second listing at the same time
                assert not gc.isenabled()
            assert not gc.isenabled()  # the first still decodes
        assert gc.isenabled()
        gc.disable()  # the application's choice: kept
        with pytest.raises(RuntimeError), pause():
            raise RuntimeError("a listing that fails")
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
