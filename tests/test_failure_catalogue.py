"""The failure catalogue, short form: every failure other routers shipped, replayed once.

Each scenario (``tests/catalogue.py``: the harness, the scenarios, their limits) runs once
against real etcd, with its engines, a router and a client that releases its handles
``failed=True`` when the engine does not answer, and must meet its limits: the issue's
targets for the time to evict, picks of a dead or hung engine at most the fence threshold
and none after eviction, no engine evicted that the fault did not touch, and no lost,
duplicate or stale table entry at the end. Timings get ``SLACK`` seconds more here, for a
loaded CI machine (the counts none): ``bench/bench_failures.py`` runs every scenario
several times (the 15 s and 30 s etcd outages too) and holds the timings to the targets
themselves, in bench/RESULTS.md, docs/failures.md's table and README's headline table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from discovery import Settings
from discovery.testing.embedded import EtcdCluster

from . import catalogue
from .catalogue import SCENARIOS, SHORT, Env
from .conftest import _checked_cluster

SLACK = 0.5


def _names(etcd: str) -> list[str]:
    return [name for name in SHORT if SCENARIOS[name].etcd == etcd]


def _check(name: str, env: Env) -> None:
    scenario = SCENARIOS[name]
    figures = catalogue.play(scenario, env)
    print(figures.line())  # shown with -rP: the figures of a passing run too
    missed = figures.missed(scenario.all_limits(), slack=SLACK)
    assert not missed, f"{'; '.join(missed)}\n{figures.line()}"


def _private(cluster: EtcdCluster, name: str) -> Env:
    settings = Settings(endpoints=cluster.endpoints, namespace=f"catalogue-{name}", dial_timeout=10)
    return Env(settings, cluster)


@pytest.mark.parametrize("name", _names("shared"))
def test_on_the_shared_etcd(name: str, settings: Settings) -> None:
    _check(name, Env(settings))


@pytest.mark.parametrize("name", _names("single"))
def test_on_a_private_member(name: str, etcd: EtcdCluster) -> None:
    _check(name, _private(etcd, name))


@pytest.mark.parametrize("name", _names("three"))
def test_on_three_members(name: str, etcd3: EtcdCluster) -> None:
    _check(name, _private(etcd3, name))


@pytest.mark.parametrize("name", _names("netns"))
def test_in_network_namespaces(name: str, netns_etcd3: EtcdCluster) -> None:
    _check(name, _private(netns_etcd3, name))


@pytest.mark.external
@pytest.mark.parametrize("name", _names("auth"))
def test_with_auth_and_short_tokens(name: str) -> None:
    with _checked_cluster(catalogue.auth_cluster()) as cluster:
        _check(name, Env(catalogue.enable_auth(cluster, f"catalogue-{name}"), cluster))


def test_every_scenario_has_a_report_a_failure_and_limits() -> None:
    for scenario in SCENARIOS.values():
        assert scenario.replays and scenario.failure and scenario.limits, scenario.name
        assert scenario.etcd in {"shared", "single", "three", "netns", "auth"}, scenario.name


def test_failure_tables_are_the_recorded_ones() -> None:
    """docs/failures.md's table and README's headline table are written from
    bench_failures.py's recorded figures, by the harness."""
    root = Path(__file__).resolve().parent.parent
    recorded = json.loads((root / catalogue.RECORD).read_text())
    for name, render in catalogue.TABLES.items():
        text = (root / name).read_text()
        assert catalogue.TABLE_BEGIN in text, f"{name} has no failure table"
        assert catalogue.write_table(text, render(recorded)) == text, (
            f"{name}'s failure table is out of date: python bench/bench_failures.py (or "
            "rewrite it from the record with tests.catalogue.write_table)"
        )
    assert [r["name"] for r in recorded["scenarios"]] == list(SCENARIOS)
