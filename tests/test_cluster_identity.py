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
)
from discovery._records.codec import encode
from discovery._records.record import EngineRecord
from discovery.testing.embedded import EtcdCluster

from .helpers import Registrar, make_endpoint, raw_call, run_cli, wait_for

# The table follows the new cluster within this: the watcher's stream notices the wipe
# when it reconnects (its member was down), then lists once.
_FOLLOWS_WITHIN = 15.0


def _value(engine_id: str, index: int = 0) -> bytes:
    return encode(EngineRecord(engine_id=engine_id, endpoint=make_endpoint(index)))


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
        raw_call(conn, lambda c: c.delete(settings.keyspace.key("filler")))
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
