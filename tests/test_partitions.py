"""Network partitions: a member cut off from the other two while clients still reach it.

Each test runs a 3-member cluster in network namespaces (``netns_etcd3``: skipped, with the
reason, where namespaces cannot be built) and cuts one member's peer link. A reference
watcher on the majority timestamps what the cluster really did.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    Connection,
    EndpointEvent,
    EndpointWatcher,
    EtcdUnavailableError,
    EventType,
    Metrics,
    RegistrationState,
    RoutingTable,
    Settings,
    WatcherState,
    register_engine,
)
from discovery._records.codec import encode
from discovery._records.record import EngineRecord
from discovery.testing.embedded import EtcdMember
from discovery.testing.embedded_netns import PartitionableCluster

from .helpers import (
    Registrar,
    connected_member,
    etcdctl,
    get_kv,
    make_endpoint,
    raw_call,
    wait_for,
)

TTL = 3
# etcd's default election timeout, which the fixture's members use.
ELECTION = 1.0
# A partitioned member notices within 2 election timeouts that it has no leader; etcd
# ends its leader-required streams 2-3 election timeouts later.
NOTICED = 5 * ELECTION


class Timeline:
    """When each (type, engine) event arrived, from a watcher callback."""

    def __init__(self) -> None:
        self._at: dict[tuple[EventType, str], float] = {}
        self._lock = threading.Lock()

    def __call__(self, event: EndpointEvent) -> None:
        with self._lock:
            self._at.setdefault((event.type, event.engine_id), time.monotonic())

    def at(self, kind: EventType, engine_id: str) -> float | None:
        with self._lock:
            return self._at.get((kind, engine_id))


def _settings(members: list[EtcdMember], namespace: str) -> Settings:
    return Settings(endpoints=[m.client_url for m in members], namespace=namespace, dial_timeout=10)


def _majority_content(majority: Settings) -> dict[str, bytes]:
    """``etcdctl get --prefix`` on the majority: engine id -> value."""
    result = wait_for(
        lambda: (
            (r := etcdctl(majority.endpoints, "get", "--prefix", majority.keyspace.prefix, "-w",
                          "json")).returncode == 0 and r
        ),
        timeout=15,
        message="etcdctl get --prefix on the majority",
    )  # fmt: skip
    kvs = json.loads(result.stdout).get("kvs") or []
    return {
        base64.b64decode(kv["key"]).decode().rsplit("/", 1)[1]: base64.b64decode(kv["value"])
        for kv in kvs
    }


def _table_content(table: RoutingTable) -> dict[str, bytes]:
    return {engine_id: encode(record) for engine_id, record in table.snapshot().items()}


def _raft_term(cluster: PartitionableCluster, member: EtcdMember) -> int:
    status = cluster.etcdctl("endpoint", "status", "-w", "json", endpoints=[member])
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)[0]["Status"]["raftTerm"]


def _put(conn: Connection, settings: Settings, engine_id: str, index: int) -> None:
    record = EngineRecord(engine_id=engine_id, endpoint=make_endpoint(index))
    raw_call(conn, lambda c: c.put(settings.keyspace.key(engine_id), encode(record)))


def _stale_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]


def test_watcher_on_a_cut_member_follows_the_majority(
    netns_etcd3: PartitionableCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's scenario: the watcher's member is cut, an engine dies, another starts."""
    cluster = netns_etcd3
    caplog.set_level(logging.INFO, logger="discovery")
    namespace = "cut-watcher"
    reference, seen = Timeline(), Timeline()
    with contextlib.ExitStack() as stack:
        watcher = stack.enter_context(EndpointWatcher(_settings(cluster.members, namespace)))
        table = stack.enter_context(RoutingTable(watcher))
        cut = connected_member(cluster, watcher._conn)
        majority_members = [m for m in cluster.members if m is not cut]
        if cluster.leader() is cut:  # a follower: the majority keeps its leader
            cluster.move_leader(majority_members[0])
        majority = _settings(majority_members, namespace)
        truth = stack.enter_context(EndpointWatcher(majority))
        truth.subscribe(reference)
        watcher.subscribe(seen)
        doomed = Registrar(majority, "doomed", ttl=TTL)
        stack.callback(doomed.stop)
        table.wait_until(lambda snap: "doomed" in snap, timeout=20)
        with cluster.partitioned(cut):
            wait_for(lambda: not cluster.has_leader(cut), timeout=15, message="leader lost")
            doomed.process.kill()  # its key goes with its lease, on the majority
            stack.callback(Registrar(majority, "newcomer", ttl=TTL).stop)
            for kind, engine in ((EventType.REMOVED, "doomed"), (EventType.ADDED, "newcomer")):
                changed = wait_for(
                    lambda kind=kind, engine=engine: reference.at(kind, engine),
                    timeout=TTL + 20,
                    message=f"the majority: {kind} {engine}",
                )
                bound = changed + TTL + 3
                wait_for(
                    lambda kind=kind, engine=engine, bound=bound: (
                        seen.at(kind, engine) or time.monotonic() > bound + 5
                    ),
                    timeout=TTL + 30,
                    message=f"the pinned watcher: {kind} {engine}",
                )
                arrived = seen.at(kind, engine)
                late = "never" if arrived is None else f"{arrived - changed:.1f} s after"
                assert arrived is not None and arrived <= bound, (
                    f"{kind} {engine} reached the watcher on the cut member {late} the "
                    f"majority (bound: {TTL + 3} s); {watcher.health()}"
                )
            assert connected_member(cluster, watcher._conn) is not cut
            assert not watcher.health().stale
        cluster.wait_healthy(members=[cut])
        wait_for(
            lambda: _table_content(table) == _majority_content(majority),
            timeout=15,
            message="the table == the majority's etcdctl get --prefix",
        )
        assert watcher.health().state is WatcherState.CONNECTED
        assert not _stale_logs(caplog)


def test_registration_on_a_cut_leader_keeps_its_record_on_the_majority(
    netns_etcd3: PartitionableCluster,
) -> None:
    """Keepalives move to a member with a leader within the TTL: the key is never deleted."""
    cluster = netns_etcd3
    pinned = _settings(cluster.members, "cut-leader")
    reference = Timeline()
    with contextlib.ExitStack() as stack:
        registration = stack.enter_context(
            register_engine(make_endpoint(1), engine_id="pinned", ttl=TTL, settings=pinned)
        )
        cut = connected_member(cluster, registration._conn)
        cluster.move_leader(cut)
        majority = _settings([m for m in cluster.members if m is not cut], "cut-leader")
        truth = stack.enter_context(EndpointWatcher(majority))
        truth.subscribe(reference)
        wait_for(lambda: reference.at(EventType.ADDED, "pinned"), message="the record")
        lease = registration.lease_id
        with cluster.partitioned(cut):
            cut_at = time.time()
            wait_for(lambda: not cluster.has_leader(cut), timeout=15, message="leader lost")
            # Without keepalives the majority expires the lease within TTL + 2 election
            # timeouts of the cut (a new leader extends leases by one): watch past that,
            # until a keepalive was answered (by the majority) after the old lease's end.
            wait_for(
                lambda: (
                    time.time() - cut_at > 2 * TTL + 2 * ELECTION
                    and (last := registration.health().last_keepalive) is not None
                    and last.timestamp() > cut_at + TTL
                ),
                timeout=6 * TTL + 20,
                message="keepalives answered by the majority after the old lease would expire",
            )
            assert reference.at(EventType.REMOVED, "pinned") is None, "record gone on majority"
            kv = get_kv(majority.endpoints, pinned.keyspace.key("pinned"))
            assert kv is not None and kv["lease"] == lease
            health = registration.health()
            assert health.state is RegistrationState.REGISTERED
            assert health.losses == 0 and health.registrations == 1


def test_a_watcher_whose_only_member_is_cut_says_stale_and_keeps_its_table(
    netns_etcd3: PartitionableCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Fail-static: the last table is served, and health, metrics, snapshot and logs say so."""
    cluster = netns_etcd3
    caplog.set_level(logging.INFO, logger="discovery")
    leader = cluster.leader()
    cut = next(m for m in cluster.members if m is not leader)
    majority = _settings([m for m in cluster.members if m is not cut], "only-cut")
    # A client that knows only that member (member sync off: it would follow the others).
    only = dataclasses.replace(_settings([cut], "only-cut"), member_sync=False)
    registry = CollectorRegistry()
    with (
        Connection(majority) as writer,
        EndpointWatcher(only, metrics=Metrics(registry)) as watcher,
        RoutingTable(watcher) as table,
    ):
        for i in range(3):
            _put(writer, majority, f"e{i}", i)
        table.wait_until(lambda snap: len(snap) == 3, timeout=15)
        before = _table_content(table)
        threshold = watcher.health().stale_after
        with cluster.partitioned(cut):
            writer.call(lambda: writer.delete(majority.keyspace.key("e0")), timeout=15)
            _put(writer, majority, "e3", 3)
            wait_for(
                lambda: watcher.health().stale and _stale_logs(caplog),
                timeout=NOTICED + threshold + 10,
                message="the watcher to call itself stale, and log it",
            )
            health = watcher.health()
            assert health.staleness > threshold
            assert health.state is WatcherState.RECONNECTING
            assert "no leader" in (health.last_error or "")
            snapshot = table.snapshot()
            assert snapshot.stale and snapshot.staleness > threshold
            assert _table_content(table) == before  # fail-static: the last table, unchanged
            # List reads are linearizable: the cut member refuses them, it never lists stale data.
            with (
                Connection(dataclasses.replace(only, request_timeout=2)) as direct,
                pytest.raises(EtcdUnavailableError),
            ):
                direct.list_prefix(only.keyspace.prefix, timeout=0)
            labels = {"prefix": only.keyspace.prefix}
            assert registry.get_sample_value("discovery_watcher_stale", labels) == 1
            staleness = registry.get_sample_value("discovery_watcher_staleness_seconds", labels)
            assert staleness is not None and staleness > threshold
        cluster.wait_healthy(members=[cut])
        wait_for(
            lambda: _table_content(table) == _majority_content(majority),
            timeout=20,
            message="the table == the majority after the heal",
        )
        wait_for(lambda: not watcher.health().stale, message="current again")
        assert not table.snapshot().stale
        assert registry.get_sample_value("discovery_watcher_stale", labels) == 0
        assert any("current again" in r.getMessage() for r in caplog.records)
        assert watcher.health().state is WatcherState.CONNECTED  # its loop lives on


def test_a_cut_shorter_than_the_election_timeout_changes_nothing(
    netns_etcd3: PartitionableCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """No election, so no leader is lost: no reconnect, no lost lease, nothing stale."""
    cluster = netns_etcd3
    caplog.set_level(logging.INFO, logger="discovery")
    pinned = _settings(cluster.members, "short-cut")
    with (
        Connection(pinned) as conn,  # one member for the watcher and the registration
        EndpointWatcher(connection=conn) as watcher,
        RoutingTable(watcher) as table,
        register_engine(make_endpoint(1), engine_id="r", ttl=TTL, connection=conn) as registration,
    ):
        member = connected_member(cluster, conn)
        cluster.move_leader(member)  # the leader: its cut is the one that could cost an election
        table.wait_until(lambda snap: "r" in snap, timeout=10)
        term = _raft_term(cluster, member)
        with cluster.partitioned(member):
            time.sleep(0.3 * ELECTION)  # the fault's length, not a synchronisation
        _put(conn, pinned, "after", 1)
        table.wait_until(lambda snap: "after" in snap, timeout=10)
        assert _raft_term(cluster, member) == term, "the short cut cost an election"
        health = watcher.health()
        assert health.reconnects == 0 and not health.stale, health
        assert registration.health().losses == 0
        assert not _stale_logs(caplog)
