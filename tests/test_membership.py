"""Clients that follow etcd membership changes (issue: ghost endpoints), against real etcd.

An operator replaces the members of a cluster one at a time, as etcd's runtime
reconfiguration has it (``member add``, start the new member, ``member remove``, stop the
old one: a quorum at every moment). With ``member_sync`` (the default) a connection
replaces its endpoints with the client URLs of etcd's member list, periodically and after
every failover; without it a client is blind once the last member it was given has left.
A member list is not followed when it comes from an etcd gRPC proxy or does not name the
URL it was read through (a load balancer): those addresses are the ones to keep.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

import pytest
from etcd3 import etcdrpc
from prometheus_client import CollectorRegistry

from discovery import (
    Connection,
    Metrics,
    RegistrationState,
    RoutingTable,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.embedded import EtcdCluster, EtcdMember

from .helpers import Registrar, TcpForwarder, WatchLog, get_kv, make_endpoint, wait_for
from .test_proxy import checked_proxy

TTL = 3
SYNC = 0.5  # member_sync_interval: short, so that the tests follow within seconds


def _settings(members: list[EtcdMember], namespace: str, **overrides: Any) -> Settings:
    urls = [m.client_url for m in members]
    return Settings(endpoints=urls, namespace=namespace, **{"dial_timeout": 10, **overrides})


def _not_followed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "not following etcd membership" in r.getMessage()
    ]


def test_registration_and_watcher_follow_every_member_replaced(
    etcd3: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's scenario: all three members replaced under a live registration and a
    watcher given the three original URLs; then an engine that only a new member knows."""
    cluster = etcd3
    caplog.set_level(logging.INFO, logger="discovery")
    original = _settings(cluster.members, "rotation", member_sync_interval=SYNC)
    registry = CollectorRegistry()
    with contextlib.ExitStack() as stack:
        reg = stack.enter_context(
            register_engine(
                make_endpoint(1),
                engine_id="steady",
                ttl=TTL,
                settings=original,
                metrics=Metrics(registry),
            )
        )
        log = WatchLog(original)
        stack.callback(log.stop)
        table = stack.enter_context(RoutingTable(log.watcher))
        log.wait("steady", "added")
        key = original.keyspace.key("steady")
        before = get_kv(cluster.endpoints, key)

        started = time.monotonic()
        for old in list(cluster.members):
            new = cluster.add_member()
            if cluster.leader() is old:
                # Removing the leader costs an election, longer than this short TTL allows
                # on a loaded machine; an operator moves leadership first, as etcd advises.
                cluster.move_leader(new)
            cluster.remove_member(old)
        assert time.monotonic() - started < 60

        rotated = time.time()
        current = cluster.endpoints
        for conn in (reg._conn, log.watcher._conn):
            wait_for(
                lambda conn=conn: set(conn.endpoints) == set(current),
                timeout=5,
                message="the connection to know the new members only",
            )

        # An engine only a new member knows reaches the watcher given the old URLs.
        newest = _settings(cluster.members[-1:], "rotation")
        reference = WatchLog(newest)
        stack.callback(reference.stop)
        late = Registrar(newest, "late", ttl=TTL)
        stack.callback(late.stop)
        written, _ = reference.wait("late", "added", timeout=30)
        arrived, _ = log.wait("late", "added", timeout=30)
        assert arrived - written <= 1.0, f"added {arrived - written:.2f} s after etcd had it"
        late.signal(signal.SIGKILL)
        killed = time.monotonic()
        gone, _ = log.wait("late", "removed", timeout=TTL + 10)
        assert gone - killed <= TTL + 1, f"removed {gone - killed:.2f} s after the SIGKILL"

        # Never absent, once a lease kept alive on removed members only would have expired:
        # a key deleted and written again has a new create revision, and this one still has
        # the first write's, on the first lease.
        wait_for(
            lambda: (
                (last := reg.health().last_keepalive) is not None
                and last.timestamp() > rotated + TTL + 1
            ),
            timeout=TTL + 10,
            message="a keepalive answered more than a TTL after the rotation",
        )
        after = get_kv(current, key)
        assert after is not None
        assert (after["create_revision"], after["lease"]) == (
            before["create_revision"],
            before["lease"],
        )
        assert reg.state is RegistrationState.REGISTERED and reg.health().losses == 0
        assert log.kinds("steady") == ["added"] and "steady" in table

    assert registry.get_sample_value("discovery_etcd_endpoints") == 3
    for change in ("added", "removed"):
        counted = registry.get_sample_value(
            "discovery_etcd_endpoint_changes_total", {"change": change}
        )
        assert counted is not None and counted >= 3, change
    changes = [r for r in caplog.records if "etcd membership changed" in r.getMessage()]
    assert changes and {r.levelno for r in changes} == {logging.INFO}


def test_without_member_sync_a_replaced_member_leaves_clients_blind(etcd3: EtcdCluster) -> None:
    """The bug, reproduced in one step: clients given one member, which is replaced."""
    cluster = etcd3
    first = cluster.members[0]
    # dial_timeout: closing retries the revoke that long, and etcd is out of reach.
    pinned = _settings([first], "blind", member_sync=False, dial_timeout=1)
    with (
        register_engine(make_endpoint(1), engine_id="pinned", ttl=TTL, settings=pinned) as reg,
        watch_table(pinned, stale_after=2) as table,
    ):
        table.wait_until(lambda snap: "pinned" in snap, timeout=10)
        replacement = cluster.add_member()
        cluster.remove_member(first)
        newcomer = _settings([replacement], "blind")
        with register_engine(make_endpoint(2), engine_id="newcomer", ttl=TTL, settings=newcomer):
            wait_for(lambda: table.watcher.health().stale, timeout=15, message="a stale watcher")
            # Registered after the watcher's only member left: it cannot have seen it.
            assert "newcomer" not in table
            wait_for(lambda: reg.state is RegistrationState.LOST, timeout=TTL + 10)
            wait_for(
                lambda: get_kv(cluster.endpoints, pinned.keyspace.key("pinned")) is None,
                timeout=TTL + 10,
                message="the pinned record to expire",
            )
        assert table.watcher._conn.endpoints == reg._conn.endpoints == (first.client_url,)


def test_a_failed_member_list_read_keeps_the_endpoints(etcd3: EtcdCluster) -> None:
    """A member list that cannot be read changes nothing; the next one read is followed."""
    cluster = etcd3
    settings = _settings(cluster.members, "kept", member_sync_interval=0)  # failovers only
    with Connection(settings) as conn:
        conn.call(lambda: conn.replace("/k", b"v", 0))
        in_use = conn.member_in_use
        gone = next(m for m in cluster.members if not m.client_url.endswith(in_use))
        cluster.remove_member(gone)
        survivors = list(cluster.members)
        for member in survivors:
            member.stop(kill=True)
        conn._refresh_members()
        assert conn.endpoints == settings.endpoints  # the removed member too: nothing newer
        for member in survivors:
            member.start()
        cluster.wait_healthy()
        wait_for(
            lambda: conn._refresh_members() or set(conn.endpoints) == set(cluster.endpoints),
            timeout=10,
            message="the member list followed",
        )
        assert conn.call(lambda: conn.get("/k")).value == b"v"


def test_a_refresh_that_meets_a_removed_member_asks_another_at_once(etcd3: EtcdCluster) -> None:
    """An idle connection (no call of its own fails over) whose member was removed: its
    refresh asks another member at once. It used to bench the member for 5 s and return,
    so the next refresh, 5 s later, asked the same removed member again, and so on: the
    connection never learned the new members and went blind when the last one it knew was
    replaced (the failure catalogue's member-rotation scenario, on its checker)."""
    cluster = etcd3
    settings = _settings(cluster.members, "idle", member_sync_interval=0)  # refreshed here
    with Connection(settings) as conn:
        conn.call(lambda: conn.replace("/k", b"v", 0))
        in_use = conn.member_in_use
        replaced = next(m for m in cluster.members if m.client_url.endswith(in_use))
        cluster.add_member()
        cluster.remove_member(replaced)  # and stopped: it refuses connections
        conn._refresh_members()  # what the sync thread runs, periodically
        assert set(conn.endpoints) == set(cluster.endpoints)
        assert conn.member_in_use != in_use


def test_a_stub_left_on_a_dropped_member_is_built_again(etcd3: EtcdCluster) -> None:
    """Following the membership closes a removed member's channel. A call racing that can
    leave a stub on the closed channel in the client's cache: the call that meets it fails
    ("closed channel"), transiently, and its retry works on a listed member."""
    settings = _settings(etcd3.members, "dropped", member_sync=False)
    with Connection(settings) as conn:
        conn.call(lambda: conn.replace("/k", b"v", 0))
        client = conn._current()
        stale = client.kvstub  # cached, bound to the member in use
        in_use = conn.member_in_use
        client.replace_members([url for url in conn.endpoints if not url.endswith(in_use)])
        client._stubs["kvstub"] = stale  # what the race leaves behind
        assert conn.call(lambda: conn.get("/k"), timeout=3).value == b"v"
        assert conn.member_in_use != in_use


def _member(member_id: int, *urls: str, learner: bool = False) -> etcdrpc.Member:
    """A member as etcd's MemberList sends it; ``isLearner`` is field 5 on the wire, newer
    than python3-etcd3's stubs."""
    wire = etcdrpc.Member(ID=member_id, name=f"m{member_id}", clientURLs=urls).SerializeToString()
    return etcdrpc.Member.FromString(wire + (b"\x28\x01" if learner else b""))


def test_what_a_member_list_gives_and_when_it_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    """The follow rule on member lists etcd can send: nothing usable keeps the endpoints."""
    configured = ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    with Connection(Settings(endpoints=configured, member_sync_interval=0)) as conn:
        client = conn._current()  # built without a call: nothing is dialled here
        unstarted = etcdrpc.Member(ID=9, peerURLs=["http://10.0.0.9:2380"])  # no name, no URLs
        for members in (
            [],
            [unstarted],
            [_member(7, "http://10.0.0.7:2379", learner=True), unstarted],
            [_member(8, "https://10.0.0.8:2379", "unix://etcd.sock")],  # not this scheme
        ):
            conn._follow(client, "10.0.0.1:2379", members)
            assert conn.endpoints == configured
        assert not _not_followed(caplog)

        conn._follow(
            client,
            "10.0.0.1:2379",
            [
                _member(1, "http://10.0.0.1:2379", "10.0.0.1:2379"),  # the same URL twice
                _member(3, "http://10.0.0.3:2379"),
                _member(7, "http://10.0.0.7:2379", learner=True),
                unstarted,
            ],
        )
        assert conn.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.3:2379")
        assert set(client.endpoints) == {"10.0.0.1:2379", "10.0.0.3:2379"}


def test_member_sync_keeps_etcd_grpc_proxies(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy's member list names itself alone (id 0): following it would drop the other."""
    with checked_proxy(etcd.endpoints) as one, checked_proxy(etcd.endpoints) as other:
        proxies = (one.client_url, other.client_url)
        with Connection(Settings(endpoints=proxies, member_sync_interval=0)) as conn:
            conn.call(lambda: conn.replace("/k", b"v", 0))
            conn._refresh_members()
            assert conn.endpoints == proxies
            assert conn.call(lambda: conn.get("/k")).value == b"v"
    (warned,) = _not_followed(caplog)
    assert "etcd gRPC proxy" in warned and "DISCOVERY_MEMBER_SYNC=0" in warned


def test_member_sync_keeps_a_load_balancer_address(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A member list read through an address it does not name is not followed."""
    host, port = etcd.endpoints[0].rsplit("//", 1)[1].split(":")
    with TcpForwarder((host, int(port))) as balancer:
        settings = Settings(endpoints=[balancer.endpoint], member_sync_interval=0)
        with Connection(settings) as conn:
            conn.call(lambda: conn.replace("/k", b"v", 0))
            conn._refresh_members()
            conn._refresh_members()
            assert conn.endpoints == (balancer.endpoint,)
            assert conn.call(lambda: conn.get("/k")).value == b"v"
    (warned,) = _not_followed(caplog)  # once per connection, not per refresh
    assert "does not name it" in warned and etcd.endpoints[0] in warned
