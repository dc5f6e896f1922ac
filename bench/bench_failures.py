"""The failure catalogue, long form: every failure other routers shipped, several runs each.

Runs every scenario of ``tests/catalogue.py`` (the harness and the scenarios the test
suite runs once each in ``tests/test_failure_catalogue.py``, plus the long ones: etcd
frozen for 15 and 30 s with TTL 10) ``--runs`` times, each on fresh etcd (a shared member
in a namespace of the run's own, or a private member, three members, or three members in
network namespaces, as the scenario needs), and records the worst figure of each against
the scenario's targets: bench/results/failures.md (and RESULTS.md), the figures in
bench/results/failures.json, and the tables between ``<!-- failures:begin -->`` and
``<!-- failures:end -->`` (docs/failures.md's, README's headline table). ``--only a,b``
runs some scenarios and keeps the others' recorded figures. Scenarios in network
namespaces need root and iproute2; without them they are reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime

from _common import (
    ROOT,
    SECTIONS,
    Target,
    etcd_cluster,
    load_average,
    machine_line,
    percentile,
    record_results,
    table_text,
    write_json,
)

sys.path.insert(0, str(ROOT))  # the harness lives with the tests

from discovery import Settings
from discovery.testing.embedded import EtcdCluster
from discovery.testing.embedded_netns import PartitionableCluster, unavailable_reason
from tests import catalogue
from tests.catalogue import COMMON, SCENARIOS, Env, Figures, Scenario

RECORD = ROOT / catalogue.RECORD
COUNTS = ("lost", "duplicate", "stale")


@contextlib.contextmanager
def environment(scenario: Scenario, run: int, shared: EtcdCluster) -> Iterator[Env]:
    """Fresh etcd for one run of ``scenario``."""
    namespace = f"{scenario.name}-{run}"
    if scenario.etcd == "shared":
        yield Env(Settings(endpoints=shared.endpoints, namespace=namespace, dial_timeout=10))
        return
    if scenario.etcd == "netns":
        cluster: EtcdCluster = PartitionableCluster(3)
        cluster.start()
        try:
            yield Env(
                Settings(endpoints=cluster.endpoints, namespace=namespace, dial_timeout=10),
                cluster,
            )
        finally:
            cluster.stop()
        return
    if scenario.etcd == "auth":
        cluster = catalogue.auth_cluster()
        cluster.start()
        try:
            yield Env(catalogue.enable_auth(cluster, namespace), cluster)
        finally:
            cluster.stop()
        return
    with etcd_cluster(1 if scenario.etcd == "single" else 3) as cluster:
        yield Env(
            Settings(endpoints=cluster.endpoints, namespace=namespace, dial_timeout=10), cluster
        )


def worst(values: list[float | None], counted: bool) -> float | None:
    """The worst of the runs: None (never happened) wins when the figure is a target."""
    if counted and any(v is None for v in values):
        return None
    present = [v for v in values if v is not None]
    return max(present) if present else None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


def aggregate(scenario: Scenario, runs: list[Figures], errors: list[str], total: int) -> dict:
    limits = scenario.all_limits()
    names = [
        "evict",
        "evict_after_recovery",
        "back",
        "absent",
        "readds",
        "failed_picks",
        "after_evict",
        "failed_requests",
        "collateral",
        *COUNTS,
        "converge",
        "picks",
    ]
    names += sorted({k for f in runs for k in f.extra})
    return {
        "name": scenario.name,
        "replays": scenario.replays,
        "failure": scenario.failure,
        "knob": scenario.knob,
        "runs": total,
        "errors": len(errors),
        "error_messages": errors,
        "limits": limits,
        "worst": {
            name: worst([f.value(name) for f in runs], name in limits) if runs else None
            for name in names
        },
        "median": {name: median([f.value(name) for f in runs]) for name in ("evict", "back")},
    }


def targets(records: list[dict]) -> list[Target]:
    found: list[Target] = []
    for record in records:
        limits, worst_ = record["limits"], record["worst"]
        for name, limit in limits.items():
            if name in COMMON:
                continue
            value = worst_.get(name)
            found.append(
                Target(
                    f"{record['name']}: {name}",
                    math.inf if value is None or record["errors"] else value,
                    limit,
                    catalogue.unit(name),
                )
            )

    def total(name: str, over: bool = False) -> float:
        values = []
        for record in records:
            value = record["worst"].get(name)
            if value is None or record["errors"]:
                return math.inf
            values.append(max(0.0, value - record["limits"][name]) if over else value)
        return max(values, default=0.0)

    found += [
        Target("every scenario: runs that failed", sum(r["errors"] for r in records), 0, ""),
        Target("every scenario: failed picks beyond its limit", total("failed_picks", True), 0, ""),
        Target("every scenario: picks after eviction", total("after_evict"), 0, ""),
        Target("every scenario: engines evicted that the fault spared", total("collateral"), 0, ""),
        Target(
            "every scenario: lost + duplicate + stale at the end",
            max((sum(r["worst"].get(k) or 0 for k in COUNTS) for r in records), default=0),
            0,
            "",
        ),
    ]
    return found


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def printout(records: list[dict], runs: int) -> str:
    rows = []
    for r in records:
        w, m = r["worst"], r["median"]
        extra = ", ".join(
            f"{k} {fmt(w.get(k), 2 if k in catalogue.TIMINGS else 0)}"
            for k in r["limits"]
            if k not in COMMON and k not in ("evict", "back", "readds", "evict_after_recovery")
        )
        rows.append(
            (
                r["name"],
                f"{r['runs'] - r['errors']}/{r['runs']}",
                f"{fmt(m['evict'])} / {fmt(w['evict'])}",
                fmt(w["evict_after_recovery"]),
                f"{fmt(w['back'])} ({fmt(w['readds'], 0)})",
                f"{fmt(w['failed_picks'], 0)} / {fmt(w['after_evict'], 0)}",
                fmt(w["failed_requests"], 0),
                "/".join(fmt(w[k], 0) for k in COUNTS),
                fmt(w["converge"], 1),
                extra,
            )
        )
    header = (
        "scenario",
        "runs ok",
        "evict p50/max s",
        "after fault end",
        "back s (re-adds)",
        "dead picks / after",
        "failed reqs",
        "lost/dup/stale",
        "converge s",
        "its own",
    )
    return f"worst of {runs} runs (evict: median / worst)\n" + table_text(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario")
    parser.add_argument("--only", help="comma-separated scenarios (others keep their record)")
    parser.add_argument("--no-results", action="store_true", help="record nothing")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    netns_problem = unavailable_reason()
    records: list[dict] = []
    started = time.monotonic()
    with etcd_cluster(1) as shared:
        for name in names:
            scenario = SCENARIOS[name]
            if scenario.etcd == "netns" and netns_problem:
                print(f"{name}: not run ({netns_problem})", flush=True)
                continue
            runs: list[Figures] = []
            errors: list[str] = []
            for i in range(args.runs):
                t0 = time.monotonic()
                try:
                    with environment(scenario, i, shared) as env:
                        figures = catalogue.play(scenario, env)
                    runs.append(figures)
                    print(f"{figures.line()} [{time.monotonic() - t0:.0f} s]", flush=True)
                except Exception as exc:  # a run that failed is a figure too
                    errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    traceback.print_exc()
            records.append(aggregate(scenario, runs, errors, args.runs))
    took = time.monotonic() - started
    if args.only and RECORD.exists():  # the others keep their recorded figures
        previous = {r["name"]: r for r in json.loads(RECORD.read_text())["scenarios"]}
        previous.update({r["name"]: r for r in records})
        records = [previous[n] for n in SCENARIOS if n in previous]
    found = targets(records)
    text = printout(records, args.runs)
    text += f"\n\nwall time {took:.0f} s\n" + "\n".join(t.line() for t in found)
    print(text)
    write_json("failures", {"scenarios": records, "targets": found})
    if args.no_results:
        return
    recorded = {
        "runs": args.runs,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine_line(),
        "load": load_average(),
        "scenarios": records,
    }
    SECTIONS.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(recorded, indent=1, default=float) + "\n", encoding="utf-8")
    for name, render in catalogue.TABLES.items():
        path = ROOT / name
        path.write_text(catalogue.write_table(path.read_text(), render(recorded)))
    record_results(
        "failures",
        text,
        targets=found,
        about="`bench_failures.py`: every scenario of `tests/catalogue.py` (what "
        "`tests/test_failure_catalogue.py` runs once each) on fresh etcd per run: stand-in "
        "engines with a request port under `discovery launch` (or `discovery register` "
        "engines), a router's table and a client that picks every 10 ms and releases "
        "`failed=True` when the engine does not answer within 1 s; the failure at a known "
        "time. Worst figure of the runs against each target; docs/failures.md's table and "
        "README's headline table are written from the same figures.",
    )


if __name__ == "__main__":
    main()
