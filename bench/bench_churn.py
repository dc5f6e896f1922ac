"""Churn: a watcher keeping up with >= 10,000 record changes per second for 30 s.

Run: ``.venv/bin/python bench/bench_churn.py [--rate 10000] [--seconds 30] [--keys 5000]``.

* Writers: ``--writers`` processes with plain python3-etcd3 clients, each owning a slice of
  ``--keys`` engine keys, each committing paced transactions of ``--batch`` operations
  on distinct keys of its slice: a put of a valid record (``added`` / ``updated``), or,
  for 10% of live keys, a delete (``removed``). Every change is one etcd event; every
  transaction is one etcd revision.
* The watcher under test: an EndpointWatcher + RoutingTable in this process, with one
  table listener (as a Router or metrics hook would have) counting events.
* Lag, every 50 ms: newest revision committed by any writer (from the transactions'
  response headers, shared through memory) minus the revision the table has applied.
  Also the delay from a transaction's response at the writer to the table having
  applied that revision (CLOCK_MONOTONIC is system-wide, so the two processes' clocks
  compare).
* Correctness at the end: the table equals etcd's content (read at one revision), which
  equals what the writers believe they left.
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing
import random
import threading
import time

import etcd3
from _common import (
    LABELS,
    CpuMeter,
    Target,
    etcd_cluster,
    host_port,
    make_endpoint,
    percentile,
    record_results,
    table_text,
    write_json,
)

from discovery import Connection, EndpointWatcher, RoutingTable, Settings
from discovery._records.codec import encode
from discovery._records.record import EngineRecord

NAMESPACE = "churn"
VARIANTS = 4


def writer_main(index, url, prefix, keys, rate, batch, seconds, newest, start_at, pipe) -> None:
    """Paced transactions over keys[index::writers]; report revisions and the final state."""
    rng = random.Random(index)
    client = etcd3.client(*host_port(url))
    txn = client.transactions
    values = {
        k: [
            encode(EngineRecord(k, make_endpoint(i + v * 7919), {**LABELS, "gen": str(v)}))
            for v in range(VARIANTS)
        ]
        for i, k in keys
    }
    names = [k for _, k in keys]
    alive: dict[str, bytes] = {}
    log: list[tuple[int, float]] = []  # (revision, monotonic time of the response)
    changes = 0
    interval = batch / rate
    while time.monotonic() < start_at:
        time.sleep(0.001)
    next_at = start_at
    end = start_at + seconds
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if now < next_at:
            time.sleep(next_at - now)
        next_at += interval
        ops = []
        for name in rng.sample(names, batch):
            if name in alive and rng.random() < 0.1:
                ops.append(txn.delete(prefix + name))
                del alive[name]
            else:
                value = values[name][rng.randrange(VARIANTS)]
                ops.append(txn.put(prefix + name, value))
                alive[name] = value
        _, responses = client.transaction(compare=[], success=ops, failure=[])
        first = responses[0]  # every op of a txn reports the txn's revision
        revision = getattr(first, first.WhichOneof("response")).header.revision
        log.append((revision, time.monotonic()))
        changes += len(ops)
        with newest.get_lock():
            newest.value = max(newest.value, revision)
    client.close()
    pipe.send({"log": log, "alive": alive, "changes": changes})


def trio(values: list[float], fmt: str) -> str:
    """p50 / p99 / max."""
    picks = (percentile(values, 50), percentile(values, 99), max(values))
    return " / ".join(format(v, fmt) for v in picks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10_000, help="changes per second")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=100, help="changes per transaction")
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()

    with etcd_cluster(1, extra_args=["--quota-backend-bytes", str(8 * 1024**3)]) as cluster:
        member = cluster.members[0]
        url = member.client_url
        settings = Settings(endpoints=[url], namespace=NAMESPACE, dial_timeout=30)
        prefix = settings.keyspace.prefix
        ctx = multiprocessing.get_context("spawn")
        newest = ctx.Value("q", 0)

        counted = [0]

        def listener(events, _snapshot) -> None:
            counted[0] += len(events)

        applied_at: list[tuple[int, float]] = []

        class TimedTable(RoutingTable):
            def deliver(self, batch):  # type: ignore[override]
                super().deliver(batch)
                applied_at.append((batch[-1].revision, time.monotonic()))

        watcher = EndpointWatcher(settings)
        table = TimedTable(watcher)
        table.subscribe(listener)
        table.start()
        watcher.start()
        start_at = time.monotonic() + 3.0  # writers spawn and build their values first
        keys = [(i, f"engine-{i:06d}") for i in range(args.keys)]
        pipes, writers = [], []
        for w in range(args.writers):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=writer_main,
                args=(
                    w, url, prefix, keys[w :: args.writers], args.rate / args.writers,
                    args.batch, args.seconds, newest, start_at, child,
                ),
            )  # fmt: skip
            process.start()
            pipes.append(parent)
            writers.append(process)
        lags: list[tuple[float, int]] = []
        stop = threading.Event()
        try:
            while time.monotonic() < start_at:
                time.sleep(0.01)
            cpu = CpuMeter([member.pid])
            me = CpuMeter([__import__("os").getpid()])
            writer_cpu = CpuMeter([p.pid for p in writers])
            while any(p.is_alive() for p in writers) and not stop.wait(0.05):
                if any(pipe.poll() for pipe in pipes):
                    break
                lags.append((time.monotonic() - start_at, newest.value - table.revision))
            reports = [pipe.recv() for pipe in pipes]
            etcd_share, my_share, writer_share = cpu.share(), me.share(), writer_cpu.share()
            for process in writers:
                process.join(30)
            final_revision = max(rev for r in reports for rev, _ in r["log"])
            t_end = time.monotonic()
            table.wait_until(lambda snap: snap.revision >= final_revision, timeout=120)
            catch_up = time.monotonic() - t_end
            # Correctness: the table == etcd's content == what the writers left.
            with Connection(settings) as conn:
                revision, kvs = conn.list_prefix(prefix)
            in_etcd = {kv.key.decode()[len(prefix) :]: kv.value for kv in kvs}
            expected = {k: v for r in reports for k, v in r["alive"].items()}
            snapshot = table.snapshot()
            in_table = {k: encode(rec) for k, rec in snapshot.items()}
            table_ok = in_table == in_etcd
            etcd_ok = in_etcd == expected
            health = watcher.health()
        finally:
            for process in writers:
                if process.is_alive():
                    process.kill()
                process.join()
            table.stop()
            watcher.stop()

    changes = sum(r["changes"] for r in reports)
    span = max(t for r in reports for _, t in r["log"]) - start_at  # the writers' active time
    rate = changes / span
    txns = sum(len(r["log"]) for r in reports)
    # Delay from a writer's response to the table having applied that revision.
    applied_revs = [rev for rev, _ in applied_at]
    delays = []
    for report in reports:
        for rev, t_written in report["log"]:
            i = bisect.bisect_left(applied_revs, rev)
            if i < len(applied_at):
                delays.append((applied_at[i][1] - t_written) * 1000)
    lag_values = [lag for _, lag in lags]
    rows = [
        ("changes written", f"{changes:,} in {txns:,} txns over {span:.1f} s: {rate:,.0f}/s"),
        ("events delivered to the listener", f"{counted[0]:,}"),
        ("lag, revisions p50 / p99 / max", trio(lag_values, ".0f")),
        ("lag, changes p99 (revisions x batch)", f"{percentile(lag_values, 99) * args.batch:,.0f}"),
        ("write -> applied, ms p50 / p99 / max", trio(delays, ".1f")),
        ("catch-up after the writers stopped, s", f"{catch_up:.2f}"),
        ("CPU: watcher process / etcd / writers", f"{my_share * 100:.0f}% / "
            f"{etcd_share * 100:.0f}% / {writer_share * 100:.0f}%"),
        ("watcher reconnects / relists / skipped", f"{health.reconnects} / {health.relists} / "
            f"{health.skipped}"),
        ("final: table == etcd == writers' state", f"{table_ok and etcd_ok} "
            f"({len(in_table):,} engines at revision {revision})"),
    ]  # fmt: skip
    text = table_text((f"churn, {args.keys:,} keys, {args.batch} changes/txn", "value"), rows)
    lag_ms_p99 = percentile(delays, 99)
    targets = [
        # The load itself: at least the asked rate of changes was written.
        Target("churn write rate (asked / written)", args.rate / rate, 1.0, "x"),
        # Keeping up: the table is never a second behind etcd (99% of revisions).
        Target("churn write -> applied p99", lag_ms_p99, 1000, "ms"),
        Target(
            "churn final mismatches (table, etcd, writers)", 0 if table_ok and etcd_ok else 1, 0, ""
        ),
    ]
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        record_results(
            "churn",
            text,
            targets=targets,
            about=(
                f"`bench_churn.py`: {args.writers} writer processes (plain python3-etcd3) "
                f"committing {args.batch}-change transactions (90% puts of valid records, 10% "
                f"deletes) over {args.keys:,} keys at {args.rate:,.0f} changes/s for "
                f"{args.seconds:g} s; the watcher under test (EndpointWatcher + RoutingTable + "
                "one listener) in the measuring process, sharing the 2 cores with etcd and "
                "the writers. Lag sampled every 50 ms as newest committed revision minus the "
                "table's revision (one revision = one transaction)."
            ),
        )
    write_json(
        "churn",
        {
            "lags": lags,
            "delays_ms": delays,
            "lag_ms_p99": lag_ms_p99,
            "rate": rate,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
