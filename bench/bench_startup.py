"""A new user's path: a fresh process to a complete table, then put -> callback / pick().

Run: ``.venv/bin/python bench/bench_startup.py [--sizes 1000,10000,50000] [--rounds 7]
[--windows 7]``.

bench_sync.py times syncs inside long-lived workers, which hides what a new process pays
once: imports, channel and thread set-up, first-call code paths. Here every sample is a
new Python process (bench/_startup_worker.py) running one client, as a user would:

* ours: ``watch_table(Settings(...))`` (+ a ``Router`` on it for the events) and
  ``start()``, which returns with the table complete (decoded and validated);
* raw python3-etcd3, aetcd, etcd3aio, etcd-client-py: a new client, pages of 1,000 at one
  revision (etcd-client-py: 1,000-key sub-prefixes, its API has neither limit nor
  revision), ``json.loads`` of every value into a dict: the peers of bench_sync.py.

**Start-up** (one etcd member holding N records of ~460 B, those of bench_sync.py): per
sample, ``import`` (the client's import, from the worker's first line), ``first page``
(from the first call to the first page in hand: client and channel set-up, connection,
the first Range; ours is noted by a one-generator wrapper around ``Connection.list_pages``)
and ``call`` (from the first call to the complete table: the figure the targets judge, as
issue 31 measured it), and ``total`` = import + call. Samples are interleaved (each round
runs every client once, the order rotated each round), after one warm-up process per
client (file cache, etcd's cache); medians of the rounds.

**Events** (100 records): per window, a new worker process lists them and watches; the
parent then puts at a steady 200 puts/s (python3-etcd3, ``perf_counter_ns()`` just before
each put; each put rewrites one engine's record with ``weight_version`` = its sequence
number) for ``--seconds`` after 100 warm-up puts. The worker stamps each put at the
callback (ours: a ``RoutingTable.subscribe`` listener; a peer: its watch callback or
loop, after ``json.loads`` into its dict) and where a lookup sees it (ours: the store's
first sink, called once the batch's snapshot, what ``pick()`` reads, is published; a
peer: its dict, the same moment as its callback).
p50 and p99 per window; the medians of the windows; windows interleaved like the syncs.
``--profile`` records our start-up with py-spy (``--gil``, 10 fresh processes at the largest
size) and adds the top of it to the printout; bench/out/startup_profile_N.txt has more.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import etcd3
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
from _startup_worker import NAMESPACE
from bench_sync import populate

from discovery import EngineRecord
from discovery._records.codec import encode

KINDS = ("ours", "raw", "aetcd", "etcd3aio", "etcd_client")
PEERS = KINDS[1:]
LABEL = {
    "ours": "ours: watch_table().start()",
    "raw": "raw python3-etcd3",
    "aetcd": "aetcd",
    "etcd3aio": "etcd3aio",
    "etcd_client": "etcd-client-py",
    "baseline": "ours, --baseline copy of the package",
}
EVENT_ENGINES = 100
RATE = 200.0  # puts/s
WARMUP_PUTS = 100


BASELINE: dict[str, str] = {}  # --baseline: the directory holding another discovery/


def worker(mode: str, kind: str, url: str, prefix: str, records: int) -> subprocess.Popen:
    env = None
    if kind == "baseline":  # ours, from another copy of the package
        kind, env = "ours", {**os.environ, "DISCOVERY_BENCH_PACKAGE": BASELINE["path"]}
    return subprocess.Popen(
        [sys.executable, str(BENCH / "_startup_worker.py"), mode, kind, url, prefix, str(records)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=BENCH,
        env=env,
    )


def finish(process: subprocess.Popen, what: str) -> dict:
    """The worker's JSON line; it must exit cleanly."""
    assert process.stdout
    line = process.stdout.readline()
    try:
        code = process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"{what}: worker did not exit") from None
    if code or not line:
        raise RuntimeError(f"{what}: worker failed (exit {code})")
    return json.loads(line)


def sync_sample(kind: str, url: str, prefix: str, records: int) -> dict:
    return finish(worker("sync", kind, url, prefix, records), f"sync {kind} @ {records}")


def rotated(kinds: list[str], r: int) -> list[str]:
    return kinds[r % len(kinds) :] + kinds[: r % len(kinds)]


# -- events ---------------------------------------------------------------------------------


class Writer:
    """Puts one engine's record per 1/RATE s; notes the time just before each put."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = etcd3.client(*host_port(url))
        self.prefix = prefix
        self.seq = 0

    def window(self, count: int) -> dict[int, int]:
        """``count`` puts at RATE; seq -> perf_counter_ns() before its put."""
        values = []
        for _ in range(count):
            self.seq += 1
            i = self.seq % EVENT_ENGINES
            record = EngineRecord(f"e{i:06d}", make_endpoint(i), LABELS, weight_version=self.seq)
            values.append((self.seq, f"{self.prefix}e{i:06d}", encode(record)))
        sent = {}
        start = time.perf_counter() + 0.01
        for n, (seq, key, value) in enumerate(values):
            delay = start + n / RATE - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent[seq] = time.perf_counter_ns()
            self.client.put(key, value)
        return sent

    def close(self) -> None:
        self.client.close()


def event_window(kind: str, url: str, prefix: str, writer: Writer, seconds: float) -> dict:
    process = worker("events", kind, url, prefix, EVENT_ENGINES)
    assert process.stdout and process.stdin
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"events {kind}: worker not ready (exit {process.poll()})")
        writer.window(WARMUP_PUTS)
        sent = writer.window(int(seconds * RATE))
        time.sleep(0.5)  # the last puts' events arrive
        process.stdin.write("stop\n")
        process.stdin.flush()
        seen = finish(process, f"events {kind}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    result = {}
    for name in ("callbacks", "visibles"):
        stamps = {int(seq): t for seq, t in seen[name].items()}
        missing = [seq for seq in sent if seq not in stamps]
        if missing:
            raise RuntimeError(f"events {kind}: {len(missing)} puts never seen ({name})")
        delays = [(stamps[seq] - t0) / 1e6 for seq, t0 in sent.items()]
        result[name] = {"p50": percentile(delays, 50), "p99": percentile(delays, 99)}
    return result


# -- profile --------------------------------------------------------------------------------


def profile(url: str, prefix: str, records: int, runs: int = 10) -> list[str]:
    """py-spy of our first call to a complete table in ``runs`` fresh processes.

    The thread holding the GIL (``--gil``: where Python's time goes, every thread);
    attached after the import and detached once the table is complete, so neither the
    import nor the teardown shows. Writes bench/out/startup_profile_N.txt; returns its
    lines (functions by share of the samples, inclusive and own).
    """
    OUT.mkdir(exist_ok=True)
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for run in range(runs):
        raw = OUT / f"startup_profile_{records}_{run}.raw"
        process = worker("profile", "ours", url, prefix, records)
        assert process.stdin and process.stdout
        pid = process.stdout.readline().split()[1]
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", pid, "--rate",
             "2000", "--gil", "--format", "raw", "--output", str(raw), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches
        process.stdin.write("go\n")
        process.stdin.flush()
        process.stdout.readline()  # complete
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(30)
        process.stdin.write("go\n")
        process.stdin.flush()
        finish(process, "profile")
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if "Times._gate" in stack:
                continue  # before "go" or after "complete"
            frames = [
                f.split(" (", 1)[0] + " " + f.rsplit("/", 1)[-1].rstrip(")")
                for f in stack.split(";")
            ]
            samples = int(count)
            total += samples
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
        raw.unlink()
    lines = [
        f"py-spy --gil, {runs} fresh processes, ours @ {records:,} records, first call to "
        f"complete table: {total} samples",
        "inclusive  own  function (file:line)",
    ]
    for frame, samples in inclusive.most_common(60):
        lines.append(f"{100 * samples / total:8.1f}% {100 * own[frame] / total:4.1f}%  {frame}")
    (OUT / f"startup_profile_{records}.txt").write_text("\n".join(lines) + "\n")
    return lines


# -- the run --------------------------------------------------------------------------------


def median_of(samples: list[dict], key: str) -> float:
    return percentile([s[key] for s in samples], 50)


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def run_syncs(url: str, prefix: str, n: int, kinds: list[str], rounds: int, loads: list[str]):
    """``rounds`` interleaved start-ups of every client at ``n`` records: stats, rows, targets."""
    samples: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for kind in kinds:  # warm-up: the file cache, etcd's
        sync_sample(kind, url, prefix, n)
    for r in range(rounds):
        for kind in rotated(kinds, r):
            samples[kind].append(sync_sample(kind, url, prefix, n))
        loads.append(load_average())
    stats = {}
    for kind in kinds:
        stats[kind] = {key: median_of(samples[kind], key) for key in SYNC_FIGURES}
        stats[kind]["total"] = percentile([s["import"] + s["call"] for s in samples[kind]], 50)
        stats[kind]["samples"] = samples[kind]
    raw = stats.get("raw", {})
    rows = []
    for kind in kinds:
        s, calls = stats[kind], [x["call"] for x in samples[kind]]
        rows.append(
            (
                f"{n:,}",
                LABEL[kind],
                f"{1e3 * s['import']:.0f}",
                f"{1e3 * s['first_page']:.1f}",
                f"{1e3 * s['call']:.1f}",
                f"{1e3 * min(calls):.1f}",
                f"{1e3 * max(calls):.1f}",
                f"{1e3 * s['cpu']:.1f}",
                ratio(s["call"], raw.get("call")),
                f"{1e3 * s['total']:.0f}",
                ratio(s["total"], raw.get("total")),
            )
        )
    targets = []
    if "ours" in stats:
        ours = stats["ours"]["call"]
        # Issue 31: within 1.1x of raw at 1,000; at or below every peer above.
        peers = ["raw"] if n <= 1000 else PEERS
        for peer in peers:
            if peer in stats:
                name = f"complete table @ {n:,}, ours/{peer} median"
                limit = 1.1 if n <= 1000 else 1.0
                targets.append(Target(name, ours / stats[peer]["call"], limit, "x"))
    return stats, rows, targets


def run_events(url: str, prefix: str, kinds: list[str], windows: int, seconds: float,
               loads: list[str]):  # fmt: skip
    """``windows`` interleaved event windows per client: medians, rows, targets."""
    populate(url, prefix, 0, EVENT_ENGINES)
    writer = Writer(url, prefix)
    seen: dict[str, list[dict]] = {kind: [] for kind in kinds}
    try:
        for r in range(windows):
            for kind in rotated(kinds, r):
                seen[kind].append(event_window(kind, url, prefix, writer, seconds))
            loads.append(load_average())
    finally:
        writer.close()
    medians = {
        kind: {
            f"{name}_{q}": percentile([w[name][q] for w in seen[kind]], 50)
            for name in ("visibles", "callbacks")
            for q in ("p50", "p99")
        }
        for kind in kinds
    }
    base = medians.get("raw", {})
    rows = []
    for kind in kinds:
        row = [LABEL[kind]]
        for key, value in medians[kind].items():
            row += [f"{1e3 * value:.0f}", ratio(value, base.get(key))]
        rows.append(row)
    targets = []
    if "ours" in medians and base:
        ours = medians["ours"]
        for what, key, limit in (
            ("put -> pick()-visible p50", "visibles_p50", 1.05),
            ("put -> callback p50", "callbacks_p50", 1.15),
            ("put -> pick()-visible p99", "visibles_p99", 1.3),
            ("put -> callback p99", "callbacks_p99", 1.3),
        ):
            targets.append(Target(f"{what}, ours/raw median", ours[key] / base[key], limit, "x"))
    return {"medians": medians, "windows": seen}, rows, targets


SYNC_FIGURES = ("import", "first_page", "call", "cpu")
SYNC_HEADER = ("records", "client", "import ms", "1st page ms", "call ms", "best", "worst",
               "CPU ms", "call/raw", "total ms", "total/raw")  # fmt: skip
EVENT_HEADER = ("client", "visible p50", "/raw", "p99", "/raw", "callback p50", "/raw", "p99",
                "/raw")  # fmt: skip
ABOUT = (
    "`bench_startup.py`: a new user's path, every sample a new Python process "
    "(bench/_startup_worker.py). Start-up: {rounds} rounds interleaved (order rotated each "
    "round) after one warm-up process per client; `import` is the client's import; `1st page` "
    "and `call` count from the first call (ours: `watch_table(Settings(...)).start()`; the "
    "peers: a new client, pages of 1,000 at one revision, `json.loads` of each value) to the "
    "first page in hand and to the complete table; `CPU`: the process's CPU time over `call` "
    "(every thread); `total` = import + call. Targets judge `call`. Events: 100 records, a new "
    "process per window watching them while the parent puts at 200/s; *visible*: ours where "
    "the store, having published the new snapshot, calls its first sink (a `pick()` from "
    "then on sees it), a peer's dict; *callback*: a `RoutingTable.subscribe` listener (ours), "
    "the watch callback or loop (a peer: the same moment as visible). Ratios are of medians; "
    "the load average is `uptime`'s after each round."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--rounds", type=int, default=7, help="start-up samples per client")
    parser.add_argument("--windows", type=int, default=7, help="event windows per client")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured puts per window")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--profile", action="store_true", help="py-spy our largest start-up")
    parser.add_argument(
        "--baseline", help="also run ours from this copy of the package (the dir of discovery/)"
    )
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.baseline:
        BASELINE["path"] = args.baseline
        kinds.append("baseline")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results: dict = {"sizes": {}}
    targets: list[Target] = []
    rows: list = []
    event_rows: list = []
    loads: list[str] = []
    profiled: list[str] = []
    prefix = f"/inference/v1/{NAMESPACE}/engines/"
    with etcd_cluster(1, extra_args=["--quota-backend-bytes", str(4 * 1024**3)]) as cluster:
        url = cluster.members[0].client_url
        written = 0
        for n in sizes:
            populate(url, prefix, written, n)
            written = n
            stats, more_rows, more_targets = run_syncs(url, prefix, n, kinds, args.rounds, loads)
            results["sizes"][n] = stats
            rows += more_rows
            targets += more_targets
            print(f"{n:,} records done; load average {load_average()}", flush=True)
            if args.profile and n == max(sizes) and "ours" in kinds:
                profiled = profile(url, prefix, n)
        if args.windows:
            events_prefix = f"/inference/v1/{NAMESPACE}-events/engines/"
            results["events"], event_rows, more_targets = run_events(
                url, events_prefix, kinds, args.windows, args.seconds, loads
            )
            targets += more_targets
    results["loads"] = loads
    text = "time to a complete table, fresh process per sample (medians)\n"
    text += table_text(SYNC_HEADER, rows)
    if event_rows:
        text += (
            f"\n\nput -> seen at {RATE:.0f} puts/s, us (median of {args.windows} windows of "
            f"{int(args.seconds * RATE)} puts)\n"
        )
        text += table_text(EVENT_HEADER, event_rows)
    if profiled:  # the top of it; bench/out/startup_profile_N.txt has more
        text += "\n\n" + "\n".join(profiled[:32])
    text += "\n\nload average after each round: " + "; ".join(loads)
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        about = ABOUT.format(rounds=args.rounds)
        record_results("startup", text, targets=targets, about=about)
    write_json("startup", {**results, "targets": targets})


if __name__ == "__main__":
    main()
