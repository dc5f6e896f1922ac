"""Router benchmark: pick latency per policy and load spread under a closed loop.

Run: ``.venv/bin/python bench/bench_router.py`` (add ``--quick`` for a smoke run that records
nothing). Prints a table and records it as its section of bench/RESULTS.md. No etcd: the
routing table is fed in memory, as the watcher would feed it.

* Latency: ``time.perf_counter_ns`` around each ``pick()`` (release is outside the timed
  span), over prompts of 1024 tokens (2 shared system blocks + 2 own blocks, block size 256).
* ``kv_aware`` latency: prompts of 32 blocks (8192 tokens), on an ``EngineStates`` started
  with ``connect=False`` and fed one ``hello`` per engine: 3,000 random block hashes each,
  plus the prompts' prefixes (Megatron's hash). Rows: ``kv_aware`` (one of 32 system
  prompts of 16 blocks, Zipf-like, each held by 4 engines, then 16 own blocks: the policy
  hashes 17 blocks), ``no match`` (no engine holds the first block: 1 block hashed),
  ``full match`` (2 engines hold all 32 blocks: 32 hashed), ``hashes given`` (as
  ``kv_aware``, with ``Router.pick(block_hashes=...)``: computed before the timed span, as
  a frontend keeping each conversation's chain would; nothing hashed). Hashing alone is
  timed too (``block_hashes``), to split the ``kv_aware`` row.
* Admission rows (``, admission``): the same policy with ``Router(wait=0)``: every pick
  checks the engine's capacity (on the router's own handles: no relay here), none waits;
  the target is the median's cost over the same policy without it, at 64 engines.
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
import inspect
import math
import os
import random
import statistics
import time
import tracemalloc
from typing import Any

from _common import Target, memory_table, record_results

from discovery import EngineStates, Router, RoutingPolicy, RoutingTable, block_hashes
from discovery._state.kvstate import pack_hashes

SIZES = (8, 64, 512)
BLOCK = 256
SLOTS = 64
KV_ROW = "kv_aware"
KV_GIVEN = "kv_aware, hashes given"
KV_ROWS = {  # row -> its prompts (make_kv_prompts)
    KV_ROW: "prefix",
    "kv_aware, no match": "none",
    "kv_aware, full match": "full",
    KV_GIVEN: "prefix",  # Router.pick(block_hashes=...): computed beforehand, untimed
}
KV_PROMPT_BLOCKS = 32
KV_HELD = 3000  # random blocks each engine holds besides the prompts' prefixes
TARGETS = {  # (row, engines) -> median target in microseconds (issue 44)
    ("round_robin", 8): 2.0,
    ("round_robin", 64): 2.0,
    ("round_robin", 512): 2.0,
    ("first_prefix_block", 64): 12.0,
    (KV_ROW, 64): 50.0,
    (KV_ROW, 512): 150.0,
    (KV_GIVEN, 64): 15.0,
    (KV_GIVEN, 512): 25.0,
}
TAIL_LIMIT = 5.0  # every target cell's p99 at most this many times its median (issue 44)
# Rows: each policy with its defaults (kv_aware: below), the prefix policies without the bound,
# and admission on (``wait=0``: capacity checked, nothing ever waits: the loop holds one
# request at a time) for the policy it costs most and for the default prefix one.
ADMITTED = ("load_balanced", "first_prefix_block")
ROWS: dict[str, dict[str, Any]] = {
    **{p.value: {"policy": p} for p in RoutingPolicy if p is not RoutingPolicy.KV_AWARE},
    "first_prefix_block c=None": {"policy": "first_prefix_block", "load_factor": None},
    "longest_prefix c=None": {"policy": "longest_prefix", "load_factor": None},
    **{f"{p}, admission": {"policy": p, "wait": 0} for p in ADMITTED},
    "session key": {"policy": "auto"},  # each pick keyed (SESSION_KEYS): the key decides
}
SESSION_ROW = "session key"
SESSION_KEYS = [f"session-{i}" for i in range(4096)]
ADMISSION_LIMIT = 5.0  # us more than the same policy without admission, median @ 64 engines


def make_table(engines: int, *, state_relays: bool = False) -> RoutingTable:
    return memory_table(
        engines,
        state_relays=state_relays,
        context_length=16384 if state_relays else 8192,  # kv_aware's 8192-token prompts fit
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


def pick_latency(
    engines: int,
    row: str,
    prompts: list[list[int]],
    picks: int,
    router: Router | None = None,
    hashes: list[dict[int, list[int]] | None] | None = None,
) -> list[int]:
    router = router or Router(make_table(engines), **ROWS[row])
    given = hashes or [None] * len(prompts)
    keys: list[str | None] = SESSION_KEYS if row == SESSION_ROW else [None]
    for i, (prompt, known) in enumerate(zip(prompts[:500], given, strict=False)):  # warm-up
        router.pick(prompt, 128, block_hashes=known, session_key=keys[i % len(keys)]).release()
    samples = []
    clock = time.perf_counter_ns
    gc.collect()
    for i in range(picks):
        prompt, known = prompts[i % len(prompts)], given[i % len(prompts)]
        key = keys[i % len(keys)]
        start = clock()
        handle = router.pick(prompt, 128, block_hashes=known, session_key=key)
        samples.append(clock() - start)
        handle.release()
    return samples


def load_spread(
    engines: int, row: str, prompts: list[list[int]], steps: int, rng: random.Random
) -> tuple[float, float]:
    router = Router(make_table(engines), **ROWS[row])
    keys: list[str | None] = SESSION_KEYS if row == SESSION_ROW else [None]
    concurrency = engines * SLOTS * 3 // 4
    now = 0.0
    heap: list[tuple[float, int, object]] = []
    counter = 0
    for _ in range(concurrency):
        key = keys[counter % len(keys)]
        handle = router.pick(prompts[counter % len(prompts)], 128, session_key=key)
        heapq.heappush(heap, (rng.expovariate(1.0), counter, handle))
        counter += 1
    ratios = []
    for step in range(steps):
        now, _, done = heapq.heappop(heap)
        done.release()  # type: ignore[attr-defined]
        key = keys[counter % len(keys)]
        handle = router.pick(prompts[counter % len(prompts)], 128, session_key=key)
        heapq.heappush(heap, (now + rng.expovariate(1.0), counter, handle))
        counter += 1
        if step >= steps // 4 and step % 16 == 0:  # after warm-up, every 16th event
            loads = router.in_flight().values()
            ratios.append(max(loads) / (sum(loads) / len(loads)))
    return statistics.fmean(ratios), max(ratios)


def key_places(router: Router, keys: int) -> dict[int, str]:
    places = {}
    for key in range(keys):
        handle = router.pick([1], 1, session_key=key)
        places[key] = handle.engine_id
        handle.release()
    return places


def key_moves(engines: int, keys: int) -> dict[str, float]:
    """Keys that move when an engine leaves (and whether only its own), and when one joins."""
    table = make_table(engines)
    router = Router(table)
    before = key_places(router, keys)
    gone = "engine-007"
    snapshot = table.snapshot()
    from discovery._reads.store import Change  # noqa: PLC0415 - feeding the table by hand

    table.store.apply([Change(f"/k/{gone}", gone, snapshot.revision + 1, None)])
    after = key_places(router, keys)
    moved = [k for k in before if before[k] != after[k]]
    record = snapshot[gone]
    table.store.apply([Change(f"/k/{gone}", gone, snapshot.revision + 2, record)])
    back = key_places(router, keys)
    joined = [k for k in after if after[k] != back[k]]
    return {
        "removed": len(moved) / keys,
        "only_its_own": all(before[k] == gone for k in moved),
        "not_its_own": sum(before[k] != gone for k in moved),
        "added": len(joined) / keys,
    }


def split_share(engines: int, picks: int) -> dict[str, float]:
    """The canaries' share of ``picks`` picks (and keys) under a 95/5 split."""
    from discovery import EngineRecord  # noqa: PLC0415
    from discovery._reads.store import Change  # noqa: PLC0415

    table = make_table(engines)
    snapshot = table.snapshot()
    revision = snapshot.revision
    for index, (engine_id, record) in enumerate(sorted(snapshot.items())):
        track = "canary" if index % 8 == 0 else "stable"
        labelled = EngineRecord(engine_id, record.endpoint, {"track": track})
        revision += 1
        table.store.apply([Change(f"/k/{engine_id}", engine_id, revision, labelled)])
    router = Router(table, split={"track=stable": 95, "track=canary": 5})
    shares = {}
    for kind in ("picks", "keys"):
        canaries = 0
        for i in range(picks):
            handle = router.pick([1], 1, session_key=i if kind == "keys" else None)
            canaries += handle.group == "track=canary"
            handle.release()
        shares[kind] = canaries / picks
    return shares


def routers_agree(engines: int, routers: int, keys: int) -> float:
    """The share of keys every router (each with its own table of the same engines) places
    on the same engine."""
    places = [key_places(Router(make_table(engines)), keys) for _ in range(routers)]
    return sum(len({p[k] for p in places}) == 1 for k in range(keys)) / keys


def make_kv_prompts(
    kind: str, engines: int, rng: random.Random
) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Prompts of 32 blocks and the block hashes each engine holds (``KV_ROWS``)."""
    held = {
        f"engine-{i:03d}": [rng.getrandbits(63) + 1 for _ in range(KV_HELD)] for i in range(engines)
    }
    ids = list(held)
    half = KV_PROMPT_BLOCKS // 2 * BLOCK

    def fresh(count: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(count)]

    if kind == "prefix":
        systems = [fresh(half) for _ in range(32)]
        for system in systems:
            for engine_id in rng.sample(ids, min(4, engines)):
                held[engine_id] += block_hashes(system, BLOCK)
        weights = [1 / (rank + 1) for rank in range(len(systems))]
        prompts = [rng.choices(systems, weights)[0] + fresh(half) for _ in range(4096)]
    elif kind == "full":
        prompts = [fresh(2 * half) for _ in range(256)]
        for prompt in prompts:
            for engine_id in rng.sample(ids, min(2, engines)):
                held[engine_id] += block_hashes(prompt, BLOCK)
    else:
        prompts = [fresh(2 * half) for _ in range(4096)]
    return prompts, held


def kv_router(engines: int, held: dict[str, list[int]]) -> Router:
    """A kv_aware router whose EngineStates is fed a hello per engine (no relay, no thread)."""
    table = make_table(engines, state_relays=True)
    # Fed once, never stale: this measures picks, not relays.
    states = EngineStates(table, stale_after=math.inf).start(connect=False)
    load = {"in_flight": 0, "routers": 1, "yours": 0, "engine": None}
    for engine_id, blocks in held.items():
        states.feed(engine_id, ["hello", 1, 0, pack_hashes(blocks), load])
    return Router(table, policy="kv_aware", states=states)


def hashing_latency(prompts: list[list[int]], count: int, limit: int | None) -> list[int]:
    """``block_hashes`` alone: what the kv_aware rows spend hashing ``limit`` blocks."""
    clock = time.perf_counter_ns
    samples = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        start = clock()
        block_hashes(prompt, BLOCK, limit)
        samples.append(clock() - start)
    return samples


def index_bytes_per_entry(prompts: list[list[int]]) -> tuple[int, float]:
    router = Router(make_table(64), policy="longest_prefix")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for prompt in prompts:
        router.pick(prompt, 128).release()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    index_file = inspect.getfile(type(router._builtins[RoutingPolicy.LONGEST_PREFIX]))
    grown = sum(
        stat.size_diff
        for stat in after.compare_to(before, "filename")
        if stat.traceback[0].filename == index_file
    )
    entries = len(router._builtins[RoutingPolicy.LONGEST_PREFIX]._index)
    return entries, grown / max(entries, 1)


def percentile99(sorted_samples: list[int]) -> float:
    return sorted_samples[int(len(sorted_samples) * 0.99)] / 1000


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
        for row, kind in KV_ROWS.items():
            kv_prompts, held = make_kv_prompts(kind, engines, random.Random(engines))
            router = kv_router(engines, held)
            known = (
                [{BLOCK: block_hashes(p, BLOCK)} for p in kv_prompts] if row == KV_GIVEN else None
            )
            samples = sorted(pick_latency(engines, row, kv_prompts, picks, router, known))
            latency[row, engines] = (samples[len(samples) // 2] / 1000, percentile99(samples))
            del router, held
    hashing = {}
    for blocks in (KV_PROMPT_BLOCKS, 1):
        samples = sorted(hashing_latency(make_kv_prompts("none", 1, rng)[0], picks, blocks))
        hashing[blocks] = (samples[len(samples) // 2] / 1000, percentile99(samples))
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
    moves = key_moves(64, 10_000)
    canary = split_share(64, 10_000)
    agreement = routers_agree(64, 8, 10_000)

    lines = [
        "pick latency in microseconds (median / p99); load spread = max/mean in-flight,",
        f"closed loop at 75% of {SLOTS} slots per engine (time-averaged / peak); @64 distinct:",
        "no shared system prompts (every first block differs); c: the load_factor",
        "",
        f"{'policy':<28}"
        + "".join(f"{f'{n} engines':>16}" for n in SIZES)
        + f"{'spread @8':>14}{'spread @64':>14}{'@64 distinct':>14}",
    ]
    for row in [*ROWS, *KV_ROWS]:
        cells = "".join(f"{latency[row, n][0]:>8.1f} /{latency[row, n][1]:>6.1f}" for n in SIZES)
        spreads = "".join(
            f"{spread[row, n][0]:>7.2f} /{spread[row, n][1]:>5.2f}" if (row, n) in spread else ""
            for n in (8, 64, "distinct")
        )
        lines.append(f"{row:<28}{cells}{spreads}".rstrip())
    per_block = hashing[KV_PROMPT_BLOCKS][0] / KV_PROMPT_BLOCKS
    lines += [
        "",
        f"session keys @64 engines, 10,000 keys: {agreement:.2%} placed on the same engine by "
        "8 routers (tables alike, no load); keys moved when an engine leaves "
        f"{moves['removed']:.2%} (all of them its own: {moves['only_its_own']}), when one "
        f"joins {moves['added']:.2%} (1/N = {1 / 64:.2%}; at most 1.2/N = {1.2 / 64:.2%})",
        f"a 95/5 split over 10,000 picks @64 engines (8 canaries): {canary['picks']:.2%} of "
        f"the picks and {canary['keys']:.2%} of 10,000 session keys went to the canaries",
    ]
    lines += [
        "",
        f"kv_aware rows: prompts of {KV_PROMPT_BLOCKS} blocks of {BLOCK} tokens; Megatron's "
        f"block hashes alone (block_hashes): {KV_PROMPT_BLOCKS} blocks "
        f"{hashing[KV_PROMPT_BLOCKS][0]:.1f} / {hashing[KV_PROMPT_BLOCKS][1]:.1f} us, 1 block "
        f"{hashing[1][0]:.1f} / {hashing[1][1]:.1f} us (median / p99)",
        "split of the kv_aware row (17 blocks hashed: the 16 held, then one held nowhere): "
        + ", ".join(
            f"@{n} {latency[KV_ROW, n][0]:.0f} us = ~{17 * per_block:.0f} hashing + "
            f"~{latency[KV_ROW, n][0] - 17 * per_block:.0f} the rest "
            f"({KV_GIVEN}: {latency[KV_GIVEN, n][0]:.0f})"
            for n in SIZES
        ),
    ]
    targets = [
        Target(f"pick median, {row} @ {engines}", latency[row, engines][0], limit, "us")
        for (row, engines), limit in TARGETS.items()
    ]
    targets += [
        Target(
            f"pick p99 / median, {row} @ {engines}",
            latency[row, engines][1] / latency[row, engines][0],
            TAIL_LIMIT,
            "x",
        )
        for row, engines in TARGETS
    ]
    targets += [
        Target(f"pick median, {SESSION_ROW} @ 64", latency[SESSION_ROW, 64][0], 25.0, "us"),
        Target("session keys placed alike by 8 routers, missing", 100 * (1 - agreement), 0, "%"),
        Target("session keys moved by a departure, not its own", moves["not_its_own"], 0, "keys"),
        Target("session keys moved by an arrival, x 1/N", moves["added"] * 64, 1.2, "x"),
        Target("95/5 split, canary share off 5%", 100 * abs(canary["picks"] - 0.05), 1, "points"),
        Target("95/5 split by key, off 5%", 100 * abs(canary["keys"] - 0.05), 1, "points"),
    ]
    targets += [
        Target(
            f"admission's cost, {p} @ 64 (median, on minus off)",
            latency[f"{p}, admission", 64][0] - latency[p, 64][0],
            ADMISSION_LIMIT,
            "us",
        )
        for p in ADMITTED
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
