"""deploy/prometheus/: the alert and recording rules, unit-tested by promtool and proven on a
real Prometheus; deploy/grafana/discovery.json's queries run against it.

* ``promtool check rules`` and ``promtool test rules`` (discovery-rules.test.yml: simulated
  time, production ``for:`` durations) pass; every rule has a unit test that fires it and
  one where it stays quiet; the unit tests have teeth.
* A real Prometheus (Debian's binary; tests/prometheus.py) scrapes ``discovery register``,
  ``discovery launch``, ``discovery watch`` and a router process, every second, with the
  same rules in which every duration is read in seconds instead of minutes
  (``tests.prometheus.shorten``: ``for: 1m`` -> ``for: 1s``, ``[15m]`` -> ``[15s]``). The
  failures behind the alerts are caused for real:

  - the watcher's only etcd member cut off in a network namespace: DiscoveryWatcherStale
    goes pending, fires, and resolves after the heal;
  - the registrar's lease revoked from outside again and again:
    DiscoveryRegistrationsFlapping fires, and resolves once that stops;
  - an engine gone silent under ``discovery launch``: DiscoveryEngineStalled fires, and
    every query of the Grafana dashboard returns series.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from discovery import Settings
from discovery.testing.embedded import EtcdCluster, _free_ports
from discovery.testing.embedded_netns import PartitionableCluster

from .helpers import ChildLog, Registrar, cli_env, etcdctl, get_kv, wait_for
from .prometheus import (
    PrometheusServer,
    prometheus_problem,
    prometheus_server,
    seconds,
    shorten,
    stop_process,
)

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "discovery-rules.yml"
RULES_TEST = PROMETHEUS_DIR / "discovery-rules.test.yml"


def rules(text: str | None = None) -> list[dict]:
    groups = yaml.safe_load(RULES.read_text() if text is None else text)["groups"]
    return [rule for group in groups for rule in group["rules"]]


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


# -- promtool: the production rules, simulated time ------------------------------------------


@pytest.mark.prometheus
def test_the_rules_pass_promtool_check() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


@pytest.mark.prometheus
def test_the_kubernetes_rules_and_the_compose_config_pass_promtool(tmp_path: Path) -> None:
    manifest = REPO / "deploy" / "k8s" / "monitoring" / "prometheus-rule.yaml"
    spec = tmp_path / "from-prometheusrule.yml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(manifest.read_text())["spec"]))
    checked = promtool("check", "rules", str(spec))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load((PROMETHEUS_DIR / "compose-prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/discovery-rules.yml"]  # the mount
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.prometheus
def test_every_rule_passes_its_promtool_unit_tests() -> None:
    tested = promtool("test", "rules", RULES_TEST.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout + tested.stderr


@pytest.mark.prometheus
def test_the_unit_tests_have_teeth(tmp_path: Path) -> None:
    """A rule changed by a little (a threshold, a ``for:``) fails its unit tests."""
    text = RULES.read_text()
    for old, new in (
        ("_total[15m]) > 3", "_total[15m]) > 4"),  # DiscoveryRegistrationsFlapping
        ("discovery_engine_stalled == 1\n        for: 5m", "discovery_engine_stalled == 1"),
        ("{{ $labels.engine_id }} has been paused", "{{ $labels.instance }} has been paused"),
        ("max by (job, selector, status)", "sum by (job, selector, status)"),
    ):
        assert old in text, old
        (tmp_path / RULES.name).write_text(text.replace(old, new))
        (tmp_path / RULES_TEST.name).write_text(RULES_TEST.read_text())
        broken = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
        assert broken.returncode != 0, f"the unit tests pass with {new!r}"


def test_every_rule_has_unit_tests_and_says_what_to_do() -> None:
    """Each alert fires in some unit test and stays quiet in another; each recording rule's
    value is checked; each alert has a severity, a summary and a description."""
    unit = yaml.safe_load(RULES_TEST.read_text())
    assert unit["rule_files"] == [RULES.name]
    fired, quiet, exprs = set(), set(), []
    for case in unit["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
            for alert in check["exp_alerts"]:
                assert set(alert["exp_annotations"]) == {"summary", "description"}, alert
        exprs += [check["expr"] for check in case.get("promql_expr_test", [])]
    alerts = [r for r in rules() if "alert" in r]
    records = [r["record"] for r in rules() if "record" in r]
    assert len(alerts) >= 15 and len(records) >= 3
    names = {r["alert"] for r in alerts}
    assert names - fired == set(), "alerts no unit test fires"
    assert names - quiet == set(), "alerts no unit test keeps quiet"
    assert fired | quiet <= names, "unit tests of alerts that do not exist"
    assert [r for r in records if not any(r in expr for expr in exprs)] == []
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert set(alert["annotations"]) == {"summary", "description"}, alert["alert"]
        assert alert["alert"].startswith("Discovery"), alert["alert"]
        assert len(alert["annotations"]["description"]) > 150, alert["alert"]
        if "for" in alert:
            assert seconds(alert["for"]) >= 60, f"{alert['alert']}: for: shorter than 1m"


def test_the_live_tests_shorten_every_duration_and_nothing_else() -> None:
    """``shorten`` divides every ``for:`` and range duration by 60, and changes nothing else."""
    text = RULES.read_text()
    short, changed = shorten(text)
    ranges = re.findall(r"\[\d+[smhdwy]\]", text)
    fors = re.findall(r"^\s*for:", text, re.M)
    assert changed == len(ranges) + len(fors) > 10
    original, shortened = rules(), rules(short)
    assert len(original) == len(shortened)
    for before, after in zip(original, shortened, strict=True):
        if "for" in before:
            assert seconds(after["for"]) * 60 == seconds(before["for"])
        durations = re.findall(r"\[(\w+)\]", before["expr"])
        assert [seconds(d) / 60 for d in durations] == [
            seconds(d) for d in re.findall(r"\[(\w+)\]", after["expr"])
        ]
        assert re.sub(r"\[\w+\]", "[]", before["expr"]) == re.sub(r"\[\w+\]", "[]", after["expr"])
        assert {k: v for k, v in before.items() if k not in ("for", "expr")} == {
            k: v for k, v in after.items() if k not in ("for", "expr")
        }
    assert shorten("expr: rate(x[90s]) > 0\nfor: 2h\n") == (
        "expr: rate(x[1500ms]) > 0\nfor: 120s\n",
        2,
    )


# -- the Grafana dashboard, offline ------------------------------------------------------------

DASHBOARD = REPO / "deploy" / "grafana" / "discovery.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
# Exported, and deliberately not on the dashboard: a close-time histogram and figures of
# rare events that the alerts and the staleness panels already cover.
OFF_DASHBOARD = {
    "discovery_etcd_endpoint_changes_total",  # rare; "etcd endpoints known" shows them
    "discovery_registrar_cluster_changes_total",  # rare (a wiped or restored etcd); WARNING
    "discovery_revoke_duration_seconds_bucket",
    "discovery_revoke_duration_seconds_count",
    "discovery_revoke_duration_seconds_sum",
    "discovery_router_unknown_policy_total",  # rare; the router logs each value once
    "discovery_watcher_apply_duration_seconds_count",
    "discovery_watcher_apply_duration_seconds_sum",
    "discovery_watcher_relists_total",
    "discovery_watcher_revision",
}
# A metric name, not part of a recorded one (level:metric:operations).
_METRIC = re.compile(r"(?<![\w:])(discovery_[a-z0-9_]+)(?![\w:])")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of the dashboard."""
    return [
        (panel["title"], target["refId"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def live_expr(expr: str, board: dict, rate_interval: str = "5s") -> str:
    """``expr`` as Grafana sends it with every variable on "All" and ``$__rate_interval``
    at ``rate_interval``."""
    values = {"__rate_interval": rate_interval}
    for variable in board["templating"]["list"]:
        if variable.get("includeAll"):
            values[variable["name"]] = variable["allValue"]
    for name, value in values.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, expr
    return expr


def exported_metric_names() -> set[str]:
    """Every sample name a ``Metrics`` registry can expose, from its families (a labelled
    family is listed even before it has a child)."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from discovery import Metrics  # noqa: PLC0415

    registry = CollectorRegistry()
    metrics = Metrics(registry)  # held: its live collector reads it through a weak reference
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    del metrics
    return names


def unknown_metrics(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in _METRIC.findall(expr)} - exported_metric_names()


def test_the_dashboard_has_what_grafanas_importer_needs() -> None:
    board = dashboard()
    assert board["uid"] == "discovery-fleet" and board["title"]
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["id"] is None  # a new dashboard on import
    inputs = {i["name"]: i for i in board["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"
    for name in ("job", "selector"):
        assert variables[name]["datasource"] == DATASOURCE, name
    panels = board["panels"]
    assert len(panels) >= 20
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    kinds = {p["type"] for p in panels}
    assert kinds <= {"row", "stat", "timeseries"}
    required = {r["id"] for r in board["__requires"] if r["type"] == "panel"}
    assert kinds - {"row"} <= required
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    used = {m for _, _, expr in panel_queries(board) for m in re.findall(r"\$\{?(\w+)", expr)}
    assert used <= set(variables) | GRAFANA_VARIABLES, used
    # Every query reads as PromQL once the variables are set (promtool is not needed:
    # the live test runs them all on a real Prometheus).
    for title, ref, expr in panel_queries(board):
        assert expr.count("(") == expr.count(")"), (title, ref)


def test_every_dashboard_and_rule_metric_is_one_the_package_exports() -> None:
    exprs = [expr for _, _, expr in panel_queries(dashboard())]
    assert unknown_metrics(exprs) == set()
    assert unknown_metrics([rule["expr"] for rule in rules()]) == set()
    # The check sees a misspelt name; and the dashboard shows every metric but a few.
    assert unknown_metrics(["rate(discovery_router_pickz_total[5m])"]) == {
        "discovery_router_pickz_total"
    }
    shown = {name for expr in exprs for name in _METRIC.findall(expr)}
    assert exported_metric_names() - shown == OFF_DASHBOARD


# -- a real Prometheus: the failures behind the alerts, caused for real -------------------------

JOBS = ("discovery-registrar", "discovery-launcher", "discovery-watcher", "discovery-router")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One server for the module: the production rules with every duration read in seconds
    (``shorten``), scraping one port per job every second; each test starts the processes
    behind the ports it uses, and stops them."""
    if prometheus_problem():
        pytest.skip(prometheus_problem())
    short, changed = shorten(RULES.read_text())
    assert changed
    rules_file = tmp_path_factory.mktemp("rules") / "discovery-rules-in-seconds.yml"
    rules_file.write_text(short)
    checked = promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ports = dict(zip(JOBS, _free_ports(len(JOBS)), strict=True))
    targets = {job: [f"127.0.0.1:{port}"] for job, port in ports.items()}
    with prometheus_server([rules_file], targets) as server:
        loaded = server.rule_names()
        assert set(loaded) == {r.get("alert") or r["record"] for r in rules()}
        yield Prometheus(server, ports)


class Prometheus:
    """The server and the metrics port of each job."""

    def __init__(self, server: PrometheusServer, ports: dict[str, int]) -> None:
        self.server = server
        self.ports = ports

    def port(self, job: str) -> int:
        return self.ports[job]

    def instance(self, job: str) -> str:
        return f"127.0.0.1:{self.ports[job]}"

    def value(self, expr: str) -> float | None:
        """The value of a query returning at most one series, None when it returns none."""
        result = self.server.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def was(self, alert: str, state: str, window: str = "5m") -> bool:
        """Whether ``alert`` was in ``state`` (pending, firing) in the last ``window``
        (Prometheus records it in its ALERTS series)."""
        return bool(
            self.server.query(
                f'max_over_time(ALERTS{{alertname="{alert}", alertstate="{state}"}}[{window}])'
            )
        )

    def wait_state(self, alert: str, state: str, timeout: float) -> float:
        """Wait until ``alert`` is ``state`` (firing, pending, inactive); the seconds it took."""
        started = time.monotonic()
        wait_for(
            lambda: self.server.state(alert) == state,
            timeout=timeout,
            message=f"{alert} {state}: {self.server.alerts(alert)}",
            interval=0.1,
        )
        return time.monotonic() - started


def _python(*args: str) -> list[str]:
    return [sys.executable, "-X", "faulthandler", *args]


def _spawn(command: list[str], settings: Settings, log: ChildLog) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command, env=cli_env(settings), stdout=log.file, stderr=subprocess.STDOUT, cwd=REPO
    )


@pytest.mark.prometheus
def test_watcher_stale_alert_fires_when_its_only_member_is_cut_off_and_resolves_after_the_heal(
    netns_etcd3: PartitionableCluster, prometheus: Prometheus
) -> None:
    cluster = netns_etcd3
    cut, *majority = cluster.members
    if cluster.leader() is cut:  # a follower: the majority keeps its leader, the test its pace
        cluster.move_leader(majority[0])
    settings = Settings(endpoints=[cut.client_url], namespace="alert-stale", dial_timeout=10)
    job = "discovery-watcher"
    port = str(prometheus.port(job))
    log = ChildLog()
    # It knows only that member (member sync would follow the others: no staleness then).
    watch = _python("-m", "discovery", "watch", "--no-member-sync", "--metrics-port", port)
    watcher = _spawn(watch, settings, log)
    stale = f'discovery_watcher_stale{{job="{job}"}}'
    try:
        wait_for(lambda: prometheus.value(stale) == 0, 30, f"{stale} scraped", interval=0.2)
        assert prometheus.server.state("DiscoveryWatcherStale") == "inactive"
        with cluster.partitioned(cut):
            took = prometheus.wait_state("DiscoveryWatcherStale", "firing", timeout=60)
            (alert,) = prometheus.server.alerts("DiscoveryWatcherStale")
            assert alert["labels"] == {
                "alertname": "DiscoveryWatcherStale",
                "severity": "critical",
                "job": job,
                "instance": prometheus.instance(job),
                "prefix": settings.keyspace.prefix,
            }
            assert settings.keyspace.prefix in alert["annotations"]["summary"]
            assert "No etcd member with a leader" in alert["annotations"]["description"]
            assert float(alert["value"]) > 4  # the staleness, past stale_after (4 s)
            assert prometheus.was("DiscoveryWatcherStale", "pending"), "never pending first"
            print(f"DiscoveryWatcherStale firing {took:.1f} s after the cut")
        healed = prometheus.wait_state("DiscoveryWatcherStale", "inactive", timeout=60)
        assert prometheus.value(stale) == 0
        print(f"DiscoveryWatcherStale resolved {healed:.1f} s after the heal")
    finally:
        stop_process(watcher)
        print(log.read()[-3000:])
        log.close()


def _lease(settings: Settings, engine_id: str) -> int | None:
    kv = get_kv(settings.endpoints, settings.keyspace.key(engine_id))
    return kv["lease"] if kv else None


@pytest.mark.prometheus
def test_flapping_alert_fires_when_a_lease_keeps_being_revoked_and_resolves_when_it_stops(
    settings: Settings, prometheus: Prometheus
) -> None:
    job = "discovery-registrar"
    port = str(prometheus.port(job))
    registrar = Registrar(settings, "flappy", ttl=3, extra=("--metrics-port", port))
    total = f'discovery_reregistrations_total{{job="{job}"}}'
    try:
        lease = wait_for(lambda: _lease(settings, "flappy"), 30, "the registration")
        wait_for(lambda: prometheus.value(total) == 0, 30, f"{total} scraped", interval=0.2)
        for _ in range(5):  # each revoke: routers see the engine go and come back
            revoked = etcdctl(settings.endpoints, "lease", "revoke", f"{lease:016x}")
            assert revoked.returncode == 0, revoked.stderr
            lease = wait_for(
                lambda old=lease: (new := _lease(settings, "flappy")) not in (None, old) and new,
                timeout=15,
                message="registered again on a new lease",
            )
        prometheus.wait_state("DiscoveryRegistrationsFlapping", "firing", timeout=30)
        (alert,) = prometheus.server.alerts("DiscoveryRegistrationsFlapping")
        assert alert["labels"]["instance"] == prometheus.instance(job)
        assert alert["labels"]["severity"] == "warning"
        assert float(alert["value"]) > 3
        assert "written again" in alert["annotations"]["summary"]
        assert prometheus.value(total) == 5
        # No revoke any more: once the window (15 min, 15 s here) has no loss, it resolves.
        quiet = prometheus.wait_state("DiscoveryRegistrationsFlapping", "inactive", timeout=60)
        print(f"DiscoveryRegistrationsFlapping resolved {quiet:.1f} s after the last revoke")
        assert registrar.process.poll() is None
    finally:
        print(registrar.output()[-3000:])  # shown when the test fails
        registrar.stop()


def _engine_pid(launcher: subprocess.Popen[bytes]) -> int | None:
    """The stand-in engine a launcher started (Linux /proc), or None."""
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        for pid in children.split():
            if b"stand_in_engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    except OSError:
        return None
    return None


@pytest.mark.prometheus
def test_every_dashboard_query_returns_series_and_a_stalled_engine_fires(
    etcd: EtcdCluster, prometheus: Prometheus
) -> None:
    """Every process of a fleet, each failure the dashboard shows, then every panel's query."""
    settings = Settings(endpoints=etcd.endpoints, namespace="alert-dashboard", dial_timeout=10)
    port = {job: str(prometheus.port(job)) for job in JOBS}
    logs: dict[str, ChildLog] = {}
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        logs[name] = ChildLog()
        processes[name] = _spawn(command, settings, logs[name])
        return processes[name]

    registrar = Registrar(
        settings,
        "engine-b",
        ttl=10,
        extra=("--label", "model=demo", "--metrics-port", port["discovery-registrar"]),
    )
    try:
        launcher = spawn("launcher", _python(
            "-m", "discovery", "launch", "--engine-id", "engine-a", "--label", "model=demo",
            "--ttl", "10", "--stall-timeout", "2", "--metrics-port", port["discovery-launcher"],
            "--", sys.executable, "-m", "discovery.testing.stand_in_engine",
            "--dynamo-parent-event-address", "{event_address}", "--kv-events", "8",
            "--kv-rate", "2",
        ))  # fmt: skip
        spawn("watcher", _python(
            "-m", "discovery", "watch", "--metrics-port", port["discovery-watcher"]
        ))  # fmt: skip
        router = spawn("router", _python(
            "-m", "tests.router_process", "--metrics-port", port["discovery-router"],
            "--fail", "engine-b", "--hold", "engine-a", "--selector", "model=demo",
            "--unconfirmed", "engine-lost",
        ))  # fmt: skip
        wait_for(lambda: "routed" in logs["router"].read(), 60, "the router's picks")
        # A value that does not decode, a hung engine, an etcd restart (watch reconnects).
        junk = etcdctl(settings.endpoints, "put", settings.keyspace.prefix + "junk", "{not json")
        assert junk.returncode == 0, junk.stderr
        engine = wait_for(lambda: _engine_pid(launcher), 10, "the stand-in engine's pid")
        os.kill(engine, signal.SIGUSR1)  # silent: its launcher marks it stalled
        etcd.restart(etcd.members[0], kill=False)
        etcd.wait_healthy()

        board = dashboard()
        queries = {(t, ref): live_expr(expr, board) for t, ref, expr in panel_queries(board)}
        empty = dict(queries)

        def all_return_series() -> bool:
            for key, expr in list(empty.items()):
                if prometheus.server.query(expr):
                    del empty[key]
            return not empty

        try:
            wait_for(all_return_series, timeout=60, message="every panel's query", interval=0.5)
        except AssertionError:
            pytest.fail(f"queries without series: {empty}")
        # The panels' series carry the failures caused above.
        fenced = prometheus.server.query(live_expr(
            'max by (engine_id) (discovery_router_fenced_seconds{job=~"$job"})', board
        ))  # fmt: skip
        assert [s["metric"]["engine_id"] for s in fenced] == ["engine-b"]
        stalled = 'discovery_routing_engines{job="discovery-router",status="stalled"}'
        # The stall reaches the router, then its next scrape: the panels may answer before.
        wait_for(lambda: prometheus.value(stalled) == 1, 30, "the router's stalled engine")
        causes = prometheus.server.query("discovery_watcher_reconnects_total")
        assert {s["metric"]["job"] for s in causes} >= {"discovery-watcher", "discovery-router"}
        # The dashboard's variables list what the fleet has.
        match = {"match[]": '{__name__=~"discovery_.+"}'}
        jobs = prometheus.server.api("label/job/values", **match)
        assert set(jobs) == set(JOBS)
        selectors = prometheus.server.api(
            "label/selector/values", **{"match[]": "discovery_routing_engines"}
        )
        assert "model=demo" in selectors

        prometheus.wait_state("DiscoveryEngineStalled", "firing", timeout=30)
        (alert,) = prometheus.server.alerts("DiscoveryEngineStalled")
        assert alert["labels"]["engine_id"] == "engine-a"
        assert alert["labels"]["instance"] == prometheus.instance("discovery-launcher")
        assert router.poll() is None and launcher.poll() is None
    finally:
        for process in processes.values():
            stop_process(process, timeout=30)
        print(f"--- registrar\n{registrar.output()[-3000:]}")
        registrar.stop()
        for name, log in logs.items():  # shown when the test fails
            print(f"--- {name}\n{log.read()[-3000:]}")
            log.close()
