"""Routing quality: prefix-cache hit rate, load spread and queueing delay per policy.

Run: ``.venv/bin/python bench/bench_routing_quality.py`` (about 12 CPU minutes, run in
``--jobs`` processes, default one per core; ``--quick`` simulates 60 s instead of 180 s and
records nothing; ``--parts`` runs some of the tables). Seeded: the same arguments give the
same table on any machine. No etcd: the routing tables are fed in memory, as the watcher
would feed them, every request is routed by a real ``Router``, and what the engines
report reaches each router's real ``EngineStates`` as the relays' messages.

**Workload** (``Workload``; every length in tokens, every draw from one seeded RNG):

* ``systems`` shared system prompts (256), lengths uniform in [1024, 4096]; a new
  conversation picks one with Zipf popularity (``P(rank k) ~ 1 / k**zipf_s``, ``zipf_s``
  1.0: the most popular is 16% of conversations).
* Conversations start as a Poisson process and have ``1 + Geometric`` turns (mean
  ``mean_turns``, at most ``max_turns``): 1 turn in the ``shared`` workload, mean 3 and at
  most 8 in ``chat``. Turn ``k``'s prompt is the system prompt, every earlier user message
  and answer, and a new user message: each turn extends the previous prompt. The next
  turn arrives an exponential think time (mean 5 s) after the answer.
* User messages: lognormal, median 150, sigma 1.0, clipped to [8, 2048]. Answers
  (``max_tokens``, all generated): lognormal, median 200, sigma 0.8, clipped to [8, 1024].
* ``pressure``: ``chat`` with 4096 system prompts and caches of 128 blocks (32,768 tokens,
  about 12 average system prompts): the blocks the prompts of any 30 s reference are about
  4 times the fleet's cache, so evictions decide what is still cached.

**Engines**: 8 or 64, each with 32 slots (``max_num_seqs``), 256-token KV blocks and a
prefix cache of 1024 blocks (``--cache-blocks``; 262,144 tokens; LRU over Megatron's
chained block hashes, ``discovery.block_hashes``: SHA-256, hashed incrementally per
conversation and once per system prompt). A request holds its pick handle from arrival
to completion, so the routers' in-flight count is queued + running. An engine runs up to
32 requests at once and queues the rest (FIFO). At admission, the longest run of the
prompt's leading blocks found in the cache is a hit; the prompt's blocks are then cached,
and on completion the blocks of prompt + answer (what the next turn extends). Each change
of a cache is what Megatron reports: ``stored`` for the blocks not cached before (a hit
is not announced again), ``removed`` for the LRU evictions. Service time: ``0.05 s + 0.4
ms x uncached prompt tokens + 20 ms x answer tokens``. Conversations arrive at the rate
that keeps ``load`` (0.9) of the fleet's slots busy if nothing were cached (Monte Carlo
over the workload's distributions).

**Routers** (``Simulation``, ``Front``): 1, 4 or 8 routers over the same engines, each
with its own table and its own ``EngineStates`` (``start(connect=False)``, fed with
``feed``), each request sent to one chosen at random (a separate seeded RNG). Relay
delays are modelled in simulated time, so the states are built with ``stale_after=inf``
(wall-clock staleness would mean nothing here):

* ``hello`` from every engine's relay when a router starts (and restarts): the engine's
  block set, its sequence number and the load view.
* ``kv`` increments for ``kv_aware`` (the only policy reading blocks): each stored /
  removed event reaches every router ``--kv-delay`` (10 ms) after the cache changed.
* Load: every ``REPORT_INTERVAL`` (50 ms) each router reports its in-flight handles per
  engine to the relays; every ``LOAD_INTERVAL`` (0.1 s, the relay's limit of 10 frames a
  second) each relay whose sum changed sends every router a ``load`` frame: the sum of
  every router's report and that router's own (``yours``). So each router's candidates
  carry its own handles, exact, plus the others' as of up to 0.15 s ago: the shared load
  view every policy and the load bound use. Rows marked ``own load`` have no
  ``EngineStates``: each router counts its own handles only.
* The **oracle** (``OraclePolicy``): ``kv_aware``'s code (scoring, bound, fallback) on the
  simulated caches themselves, and every router fed the exact global load at each pick
  and release: what ``kv_aware`` would reach with no relay delay.
* **Restart**: router 0 of ``--restart-routers`` (4) is replaced mid-way through the
  measured period by a new Router and EngineStates (empty per-router state:
  ``longest_prefix``'s index, ``kv_aware``'s estimate), which get a ``hello`` from every
  relay at once; the old router's requests finish on their engines and its last report
  stays in the relays' sums until it ages out (``SUBSCRIBER_TIMEOUT``, 5 s). Measured:
  the hit rate of the requests the new router picks in the 30 s after, against the
  steady state (every router, warm-up to the restart).

**Figures** (after a warm-up of the first quarter of the simulated time): hit rate =
prompt tokens found in the cache / prompt tokens; spread = max / mean in-flight over the
engines (every router's requests), sampled every 0.25 simulated seconds (time-averaged,
and the peak sample); queueing delay = arrival to admission (p50 / p99); balanced = the
share of picks a prefix policy sent to the least loaded (its fallback); working set =
distinct blocks the prompts of each 30 s reference, over the fleet's cache.

**Rows**: round robin, load-balanced (least in-flight per slot), pure affinity
(``first_prefix_block`` with ``load_factor=None``: the behaviour before the bound), the
old ``longest_prefix`` (no bound, ``load_gap`` 0.25), ``CacheAwarePolicy`` (SGLang's router
``cache_aware`` policy written from its public description, plugged in as a ``Policy``),
bounded ``first_prefix_block`` for load factors ``c`` in ``FACTORS``, ``longest_prefix``
with the default ``c``, ``kv_aware`` and the oracle (one router, 8 and 64 engines); the
six policies of ``MULTI_ROWS`` at 4 and 8 routers over 64 engines (and three with their
own load only); the restart; the pressure workload at 1 and 8 routers.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import hashlib
import heapq
import itertools
import json
import math
import os
import random
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from _common import OUT, Target, memory_table, percentile, record_results, table_text

from discovery import (
    Candidate,
    EngineStates,
    PickHandle,
    PickRequest,
    Policy,
    Router,
    RoutingTable,
    block_hashes,
)
from discovery._routing.policies import DEFAULT_LOAD_FACTOR, KvAwarePolicy
from discovery._state.engine_states import REPORT_INTERVAL
from discovery._state.kvstate import pack_hashes
from discovery._state.relay import LOAD_INTERVAL, SUBSCRIBER_TIMEOUT

BLOCK = 256
SLOTS = 32
CACHE_BLOCKS = 1024  # default prefix cache per engine (--cache-blocks)
CONTEXT = 32768
TICK = 0.25  # seconds between spread samples
KV_DELAY = 0.01  # engine event -> relay -> router, simulated (--kv-delay)
EPOCH = 1  # the relays' epoch: the simulated launchers never restart
# Event kinds: new conversation, next turn, done, spread sample, a KV increment reaching the
# routers, routers reporting their counts, relays sending load views, a router restart.
START, ARRIVE, DONE, TICKS, KV, REPORT, LOADS, RESTART = range(8)


# -- the SGLang-style baseline -----------------------------------------------------------


class CacheAwarePolicy(Policy):
    """SGLang router's ``cache_aware``, from its README and source comments.

    An approximate prefix tree per engine, built from the requests routed there (here:
    chained hashes of ``chunk``-token pieces, shared by all engines, each engine with an
    LRU of its pieces up to ``max_tree_tokens``; SGLang keeps characters and evicts LRU
    leaves every 60 s down to 2**24 characters, about 4M tokens). If the system is
    imbalanced, ``max_load - min_load > balance_abs_threshold`` and ``max_load >
    balance_rel_threshold * min_load`` (loads: in-flight requests), the least loaded
    engine. Else the engine with the longest prefix match if matched / prompt tokens >
    ``cache_threshold``, otherwise the engine with the smallest tree. Either way the
    prompt is added to the chosen engine's tree. Defaults are SGLang's (0.5, 32, 1.0001).
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        chunk: int = 32,
        max_tree_tokens: int = 2**22,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.chunk = chunk
        self.max_pieces = max_tree_tokens // chunk
        self._owners: dict[int, set[str]] = {}
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate:
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        chain = self._chain(request.prompt_tokens)
        if high - low > self.abs_threshold and high > self.rel_threshold * low:
            chosen = candidates[loads.index(low)]
        else:
            chosen = self._cache_choice(candidates, chain, len(request.prompt_tokens))
        self._insert(chosen.engine_id, chain)
        return chosen

    def forget(self, engine_id: str) -> None:
        for piece in self._trees.pop(engine_id, ()):
            self._owners[piece].discard(engine_id)

    def _cache_choice(
        self, candidates: Sequence[Candidate], chain: list[int], prompt_len: int
    ) -> Candidate:
        by_id = {c.engine_id: c for c in candidates}
        holders = set(by_id)
        matched = 0
        for piece in chain:
            still = holders & self._owners.get(piece, set())
            if not still:
                break
            holders, matched = still, matched + 1
        if matched and matched * self.chunk / max(prompt_len, 1) > self.cache_threshold:
            return min((by_id[h] for h in holders), key=lambda c: (c.in_flight, c.engine_id))
        return min(candidates, key=lambda c: (len(self._trees.get(c.engine_id, ())), c.engine_id))

    def _chain(self, tokens: Sequence[int]) -> list[int]:
        chain, value, step = [], 0, self.chunk
        for start in range(0, len(tokens) - step + 1, step):
            value = hash((value, tuple(tokens[start : start + step])))
            chain.append(value)
        return chain

    def _insert(self, engine_id: str, chain: list[int]) -> None:
        tree = self._trees.setdefault(engine_id, OrderedDict())
        for piece in chain:
            if piece in tree:
                tree.move_to_end(piece)
            else:
                tree[piece] = None
                self._owners.setdefault(piece, set()).add(engine_id)
        while len(tree) > self.max_pieces:
            self._owners[tree.popitem(last=False)[0]].discard(engine_id)


# -- workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The synthetic workload's parameters (module docs)."""

    systems: int = 256
    zipf_s: float = 1.0
    mean_turns: float = 3.0
    max_turns: int = 8
    think_seconds: float = 5.0
    load: float = 0.9
    seconds: float = 180.0
    cache_blocks: int = CACHE_BLOCKS  # each engine's prefix cache
    system_tokens: tuple[int, int] = (1024, 4096)  # a system prompt's length: uniform in


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def segment(rng: random.Random, length: int) -> range:
    """Fresh token ids: a random 40-bit base, so two segments never share a block."""
    base = rng.getrandbits(40)
    return range(base, base + length)


_MOD = 2**63 - 1
_PACK = struct.Struct(f"<{BLOCK}q").pack


class Chain:
    """Megatron's block hashes of a growing token list (``discovery.block_hashes``).

    SHA-256 per block costs about 10 us: each conversation keeps its chain (the last
    digest) and hashes only the blocks a turn adds; system prompts are hashed once.
    """

    __slots__ = ("digest", "hashes")

    def __init__(self, digest: bytes = bytes(32), hashes: Sequence[int] = ()) -> None:
        self.digest = digest
        self.hashes = list(hashes)

    def copy(self) -> Chain:
        return Chain(self.digest, self.hashes)

    def extend(self, tokens: Sequence[int]) -> None:
        """Hash ``tokens``' complete blocks past those already hashed."""
        hashes, digest = self.hashes, self.digest
        for start in range(len(hashes) * BLOCK, len(tokens) - BLOCK + 1, BLOCK):
            digest = hashlib.sha256(digest + _PACK(*tokens[start : start + BLOCK])).digest()
            hashes.append(int.from_bytes(digest[:8], "little") % _MOD + 1)
        self.digest = digest


def draw_turns(rng: random.Random, work: Workload) -> int:
    """1 + Geometric: another turn with probability 1 - 1 / mean_turns, up to max_turns."""
    turns = 1
    while turns < work.max_turns and rng.random() >= 1 / work.mean_turns:
        turns += 1
    return turns


def busy_per_conversation(work: Workload, rng: random.Random, samples: int = 20_000) -> float:
    """Mean slot-seconds a conversation takes when nothing is cached (Monte Carlo)."""
    total = 0.0
    for _ in range(samples):
        prompt = rng.randint(*work.system_tokens)
        for _ in range(draw_turns(rng, work)):
            prompt += lognormal(rng, 150, 1.0, 8, 2048)
            answer = lognormal(rng, 200, 0.8, 8, 1024)
            total += service_seconds(prompt, answer)
            prompt += answer
    return total / samples


class Conversation:
    __slots__ = ("chain", "key", "tokens", "turns")

    def __init__(self, system: list[int], system_chain: Chain, turns: int, key: int) -> None:
        self.tokens = list(system)
        self.chain = system_chain.copy()
        self.turns = turns
        self.key = key  # its session key, for rows that route by it


# -- simulated engines -------------------------------------------------------------------


class Engine:
    """A simulated engine: slots, a FIFO queue, an LRU prefix cache that reports its changes."""

    __slots__ = ("cache", "capacity", "engine_id", "index", "queue", "running", "seq")

    def __init__(self, engine_id: str, index: int, capacity: int) -> None:
        self.engine_id = engine_id
        self.index = index
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[Request] = deque()
        self.running = 0
        self.seq = 0  # its relay's sequence number: the KV increments published

    def cached_blocks(self, hashes: list[int]) -> int:
        hit = 0
        for block_hash in hashes:
            if block_hash not in self.cache:
                break
            hit += 1
        return hit

    def store(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Cache ``hashes`` (the newest now); Megatron's ``stored`` and ``removed`` hashes.

        ``stored``: the blocks not cached before (a hit is not announced again);
        ``removed``: the least recently used blocks evicted to make room.
        """
        cache = self.cache
        stored = []
        for block_hash in hashes:
            if block_hash in cache:
                cache.move_to_end(block_hash)
            else:
                cache[block_hash] = None
                stored.append(block_hash)
        removed = []
        while len(cache) > self.capacity:
            removed.append(cache.popitem(last=False)[0])
        return stored, removed


@dataclass
class Request:
    conversation: Conversation
    arrival: float
    prompt_len: int
    answer: int
    handle: PickHandle
    front: Front


def service_seconds(uncached: int, answer: int) -> float:
    return 0.05 + 0.0004 * uncached + 0.02 * answer


def make_table(engines: int, cache_blocks: int) -> RoutingTable:
    return memory_table(
        engines,
        state_relays=True,
        context_length=CONTEXT,
        kv_cache_block_size=BLOCK,
        total_kv_blocks=cache_blocks,
        max_num_seqs=SLOTS,
    )


# -- the oracle --------------------------------------------------------------------------


class CacheTruth:
    """A ``StateView`` reading the simulated caches themselves: exact, never late."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self._view = {engine_id: engine.cache for engine_id, engine in engines.items()}

    def fresh_view(self) -> Mapping[str, Container[int]]:
        return self._view


class OraclePolicy(KvAwarePolicy):
    """``kv_aware``'s scoring and load bound (its code) on the truth.

    The caches are read directly (``CacheTruth``) and the simulation feeds every router
    the exact global load at each pick and release: what ``kv_aware`` would do with no
    relay delay and no rate limit.
    """

    name = "oracle"

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        super().__init__(CacheTruth(engines))


# -- routers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """How each router of a row is built, and what it is fed."""

    make: Callable[[RoutingTable, EngineStates | None, Mapping[str, Engine]], Router]
    shared_load: bool = True
    """Each router has an EngineStates fed the relays' load frames: one load view."""
    kv_state: bool = False
    """Its policy reads the engines' blocks: KV increments are fed too."""
    exact: bool = False
    """The oracle: every router gets the exact global load at every change."""
    session: bool = False
    """Each pick gives its conversation as ``session_key``."""


class Front:
    """One router (its own process in a deployment): Router, EngineStates, what it holds."""

    __slots__ = ("alive", "dead_at", "index", "own", "report", "router", "states")

    def __init__(self, index: int, router: Router, states: EngineStates | None, n: int) -> None:
        self.index = index
        self.router = router
        self.states = states
        self.own = [0] * n  # its in-flight handles per engine (the sim's count)
        self.report = [0] * n  # what it last reported to each engine's relay
        self.alive = True
        self.dead_at = math.inf


@dataclass
class Outcome:
    hit_rate: float
    spread_mean: float
    spread_peak: float
    queue_p50: float
    queue_p99: float
    requests: int
    cpu_seconds: float  # CPU time of the cell: meaningful on a shared machine too
    balanced_share: float = 0.0  # picks a prefix policy load-balanced (its fallback)
    working_set: float = 0.0  # distinct blocks prompts referenced per 30 s / the fleet's cache
    kv_fallbacks: int = 0  # kv_aware candidates scored without fresh state (expected 0)
    restart: dict[str, float] = field(default_factory=dict)
    series: list[float] = field(default_factory=list)  # router 0's hit rate per 5 s bin


WINDOW = 30.0  # seconds after a restart that are measured
BIN = 5.0  # the restart series' bins
WS_BIN = 30.0  # working-set window


def restart_time(seconds: float) -> float:
    """Mid-way through the measured period, leaving WINDOW after it."""
    warm = seconds / 4
    return warm + (seconds - warm - WINDOW) / 2


class Simulation:
    """One cell: a fleet of simulated engines, ``routers`` routers, one workload (module docs)."""

    def __init__(
        self,
        engines: int,
        routers: int,
        row: Row,
        work: Workload,
        seed: int,
        kv_delay: float,
        restart: bool = False,
    ) -> None:
        self.row, self.work, self.kv_delay = row, work, kv_delay
        self.seed = seed
        random.seed(f"policies/{seed}")  # what routers' policies draw (load_balanced's pairs)
        self.rng = random.Random(seed)
        self.route_rng = random.Random(f"routers/{seed}")  # which router takes a request
        self.engines = [Engine(f"engine-{i:03d}", i, work.cache_blocks) for i in range(engines)]
        self.by_id = {engine.engine_id: engine for engine in self.engines}
        self.load = [0] * engines  # in flight per engine, every router's: the truth
        self.sent: list[tuple[int, int]] = [(0, 0)] * engines  # each relay's last load view
        self.fronts: list[Front] = []  # every router ever started, restarted ones too
        self.alive = [self.new_front(i, 0.0) for i in range(routers)]
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.restart_at = restart_time(work.seconds) if restart else math.inf

    # -- routers and what they are fed -------------------------------------------------

    def new_front(self, index: int, now: float) -> Front:
        """A router starting: its own table and EngineStates, a hello from every relay."""
        table = make_table(len(self.engines), self.work.cache_blocks)
        states = None
        if self.row.shared_load:
            # Simulated time drives staleness (relay delays are events here): never stale.
            states = EngineStates(table, stale_after=math.inf).start(connect=False)
        router = self.row.make(table, states, self.by_id)
        front = Front(index, router, states, len(self.engines))
        self.fronts.append(front)
        if states is not None:
            reporters = [*self.reporters(now), front]
            for engine in self.engines:
                blocks = pack_hashes(engine.cache) if self.row.kv_state else b""
                load = {
                    "in_flight": sum(f.report[engine.index] for f in reporters),
                    "routers": len(reporters),
                    "yours": 0,
                    "engine": None,
                }
                states.feed(engine.engine_id, ["hello", EPOCH, engine.seq, blocks, load])
        return front

    def reporters(self, now: float) -> list[Front]:
        """Routers whose reports the relays sum: live ones, and dead ones until they age out."""
        return [
            f
            for f in self.fronts
            if f.states is not None and (f.alive or now - f.dead_at <= SUBSCRIBER_TIMEOUT)
        ]

    def publish(self, engine: Engine, stored: list[int], removed: list[int], now: float) -> None:
        """The engine's KV events, through its relay, to every router (after ``kv_delay``)."""
        for kind, hashes in (("stored", stored), ("removed", removed)):
            if not hashes:
                continue
            engine.seq += 1
            if not self.row.kv_state:
                continue
            message = ["kv", EPOCH, engine.seq, kind, pack_hashes(hashes)]
            if self.kv_delay:
                self.push(now + self.kv_delay, KV, (engine.engine_id, message))
            else:
                self.deliver(engine.engine_id, message)

    def deliver(self, engine_id: str, message: list[object]) -> None:
        for front in self.alive:
            if front.states is not None:
                front.states.feed(engine_id, message)

    def report(self) -> None:
        """Every REPORT_INTERVAL: each live router reports its counts to every relay."""
        for front in self.alive:
            front.report[:] = front.own

    def relay_loads(self, now: float) -> None:
        """Every LOAD_INTERVAL: each relay whose sum changed sends it, with ``yours``."""
        reporters = self.reporters(now)
        count = len(reporters)
        for engine in self.engines:
            index = engine.index
            total = sum(f.report[index] for f in reporters)
            if (total, count) == self.sent[index]:
                continue
            self.sent[index] = (total, count)
            for front in self.alive:
                load = {"in_flight": total, "routers": count, "yours": front.report[index]}
                front.states.feed(engine.engine_id, ["load", EPOCH, {**load, "engine": None}])

    def exact_load(self, engine: Engine) -> None:
        """The oracle's load view: the truth, to every router, at every change."""
        if len(self.alive) == 1:
            return  # its own handles are all there is
        index = engine.index
        total, count = self.load[index], len(self.alive)
        for front in self.alive:
            load = {"in_flight": total, "routers": count, "yours": front.own[index]}
            front.states.feed(engine.engine_id, ["load", EPOCH, {**load, "engine": None}])

    def push(self, when: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    # -- the run -----------------------------------------------------------------------

    def run(self) -> Outcome:
        started = time.process_time()
        rng, work = self.rng, self.work
        systems = [
            list(segment(rng, rng.randint(*work.system_tokens))) for _ in range(work.systems)
        ]
        chains = []
        for system in systems:
            chain = Chain()
            chain.extend(system)
            chains.append(chain)
        assert chains[0].hashes == block_hashes(systems[0], BLOCK)  # Megatron's, exactly
        cumulative = list(
            itertools.accumulate(1 / k**work.zipf_s for k in range(1, work.systems + 1))
        )
        # Conversations per second that keep `load` of the slots busy when nothing is cached.
        slots = len(self.engines) * SLOTS
        rate = work.load * slots / busy_per_conversation(work, random.Random(self.seed))
        push = self.push
        push(rng.expovariate(rate), START, None)
        push(0.0, TICKS, None)
        exact = self.row.exact
        session = self.row.session
        keys = itertools.count()
        if self.row.shared_load and not exact:
            push(REPORT_INTERVAL, REPORT, None)
            push(LOAD_INTERVAL + REPORT_INTERVAL / 2, LOADS, None)
        push(self.restart_at, RESTART, None)
        warm = work.seconds / 4
        restart_at = self.restart_at
        hit_tokens = prompt_tokens = 0
        delays: list[float] = []
        spreads: list[float] = []
        requests = balanced = 0
        windows: dict[int, set[int]] = {}
        # Restart figures: [hit, prompt tokens, requests] per key; router 0's series in bins.
        tally = {key: [0, 0, 0] for key in ("steady", "after", "after_all", "before_same")}
        series_start = restart_at - WINDOW
        bins = [[0, 0, 0] for _ in range(int(3 * WINDOW / BIN))]
        load, alive, by_id = self.load, self.alive, self.by_id

        def admit(engine: Engine, request: Request, now: float) -> None:
            nonlocal hit_tokens, prompt_tokens
            hashes = request.conversation.chain.hashes
            hit = engine.cached_blocks(hashes) * BLOCK
            stored, removed = engine.store(hashes)
            self.publish(engine, stored, removed, now)
            engine.running += 1
            arrival = request.arrival
            if arrival >= warm:
                hit_tokens += hit
                prompt_tokens += request.prompt_len
                delays.append(now - arrival)
                if restart_at < math.inf:
                    pair = (hit, request.prompt_len, 1)
                    if arrival < restart_at:
                        add(tally["steady"], pair)
                        if request.front.index == 0:
                            add(tally["before_same"], pair)
                    elif arrival < restart_at + WINDOW:
                        add(tally["after_all"], pair)
                        if request.front is alive[0]:
                            add(tally["after"], pair)
                    slot = int((arrival - series_start) // BIN)
                    if request.front.index == 0 and 0 <= slot < len(bins):
                        add(bins[slot], pair)
            done = now + service_seconds(request.prompt_len - hit, request.answer)
            push(done, DONE, (engine, request))

        def arrive(conv: Conversation, now: float) -> None:
            nonlocal requests, balanced
            conv.tokens.extend(segment(rng, lognormal(rng, 150, 1.0, 8, 2048)))
            conv.chain.extend(conv.tokens)
            answer = lognormal(rng, 200, 0.8, 8, 1024)
            answer = min(answer, CONTEXT - len(conv.tokens))
            front = alive[self.route_rng.randrange(len(alive))] if len(alive) > 1 else alive[0]
            handle = front.router.pick(
                conv.tokens, answer, session_key=conv.key if session else None
            )
            engine = by_id[handle.engine_id]
            front.own[engine.index] += 1
            load[engine.index] += 1
            if exact:
                self.exact_load(engine)
            requests += 1
            if now >= warm:
                balanced += handle.policy == "load_balanced"
                windows.setdefault(int(now // WS_BIN), set()).update(conv.chain.hashes)
            request = Request(conv, now, len(conv.tokens), answer, handle, front)
            if engine.running < SLOTS:
                admit(engine, request, now)
            else:
                engine.queue.append(request)

        events = self.events
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > work.seconds:
                break
            if kind == START:
                index = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
                turns = draw_turns(rng, work)
                conv = Conversation(systems[index], chains[index], turns, next(keys))
                arrive(conv, now)
                push(now + rng.expovariate(rate), START, None)
            elif kind == ARRIVE:
                arrive(payload, now)  # type: ignore[arg-type]
            elif kind == DONE:
                engine, request = payload  # type: ignore[misc]
                engine.running -= 1
                conv = request.conversation
                conv.tokens.extend(segment(rng, request.answer))
                conv.chain.extend(conv.tokens)
                stored, removed = engine.store(conv.chain.hashes)
                self.publish(engine, stored, removed, now)
                request.front.own[engine.index] -= 1
                load[engine.index] -= 1
                request.handle.release()
                if exact:
                    self.exact_load(engine)
                conv.turns -= 1
                room = CONTEXT - len(conv.tokens) - 2048 - 1024
                if conv.turns and room > 0:
                    think = rng.expovariate(1 / work.think_seconds)
                    push(now + think, ARRIVE, conv)
                if engine.queue:
                    admit(engine, engine.queue.popleft(), now)
            elif kind == KV:
                self.deliver(*payload)  # type: ignore[misc]
            elif kind == REPORT:
                self.report()
                push(now + REPORT_INTERVAL, REPORT, None)
            elif kind == LOADS:
                self.relay_loads(now)
                push(now + LOAD_INTERVAL, LOADS, None)
            elif kind == RESTART:
                old = alive[0]
                old.alive, old.dead_at = False, now
                if old.states is not None:
                    old.states.stop()
                alive[0] = self.new_front(0, now)
            else:
                if now >= warm:
                    mean = sum(load) / len(load)
                    if mean:
                        spreads.append(max(load) / mean)
                push(now + TICK, TICKS, None)
        full = [len(blocks) for start, blocks in windows.items() if start * WS_BIN >= warm]
        full = full[:-1] or full  # the last window is cut short by the end of the run
        fleet_cache = len(self.engines) * work.cache_blocks
        kv_fallbacks = sum(f.router.health().kv_fallbacks for f in self.fronts)
        restart: dict[str, float] = {}
        if restart_at < math.inf:
            restart = {key: hit / max(total, 1) for key, (hit, total, _) in tally.items()}
            restart["after_requests"] = tally["after"][2]
        for front in self.fronts:
            if front.states is not None:
                front.states.stop()
        return Outcome(
            hit_rate=hit_tokens / max(prompt_tokens, 1),
            spread_mean=sum(spreads) / len(spreads),
            spread_peak=max(spreads),
            queue_p50=percentile(delays, 50),
            queue_p99=percentile(delays, 99),
            requests=requests,
            cpu_seconds=time.process_time() - started,
            balanced_share=balanced / max(len(delays), 1),
            working_set=sum(full) / max(len(full), 1) / fleet_cache,
            kv_fallbacks=kv_fallbacks,
            restart=restart,
            series=[hit / total if total else math.nan for hit, total, _ in bins]
            if restart_at < math.inf
            else [],
        )


def add(sums: list[int], more: tuple[int, int, int]) -> None:
    for i, value in enumerate(more):
        sums[i] += value


# -- the table ---------------------------------------------------------------------------

FACTORS = (1.1, 1.25, 1.5, 2.0)
WORKLOADS = {
    "shared": Workload(mean_turns=1.0, max_turns=1),  # one turn: shared system prompts only
    "chat": Workload(),  # multi-turn conversations on the same system prompts
    # Caches an eighth the size, 16 times the system prompts: the working set is about 4
    # times the fleet's cache and evictions decide what is still there.
    "pressure": Workload(systems=4096, cache_blocks=128),
    # Agents: one system prompt of 16 blocks that every session shares, long sessions of
    # short steps (tool calls), each resending the whole conversation.
    "agent": Workload(
        systems=1, mean_turns=12.0, max_turns=40, think_seconds=1.0, system_tokens=(4096, 4096)
    ),
}
PURE = "first_prefix_block c=None"  # pure affinity: the old first_prefix_block
FPB = f"first_prefix_block c={DEFAULT_LOAD_FACTOR}"
LP = f"longest_prefix c={DEFAULT_LOAD_FACTOR}"
KV_AWARE = "kv_aware"
ORACLE = "oracle"
OWN = ", own load"  # a row of routers without the shared load view
MULTI_ROWS = ("round_robin", "load_balanced", FPB, LP, KV_AWARE, ORACLE)
OWN_ROWS = ("load_balanced", FPB, LP)  # also on routers that count their own handles only
RESTART_ROWS = (FPB, LP, KV_AWARE)
SESSION = "session"  # each pick keyed by its conversation
SESSION_PREFIX_BOUND = f"session c={DEFAULT_LOAD_FACTOR}"  # the prefix policies' bound
AGENT_ROWS = (SESSION, SESSION_PREFIX_BOUND, LP, KV_AWARE)
PARTS = ("single", "routers", "restart", "pressure", "agent")


def rows(factors: Sequence[float]) -> dict[str, Row]:
    """Every row: baselines, first_prefix_block per load factor, longest_prefix, kv_aware,
    the oracle, and OWN_ROWS on routers that count their own handles only."""

    def policy(name: str, **options: float | None) -> Row:
        return Row(lambda t, s, e: Router(t, policy=name, states=s, **options))

    made: dict[str, Row] = {
        "round_robin": policy("round_robin"),
        "load_balanced": policy("load_balanced"),
        PURE: policy("first_prefix_block", load_factor=None),
        "longest_prefix c=None": policy("longest_prefix", load_factor=None),
        "sglang-style cache_aware": Row(
            lambda t, s, e: Router(t, policy=CacheAwarePolicy(), states=s)
        ),
    }
    for c in factors:
        made[f"first_prefix_block c={c}"] = policy("first_prefix_block", load_factor=c)
    made[FPB] = policy("first_prefix_block")
    made[LP] = policy("longest_prefix")
    made[KV_AWARE] = Row(lambda t, s, e: Router(t, policy="kv_aware", states=s), kv_state=True)
    made[ORACLE] = Row(lambda t, s, e: Router(t, policy=OraclePolicy(e), states=s), exact=True)
    made[SESSION] = Row(lambda t, s, e: Router(t, policy="session", states=s), session=True)
    made[SESSION_PREFIX_BOUND] = Row(
        lambda t, s, e: Router(
            t, policy="session", states=s, session_load_factor=DEFAULT_LOAD_FACTOR
        ),
        session=True,
    )
    for name in OWN_ROWS:
        made[name + OWN] = Row(
            lambda t, s, e, name=name: Router(t, policy=name.split()[0]), shared_load=False
        )
    return made


@dataclass(frozen=True)
class Cell:
    """One simulation: a process-pool task, so it rebuilds its row here."""

    part: str
    workload: str
    engines: int
    routers: int
    row: str
    work: Workload
    factors: tuple[float, ...]
    seed: int
    kv_delay: float
    restart: bool = False

    @property
    def key(self) -> tuple[str, str, int, int, str]:
        return (self.part, self.workload, self.engines, self.routers, self.row)


def run_cell(cell: Cell) -> Outcome:
    row = rows(cell.factors)[cell.row]
    return Simulation(
        cell.engines, cell.routers, row, cell.work, cell.seed, cell.kv_delay, cell.restart
    ).run()


def plan(args: argparse.Namespace, seconds: float) -> list[Cell]:
    factors = tuple(float(c) for c in args.factors.split(",") if c)
    parts = args.parts.split(",")
    single_rows = [r for r in rows(factors) if not r.endswith(OWN)]

    def work(label: str) -> Workload:
        chosen = replace(WORKLOADS[label], load=args.load, seconds=seconds)
        if args.cache_blocks and label != "pressure":
            chosen = replace(chosen, cache_blocks=args.cache_blocks)
        return chosen

    def cell(part: str, label: str, engines: int, routers: int, row: str, **kw: bool) -> Cell:
        return Cell(part, label, engines, routers, row, work(label), factors, args.seed,
                    args.kv_delay, **kw)  # fmt: skip

    cells = []
    if "single" in parts:
        for label in args.workloads.split(","):
            for engines in (int(n) for n in args.sizes.split(",")):
                cells += [cell("single", label, engines, 1, row) for row in single_rows]
    if "routers" in parts:
        for routers in (int(n) for n in args.routers.split(",")):
            for label in ("chat", "shared") if routers == max_routers(args) else ("chat",):
                cells += [cell("routers", label, 64, routers, row) for row in MULTI_ROWS]
                if label == "chat" and routers == max_routers(args):
                    cells += [cell("routers", label, 64, routers, row + OWN) for row in OWN_ROWS]
    if "restart" in parts:
        routers = args.restart_routers
        cells += [cell("restart", "chat", 64, routers, row, restart=True) for row in RESTART_ROWS]
    if "pressure" in parts:
        for routers in (1, max_routers(args)):
            cells += [cell("pressure", "pressure", 64, routers, row) for row in MULTI_ROWS]
    if "agent" in parts:
        for routers in (1, max_routers(args)):
            cells += [cell("agent", "agent", 64, routers, row) for row in AGENT_ROWS]
    return cells


def max_routers(args: argparse.Namespace) -> int:
    return max(int(n) for n in args.routers.split(","))


def lookup(
    results: dict[tuple[str, str, int, int, str], Outcome],
    workload: str,
    routers: int,
    row: str,
    engines: int = 64,
) -> Outcome | None:
    """A cell's outcome, whichever part ran it (one router: ``single`` or ``pressure``)."""
    for part in ("single", "routers", "pressure", "agent"):
        out = results.get((part, workload, engines, routers, row))
        if out is not None:
            return out
    return None


def verdicts(results: dict[tuple[str, str, int, int, str], Outcome], routers: int) -> list[Target]:
    """The targets (module docs). Target is lower-is-better: ">= 95% of X" is "at most 5%
    below X", "beats X" is "X's hit rate minus ours, in points, <= 0"."""
    targets = []
    for label in ("shared", "chat"):
        pure = lookup(results, label, 1, PURE)
        for row in (FPB, LP):
            out = lookup(results, label, 1, row)
            if pure is None or out is None:
                continue
            below = 100 * (1 - out.hit_rate / pure.hit_rate)
            targets += [
                Target(f"@64 {label}, {row}: hit rate below pure affinity's", below, 5, "%"),
                Target(f"@64 {label}, {row}: peak spread", out.spread_peak, 1.5, "x"),
            ]
    kv = lookup(results, "chat", routers, KV_AWARE)
    oracle = lookup(results, "chat", routers, ORACLE)
    single_lp = lookup(results, "chat", 1, LP)
    if kv is not None and oracle is not None:
        name = f"@64 chat, {routers} routers, kv_aware"
        below = 100 * (1 - kv.hit_rate / oracle.hit_rate)
        targets.append(Target(f"{name}: hit rate below the oracle's", below, 5, "%"))
        if single_lp is not None:
            targets.append(
                Target(
                    f"{name}: hit rate below one router's {LP}'s",
                    100 * (single_lp.hit_rate - kv.hit_rate),
                    0,
                    "points",
                )
            )
        targets.append(Target(f"{name}: peak spread", kv.spread_peak, 1.5, "x"))
    for key, out in results.items():
        if key[0] == "restart" and key[4] == KV_AWARE:
            steady, after = out.restart["steady"], out.restart["after"]
            targets.append(
                Target(
                    f"restart ({key[3]} routers, chat), kv_aware: the restarted router's hit "
                    f"rate in the {WINDOW:.0f} s after, below steady state",
                    100 * (1 - after / steady),
                    5,
                    "%",
                )
            )
    agent_lp = lookup(results, "agent", 1, LP)
    for count in sorted({key[3] for key in results if key[0] == "agent"}):
        out = lookup(results, "agent", count, SESSION)
        if out is None or agent_lp is None:
            continue
        name = f"@64 agent, {count} router{'s' * (count > 1)}, session"
        targets += [
            Target(
                f"{name}: hit rate below one router's {LP}'s",
                100 * (1 - out.hit_rate / agent_lp.hit_rate),
                5,
                "%",
            ),
            Target(f"{name}: peak spread", out.spread_peak, 1.5, "x"),
        ]
    for count in sorted({key[3] for key in results if key[0] == "pressure"}):
        kv = lookup(results, "pressure", count, KV_AWARE)
        others = [
            (row, out)
            for row in MULTI_ROWS
            if row not in (KV_AWARE, ORACLE)
            and (out := lookup(results, "pressure", count, row)) is not None
        ]
        if kv is None or not others:
            continue
        best_row, best = max(others, key=lambda pair: pair[1].hit_rate)
        name = f"@64 pressure, {count} router{'s' * (count > 1)}, kv_aware"
        targets += [
            Target(
                f"{name}: best other hit rate ({best_row}) minus kv_aware's",
                100 * (best.hit_rate - kv.hit_rate),
                0,
                "points",
            ),
            Target(f"{name}: peak spread", kv.spread_peak, 1.5, "x"),
        ]
    return targets


def plot(results: dict[tuple[str, str, int, int, str], Outcome], path: Path) -> None:
    """Three panels: hit rate per router count (chat), the restart, cache pressure."""
    import matplotlib  # noqa: PLC0415 - the bench extra; only the recorded run plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    color = {row: f"C{i}" for i, row in enumerate(MULTI_ROWS)}
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 5.5))
    counts = sorted({key[3] for key in results if key[0] == "routers"} | {1})
    for row in MULTI_ROWS:
        points = [(n, out.hit_rate) for n in counts if (out := lookup(results, "chat", n, row))]
        if points:
            style = "--" if row == ORACLE else "-"
            left.plot(*zip(*points, strict=True), style, marker="o", color=color[row], label=row)
    left.set(
        title="chat, 64 engines: hit rate by router count",
        xlabel="routers (each request to one at random)",
        ylabel="hit rate (prompt tokens found cached)",
        xticks=counts,
    )
    left.legend(fontsize=8)
    for key, out in results.items():
        if key[0] == "restart" and out.series:
            xs = [BIN * (i + 0.5) - WINDOW for i in range(len(out.series))]
            middle.plot(xs, out.series, marker=".", color=color.get(key[4]), label=key[4])
    middle.axvline(0, color="grey", linestyle=":")
    middle.set(
        title="chat, a router restarted: its picks' hit rate (5 s bins)",
        xlabel="seconds from the restart",
        ylabel="hit rate",
    )
    middle.legend(fontsize=8)
    pressure = sorted({key[3] for key in results if key[0] == "pressure"})
    width = 0.8 / max(len(pressure), 1)
    for j, n in enumerate(pressure):
        for i, row in enumerate(MULTI_ROWS):
            out = lookup(results, "pressure", n, row)
            if out is None:
                continue
            x = i + (j - (len(pressure) - 1) / 2) * width
            right.bar(x, out.hit_rate, width, color=color[row], alpha=1.0 if j else 0.55)
            label = f"{n}r\n{out.spread_peak:.2f}"
            right.annotate(label, (x, out.hit_rate), ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(MULTI_ROWS)), [r.replace(" c=", "\nc=") for r in MULTI_ROWS])
    right.tick_params(axis="x", labelsize=8)
    right.set(
        title="cache pressure, 64 engines: hit rate (label: routers, peak spread)",
        ylabel="hit rate",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 s simulated, nothing recorded")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--parts", default=",".join(PARTS), help="which tables to run")
    parser.add_argument("--sizes", default="8,64", help="fleet sizes of the one-router table")
    parser.add_argument("--routers", default="4,8", help="router counts over 64 engines")
    parser.add_argument("--restart-routers", type=int, default=4, help="routers in the restart")
    parser.add_argument("--factors", default=",".join(map(str, FACTORS)), help="load factors")
    parser.add_argument("--workloads", default="shared,chat", help="of the one-router table")
    parser.add_argument("--load", type=float, default=Workload.load, help="offered load")
    parser.add_argument("--kv-delay", type=float, default=KV_DELAY, help="KV event delay, s")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--cache-blocks", type=int, help="per engine (not for pressure)")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    parser.add_argument("--plot-only", action="store_true", help="redraw from bench/out/")
    args = parser.parse_args()
    saved = OUT / "routing_quality.json"
    if args.plot_only:
        results = {tuple(key): Outcome(**out) for key, out in json.loads(saved.read_text())}
        plot(results, PLOT_PATH)  # type: ignore[arg-type]
        return
    seconds = 60.0 if args.quick else Workload.seconds
    cells = plan(args, seconds)
    wall = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(run_cell, cells))
    results = {cell.key: out for cell, out in zip(cells, outcomes, strict=True)}
    OUT.mkdir(exist_ok=True)
    saved.write_text(json.dumps([[key, asdict(out)] for key, out in results.items()]))
    header = (
        "workload",
        "engines",
        "routers",
        "policy (c: load_factor)",
        "hit rate",
        "spread avg",
        "spread peak",
        "queue p50 s",
        "queue p99 s",
        "balanced",
        "requests",
    )
    table = [
        (
            label,
            engines,
            routers,
            row,
            f"{out.hit_rate:.3f}",
            f"{out.spread_mean:.2f}",
            f"{out.spread_peak:.2f}",
            f"{out.queue_p50:.2f}",
            f"{out.queue_p99:.2f}",
            f"{100 * out.balanced_share:.0f}%",
            out.requests,
        )
        for (part, label, engines, routers, row), out in results.items()
        if part != "restart"
    ]
    lines = [table_text(header, table)]
    restarts = [
        (
            row,
            routers,
            f"{out.restart['steady']:.3f}",
            f"{out.restart['before_same']:.3f}",
            f"{out.restart['after']:.3f}",
            f"{100 * out.restart['after'] / out.restart['steady']:.1f}%",
            f"{out.restart['after_all']:.3f}",
            f"{out.spread_peak:.2f}",
            int(out.restart["after_requests"]),
        )
        for (part, label, engines, routers, row), out in results.items()
        if part == "restart"
    ]
    if restarts:
        at = restart_time(seconds)
        lines += [
            "",
            f"restart: router 0 of {args.restart_routers} restarted at {at:.1f} s (chat, 64 "
            f"engines); hit rates of the requests it picked in the {WINDOW:.0f} s after, against",
            "steady state (every router, warm-up to the restart)",
            table_text(
                (
                    "policy",
                    "routers",
                    "steady",
                    "router 0 before",
                    f"restarted, {WINDOW:.0f} s",
                    "of steady",
                    f"all, {WINDOW:.0f} s",
                    "spread peak",
                    "its requests",
                ),
                restarts,
            ),
        ]
    working = {}
    for (_, label, engines, _, _), out in results.items():
        working.setdefault((label, engines), out.working_set)
    lines += [
        "",
        "working set (distinct blocks the prompts of 30 s reference / the fleet's cache): "
        + ", ".join(f"{label} @{n} {ws:.2f}x" for (label, n), ws in working.items()),
    ]
    fallbacks = sum(out.kv_fallbacks for key, out in results.items() if key[4] == KV_AWARE)
    lines.append(f"kv_aware candidates scored without fresh state: {fallbacks}")
    routers = max_routers(args)
    beside = [
        f"{row} {out.hit_rate:.3f} (peak {out.spread_peak:.2f})"
        for row in (FPB, LP, FPB + OWN, LP + OWN, "load_balanced", "load_balanced" + OWN)
        if (out := lookup(results, "chat", routers, row)) is not None
    ]
    if beside:
        lines.append(f"beside: @64 chat, {routers} routers: " + "; ".join(beside))
    targets = verdicts(results, routers)
    cpu = sum(out.cpu_seconds for out in outcomes)
    lines += [
        "",
        *(t.line() for t in targets),
        f"wall time {time.perf_counter() - wall:.0f} s in {args.jobs} processes, CPU time "
        f"{cpu:.0f} s; seed {args.seed}, load {args.load}, {seconds:.0f} s simulated, KV "
        f"events {1000 * args.kv_delay:.0f} ms late, load frames every {LOAD_INTERVAL} s",
    ]
    body = "\n".join(lines)
    print(body)
    recorded = not (args.quick or args.no_results)
    path = PLOT_PATH if recorded else OUT / PLOT_PATH.name  # a smoke run's plot: bench/out/
    try:
        plot(results, path)
        print(f"plot: {path}")
    except ImportError:
        print("matplotlib missing (the bench extra): no plot")
    if recorded:
        record_results("routing_quality", body, about=ABOUT, targets=targets)


PLOT_PATH = Path(__file__).resolve().parent / "routing_quality.png"
ABOUT = """`bench_routing_quality.py`: the real Router over simulated engines (module docs:
workload, engines, service time, routers and what they are fed). Hit rate = prompt tokens
found in the engine's prefix cache; spread = max / mean in-flight over the engines (time
average of 0.25 s samples, and the peak sample); queueing = arrival to admission;
balanced = picks a prefix policy sent to the least loaded (its fallback). First quarter of
the simulated time is warm-up. `c` is the router's `load_factor` (None: no load bound);
routers > 1 split the traffic at random, each with its own EngineStates fed the relays'
frames in simulated time (`own load`: no EngineStates, each router counts its own handles).
The oracle is kv_aware's scoring on the exact caches and the exact global load. Plot:
[routing_quality.png](../routing_quality.png)."""


if __name__ == "__main__":
    main()
