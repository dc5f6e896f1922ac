"""Initial sync: a new watcher's complete table vs raw and peer etcd clients, same run.

Run: ``.venv/bin/python bench/bench_sync.py [--sizes 10000,50000] [--rounds 5]``.

One etcd member holds N records of about 440 bytes (what ``register_engine`` writes: a full
endpoint, three labels, ``registered_at``). Every contender reads all N the same way, from a
new client each time (channel set-up included): pages of 1,000 keys at one revision (the
first page's), every value JSON-decoded into a dict keyed by key.

* ours: ``watch_table(settings).start()`` (its own Connection and EndpointWatcher;
  public API only) until it returns with all N engines, decoded and validated;
* raw python3-etcd3: ``get_range_response`` pages + ``json.loads`` of each value;
* aetcd (asyncio): its ``kvstub.Range`` with limit and revision (its ``get_range`` and
  ``get_prefix`` take neither), + ``json.loads``;
* etcd3aio (grpc.aio): ``kv.get(range_end=, revision=, limit=)`` pages + ``json.loads``;
* etcd-client-py (Rust, tonic): ``get_prefix`` + ``json.loads``. Its API has neither limit
  nor revision, and one read of the whole prefix fails from 10,000 records on (its 4 MiB
  message limit), so it reads 1,000-key sub-prefixes of the ids, not at one revision.

Each contender runs in its own process (aetcd's and etcd3aio's generated protobuf modules
cannot share a process with python3-etcd3's), started once per size; the samples are
interleaved round by round in a shuffled order so that load from other processes on the
machine spreads over all. Wall time and the worker process's CPU time per sync; the targets
(issue 44) are ours <= raw and <= every peer, in wall time and in CPU, each judged on the
median of the rounds (run_all.py takes them idle and beside one CPU-burning process).
Memory: tracemalloc of what a finished sync keeps (ours: the watcher's cache, the table
and one snapshot; raw: the dict of decoded values), per endpoint.
``--profile`` also samples our worker with py-spy (every thread; the list runs on the
watcher's) over 5 syncs at the largest size: bench/out/sync_profile_N.txt holds the
functions by share of the samples (inclusive and own), next to the raw collapsed stacks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from _common import (
    BENCH,
    LABELS,
    OUT,
    Target,
    etcd_cluster,
    host_port,
    load_average,
    make_endpoint,
    percentile,
    record_results,
    table_text,
    write_json,
)
from _sync_worker import NAMESPACE

KINDS = ("ours", "raw", "aetcd", "etcd3aio", "etcd_client")
LABEL = {
    "ours": "ours: EndpointWatcher + RoutingTable ready",
    "raw": "raw python3-etcd3 paged + json.loads",
    "aetcd": "aetcd paged + json.loads",
    "etcd3aio": "etcd3aio paged + json.loads",
    "etcd_client": "etcd-client-py sub-prefixes + json.loads",
}


class Worker:
    def __init__(self, kind: str, url: str, prefix: str) -> None:
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, str(BENCH / "_sync_worker.py"), kind, url, prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=BENCH,
        )

    def ask(self, command: str) -> dict:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker died (exit {self.process.wait()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.ask("quit")
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# -- the parent ------------------------------------------------------------------------------


def populate(url: str, prefix: str, start: int, stop: int) -> float:
    """Write records start..stop-1 in transactions of 100; return the mean value size."""
    import etcd3  # noqa: PLC0415

    from discovery import EngineRecord  # noqa: PLC0415
    from discovery._records.codec import encode  # noqa: PLC0415

    client = etcd3.client(*host_port(url))
    now = datetime.now(UTC)
    sizes = []
    try:
        for first in range(start, stop, 100):
            puts = []
            for i in range(first, min(first + 100, stop)):
                value = encode(
                    EngineRecord(f"e{i:06d}", make_endpoint(i), LABELS, registered_at=now)
                )
                sizes.append(len(value))
                puts.append(client.transactions.put(f"{prefix}e{i:06d}", value))
            client.transaction(compare=[], success=puts, failure=[])
    finally:
        client.close()
    return sum(sizes) / max(len(sizes), 1)


def profile(worker: Worker, n: int) -> Path:
    """py-spy samples of 5 syncs by ``worker``; a per-function summary of them."""
    OUT.mkdir(exist_ok=True)
    raw = OUT / f"sync_profile_{n}.raw"
    pid = str(worker.ask("pid")["pid"])
    spy = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", pid, "--rate", "500",
         "--format", "raw", "--output", str(raw), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # py-spy attaches
        for _ in range(5):
            worker.ask("run")
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(30)
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [
            f.split(" (", 1)[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")
        ]
        if not any("_relist" in f for f in frames):
            continue  # other threads: gRPC's, the main thread waiting
        samples = int(count)
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    lines = [f"py-spy, 5 syncs of {n:,} records, the watcher thread's list: {total} samples"]
    lines += ["", "inclusive  own  function (file:line)"]
    for frame, samples in inclusive.most_common(40):
        lines.append(f"{100 * samples / total:8.1f}% {100 * own[frame] / total:4.1f}%  {frame}")
    summary = OUT / f"sync_profile_{n}.txt"
    summary.write_text("\n".join(lines) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,50000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--profile", action="store_true", help="py-spy 5 of our syncs")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict = {"sizes": {}, "rounds": args.rounds}
    targets: list[Target] = []
    rows = []
    prefix = f"/inference/v1/{NAMESPACE}/engines/"
    with etcd_cluster(1, extra_args=["--quota-backend-bytes", str(4 * 1024**3)]) as cluster:
        url = cluster.members[0].client_url
        written, value_bytes = 0, 0.0
        for n in sizes:
            value_bytes = populate(url, prefix, written, n) or value_bytes
            written = n
            workers = {kind: Worker(kind, url, prefix) for kind in kinds}
            samples: dict[str, list[dict]] = {kind: [] for kind in kinds}
            try:
                for kind in kinds:  # warm-up: imports, first channel, code paths
                    workers[kind].ask("run")
                for _ in range(args.rounds):
                    order = random.sample(kinds, len(kinds))
                    for kind in order:
                        sample = workers[kind].ask("run")
                        if sample["count"] != n:
                            raise RuntimeError(f"{kind} read {sample['count']} of {n}")
                        samples[kind].append(sample)
                memory = {k: workers[k].ask("mem") for k in ("ours", "raw") if k in workers}
                if args.profile and n == max(sizes) and "ours" in workers:
                    path = profile(workers["ours"], n)
                    print(f"profile of 5 syncs of {n:,} written to {path}")
            finally:
                for w in workers.values():
                    w.stop()
            stats = {}
            for kind in kinds:
                walls = [s["wall"] for s in samples[kind]]
                cpus = [s["cpu"] for s in samples[kind]]
                stats[kind] = {
                    "walls": walls,
                    "cpus": cpus,
                    "median": percentile(walls, 50),
                    "best": min(walls),
                    "cpu_median": percentile(cpus, 50),
                }
            raw = stats.get("raw", {}).get("median")
            for kind in kinds:
                s = stats[kind]
                ratio = f"{s['median'] / raw:.2f}x" if raw else "-"
                rows.append(
                    (
                        f"{n:,}",
                        LABEL[kind],
                        f"{s['median']:.3f}",
                        f"{s['best']:.3f}",
                        f"{max(s['walls']):.3f}",
                        f"{s['cpu_median']:.3f}",
                        ratio,
                        f"{1e6 * s['median'] / n:.1f}",
                    )
                )
            results["sizes"][n] = {"stats": stats, "memory": memory, "value_bytes": value_bytes}
            if "ours" in stats and raw:
                # Issue 44: wall time and CPU each <= raw's and every peer's (issue 16's
                # 1.2x raw superseded).
                for peer in ("raw", "aetcd", "etcd3aio", "etcd_client"):
                    if peer not in stats:
                        continue
                    for measure, key in (("median", "median"), ("CPU median", "cpu_median")):
                        ratio = stats["ours"][key] / stats[peer][key]
                        name = f"initial sync @ {n:,}, ours/{peer} {measure}"
                        targets.append(Target(name, ratio, 1.0, "x"))
            if "ours" in memory:
                per = memory["ours"]["per_endpoint"] / 1024
                targets.append(Target(f"table memory per endpoint @ {n:,}", per, 1.0, "KiB"))
            print(f"{n:,} records done; load average {load_average()}", flush=True)
    header = ("records", "contender", "median s", "best s", "worst s", "CPU s", "/raw", "us/rec")
    text = table_text(header, rows)
    mem_lines = []
    for n, data in results["sizes"].items():
        for kind, m in data["memory"].items():
            mem_lines.append(
                f"memory kept @ {n:,}, {LABEL[kind]}: {m['per_endpoint']:,.0f} B/endpoint"
            )
    text += "\n\n" + "\n".join(mem_lines)
    text += f"\nvalue size: {value_bytes:.0f} B mean"
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        record_results(
            "sync",
            text,
            targets=targets,
            about=(
                f"`bench_sync.py`: initial sync from one etcd member, {args.rounds} rounds "
                "interleaved in shuffled order, each contender in its own process and a new "
                "client per sync (channel set-up included); pages of 1,000 at one revision, "
                "every value JSON-decoded (etcd-client-py: 1,000-key sub-prefixes, its API has "
                "no limit or revision and one whole read overflows its 4 MiB limit). `/raw` "
                "is the ratio of medians. CPU: the worker "
                "process's CPU time per sync (all its threads). Memory: tracemalloc of what "
                "one finished sync keeps (ours: watcher cache + table + one snapshot)."
            ),
        )
    write_json("sync", {**results, "targets": targets})


if __name__ == "__main__":
    main()
