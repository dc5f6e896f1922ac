"""Run every benchmark (issues 7 and 16), then plot, summarise and rewrite RESULTS.md.

Run: ``.venv/bin/python bench/run_all.py`` (about 50 minutes on 2 cores, 9 of them the
failure catalogue, 20 bench_startup.py's fresh processes, doubled by the busy runs). Each
benchmark runs as its own process (``bench/bench_<name>.py``), twice (issue 44): idle, then
beside one CPU-burning process, recorded as <name>.busy (``--idle-only``: the first only;
bench_megatron.py and bench_serve.py take both phases themselves). Each prints its table and
records the run: its section
replaces bench/results/<name>.md (the previous one moves to bench/history/<name>.md) and
its targets bench/results/<name>.targets.json. This script then draws bench/latency.png (latency
distributions, ours vs raw; detection times; churn lag; new-watcher times; only if one of
those ran), prints every target of the run, met or missed, and rewrites bench/RESULTS.md
from the latest section of every benchmark. ``--quick`` is a smoke run with small counts
that records nothing (its plot goes to bench/out/); ``--only latency,codec`` runs some;
``--plot-only`` redraws from bench/out/*.json; ``--page-only`` only rewrites RESULTS.md
(after editing bench/notes/). bench_router.py and bench_routing_quality.py start no etcd
(minutes of CPU each). bench_failures.py also rewrites the failure tables
(docs/failures.md, README).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    BENCH,
    BUSY,
    BUSY_ENV,
    OUT,
    PLOT,
    PLOTTED,
    Target,
    burners,
    percentile,
    read_json,
    render_page,
    table_text,
)

# Every bench/bench_<name>.py (tests/test_bench.py checks): its arguments for a full run, and
# for --quick (which records nothing: --no-results, or --quick where that says so).
BENCHMARKS = {
    "latency": ([], ["--count", "100", "--no-results"]),
    "detection": ([], ["--kills", "4", "--terms", "4", "--batch", "4", "--no-results"]),
    "scale": ([], ["--sizes", "1000,3000", "--window", "10", "--watchers", "2", "--no-results"]),
    "churn": ([], ["--seconds", "5", "--no-results"]),
    "codec": ([], ["--records", "2000", "--no-results"]),
    "sync": (["--profile"], ["--sizes", "2000", "--rounds", "1", "--no-results"]),
    "startup": (
        ["--profile"],
        ["--sizes", "1000", "--rounds", "1", "--windows", "1", "--seconds", "1", "--no-results"],
    ),
    "fanout": ([], ["--watchers", "10,50", "--events", "40", "--no-results"]),
    "sessions": ([], ["--count", "300", "--sizes", "1,100", "--no-results"]),
    "relay": ([], ["--engines", "10", "--events", "20", "--hashes", "8", "--no-results"]),
    "pairs": ([], ["--quick", "--no-results"]),
    "overload": ([], ["--seconds", "15", "--no-results"]),
    "failures": (
        [],
        ["--runs", "1", "--only", "launch-death,register-death,drain", "--no-results"],
    ),
    "fleet": ([], ["--no-results"]),
    "megatron": ([], ["--rounds", "1", "--no-results"]),
    "serve": ([], ["--rounds", "1", "--requests", "200", "--no-results"]),
    "router": ([], ["--quick"]),
    "hashing": ([], ["--rounds", "200", "--no-results"]),
    "routing_quality": ([], ["--quick"]),
}
# These take each figure idle and beside a burner themselves (their targets name the phase).
BUSY_ITSELF = ("megatron", "serve", "hashing")


def run(names: list[str], quick: bool, idle_only: bool) -> dict[str, float]:
    took = {}
    for name in names:
        full, small = BENCHMARKS[name]
        command = [sys.executable, str(BENCH / f"bench_{name}.py"), *(small if quick else full)]
        busy = not (quick or idle_only or name in BUSY_ITSELF)
        for phase in ("idle", "busy") if busy else ("idle",):
            env = {**os.environ, BUSY_ENV: "1"} if phase == "busy" else None
            print(f"\n=== {' '.join(command[1:])} ({phase})", flush=True)
            t0 = time.monotonic()
            with burners(1 if phase == "busy" else 0):
                subprocess.run(command, check=True, env=env)
            took[name + ("" if phase == "idle" else BUSY)] = time.monotonic() - t0
    return took


def cdf(ax, values: list[float], label: str, **style) -> None:
    data = sorted(values)
    n = len(data)
    ax.plot(data, [(i + 1) / n for i in range(n)], label=label, **style)


def plot(path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the plot needs it (bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    latency, detection = read_json("latency"), read_json("detection")
    churn, scale = read_json("churn"), read_json("scale")

    if latency:
        s = latency["samples"]
        ax = axes[0][0]
        cdf(ax, s["raw"]["write_event"], "raw etcd3: put -> callback", color="black")
        cdf(ax, s["raw_txn"]["write_event"], "raw etcd3: our txn -> callback", color="gray")
        cdf(ax, s["ours"]["write_event"], "ours: record txn -> table listener", color="C0")
        cdf(ax, s["ours_raw_write"]["write_event"], "ours: raw put -> table listener", color="C2")
        ax.set(xscale="log", xlabel="ms", ylabel="fraction of samples")
        ax.set_title(f"record write -> added (n={latency['count']} each)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        ax = axes[0][1]
        cdf(ax, s["raw"]["reg_event"], "raw etcd3: lease + put -> callback", color="black")
        cdf(ax, s["ours"]["reg_event"], "ours: register_engine -> table listener", color="C0")
        cdf(ax, s["raw"]["remove"], "raw etcd3: revoke -> delete callback", color="gray", ls="--")
        cdf(ax, s["ours"]["remove"], "ours: close() -> table removed", color="C1", ls="--")
        ax.set(xscale="log", xlabel="ms", ylabel="fraction of samples")
        ax.set_title("whole registration (lease grant + write), and removal")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    if detection:
        ttl = detection["ttl"]
        ax = axes[0][2]
        kills = detection["sigkill"]
        ax.hist(kills, bins=20, color="C3", alpha=0.8, label=f"SIGKILL (n={len(kills)})")
        ax.axvline(ttl, color="black", ls=":", label=f"TTL {ttl:g} s")
        ax.axvline(ttl + 1.5, color="red", ls="--", label="target max: TTL + 1.5 s")
        ax.set(xlabel="s from SIGKILL to removed", ylabel="registrars")
        ax.set_title("failure detection, SIGKILL")
        ax.legend(fontsize=8)
        ax = axes[1][0]
        terms = [t * 1000 for t in detection["sigterm"]]
        ax.hist(terms, bins=20, color="C4", alpha=0.8, label=f"SIGTERM (n={len(terms)})")
        ax.axvline(percentile(terms, 50), color="black", ls=":", label="p50")
        ax.set(xlabel="ms from SIGTERM to removed", ylabel="registrars")
        ax.set_title("failure detection, SIGTERM (target p50 <= 100 ms)")
        ax.legend(fontsize=8)
    if churn:
        ax = axes[1][1]
        # A delay <= 0: the table had applied the revision before the writer process
        # noted its own response (the event and the response race).
        cdf(ax, churn["delays_ms"], "writer's response -> table applied", color="C0")
        lags = [lag for _, lag in churn["lags"]]
        ax.set(xlabel="ms", ylabel="fraction of transactions")
        ax.set_title(
            f"churn {churn.get('rate', 10000):,.0f} changes/s: lag p99 "
            f"{percentile(lags, 99):.0f} revision(s)"
        )
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    if scale:
        ax = axes[1][2]
        rows = scale["results"]
        sizes = [r["engines"] for r in rows]
        ax.plot(sizes, [max(r["watch_s"]) for r in rows], "o-", label="new watcher, worst")
        ax.plot(sizes, [min(r["watch_s"]) for r in rows], "o-", label="new watcher, best")
        if all("watch_alone_s" in r for r in rows):
            alone = [max(r["watch_alone_s"]) for r in rows]
            ax.plot(sizes, alone, "o--", label="new watcher, worst, fleet paused")
        targets = {1000: 0.3, 10000: 1.0, 50000: 5.0}
        ax.plot(list(targets), list(targets.values()), "r--", label="target")
        ax.set(xscale="log", yscale="log", xlabel="registered engines", ylabel="s")
        ax.set_title("scale: time to a complete table")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: PLC0415

    for ax in (axes[0][0], axes[0][1]):
        ax.set_xticks([0.5, 0.7, 1, 1.5, 2, 3, 5])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def summary(names: list[str]) -> str:
    rows = []
    for name in (n + phase for n in names for phase in ("", BUSY)):
        data = read_json(name)
        for t in (data or {}).get("targets", []):
            target = Target(**t)
            rows.append(
                (
                    target.name + (", busy" if name.endswith(BUSY) else ""),
                    f"{target.measured} {target.unit}",
                    target.bound,
                    target.verdict,
                )
            )
    return table_text(("target", "measured", "limit", "verdict"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts; nothing recorded")
    parser.add_argument("--only", help="comma-separated subset of " + ",".join(BENCHMARKS))
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--page-only", action="store_true", help="only rewrite RESULTS.md")
    parser.add_argument("--idle-only", action="store_true", help="no run beside a burner")
    args = parser.parse_args()
    if not args.page_only:
        names = args.only.split(",") if args.only else list(BENCHMARKS)
        took = {} if args.plot_only else run(names, args.quick, args.idle_only)
        if set(names) & set(PLOTTED):  # its panels: a run of none of them leaves it alone
            OUT.mkdir(exist_ok=True)
            plot(OUT / PLOT.name if args.quick else PLOT)
        text = summary(names)
        if took:
            text += "\n\nwall time: " + ", ".join(f"{n} {s:.0f} s" for n, s in took.items())
        print(text)
    if not args.quick:
        render_page()


if __name__ == "__main__":
    main()
