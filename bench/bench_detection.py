"""Failure detection: a registrar killed -> ``removed`` at the watcher (SIGKILL and SIGTERM).

Run: ``.venv/bin/python bench/bench_detection.py [--kills 24] [--terms 24] [--ttl 3]``.
One private etcd member; registrars are ``python -m discovery register --ttl 3``
subprocesses (each its own lease, keepalive every TTL/3); the watcher is an
EndpointWatcher + RoutingTable in this process. Registrars are started in rounds of
``--batch``; once all of a round are in the table, each is signalled after a random pause
(0-1.2 s, so the kill falls at a random point of its keepalive cycle). The time is from
``perf_counter_ns()`` just before ``os.kill`` to when the table listener sees ``removed``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

from _common import (
    ROOT,
    Target,
    etcd_cluster,
    percentile,
    record_results,
    table_text,
    write_json,
)

from discovery import EventType, RoutingTable, Settings, watch_table


def start_registrar(settings: Settings, engine_id: str, ttl: float, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    env.update(
        DISCOVERY_ETCD_ENDPOINTS=",".join(settings.endpoints),
        DISCOVERY_NAMESPACE=settings.namespace,
        PYTHONPATH=str(ROOT),
    )
    flags = {
        "--engine-id": engine_id,
        "--coordinator-address": f"tcp://{engine_id}:5555",
        "--context-length": "8192",
        "--kv-cache-block-size": "256",
        "--total-kv-blocks": "4000",
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "8192",
        "--bos-token-id": "1",
        "--ttl": str(ttl),
        "--log-level": "WARNING",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "discovery", "register", *(x for f in flags.items() for x in f)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


class Removals:
    """perf_counter_ns of each engine's ``removed`` event, from the table listener."""

    def __init__(self) -> None:
        self.times: dict[str, int] = {}
        self.cond = threading.Condition()

    def listener(self, events, _snapshot) -> None:
        now = time.perf_counter_ns()
        with self.cond:
            for event in events:
                if event.type is EventType.REMOVED:
                    self.times.setdefault(event.engine_id, now)
            self.cond.notify_all()

    def wait(self, engine_ids, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(e in self.times for e in engine_ids), timeout)


def run_rounds(
    sig: signal.Signals,
    total: int,
    batch: int,
    ttl: float,
    settings: Settings,
    table: RoutingTable,
    removals: Removals,
    rng: random.Random,
) -> tuple[list[float], list[int]]:
    samples: list[float] = []
    exit_codes: list[int] = []
    n = 0
    while len(samples) < total:
        size = min(batch, total - len(samples))
        ids = [f"{sig.name.lower()}-{n + i}" for i in range(size)]
        n += size
        processes: dict[str, subprocess.Popen] = {}
        with tempfile.TemporaryFile() as log:
            try:
                for engine_id in ids:
                    processes[engine_id] = start_registrar(settings, engine_id, ttl, log)
                table.wait_until(lambda snap, ids=ids: all(e in snap for e in ids), timeout=60)
                sent: dict[str, int] = {}
                for engine_id in ids:
                    time.sleep(rng.uniform(0.0, 1.2))  # the workload: a random phase
                    sent[engine_id] = time.perf_counter_ns()
                    os.kill(processes[engine_id].pid, sig)
                if not removals.wait(ids, timeout=ttl + 30):
                    missing = [e for e in ids if e not in removals.times]
                    raise RuntimeError(f"no removed event for {missing}")
                for engine_id in ids:
                    samples.append((removals.times[engine_id] - sent[engine_id]) / 1e9)
                    exit_codes.append(processes[engine_id].wait(30))
            except BaseException:
                log.seek(0)
                sys.stderr.write(log.read().decode(errors="replace")[-4000:])
                raise
            finally:
                for process in processes.values():
                    if process.poll() is None:
                        process.kill()
                    process.wait()
    return samples, exit_codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--terms", type=int, default=24)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    rng = random.Random(11)
    with etcd_cluster(1) as cluster:
        settings = Settings(endpoints=cluster.endpoints, namespace="detect", dial_timeout=10)
        removals = Removals()
        table = watch_table(settings)
        table.subscribe(removals.listener)
        table.start()
        try:
            kills, kill_codes = run_rounds(
                signal.SIGKILL, args.kills, args.batch, args.ttl, settings, table, removals, rng
            )
            terms, term_codes = run_rounds(
                signal.SIGTERM, args.terms, args.batch, args.ttl, settings, table, removals, rng
            )
        finally:
            table.stop()
    assert all(code == -signal.SIGKILL for code in kill_codes), kill_codes
    bad_terms = [code for code in term_codes if code != 0]

    def row(label: str, values: list[float], unit: float, fmt: str) -> list[str]:
        return [label, str(len(values))] + [
            format(v * unit, fmt)
            for v in (min(values), percentile(values, 50), percentile(values, 99), max(values))
        ]

    rows = [
        row(f"SIGKILL -> removed, s (TTL {args.ttl:g} s)", kills, 1, ".2f"),
        row("SIGTERM -> removed, ms", terms, 1000, ".1f"),
    ]
    text = table_text(("failure detection", "n", "min", "p50", "p99", "max"), rows)
    text += f"\nSIGTERM exit codes: {len(term_codes) - len(bad_terms)} x 0" + (
        f", others: {bad_terms}" if bad_terms else ""
    )
    targets = [
        Target("SIGKILL->removed max", max(kills), args.ttl + 1.5, "s"),
        Target("SIGTERM->removed p50", percentile(terms, 50) * 1000, 100, "ms"),
    ]
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        record_results(
            "detection",
            text,
            targets=targets,
            about="`bench_detection.py`: `discovery register --ttl "
            f"{args.ttl:g}` subprocesses against one etcd member, signalled at a random "
            "point of their keepalive cycle; time from just before `os.kill` to the "
            "`removed` event in a RoutingTable listener of the watching process.",
        )
    write_json(
        "detection", {"ttl": args.ttl, "sigkill": kills, "sigterm": terms, "targets": targets}
    )
    if bad_terms:
        sys.exit(f"registrars exited with {bad_terms} after SIGTERM")


if __name__ == "__main__":
    main()
