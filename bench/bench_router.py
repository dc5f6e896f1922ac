"""Router benchmark: pick latency per policy and load spread under a closed loop.

Run: ``.venv/bin/python bench/bench_router.py`` (add ``--quick`` for a smoke run that records
nothing). Prints a table and records it as its section of bench/RESULTS.md. No etcd: the
routing table is fed in memory, as the watcher would feed it.

* Latency: ``time.perf_counter_ns`` around each ``pick()`` (release is outside the timed
  span), over prompts of 1024 tokens (2 shared system blocks + 2 own blocks, block size 256).
* Spread: a discrete-event closed loop over the same prompts (32 shared system prompts,
  Zipf-like popularity) and over distinct prompts. Clients at 75% of the fleet's slots
  each send a request, hold the handle for an exponentially distributed time, release it
  and send the next. After a warm-up, every 16th event samples max / mean in-flight over
  the engines; the table shows the average of that ratio (1.00 = even) and its peak.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import os
import random
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from _common import Target, memory_table, record_results

from discovery import Router, RoutingPolicy, RoutingTable

SIZES = (8, 64, 512)
BLOCK = 256
SLOTS = 64
TARGETS = {  # (row, engines) -> median target in microseconds
    ("round_robin", 8): 5.0,
    ("round_robin", 64): 5.0,
    ("round_robin", 512): 5.0,
    ("first_prefix_block", 64): 30.0,
}
# Rows: each policy with its defaults, and the two prefix policies without the load bound.
ROWS: dict[str, dict[str, Any]] = {
    **{p.value: {"policy": p} for p in RoutingPolicy},
    "first_prefix_block c=None": {"policy": "first_prefix_block", "load_factor": None},
    "longest_prefix c=None": {"policy": "longest_prefix", "load_factor": None},
}


def make_table(engines: int) -> RoutingTable:
    return memory_table(
        engines,
        context_length=8192,
        kv_cache_block_size=BLOCK,
        total_kv_blocks=4000,
        max_num_seqs=SLOTS,
    )


def make_prompts(count: int, systems: int, rng: random.Random) -> list[list[int]]:
    """Prompts of 4 blocks: one of ``systems`` shared 2-block prefixes, then 2 own blocks."""
    if not systems:
        return [[rng.randrange(32000) for _ in range(4 * BLOCK)] for _ in range(count)]
    shared = [[rng.randrange(32000) for _ in range(2 * BLOCK)] for _ in range(systems)]
    weights = [1 / (rank + 1) for rank in range(systems)]  # Zipf-like popularity
    return [
        rng.choices(shared, weights)[0] + [rng.randrange(32000) for _ in range(2 * BLOCK)]
        for _ in range(count)
    ]


def pick_latency(engines: int, row: str, prompts: list[list[int]], picks: int) -> list[int]:
    router = Router(make_table(engines), **ROWS[row])
    for prompt in prompts[:500]:  # warm-up: the router's derived state and the index
        router.pick(prompt, 128).release()
    samples = []
    clock = time.perf_counter_ns
    gc.collect()
    for i in range(picks):
        prompt = prompts[i % len(prompts)]
        start = clock()
        handle = router.pick(prompt, 128)
        samples.append(clock() - start)
        handle.release()
    return samples


def load_spread(
    engines: int, row: str, prompts: list[list[int]], steps: int, rng: random.Random
) -> tuple[float, float]:
    router = Router(make_table(engines), **ROWS[row])
    concurrency = engines * SLOTS * 3 // 4
    now = 0.0
    heap: list[tuple[float, int, object]] = []
    counter = 0
    for _ in range(concurrency):
        handle = router.pick(prompts[counter % len(prompts)], 128)
        heapq.heappush(heap, (rng.expovariate(1.0), counter, handle))
        counter += 1
    ratios = []
    for step in range(steps):
        now, _, done = heapq.heappop(heap)
        done.release()  # type: ignore[attr-defined]
        handle = router.pick(prompts[counter % len(prompts)], 128)
        heapq.heappush(heap, (now + rng.expovariate(1.0), counter, handle))
        counter += 1
        if step >= steps // 4 and step % 16 == 0:  # after warm-up, every 16th event
            loads = router.in_flight().values()
            ratios.append(max(loads) / (sum(loads) / len(loads)))
    return statistics.fmean(ratios), max(ratios)


def index_bytes_per_entry(prompts: list[list[int]]) -> tuple[int, float]:
    router = Router(make_table(64), policy="longest_prefix")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for prompt in prompts:
        router.pick(prompt, 128).release()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    index_file = str(Path(__file__).resolve().parent.parent / "discovery" / "_policies.py")
    grown = sum(
        stat.size_diff
        for stat in after.compare_to(before, "filename")
        if stat.traceback[0].filename == index_file
    )
    entries = len(router._builtins[RoutingPolicy.LONGEST_PREFIX]._index)
    return entries, grown / max(entries, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, nothing recorded")
    args = parser.parse_args()
    picks = 2_000 if args.quick else 20_000
    steps = 4_000 if args.quick else 40_000
    rng = random.Random(1234)
    prompts = make_prompts(4096, 32, rng)

    latency: dict[tuple[str, int], tuple[float, float]] = {}
    for engines in SIZES:
        for row in ROWS:
            samples = sorted(pick_latency(engines, row, prompts, picks))
            p50 = samples[len(samples) // 2] / 1000
            p99 = samples[int(len(samples) * 0.99)] / 1000
            latency[row, engines] = (p50, p99)
    spread = {
        (row, engines): load_spread(engines, row, prompts, steps, random.Random(7))
        for engines in (8, 64)
        for row in ROWS
    }
    # Without shared system prompts every first block is distinct: rendezvous balance alone.
    distinct = make_prompts(4096, 0, rng)
    for row in ROWS:
        spread[row, "distinct"] = load_spread(64, row, distinct, steps, random.Random(7))
    entries, per_entry = index_bytes_per_entry(prompts)

    lines = [
        "pick latency in microseconds (median / p99); load spread = max/mean in-flight,",
        f"closed loop at 75% of {SLOTS} slots per engine (time-averaged / peak); @64 distinct:",
        "no shared system prompts (every first block differs); c: the load_factor",
        "",
        f"{'policy':<28}"
        + "".join(f"{f'{n} engines':>16}" for n in SIZES)
        + f"{'spread @8':>14}{'spread @64':>14}{'@64 distinct':>14}",
    ]
    for row in ROWS:
        cells = "".join(f"{latency[row, n][0]:>8.1f} /{latency[row, n][1]:>6.1f}" for n in SIZES)
        spreads = "".join(
            f"{spread[row, n][0]:>7.2f} /{spread[row, n][1]:>5.2f}" for n in (8, 64, "distinct")
        )
        lines.append(f"{row:<28}{cells}{spreads}")
    targets = [
        Target(f"pick median, {row} @ {engines}", latency[row, engines][0], limit, "us")
        for (row, engines), limit in TARGETS.items()
    ]
    lines += ["", *(t.line() for t in targets)]
    lines.append(f"longest-prefix index: {entries} entries, ~{per_entry:.0f} bytes per entry")
    report = "\n".join(lines)
    print(report)
    print("load average:", ", ".join(f"{value:.2f}" for value in os.getloadavg()))
    if not args.quick:
        about = f"{picks} picks per latency cell, {steps} closed-loop events per spread cell."
        record_results("router", report, about=about, targets=targets)


if __name__ == "__main__":
    main()
