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
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .prometheus import PROMETHEUS_OUTCOMES, prometheus_problem, seconds, shorten

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
    "discovery_revoke_duration_seconds_bucket",
    "discovery_revoke_duration_seconds_count",
    "discovery_revoke_duration_seconds_sum",
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


_ = (sys, PROMETHEUS_OUTCOMES, prometheus_problem)
