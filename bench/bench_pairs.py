"""Prefill/decode pairs: cache hits, decode spread, racks, skipped hops and pick cost.

Run: ``.venv/bin/python bench/bench_pairs.py`` (a few CPU minutes; ``--quick`` simulates
40 s instead of 120 s, fewer latency samples, and records nothing). Seeded. No etcd: the
routing tables are fed in memory, every request is paired by a real ``Router.pick_pair``
and what the engines report reaches each router's real ``EngineStates`` as the relays'
messages, in simulated time (bench_routing_quality.py's model, whose workload pieces,
engines and block hashes this reuses).

**Fleet**: 8 prefill and 8 decode engines in 4 racks (2 of each per rack, label ``rack``),
nixl and one layout, so every prefill engine can hand off to every decode engine; in the
conditional rows also 4 aggregated engines (one per rack). 32 slots each
(``max_num_seqs``, the router's admission capacity: ``Router(wait=0)``; a pick that
finds no room is retried by the frontend 0.1 s later), 256-token blocks, a prefix cache
of 1024 blocks on every engine that computes prompts.

**Workload** (``mixed``): bench_routing_quality's chat conversations (256 system prompts
with Zipf popularity, mean 3 turns, each turn's prompt extending the previous one, user
messages median 150 tokens, answers median 200), with system prompts of 128 to 4096
tokens, so some conversations start below ``alone_below`` (512 tokens).

**A request**: a pair's prefill engine computes the prompt (cached prefix found, then the
prompt's blocks cached: Megatron's ``stored`` events, relayed; 0.05 s + 0.4 ms per
uncached token, in one of its slots) and releases its handle; the decode engine then
generates (10 ms for the hand-off + 20 ms per token) and releases. A decode engine relays
no cached block (Megatron sends none for imported blocks). An aggregated engine serving
alone does both in one slot, and caches prompt and answer (the next turn extends them).

**Routers**: 1 or 4, each request to one at random; each with its own table and
``EngineStates`` fed the relays' ``hello``, ``kv`` (10 ms late) and ``load`` frames
(every router's reports summed, every 0.1 s). Rows: the defaults (prefill by
``kv_aware`` on the relayed caches, decode by load) with ``pair_within="rack"``
required, preferred (also at an offered load of 0.95, where a rack runs out of room),
and not asked; round robin on both sides (no cache, no load: the
baseline); and with the aggregated engines allowed (``allow_aggregated``,
``alone_below`` 512, rack preferred) at ``alone_share`` 0.5, 0.9 (the default) and 1.0.

**Figures** (after a 30 s warm-up): prefill hit rate = prompt tokens found cached on the
prefill engine / prompt tokens, over the paired requests; decode peak spread = max / mean
in-flight over the decode engines, sampled every 0.25 s, the peak; in rack = paired
requests whose two engines share the rack; out, room = paired requests outside the prefill
engine's rack while a decode engine there had a free slot (by every router's handles), of
those whose rack had one (the target's "when room exists"); alone = requests served
without the prefill hop, against ``rule``: those the rule admits by the simulated caches
at pick time (the routers see them through the relays, 10 ms late); retried = picks
retried for room.

**Pick cost**: ``pick_pair`` against ``pick`` (the direct path: one engine) on the same
router, fleets of 16 and 128 engines (half prefill, half decode, 4 racks), prompts of 4
blocks with their hashes given, the engines' states fed once (random blocks plus the
prompts' prefixes); median and p99 of ``time.perf_counter_ns`` around the call.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import gc
import heapq
import itertools
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from _common import Target, percentile, record_results, table_text
from bench_routing_quality import (
    BLOCK,
    CONTEXT,
    EPOCH,
    KV_DELAY,
    TICK,
    Chain,
    Conversation,
    Engine,
    Workload,
    draw_turns,
    lognormal,
    segment,
)

from discovery import (
    EngineRecord,
    EngineStates,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    KvLayout,
    OverloadedError,
    PickPair,
    PrefixCachingCoordinatorPolicy,
    Router,
    RoutingTable,
    block_hashes,
)
from discovery._reads.store import EngineStore, Entry
from discovery._routing.pairs import DEFAULT_ALONE_BELOW, DEFAULT_ALONE_SHARE
from discovery._state.engine_states import REPORT_INTERVAL
from discovery._state.kvstate import pack_hashes
from discovery._state.relay import LOAD_INTERVAL

RACKS = 4
SLOTS = 32
PREFILL, DECODE, AGGREGATED = 8, 8, 4
LAYOUT = KvLayout(
    tp_size=2, pp_size=1, num_layers_global=32, num_kv_heads_global=8, head_dim=128,
    dtype="bfloat16",
)  # fmt: skip
HANDOFF_SECONDS = 0.01
RETRY_SECONDS = 0.1
WARM = 30.0
WORK = Workload(system_tokens=(128, 4096), load=0.7, seconds=120.0)
# Event kinds: new conversation, next turn, prefill done, decode done, spread sample, a KV
# increment reaching the routers, routers reporting their counts, relays sending loads.
START, ARRIVE, PREFILLED, DONE, TICKS, KV, REPORT, LOADS = range(8)


# -- the fleet -----------------------------------------------------------------------------


def fleet_records(prefill: int, decode: int, aggregated: int) -> list[EngineRecord]:
    """The engines, ``rack`` label round robin over RACKS; prefill and decode pair freely."""
    caps = InferenceEngineCapabilities(
        context_length=CONTEXT,
        kv_cache_block_size=BLOCK,
        total_kv_blocks=WORK.cache_blocks,
        max_num_seqs=SLOTS,
        max_num_batched_tokens=8192,
        bos_token_id=1,
        enable_prefix_caching=True,
        prefix_caching_coordinator_policy=PrefixCachingCoordinatorPolicy.LONGEST_PREFIX,
    )
    records = []
    for role, count in (("prefill", prefill), ("decode", decode), ("aggregated", aggregated)):
        for i in range(count):
            n = len(records)
            records.append(
                EngineRecord(
                    f"{role[0]}{i:03d}",
                    InferenceEngineEndpoint(f"tcp://10.0.{n // 250}.{n % 250}:5555", caps),
                    {"rack": f"r{i % RACKS}"},
                    state_address=f"tcp://10.1.{n // 250}.{n % 250}:5556",
                    role=role,
                    kv_transfer_backend=None if role == "aggregated" else "nixl",
                    kv_layout=None if role == "aggregated" else LAYOUT,
                )
            )
    return records


def make_table(records: Sequence[EngineRecord]) -> RoutingTable:
    table = RoutingTable(EngineStore())
    table.store.replace({r.engine_id: Entry(f"/k/{r.engine_id}", r, 1) for r in records}, 1)
    return table


# -- the rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """How a row's routers are built and what each pick asks."""

    policy: str = "kv_aware"
    decode_policy: str = "load_balanced"
    within: str | None = "rack"
    required: bool = False
    alone_share: float | None = None
    """None: no aggregated engine in the fleet, ``allow_aggregated`` off."""
    load: float | None = None
    """The offered load, if not the workload's."""

    @property
    def aggregated(self) -> bool:
        return self.alone_share is not None


ROWS = {
    "rack required": Row(required=True),
    "rack preferred": Row(),
    "rack not asked": Row(within=None),
    "rack required, load 0.95": Row(required=True, load=0.95),
    "rack preferred, load 0.95": Row(load=0.95),
    "round robin both sides": Row("round_robin", "round_robin", within=None),
    **{
        f"alone_share {share:g}": Row(alone_share=share)
        for share in (0.5, DEFAULT_ALONE_SHARE, 1.0)
    },
}


@dataclass
class Outcome:
    hit_rate: float
    spread_peak: float
    spread_mean: float
    in_rack: float
    away_with_room: float
    """Paired requests outside the prefill engine's rack though a decode engine there had a
    free slot, of those whose rack had one."""
    alone: float
    rule: float
    disagree: int
    requests: int
    retried: int
    cpu_seconds: float


@dataclass
class Request:
    conv: Conversation
    answer: int
    front: int
    pair: PickPair
    prefill: Engine | None
    decode: Engine
    measured: bool


class Simulation:
    """One cell: the fleet, ``routers`` routers, one row (module docs)."""

    def __init__(self, row: Row, routers: int, work: Workload, seed: int) -> None:
        self.row, self.work = row, work
        random.seed(f"policies/{seed}")
        self.rng = random.Random(seed)
        self.route_rng = random.Random(f"routers/{seed}")
        records = fleet_records(PREFILL, DECODE, AGGREGATED if row.aggregated else 0)
        self.engines = [Engine(r.engine_id, i, work.cache_blocks) for i, r in enumerate(records)]
        self.by_id = {e.engine_id: e for e in self.engines}
        self.rack = {r.engine_id: r.labels["rack"] for r in records}
        self.decodes = [e for e, r in zip(self.engines, records, strict=True) if r.role == "decode"]
        self.aggregated = [
            e for e, r in zip(self.engines, records, strict=True) if r.role == "aggregated"
        ]
        self.states: list[EngineStates] = []
        self.routers: list[Router] = []
        for _ in range(routers):
            table = make_table(records)
            states = EngineStates(table, stale_after=math.inf).start(connect=False)
            load = {"in_flight": 0, "routers": routers, "yours": 0, "engine": None}
            for engine in self.engines:
                states.feed(engine.engine_id, ["hello", EPOCH, 0, b"", load])
            self.states.append(states)
            self.routers.append(Router(table, policy=row.policy, states=states, wait=0))
        n = len(self.engines)
        self.own = [[0] * n for _ in range(routers)]  # each router's handles per engine
        self.report = [[0] * n for _ in range(routers)]  # what it last reported
        self.sent = [-1] * n
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()

    def push(self, when: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def publish(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Cache ``hashes`` on ``engine``; its stored and removed blocks, relayed."""
        for kind, changed in zip(("stored", "removed"), engine.store(hashes), strict=True):
            if changed:
                engine.seq += 1
                message = ["kv", EPOCH, engine.seq, kind, pack_hashes(changed)]
                self.push(now + KV_DELAY, KV, (engine.engine_id, message))

    def relay_loads(self) -> None:
        """Each relay whose summed report changed sends every router its load view."""
        for engine in self.engines:
            total = sum(report[engine.index] for report in self.report)
            if total == self.sent[engine.index]:
                continue
            self.sent[engine.index] = total
            for states, report in zip(self.states, self.report, strict=True):
                load = {"in_flight": total, "routers": len(self.states)}
                load |= {"yours": report[engine.index], "engine": None}
                states.feed(engine.engine_id, ["load", EPOCH, load])

    def rule_says_alone(self, conv: Conversation) -> bool:
        """Whether the skip rule admits this prompt, by the simulated caches themselves."""
        if not self.aggregated:
            return False
        if len(conv.tokens) < DEFAULT_ALONE_BELOW:
            return True
        blocks = len(conv.tokens) // BLOCK
        best = max(e.cached_blocks(conv.chain.hashes) for e in self.aggregated)
        share = self.row.alone_share
        return share is not None and bool(blocks) and best / blocks >= share

    def run(self) -> Outcome:
        started = time.process_time()
        rng, work, row = self.rng, self.work, self.row
        systems = [list(segment(rng, rng.randint(*work.system_tokens))) for _ in range(256)]
        chains = []
        for system in systems:
            chain = Chain()
            chain.extend(system)
            chains.append(chain)
        cumulative = list(itertools.accumulate(1 / k**work.zipf_s for k in range(1, 257)))
        rate = work.load * len(self.decodes) * SLOTS / decode_seconds_per_conversation(work)
        push = self.push
        push(rng.expovariate(rate), START, None)
        push(0.0, TICKS, None)
        push(REPORT_INTERVAL, REPORT, None)
        push(LOAD_INTERVAL + REPORT_INTERVAL / 2, LOADS, None)
        hit = prompt = paired = in_rack = alone = rule = disagree = requests = retried = 0
        roomy = away = 0
        spreads: list[float] = []
        ask = {
            "pair_within": row.within,
            "require_within": row.required,
            "decode_policy": row.decode_policy,
            "allow_aggregated": row.aggregated,
            "alone_share": row.alone_share,
        }

        def start_work(engine: Engine, request: Request, now: float) -> None:
            """A slot on ``engine``: prefill (or the whole request alone), or decode."""
            nonlocal hit, prompt
            conv = request.conv
            engine.running += 1
            if engine is request.decode and request.prefill is not None:
                push(now + HANDOFF_SECONDS + 0.02 * request.answer, DONE, request)
                return
            found = engine.cached_blocks(conv.chain.hashes) * BLOCK
            self.publish(engine, conv.chain.hashes, now)
            if request.measured and request.prefill is not None:
                hit += found
                prompt += len(conv.tokens)
            seconds = 0.05 + 0.0004 * (len(conv.tokens) - found)
            if request.prefill is None:  # alone: the answer too, in the same slot
                push(now + seconds + 0.02 * request.answer, DONE, request)
            else:
                push(now + seconds, PREFILLED, request)

        def enter(engine: Engine, request: Request, now: float) -> None:
            if engine.running < SLOTS:
                start_work(engine, request, now)
            else:
                engine.queue.append(request)

        def leave(engine: Engine, front: int, now: float) -> None:
            engine.running -= 1
            self.own[front][engine.index] -= 1
            if engine.queue:
                start_work(engine, engine.queue.popleft(), now)

        def arrive(conv: Conversation, answer: int, now: float) -> None:
            nonlocal requests, retried, paired, in_rack, alone, rule, disagree, roomy, away
            front = self.route_rng.randrange(len(self.routers))
            should = self.rule_says_alone(conv)
            try:
                pair = self.routers[front].pick_pair(
                    conv.tokens, answer, block_hashes={BLOCK: conv.chain.hashes}, **ask
                )
            except OverloadedError:
                retried += 1
                push(now + RETRY_SECONDS, ARRIVE, (conv, answer))
                return
            measured = now >= WARM
            decode = self.by_id[pair.decode.engine_id]
            prefill = None if pair.prefill is None else self.by_id[pair.prefill.engine_id]
            request = Request(conv, answer, front, pair, prefill, decode, measured)
            if measured and prefill is not None:
                rack = self.rack[prefill.engine_id]
                room = any(
                    sum(own[d.index] for own in self.own) < SLOTS
                    for d in self.decodes
                    if self.rack[d.engine_id] == rack
                )
                roomy += room
                away += room and self.rack[decode.engine_id] != rack
            for engine in (prefill, decode):
                if engine is not None:
                    self.own[front][engine.index] += 1
            requests += 1
            if measured:
                alone += pair.alone
                rule += should
                disagree += pair.alone != should
                if prefill is not None:
                    paired += 1
                    in_rack += self.rack[prefill.engine_id] == self.rack[decode.engine_id]
            enter(decode if prefill is None else prefill, request, now)

        def next_turn(conv: Conversation, now: float) -> None:
            conv.tokens.extend(segment(rng, lognormal(rng, 150, 1.0, 8, 2048)))
            conv.chain.extend(conv.tokens)
            answer = min(lognormal(rng, 200, 0.8, 8, 1024), CONTEXT - len(conv.tokens))
            arrive(conv, answer, now)

        events = self.events
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > work.seconds:
                break
            if kind == START:
                index = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
                conv = Conversation(systems[index], chains[index], draw_turns(rng, work), 0)
                next_turn(conv, now)
                push(now + rng.expovariate(rate), START, None)
            elif kind == ARRIVE:
                if isinstance(payload, Conversation):
                    next_turn(payload, now)
                else:
                    arrive(*payload, now)  # type: ignore[misc]  # a retry
            elif kind == PREFILLED:
                request: Request = payload  # type: ignore[assignment]
                assert request.prefill is not None and request.pair.prefill is not None
                leave(request.prefill, request.front, now)
                request.pair.prefill.release()
                enter(request.decode, request, now)
            elif kind == DONE:
                request = payload  # type: ignore[assignment]
                leave(request.decode, request.front, now)
                request.pair.decode.release()
                conv = request.conv
                conv.tokens.extend(segment(rng, request.answer))
                conv.chain.extend(conv.tokens)
                if request.prefill is None:  # the aggregated engine caches the answer too
                    self.publish(request.decode, conv.chain.hashes, now)
                conv.turns -= 1
                if conv.turns and CONTEXT - len(conv.tokens) - 2048 - 1024 > 0:
                    push(now + rng.expovariate(1 / work.think_seconds), ARRIVE, conv)
            elif kind == KV:
                engine_id, message = payload  # type: ignore[misc]
                for states in self.states:
                    states.feed(engine_id, message)
            elif kind == REPORT:
                for own, report in zip(self.own, self.report, strict=True):
                    report[:] = own
                push(now + REPORT_INTERVAL, REPORT, None)
            elif kind == LOADS:
                self.relay_loads()
                push(now + LOAD_INTERVAL, LOADS, None)
            else:
                if now >= WARM:
                    loads = [sum(own[e.index] for own in self.own) for e in self.decodes]
                    mean = sum(loads) / len(loads)
                    if mean:
                        spreads.append(max(loads) / mean)
                push(now + TICK, TICKS, None)
        for states in self.states:
            states.stop()
        served = alone + paired
        return Outcome(
            hit_rate=hit / max(prompt, 1),
            spread_peak=max(spreads),
            spread_mean=sum(spreads) / len(spreads),
            in_rack=in_rack / max(paired, 1),
            away_with_room=away / max(roomy, 1),
            alone=alone / max(served, 1),
            rule=rule / max(served, 1),
            disagree=disagree,
            requests=requests,
            retried=retried,
            cpu_seconds=time.process_time() - started,
        )


def decode_seconds_per_conversation(work: Workload, samples: int = 20_000) -> float:
    """Mean seconds a conversation holds decode handles, nothing cached (Monte Carlo)."""
    rng = random.Random(0)
    total = 0.0
    for _ in range(samples):
        prompt = rng.randint(*work.system_tokens)
        for _ in range(draw_turns(rng, work)):
            prompt += lognormal(rng, 150, 1.0, 8, 2048)
            answer = lognormal(rng, 200, 0.8, 8, 1024)
            total += 0.05 + 0.0004 * prompt + HANDOFF_SECONDS + 0.02 * answer
            prompt += answer
    return total / samples


@dataclass(frozen=True)
class Cell:
    row: str
    routers: int
    work: Workload
    seed: int


def run_cell(cell: Cell) -> Outcome:
    row = ROWS[cell.row]
    work = cell.work if row.load is None else replace(cell.work, load=row.load)
    return Simulation(row, cell.routers, work, cell.seed).run()


# -- pick cost -----------------------------------------------------------------------------

CALLS: dict[str, Callable[[Router, list[int], dict[int, list[int]]], object]] = {
    "pick (one engine)": lambda r, p, h: r.pick(p, 128, block_hashes=h),
    "pick_pair": lambda r, p, h: r.pick_pair(p, 128, block_hashes=h),
    "pick_pair, rack preferred": lambda r, p, h: r.pick_pair(
        p, 128, block_hashes=h, pair_within="rack"
    ),
    "pick_pair, rack required": lambda r, p, h: r.pick_pair(
        p, 128, block_hashes=h, pair_within="rack", require_within=True
    ),
}
SINGLE = "pick (one engine)"


def pick_cost(engines: int, picks: int, seed: int) -> dict[str, tuple[float, float]]:
    """Median and p99 microseconds of each of CALLS on one kv_aware router, interleaved."""
    rng = random.Random(seed)
    records = fleet_records(engines // 2, engines // 2, 0)
    table = make_table(records)
    states = EngineStates(table, stale_after=math.inf).start(connect=False)
    systems = [[rng.randrange(32000) for _ in range(2 * BLOCK)] for _ in range(32)]
    weights = [1 / (rank + 1) for rank in range(len(systems))]
    prompts = [
        rng.choices(systems, weights)[0] + [rng.randrange(32000) for _ in range(2 * BLOCK)]
        for _ in range(1024)
    ]
    hashes = [{BLOCK: block_hashes(p, BLOCK)} for p in prompts]
    held = {r.engine_id: [rng.getrandbits(63) + 1 for _ in range(3000)] for r in records}
    prefills = [r.engine_id for r in records if r.role == "prefill"]
    for system in systems:
        for engine_id in rng.sample(prefills, 2):
            held[engine_id] += block_hashes(system, BLOCK)
    load = {"in_flight": 0, "routers": 1, "yours": 0, "engine": None}
    for engine_id, blocks in held.items():
        states.feed(engine_id, ["hello", EPOCH, 0, pack_hashes(blocks), load])
    router = Router(table, policy="kv_aware", states=states)
    samples: dict[str, list[int]] = {name: [] for name in CALLS}
    clock = time.perf_counter_ns
    for i in range(picks + 500):  # the first 500 of each warm up
        prompt, known = prompts[i % len(prompts)], hashes[i % len(prompts)]
        for name, call in CALLS.items():  # interleaved: the machine's load hits every row
            start = clock()
            handle = call(router, prompt, known)
            took = clock() - start
            handle.release()  # type: ignore[attr-defined]
            if i >= 500:
                samples[name].append(took)
        if i == 500:
            gc.collect()
    states.stop()
    return {
        name: (percentile(values, 50) / 1000, percentile(values, 99) / 1000)
        for name, values in samples.items()
    }


# -- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 s simulated, nothing recorded")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    seconds = 40.0 if args.quick else WORK.seconds
    work = replace(WORK, seconds=seconds)
    cells = [Cell(row, routers, work, args.seed) for routers in (1, 4) for row in ROWS]
    wall = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        outcomes = dict(zip(cells, pool.map(run_cell, cells), strict=True))
    header = (
        "row", "routers", "prefill hit", "decode spread", "peak", "in rack", "out, room",
        "alone", "rule",
        "differ", "requests", "retried",
    )  # fmt: skip
    table = [
        (
            cell.row,
            cell.routers,
            f"{out.hit_rate:.3f}",
            f"{out.spread_mean:.2f}",
            f"{out.spread_peak:.2f}",
            f"{100 * out.in_rack:.1f}%",
            f"{100 * out.away_with_room:.1f}%",
            f"{100 * out.alone:.1f}%",
            f"{100 * out.rule:.1f}%",
            out.disagree,
            out.requests,
            out.retried,
        )
        for cell, out in outcomes.items()
    ]
    picks = 2_000 if args.quick else 20_000
    cost = {engines: pick_cost(engines, picks, args.seed) for engines in (16, 128)}
    cost_rows = [
        (name, *(f"{cost[n][name][0]:.1f} / {cost[n][name][1]:.1f}" for n in cost),
         *(f"{cost[n][name][0] / cost[n][SINGLE][0]:.2f}x" for n in cost))
        for name in CALLS
    ]  # fmt: skip
    targets = []
    for cell, out in outcomes.items():
        name, routers = cell.row, cell.routers
        if name.startswith("rack required"):
            targets.append(Target(f"{name}, {routers} router(s): pairs outside one rack",
                                  100 * (1 - out.in_rack), 0, "%"))  # fmt: skip
        if name.startswith("rack preferred"):
            targets.append(Target(f"{name}, {routers} router(s): pairs outside the rack while "
                                  "it had room", 100 * out.away_with_room, 5, "%"))  # fmt: skip
    for engines, figures in cost.items():
        for name in ("pick_pair", "pick_pair, rack preferred"):
            targets.append(Target(f"{name} p50 @ {engines}, x a single pick's",
                                  figures[name][0] / figures[SINGLE][0], 2, "x"))  # fmt: skip
    lines = [
        table_text(header, table),
        "",
        "hit: prompt tokens found cached on the prefill engine (paired requests); spread: max /",
        "mean handles over the decode engines (time average / peak); in rack: pairs in one rack;",
        "out, room: pairs outside the prefill engine's rack while a decode engine there had a",
        "free slot (of those whose rack had one); alone: served without the prefill hop; rule:",
        "admitted by the skip rule on the simulated caches at pick time;",
        "differ: requests where the two disagree; retried: picks retried for room",
        "",
        "pick cost, kv_aware router, prompts of 4 blocks with hashes given, microseconds",
        table_text(
            ("call", *(f"{n} engines p50 / p99" for n in cost), *(f"x pick @{n}" for n in cost)),
            cost_rows,
        ),
        "",
        *(t.line() for t in targets),
        f"wall time {time.perf_counter() - wall:.0f} s in {args.jobs} processes, CPU time of "
        f"the simulations {sum(o.cpu_seconds for o in outcomes.values()):.0f} s; seed "
        f"{args.seed}, load {work.load} of the decode slots, {seconds:.0f} s simulated, KV "
        f"events {1000 * KV_DELAY:.0f} ms late, load frames every {LOAD_INTERVAL} s",
    ]
    body = "\n".join(lines)
    print(body)
    if not (args.quick or args.no_results):
        record_results("pairs", body, about=ABOUT, targets=targets)


ABOUT = """`bench_pairs.py`: the real `Router.pick_pair` over simulated prefill, decode and
aggregated engines (module docs: fleet, workload, service times, routers and what they are
fed). 8 prefill + 8 decode engines in 4 racks (+ 4 aggregated in the `alone_share` rows),
32 slots each, admission on; 1 and 4 routers. The pick cost compares `pick_pair` with a
single `pick` on the same router in the same run, calls interleaved."""


if __name__ == "__main__":
    main()
