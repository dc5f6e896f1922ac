"""Prometheus metrics, JSON logs and health (issue 8): the metrics' values on the memory
port and on real etcd (``store``); reconnects of a real cluster, the CLI's metrics and log
lines on real etcd."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from discovery import (
    Connection,
    EndpointWatcher,
    Metrics,
    NoEngineAvailableError,
    RegistrationState,
    Router,
    Settings,
    WatcherState,
    register_engine,
    watch_table,
)
from discovery._records.codec import encode
from discovery._records.record import EngineRecord

from .conftest import Store
from .helpers import cli_env, make_endpoint, raw_call, run_cli, wait_for


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_registration_metrics_follow_the_lifecycle(store: Store) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    reg = register_engine(make_endpoint(), engine_id="m1", ttl=3, metrics=metrics, **store.using())
    state = "discovery_registration_state"
    assert _value(registry, state, engine_id="m1", state="registered") == 1
    assert _value(registry, state, engine_id="m1", state="lost") == 0
    assert _value(registry, "discovery_lease_grants_total") == 1
    wait_for(
        lambda: (
            registry.get_sample_value("discovery_keepalive_age_seconds", {"engine_id": "m1"})
            is not None
        ),
        message="a keepalive",
    )
    assert _value(registry, "discovery_keepalive_age_seconds", engine_id="m1") < 3

    store.port.revoke(reg.lease_id)
    wait_for(
        lambda: _value(registry, "discovery_reregistrations_total") == 1, message="re-registration"
    )
    assert _value(registry, "discovery_lease_grants_total") == 2
    assert reg.state is RegistrationState.REGISTERED
    assert _value(registry, state, engine_id="m1", state="registered") == 1

    reg.close()
    assert _value(registry, "discovery_revoke_duration_seconds_count") == 1
    assert registry.get_sample_value(state, {"engine_id": "m1", "state": "registered"}) is None
    assert registry.get_sample_value("discovery_keepalive_age_seconds", {"engine_id": "m1"}) is None


def test_status_metrics_of_a_registration_and_a_table(store: Store) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    status = "discovery_registration_status"
    engines = "discovery_routing_engines"
    with watch_table(metrics=metrics, **store.using()) as table:
        reg = register_engine(
            make_endpoint(), engine_id="st", status="starting", metrics=metrics, **store.using()
        )
        assert _value(registry, status, engine_id="st", status="starting") == 1
        table.wait_until(lambda snap: "st" in snap, timeout=10)
        assert _value(registry, engines, selector="", status="starting") == 1
        assert _value(registry, engines, selector="", status="ready") == 0
        reg.drain(60)
        assert _value(registry, status, engine_id="st", status="draining") == 1
        assert _value(registry, status, engine_id="st", status="starting") == 0
        table.wait_until(lambda snap: snap["st"].status == "draining", timeout=10)
        assert _value(registry, engines, selector="", status="draining") == 1
        reg.close()
        assert registry.get_sample_value(status, {"engine_id": "st", "status": "draining"}) is None


def test_watcher_metrics_for_events_malformed_values_and_an_expired_lease(store: Store) -> None:
    registry = CollectorRegistry()
    prefix = store.settings.keyspace.prefix
    with watch_table(metrics=Metrics(registry), **store.using()) as table:
        assert _value(registry, "discovery_watcher_connected", prefix=prefix) == 1
        assert _value(registry, "discovery_routing_engines", selector="", status="ready") == 0
        # A registrar that dies: its record on a lease nobody keeps alive.
        doomed = EngineRecord(engine_id="doomed", endpoint=make_endpoint())
        store.port.create(prefix + "doomed", encode(doomed), store.port.grant(2))
        table.wait_until(lambda snap: "doomed" in snap, timeout=10)
        engines = "discovery_routing_engines"
        assert _value(registry, engines, selector="", status="ready") == 1
        assert _value(registry, engines, selector="", status="draining") == 0
        events = "discovery_watcher_events_total"
        # Counted just after the table applies the batch: waited for, not raced.
        wait_for(lambda: _value(registry, events, prefix=prefix, type="added") == 1)
        table.wait_until(lambda snap: "doomed" not in snap, timeout=2 + 2)
        wait_for(lambda: _value(registry, events, prefix=prefix, type="removed") == 1)
        junk = store.port.replace(prefix + "junk", b"\xff not json", 0).revision
        wait_for(
            lambda: _value(registry, "discovery_watcher_revision", prefix=prefix) == junk,
            message="the watcher at the junk's revision",
        )
        assert table.watcher.revision == junk
        assert _value(registry, "discovery_watcher_malformed_values_total", prefix=prefix) == 1
        assert _value(registry, "discovery_watcher_lag_revisions", prefix=prefix) == 0
        assert (
            _value(registry, "discovery_watcher_apply_duration_seconds_count", prefix=prefix) >= 2
        )


def test_reconnect_and_compaction_relist_metrics(etcd3) -> None:
    member = etcd3.members[0]
    lonely = Settings(endpoints=[member.client_url], namespace="metrics", dial_timeout=10)
    others = Settings(
        endpoints=[m.client_url for m in etcd3.members[1:]], namespace="metrics", dial_timeout=15
    )
    prefix = lonely.keyspace.prefix
    registry = CollectorRegistry()
    with (
        Connection(others) as conn,
        EndpointWatcher(lonely, heartbeat=1.0, metrics=Metrics(registry)) as watcher,
    ):
        member.stop(kill=True)
        wait_for(lambda: watcher.health().state is WatcherState.RECONNECTING, message="disconnect")
        assert _value(registry, "discovery_watcher_connected", prefix=prefix) == 0
        assert (
            _value(
                registry, "discovery_watcher_reconnects_total", prefix=prefix, cause="stream_error"
            )
            >= 1
        )
        for name in ("late", "later"):  # two revisions: the watcher's resume point goes
            record = EngineRecord(engine_id=name, endpoint=make_endpoint())
            raw_call(conn, lambda c, name=name, record=record: c.put(prefix + name, encode(record)))
        revision = raw_call(conn, lambda c: c.get_response(prefix + "later")).header.revision
        raw_call(conn, lambda c: c.compact(revision, physical=True))
        member.start()
        etcd3.wait_healthy(members=[member])
        wait_for(
            lambda: (
                _value(
                    registry, "discovery_watcher_relists_total", prefix=prefix, cause="compaction"
                )
                == 1
            ),
            timeout=15,
            message="relist",
        )
        wait_for(
            lambda: _value(registry, "discovery_watcher_connected", prefix=prefix) == 1,
            message="connected again",
        )
        assert (
            _value(
                registry, "discovery_watcher_reconnects_total", prefix=prefix, cause="compaction"
            )
            == 1
        )
        assert _value(registry, "discovery_watcher_events_total", prefix=prefix, type="added") == 2


def test_router_metrics(store: Store) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    with (
        register_engine(make_endpoint(1), engine_id="r1", **store.using()),
        watch_table(metrics=metrics, **store.using()) as table,
    ):
        table.wait_until(lambda snap: "r1" in snap, timeout=5)
        router = Router(table, policy="round_robin", metrics=metrics)
        handle = router.pick([1, 2, 3], max_tokens=10)
        assert _value(registry, "discovery_router_picks_total", policy="round_robin") == 1
        assert _value(registry, "discovery_router_in_flight", engine_id="r1") == 1
        handle.release()
        assert _value(registry, "discovery_router_in_flight", engine_id="r1") == 0
        with pytest.raises(NoEngineAvailableError):
            router.pick([1], max_tokens=10**9)
        assert _value(registry, "discovery_router_no_engine_total") == 1


_NAME = re.compile(r"discovery_[a-z][a-z0-9_]*")
_FORBIDDEN_LABELS = {"request_id", "prompt", "key", "lease", "lease_id", "revision", "address"}


def test_exposition_follows_prometheus_conventions(store: Store) -> None:
    """Valid names, _total counters, base units in seconds, bounded labels, help text."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    with (
        register_engine(make_endpoint(), engine_id="lint", metrics=metrics, **store.using()) as reg,
        watch_table(metrics=metrics, **store.using()) as table,
    ):
        table.wait_until(lambda snap: "lint" in snap, timeout=5)
        Router(table, metrics=metrics).pick([1] * 300, max_tokens=5).release()
        reg.update(labels={"a": "b"})
        table.wait_until(lambda snap: snap["lint"].labels == {"a": "b"}, timeout=5)
        text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    names = {family.name for family in families}
    for expected in (
        "discovery_registration_state",
        "discovery_watcher_events",
        "discovery_router_picks",
        "discovery_keepalive_age_seconds",
        "discovery_watcher_staleness_seconds",
        "discovery_watcher_stale",
    ):
        assert expected in names, expected
    for family in families:
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps, parsed as their own gauges
        assert _NAME.fullmatch(family.name), family.name
        assert family.documentation.strip(), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram" or "duration" in family.name or "age" in family.name:
            assert family.name.endswith("_seconds"), family.name
        label_names = {name for sample in family.samples for name in sample.labels}
        assert not label_names & _FORBIDDEN_LABELS, (family.name, label_names)
        series = {tuple(sorted(s.labels.items())) for s in family.samples}
        assert len(series) <= 40, (family.name, len(series))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serves_metrics(settings: Settings) -> None:
    port = _free_port()
    watch = subprocess.Popen(
        [sys.executable, "-m", "discovery", "watch", "--metrics-port", str(port)],
        env=cli_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def scrape() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    return r.read().decode()
            except OSError:
                return ""

        text = wait_for(
            lambda: "discovery_watcher_connected{" in scrape() and scrape(),
            message="metrics endpoint",
        )
        assert f'discovery_watcher_connected{{prefix="{settings.keyspace.prefix}"}} 1.0' in text
    finally:
        watch.terminate()
        watch.wait(10)


def test_json_log_lines(settings: Settings) -> None:
    result = run_cli(
        settings,
        "list",
        "--log-format",
        "json",
        "--log-level",
        "DEBUG",
        "--endpoints",
        "http://127.0.0.1:9",
        "--dial-timeout",
        "0.5",
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines, result.stderr
    records = [json.loads(line) for line in lines]  # every line, the last one included
    for record in records:
        assert set(record) >= {"time", "level", "logger", "message"}
    assert any(
        r["level"] == "WARNING" and r["logger"] == "discovery._etcd.connection" for r in records
    )
    assert records[-1]["level"] == "ERROR"
    assert records[-1]["message"].startswith("discovery list: etcd unavailable")
