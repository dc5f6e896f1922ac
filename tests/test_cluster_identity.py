"""A replaced etcd cluster (issue 43, item 1): its data wiped and the member started again
(a disaster rebuild: revision back to 1, the same cluster id or a new one), or an older
snapshot restored. Every watcher and registrar notices and starts over: the table is
replaced by what the new cluster holds (no ghosts, nothing lost), every live registration
writes its record again, each says so once. Real etcd members, really wiped."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from discovery import Connection, EndpointWatcher, Metrics, RoutingTable, Settings
from discovery._records.codec import encode
from discovery._records.record import EngineRecord
from discovery.testing.embedded import EtcdCluster

from .helpers import make_endpoint, raw_call, wait_for

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
