"""Routing policies: one class per policy behind the small ``Policy`` base class.

A ``Router`` filters the engines (labels, fit, fencing) and hands the survivors to its
policy as ``Candidate`` objects, with the request as a ``PickRequest``. The policy's
``choose(candidates, request)`` returns one of the candidates, or a ``Choice`` that also
says which policy chose it (a fallback) and how many prompt tokens matched. The router
calls ``choose`` under its own lock and always with the same tuple object for the same
candidate set, so a policy belonging to one router needs no locking and may cache what
it derives from a candidate tuple by identity. ``choose`` must not block or do I/O.

**Built-in policies** (``RoutingPolicy`` names them; ``auto`` maps what the engines
advertise onto them):

* ``RoundRobinPolicy`` (``round_robin``): the candidates in turn.
* ``LoadBalancedPolicy`` (``load_balanced``): the lowest ``(in_flight + 1) / capacity``,
  where ``in_flight`` counts the router's unreleased handles and ``capacity =
  max_num_seqs * logical_data_parallel_size`` (``max_num_seqs`` is per data-parallel
  rank). An engine with twice the slots takes twice the load; exact ties rotate.
* ``FirstPrefixBlockPolicy`` (``first_prefix_block``): the first ``kv_cache_block_size``
  prompt tokens are hashed and the candidates ranked by rendezvous (highest-random-weight)
  hashing, unweighted: each engine is first for an equal share of first blocks, and
  removing an engine remaps only its share. The request goes to the first engine in that
  order that is under its load bound (below). Candidates with different block sizes are
  hashed on the smallest (logged once). A prompt shorter than one block has nothing
  cacheable and is load-balanced.
* ``LongestPrefixPolicy`` (``longest_prefix``): the router remembers the chained block
  hashes it recently sent to each engine (an approximate index, below) and sends the
  prompt to the candidate holding the longest run of its leading blocks (ties: least
  loaded), if that engine is under its load bound and its utilisation ``in_flight /
  capacity`` is at most ``load_gap`` above the least-loaded candidate's. Otherwise, or
  when nothing matches, the request is load-balanced; either way its blocks are recorded
  for the engine that got it.
* ``SessionPolicy`` (``session``): the pick's ``session_key`` (a conversation id, a
  user, an agent run) hashed and the candidates ranked by rendezvous hashing as for the
  first block: every router sends a key to the same engine with no shared state, an
  engine that leaves moves only its keys, and the key's next engine in its own order
  takes a request its first one has no bound for. A pick that gives ``session_key`` is
  routed so under any router policy: the key decides (docs/routing.md has the agent
  workload's figures).

**Load bound** (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam
2018). With ``T`` requests in flight on the candidates, ``C`` their total capacity and
``c`` the ``load_factor``, engine ``e`` may take the new request only if ``in_flight(e) +
1 <= ceil(c * (T + 1) * capacity(e) / C)``: the mean counts the new request, as in the
paper, and is weighted by capacity (equal capacities give the paper's ``ceil(c * (T + 1)
/ n)``). Since these bounds add up to more than ``T``, some candidate is always under its
bound. ``load_factor=None`` removes the bound (pure affinity). Loads are this router's
handles: independent routers agree on an engine's first choice whenever the first engine
is under each router's bound, and each router bounds only its own traffic.

**What one engine may claim.** Every policy weighs an engine by its capacity, which its
record states: a record that lies (a buggy or hostile writer's ``max_num_seqs`` of 10**12,
inside the codec's bounds) would take every pick. So among any candidate set an engine
weighs at most ``MAX_MEDIAN_MULTIPLE`` (2) times the set's median capacity (the upper median:
with two engines, neither is capped): in the score, the load bound and the utilisation.
In such a set the least loaded is the lowest ``load / weight`` (idle engines tie, and ties
rotate), so one such engine among ``N`` holds at most ``2 / (N + 1)`` of the requests in
flight and takes an idle fleet's picks in turn with the others. An honest fleet whose
engines are within twice the median, the usual case, is routed exactly as before.

**Hashing** is deterministic across processes and machines: prompt tokens are packed as
little-endian int64 and hashed with BLAKE2b (64-bit digests; block ``i``'s hash covers
tokens ``[0, (i + 1) * block_size)``, so it identifies the whole prefix). An engine's
rendezvous score for a key is ``((key ^ seed) * 0x9E3779B97F4A7C15) mod 2**64`` with
``seed`` the BLAKE2b digest of its engine id; the highest score ranks first.

**Memory bound of the longest-prefix index.** Per engine, an LRU of at most
``min(prefix_index_blocks, total_kv_blocks)`` block hashes (``prefix_index_blocks``
defaults to 4096; an engine advertising ``total_kv_blocks=0`` gets
``prefix_index_blocks``), plus a reverse map from hash to the engines holding it. Each
remembered (engine, block) pair costs about 200 bytes, so the index stays under
``engines * prefix_index_blocks * 200`` bytes (about 0.8 MB per engine by default). An
engine's entries are dropped when it leaves the router's view or changes its block size
(``Policy.forget``).
"""

from __future__ import annotations

import abc
import enum
import hashlib
import logging
import math
import random
import struct
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from itertools import takewhile
from operator import attrgetter, itemgetter
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from discovery._records.endpoint import PrefixCachingCoordinatorPolicy
from discovery._records.record import EngineRecord
from discovery._records.selector import Selector
from discovery._state.blockhash import LazyBlockHashes

__all__ = [
    "Candidate",
    "Choice",
    "FirstPrefixBlockPolicy",
    "KvAwarePolicy",
    "LoadBalancedPolicy",
    "LongestPrefixPolicy",
    "PickRequest",
    "Policy",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "SessionPolicy",
]

log = logging.getLogger(__name__)

DEFAULT_LOAD_FACTOR = 1.25
# Session keys spread evenly by hash, and many routers add to an engine on a load view up
# to 0.15 s old: a tighter bound keeps the peak under 1.5 x the mean with 8 routers on
# bench_routing_quality's agent workload, at 3% of the hit rate (1.25: peak 1.55).
DEFAULT_SESSION_LOAD_FACTOR = 1.15
DEFAULT_LOAD_GAP = 0.25
DEFAULT_INDEX_BLOCKS = 4096
DEFAULT_LOAD_WEIGHT = 1.0

_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd, so multiplying is a bijection mod 2**64
_SEED_PERSON = b"discovery/rdv"  # BLAKE2b personalisation: these digests mean nothing else
_BLOCK_PERSON = b"discovery/block"
_SESSION_PERSON = b"discovery/sess"
_SCORE = attrgetter("_score")
_LOAD = attrgetter("load")
_OTHERS = attrgetter("others")
_RUN = itemgetter(1)
_KEPT_SETS = 64  # candidate sets a policy keeps what it derived from (a router's pools)
_KEPT_KEYS = 4096  # rendezvous keys (first blocks, sessions) whose first engine a set keeps
MAX_MEDIAN_MULTIPLE = 2  # an engine's weight: at most this times its set's median capacity


class RoutingPolicy(enum.StrEnum):
    """The built-in policies by name, plus ``auto``: what the candidates advertise."""

    ROUND_ROBIN = "round_robin"
    """The candidates in turn."""
    LOAD_BALANCED = "load_balanced"
    """The fewest in-flight requests per slot (``max_num_seqs``)."""
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    """Rendezvous hashing of the prompt's first KV-cache block, under a load bound."""
    LONGEST_PREFIX = "longest_prefix"
    """The engine recently sent the longest run of the prompt's leading blocks."""
    KV_AWARE = "kv_aware"
    """The engine that reports caching the longest run of the prompt's leading blocks."""
    SESSION = "session"
    """Rendezvous hashing of the pick's ``session_key``, under the load bound (no key:
    load-balanced). A pick with a key is routed so whatever the router's policy."""
    AUTO = "auto"
    """What the candidates advertise in ``prefix_caching_coordinator_policy``."""


_ADVERTISED: dict[object, RoutingPolicy] = {
    policy.value: RoutingPolicy(policy.value) for policy in PrefixCachingCoordinatorPolicy
}
"""Megatron's policies (every version's) by value: the built-in policy each one asks for."""


def unknown_policy(record: EngineRecord) -> str | None:
    """The record's ``prefix_caching_coordinator_policy`` if this version does not know it."""
    policy = record.endpoint.capabilities.prefix_caching_coordinator_policy
    return None if policy is None or policy in _ADVERTISED else str(policy)


# -- hashing ---------------------------------------------------------------------------


def _digest(data: bytes, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little")


def _pack(tokens: Sequence[int], count: int) -> bytes:
    try:
        return struct.pack(f"<{count}q", *tokens[:count])
    except struct.error as exc:
        raise ValueError(f"prompt token ids must be 64-bit integers: {exc}") from exc


def session_hash(key: str | bytes | int) -> int:
    """A session key as the 64-bit number its rendezvous order is drawn from.

    Deterministic across processes and machines: BLAKE2b of the key's UTF-8 bytes (an
    integer's decimal text; bytes as they are).
    """
    if isinstance(key, bool) or not isinstance(key, str | bytes | int):
        raise TypeError(f"session_key must be a str, bytes or int, not {type(key).__name__}")
    data = key if isinstance(key, bytes) else str(key).encode()
    return _digest(data, _SESSION_PERSON)


def _first_block_key(tokens: Sequence[int], block_size: int) -> int:
    """The hash of the first block; equal to ``_block_hashes(...)[0]``."""
    return _digest(_pack(tokens, block_size), _BLOCK_PERSON)


def _block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every complete block: hash ``i`` covers the first ``i + 1`` blocks."""
    blocks = len(tokens) // block_size
    if not blocks:
        return []
    data = memoryview(_pack(tokens, blocks * block_size))
    step = block_size * 8
    hasher = hashlib.blake2b(digest_size=8, person=_BLOCK_PERSON)
    hashes = []
    for start in range(0, blocks * step, step):
        hasher.update(data[start : start + step])
        # digest() does not finalise the state: later updates extend the same prefix.
        hashes.append(int.from_bytes(hasher.digest(), "little"))
    return hashes


# -- what a policy sees ----------------------------------------------------------------


class Candidate:
    """An engine a policy may choose, with its current load; kept up to date by the Router.

    ``engine_id``, ``record`` (its EngineRecord), ``capacity`` (``max_num_seqs *
    logical_data_parallel_size``), ``block_size`` (``kv_cache_block_size``),
    ``context_length``, ``advertised`` (the RoutingPolicy its capabilities ask for),
    ``in_flight`` (the router's unreleased handles on it), ``others`` (what other routers
    hold there, or the engine's own count, as its state relay reports; 0 without one),
    ``load`` (``in_flight + others``: the load view every policy and the bound use),
    ``routers`` (how many routers report to its relay; 1 without one) and ``rank`` (this
    router's place among them). Policies read, never write.
    """

    __slots__ = (
        "_listening",
        "_losses",
        "_score",
        "_seed",
        "_tally",
        "advertised",
        "block_size",
        "capacity",
        "context_length",
        "engine_id",
        "in_flight",
        "load",
        "others",
        "rank",
        "record",
        "routers",
    )

    def __init__(self, record: EngineRecord) -> None:
        self.engine_id = record.engine_id
        self._seed = _digest(record.engine_id.encode(), _SEED_PERSON)
        self.in_flight = self.others = self.load = 0
        self.routers = 1
        self.rank = 0
        # The router's: each time it stopped being a good target (a counter, why), and
        # the held handles' listeners waiting to hear of the next time.
        self._losses: list[tuple[int, str]] | None = None
        self._listening: dict[Any, tuple[Any, ...]] | None = None  # handle -> listeners
        self._tally: LoadTally | None = None  # the router's picker's set, when in it
        self._update(record)

    def _update(self, record: EngineRecord) -> None:
        caps = record.endpoint.capabilities
        self.record = record
        self.block_size = caps.kv_cache_block_size
        self.context_length = caps.context_length
        self.capacity = caps.max_num_seqs * caps.logical_data_parallel_size
        policy = caps.prefix_caching_coordinator_policy
        self.advertised = (
            _ADVERTISED.get(policy, RoutingPolicy.LOAD_BALANCED)  # an unknown one: by load
            if caps.enable_prefix_caching
            else RoutingPolicy.LOAD_BALANCED
        )
        if self._tally is not None:
            self._tally.ranks = None  # its capacity may weigh the set anew: ranked again
        self._rescore()

    def _rescore(self) -> None:
        load = self.in_flight + self.others
        kept = self._tally
        if kept is not None:
            kept.total += load - self.load
        self.load = load
        self._score = (load + 1) / self.capacity
        if kept is not None and kept.ranks is not None:
            kept.ranks.moved(self)

    def _acquire(self) -> None:
        self.in_flight += 1
        self.load += 1  # _rescore's, inline: once per pick
        self._score = (self.load + 1) / self.capacity
        kept = self._tally
        if kept is not None:
            kept.total += 1
            if kept.ranks is not None:
                kept.ranks.moved(self)

    def _release(self) -> None:
        self.in_flight -= 1
        self.load -= 1  # _rescore's, inline: once per release
        self._score = (self.load + 1) / self.capacity
        kept = self._tally
        if kept is not None:
            kept.total -= 1
            if kept.ranks is not None:
                kept.ranks.moved(self)

    def _set_others(self, others: int, routers: int = 1, rank: int = 0) -> None:
        if self._tally is not None:
            self._tally.shared += bool(others) - bool(self.others)
        self.others = others
        self.routers = routers
        self.rank = rank
        self._rescore()

    def __repr__(self) -> str:
        return (
            f"<Candidate {self.engine_id} in_flight={self.in_flight} others={self.others}"
            f"/{self.capacity}>"
        )


class LoadTally:
    """The total load of one candidate set, kept as its candidates' loads change.

    A router keeps one for the set its picker hands out (``tally``), so the load bound
    reads a number instead of summing every candidate per pick, and, once a policy asks
    for the least loaded (``ranked``), the candidates by score, so that is no scan either.
    """

    __slots__ = ("candidates", "ranks", "shared", "total")

    def __init__(self, candidates: tuple[Candidate, ...]) -> None:
        self.candidates = candidates
        self.total: int = sum(map(_LOAD, candidates))
        self.shared = sum(1 for c in candidates if c.others)
        """Candidates some other router holds load on."""
        self.ranks: _Ranks | None = None
        """The candidates by score, from the first ``ranked()`` on."""

    def ranked(self) -> _Ranks:
        """The candidates by score, kept from now on as their loads change."""
        if self.ranks is None:
            self.ranks = _Ranks(self.candidates, _scorer(_weights(self.candidates)[1]))
        return self.ranks

    def detach(self) -> None:
        """Stop counting: its candidates' loads no longer reach it."""
        for candidate in self.candidates:
            if candidate._tally is self:
                candidate._tally = None


class _Ranks:
    """A tallied set's candidates by score (``_scorer``): the lowest without a scan.

    Each score present holds the places (in the set) of its candidates, ascending; the
    scores present are kept sorted. A load change moves one place between two scores.
    """

    __slots__ = ("levels", "places", "score", "scores", "slots")

    def __init__(
        self, candidates: Sequence[Candidate], score: Callable[[Candidate], float]
    ) -> None:
        self.score = score
        self.places = {c: place for place, c in enumerate(candidates)}
        self.scores = list(map(score, candidates))
        self.slots: dict[float, list[int]] = {}
        for place, value in enumerate(self.scores):
            self.slots.setdefault(value, []).append(place)
        self.levels = sorted(self.slots)

    def moved(self, candidate: Candidate) -> None:
        """``candidate``'s load changed: move it to its new score."""
        place = self.places[candidate]
        old, new = self.scores[place], self.score(candidate)
        if new == old:
            return
        self.scores[place] = new
        slots = self.slots
        places = slots[old]
        if len(places) == 1:
            del slots[old]
            del self.levels[bisect_left(self.levels, old)]
        else:
            del places[bisect_left(places, place)]
        joined = slots.get(new)
        if joined is None:
            slots[new] = [place]
            insort(self.levels, new)
        else:
            insort(joined, place)

    def lowest(self, start: int) -> int:
        """The place of the first lowest-scored candidate at or after ``start``, else the first."""
        places = self.slots[self.levels[0]]
        at = bisect_left(places, start)
        return places[at] if at < len(places) else places[0]


def tally(candidates: tuple[Candidate, ...]) -> LoadTally:
    """Keep the total load of ``candidates`` from now on (each candidate counts in one)."""
    kept = LoadTally(candidates)
    for candidate in candidates:
        candidate._tally = kept
    return kept


def _kept(candidates: Sequence[Candidate]) -> LoadTally | None:
    """The tally kept for exactly ``candidates`` (the router's picker's set), if any."""
    kept = candidates[0]._tally
    return kept if kept is not None and kept.candidates is candidates else None


def _others_hold(candidates: Sequence[Candidate], kept: LoadTally | None) -> bool:
    """Whether other routers hold some load on a candidate: kept (``_kept``) for the picker's."""
    return kept.shared > 0 if kept is not None else any(map(_OTHERS, candidates))


def _total_load(candidates: Sequence[Candidate]) -> int:
    """The candidates' total load: kept (``tally``) for the router's picker's set."""
    kept = _kept(candidates)
    return kept.total if kept is not None else sum(map(_LOAD, candidates))


class PickRequest(NamedTuple):
    """One request to route, as a policy sees it."""

    prompt_tokens: Sequence[int]
    """The prompt's token ids."""
    max_tokens: int
    """The most tokens the request may generate."""
    selector: Selector
    """The selector this call gave (empty if none; the router's own is already applied)."""
    block_hashes: Mapping[int, Sequence[int]] | None = None
    """Megatron's hashes of the prompt's complete blocks, per block size, if the caller
    computed them (``Router.pick(block_hashes=...)``); ``kv_aware`` then hashes nothing."""
    session_key: int | None = None
    """The pick's session key, hashed (``Router.pick(session_key=...)``); None: no key."""


class Choice(NamedTuple):
    """A policy's answer when it has more to say than the candidate."""

    candidate: Candidate
    """The engine to use: one of the candidates the policy was given."""
    policy: str | None = None
    """The policy to credit (``PickHandle.policy``, metrics); None: the policy's name."""
    matched_tokens: int = 0
    """Prompt tokens the engine is thought to hold in its prefix cache."""


class Policy(abc.ABC):
    """How a Router chooses among the candidates that pass its filters.

    Subclass it, implement ``choose``, and pass an instance as ``Router(policy=...)``;
    give each router its own instance. ``name`` labels the picks it makes.
    """

    name: str = "custom"
    """The label of this policy's picks (``PickHandle.policy``, the metrics)."""

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate | Choice:
        """Return one of ``candidates`` (never empty), or a Choice naming one, for ``request``."""

    def forget(self, engine_id: str) -> None:  # noqa: B027 - a hook: most policies keep nothing
        """Drop what you keep about ``engine_id``: it left, or its KV block size changed."""


def _check_load_factor(load_factor: float | None) -> float | None:
    if load_factor is not None and not load_factor >= 1:  # also rejects NaN
        raise ValueError(f"load_factor must be >= 1 (or None for no bound), got {load_factor!r}")
    return None if load_factor is None else float(load_factor)


S = TypeVar("S")


class _PerCandidateSet(Generic[S]):
    """What a policy derives from a candidate set, kept per set.

    A router reuses one set per selector and fit across picks, and picks for different
    models (selectors) alternate: derived once per set, not at every switch.
    """

    def __init__(self, derive: Callable[[Sequence[Candidate]], S]) -> None:
        self._derive = derive
        self._kept: dict[int, tuple[Sequence[Candidate], S]] = {}

    def __call__(self, candidates: Sequence[Candidate]) -> S:
        kept = self._kept.get(id(candidates))
        if kept is None or kept[0] is not candidates:  # holding the set keeps its id its own
            if len(self._kept) >= _KEPT_SETS:
                self._kept.clear()  # sets of older tables: a router rebuilds its own
            kept = self._kept[id(candidates)] = (candidates, self._derive(candidates))
        return kept[1]


def _bound_scale(candidates: Sequence[Candidate], load_factor: float, capacity: int) -> float:
    """``c * (T + 1) / C``: engine ``e`` is under its bound iff ``load < scale * cap``.

    For an integer ``k``, ``k + 1 <= ceil(x)`` holds exactly when ``k < x``.
    """
    return load_factor * (_total_load(candidates) + 1) / capacity


def _weights(candidates: Sequence[Candidate]) -> tuple[int, int | None]:
    """The candidates' total weight, and the cap on one's weight if some claim more (else None).

    The cap is MAX_MEDIAN_MULTIPLE times the upper median capacity (module docs).
    """
    capacities = sorted(c.capacity for c in candidates)
    cap = MAX_MEDIAN_MULTIPLE * capacities[len(capacities) // 2]
    if capacities[-1] <= cap:
        return sum(capacities), None
    return sum(min(capacity, cap) for capacity in capacities), cap


def _weight(candidate: Candidate, cap: int | None) -> int:
    """``candidate``'s capacity as the policies weigh it: at most ``cap``."""
    return candidate.capacity if cap is None else min(candidate.capacity, cap)


def _scorer(cap: int | None) -> Callable[[Candidate], float]:
    """The candidates' own score; where ``cap`` caps a weight, ``load / weight``.

    Any ``(load + 1) / weight`` prefers the heaviest of idle engines: among engines a lie
    may be in, idle ones tie on their utilisation (0), and ties rotate.
    """
    return _SCORE if cap is None else lambda c: c.load / min(c.capacity, cap)


# -- the built-in policies -------------------------------------------------------------


class RoundRobinPolicy(Policy):
    """The candidates in turn."""

    name = RoutingPolicy.ROUND_ROBIN

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate:
        """The next candidate in turn."""
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen


class LoadBalancedPolicy(Policy):
    """The fewest requests in flight per slot; exact ties rotate.

    Where other routers' load is part of the view (``Candidate.others``, relayed up to a
    tenth of a second late), every router would send its next requests to the same
    least-loaded engine until the next report: then the less loaded of two candidates
    drawn at random wins (power of two choices), which spreads them.
    """

    name = RoutingPolicy.LOAD_BALANCED

    def __init__(self) -> None:
        self._turn = 0
        self._random = random.Random(random.getrandbits(64))  # each router draws its own
        self._weights = _PerCandidateSet(_weights)
        # The last set's score: a router picks from one set most of the time.
        self._scored: tuple[Sequence[Candidate] | None, Callable[[Candidate], float]] = (
            None,
            _SCORE,
        )

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate:
        """The least-loaded candidate."""
        return self.least_loaded(candidates)

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """The lowest ``(in_flight + 1) / capacity`` (capped: module docs); exact ties rotate."""
        count = len(candidates)
        if count == 1:
            return candidates[0]
        last, score = self._scored
        if last is not candidates:
            score = _scorer(self._weights(candidates)[1])
            self._scored = (candidates, score)
        kept = _kept(candidates)
        if count > 2 and _others_hold(candidates, kept):
            first = self._random.randrange(count)
            second = self._random.randrange(count - 1)
            second += second >= first
            one, two = candidates[first], candidates[second]
            return one if score(one) <= score(two) else two
        # The first of the lowest at or after a rotating start spreads exact ties.
        start = self._turn % len(candidates)
        self._turn += 1
        if kept is not None:  # the picker's set: its candidates are kept by score
            return candidates[kept.ranked().lowest(start)]
        scores = list(map(score, candidates))
        lowest = min(scores)
        try:
            return candidates[scores.index(lowest, start)]
        except ValueError:  # every lowest one is before the start
            return candidates[scores.index(lowest)]


class FirstPrefixBlockPolicy(Policy):
    """Rendezvous hashing of the first KV-cache block, walked to an engine under the bound.

    ``load_factor`` is ``c`` of the load bound (module docs); None: pure affinity.
    """

    name = RoutingPolicy.FIRST_PREFIX_BLOCK

    def __init__(self, *, load_factor: float | None = DEFAULT_LOAD_FACTOR) -> None:
        self.load_factor = _check_load_factor(load_factor)
        self._balance = LoadBalancedPolicy()
        self._prepared = _PerCandidateSet(self._prepare)
        self._warned: set[tuple[int, ...]] = set()

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate | Choice:
        """The first candidate in the first block's rendezvous order that is under its bound."""
        block_size, seeds, weights = self._prepared(candidates)
        tokens = request.prompt_tokens
        if len(tokens) < block_size:
            return Choice(self._balance.least_loaded(candidates), RoutingPolicy.LOAD_BALANCED)
        key = _first_block_key(tokens, block_size)
        return _rendezvous(candidates, seeds, weights, key, self.load_factor)

    def _prepare(
        self, candidates: Sequence[Candidate]
    ) -> tuple[int, _Seeds, tuple[int, int | None]]:
        """The hashed block size (the smallest), each candidate's seed, their weights."""
        sizes = sorted({c.block_size for c in candidates})
        if len(sizes) > 1 and tuple(sizes) not in self._warned:
            self._warned.add(tuple(sizes))
            log.warning(
                "first_prefix_block: candidates use block sizes %s; hashing the first %d "
                "tokens (the smallest) for all of them",
                sizes,
                sizes[0],
            )
        return sizes[0], _Seeds(candidates), _weights(candidates)


class SessionPolicy(Policy):
    """Rendezvous hashing of the session key: every router sends a key to the same engine.

    The candidates are ranked by highest random weight for the key (``session_hash``, the
    engine's seed): the first under its load bound takes the request. With the same
    candidates every router agrees, with no shared state; an engine that leaves moves
    only its own keys, one that arrives takes about 1/N of them. A request without a key
    is load-balanced. ``load_factor`` is ``c`` of the bound (module docs); None: pure
    affinity.
    """

    name = RoutingPolicy.SESSION

    def __init__(self, *, load_factor: float | None = DEFAULT_SESSION_LOAD_FACTOR) -> None:
        self.load_factor = _check_load_factor(load_factor)
        self._balance = LoadBalancedPolicy()
        self._prepared = _PerCandidateSet(_seeds_and_capacity)

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Candidate | Choice:
        """The first candidate in the key's rendezvous order that is under its bound."""
        key = request.session_key
        if key is None:
            return Choice(self._balance.least_loaded(candidates), RoutingPolicy.LOAD_BALANCED)
        seeds, weights = self._prepared(candidates)
        return _rendezvous(candidates, seeds, weights, key, self.load_factor)


def _seeds_and_capacity(
    candidates: Sequence[Candidate],
) -> tuple[_Seeds, tuple[int, int | None]]:
    return _Seeds(candidates), _weights(candidates)


class _Seeds:
    """A candidate set's rendezvous seeds, and the first candidate of each key seen.

    Keys repeat (a system prompt's first block, a conversation's session): the first in
    a key's order is scored once per set, not per pick.
    """

    __slots__ = ("_firsts", "seeds")

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.seeds = [c._seed for c in candidates]
        self._firsts: dict[int, int] = {}

    def scores(self, key: int) -> list[int]:
        """Each candidate's rendezvous score for ``key`` (the highest ranks first)."""
        return [((key ^ seed) * _MIX) & _MASK64 for seed in self.seeds]

    def first(self, key: int) -> int:
        """The index of the candidate first in ``key``'s order."""
        first = self._firsts.get(key)
        if first is None:
            scores = self.scores(key)
            first = scores.index(max(scores))
            if len(self._firsts) >= _KEPT_KEYS:
                self._firsts.clear()
            self._firsts[key] = first
        return first


def _rendezvous(
    candidates: Sequence[Candidate],
    seeds: _Seeds,
    weights: tuple[int, int | None],
    key: int,
    load_factor: float | None,
) -> Candidate:
    """The first of ``candidates`` in ``key``'s rendezvous order that is under its bound."""
    chosen = candidates[seeds.first(key)]
    if load_factor is None or len(candidates) == 1:
        return chosen
    capacity, cap = weights
    scale = _bound_scale(candidates, load_factor, capacity)
    if chosen.load < scale * _weight(chosen, cap):
        return chosen
    # Over its bound: walk on in this key's rendezvous order (rarely taken, so sorted
    # only here). Some candidate is under its bound, so the walk ends in the order.
    scores = seeds.scores(key)
    order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
    return next(
        (c for c in map(candidates.__getitem__, order) if c.load < scale * _weight(c, cap)),
        chosen,
    )


class _PrefixIndex:
    """Block hashes recently routed to each engine: a per-engine LRU plus a reverse map.

    The per-engine LRU is the memory bound; the reverse map (hash -> owning engine ids, a
    tuple because almost every hash has one owner) only holds what some LRU holds.
    """

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def longest(self, hashes: Iterable[int], candidates: frozenset[str]) -> tuple[int, set[str]]:
        """How many leading blocks the best candidates hold, and which candidates they are."""
        owners_of = self._owners
        matched = 0
        holders: set[str] = set()
        for block_hash in hashes:
            owners = owners_of.get(block_hash)
            if owners is None:
                break
            alive = candidates if not matched else holders
            still = {owner for owner in owners if owner in alive}
            if not still:
                break
            holders = still
            matched += 1
        return matched, holders

    def record(self, engine_id: str, limit: int, hashes: Iterable[int]) -> None:
        """Remember ``hashes`` as the newest blocks of ``engine_id``, evicting its oldest."""
        lru = self._lru.get(engine_id)
        if lru is None:
            lru = self._lru[engine_id] = OrderedDict()
        owners_of = self._owners
        for block_hash in hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)
                continue
            lru[block_hash] = None
            owners_of[block_hash] = (*owners_of.get(block_hash, ()), engine_id)
        while len(lru) > limit:
            self._disown(lru.popitem(last=False)[0], engine_id)

    def forget(self, engine_id: str) -> None:
        """Drop every block of ``engine_id``."""
        for block_hash in self._lru.pop(engine_id, ()):
            self._disown(block_hash, engine_id)

    def _disown(self, block_hash: int, engine_id: str) -> None:
        owners = tuple(owner for owner in self._owners[block_hash] if owner != engine_id)
        if owners:
            self._owners[block_hash] = owners
        else:
            del self._owners[block_hash]


class LongestPrefixPolicy(Policy):
    """The engine recently sent the longest run of the prompt's leading blocks.

    It must be under its load bound (``load_factor``, None: no bound) and within
    ``load_gap`` utilisation of the least-loaded candidate, else the request is
    load-balanced. ``prefix_index_blocks`` bounds the remembered blocks per engine.
    """

    name = RoutingPolicy.LONGEST_PREFIX

    def __init__(
        self,
        *,
        load_factor: float | None = DEFAULT_LOAD_FACTOR,
        load_gap: float = DEFAULT_LOAD_GAP,
        prefix_index_blocks: int = DEFAULT_INDEX_BLOCKS,
    ) -> None:
        if not load_gap >= 0:  # also rejects NaN
            raise ValueError(f"load_gap must be >= 0, got {load_gap!r}")
        self.load_factor = _check_load_factor(load_factor)
        self.load_gap = float(load_gap)
        self.prefix_index_blocks = _check_index_blocks(prefix_index_blocks)
        self._index = _PrefixIndex()
        self._balance = LoadBalancedPolicy()
        self._prepared = _PerCandidateSet(self._prepare)

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Choice:
        """The best-matching candidate if under its bound and the gap, else the least loaded."""
        by_block, by_id, (capacity, cap) = self._prepared(candidates)
        chains: dict[int, list[int]] = {}
        best_tokens = 0
        holders: set[str] = set()
        for size, ids in by_block.items():
            chain = chains[size] = _block_hashes(request.prompt_tokens, size)
            blocks, owners = self._index.longest(chain, ids)
            if blocks * size > best_tokens:
                best_tokens, holders = blocks * size, owners
        least = self._balance.least_loaded(candidates)
        chosen, policy = least, RoutingPolicy.LOAD_BALANCED
        if holders:
            score = _scorer(cap)
            best = min(map(by_id.__getitem__, holders), key=lambda c: (score(c), c.engine_id))
            weight = _weight(best, cap)
            gap = best.load / weight - least.load / _weight(least, cap)
            if gap <= self.load_gap and (
                self.load_factor is None
                or best.load < weight * _bound_scale(candidates, self.load_factor, capacity)
            ):
                chosen, policy = best, RoutingPolicy.LONGEST_PREFIX
        # total_kv_blocks=0 means not advertised: then the option alone bounds the index.
        limit = chosen.record.endpoint.capabilities.total_kv_blocks or self.prefix_index_blocks
        limit = min(limit, self.prefix_index_blocks)
        self._index.record(chosen.engine_id, limit, chains[chosen.block_size])
        return Choice(chosen, policy, best_tokens if policy is RoutingPolicy.LONGEST_PREFIX else 0)

    def forget(self, engine_id: str) -> None:
        """Drop the remembered blocks of ``engine_id``."""
        self._index.forget(engine_id)

    @staticmethod
    def _prepare(
        candidates: Sequence[Candidate],
    ) -> tuple[dict[int, frozenset[str]], dict[str, Candidate], tuple[int, int | None]]:
        """The candidates' ids per block size, the candidates by id, their weights."""
        by_block: dict[int, set[str]] = {}
        for c in candidates:
            by_block.setdefault(c.block_size, set()).add(c.engine_id)
        return (
            {size: frozenset(ids) for size, ids in by_block.items()},
            {c.engine_id: c for c in candidates},
            _weights(candidates),
        )


class StateView(Protocol):
    """What ``KvAwarePolicy`` reads of the engines' reported state (``EngineStates``)."""

    def fresh_view(self) -> Mapping[str, Container[int]]:
        """Engine id -> cached block hashes, for every engine whose state is synced and fresh.

        Read once per pick; returning the same object while nothing changed lets the
        policy reuse what it derived from it.
        """
        ...


class KvAwarePolicy(Policy):
    """The engine that reports caching the most of the prompt, less a load cost, under the bound.

    For each candidate: ``cached`` = the prompt's leading blocks it reports holding (the
    engine's own KV events, relayed: ``states``, an ``EngineStates``; the prompt hashed as
    Megatron hashes it, ``block_hashes``), and ``score = cached - load_weight x
    utilisation x prompt_blocks`` with ``utilisation = load / capacity`` (``load``: the
    shared load view, this router's handles plus what the others hold). The best score
    among the candidates under their load bound (``load_factor``, as the prefix policies;
    None: no bound) wins; exact ties and a prompt shorter than a block go to the least
    loaded. A candidate whose state is missing, unsynced or stale (older than the
    ``EngineStates``' ``stale_after``, 3 s by default) is scored, that engine alone, with
    today's estimate: the blocks this router itself sent it recently (``longest_prefix``'s
    index, bounded by ``prefix_index_blocks``); each such scoring counts in ``fallbacks``.

    **Cost.** The prompt is hashed lazily, only as deep as some candidate still holds it
    (SHA-256 per block, about 5 us): a pick whose first block no engine holds hashes one
    block. A caller holding the hashes already (a frontend keeping each conversation's
    chain) passes them (``PickRequest.block_hashes``, ``Router.pick(block_hashes=...)``)
    and nothing is hashed. The engines' states are read once per pick
    (``states.fresh_view()``); which candidates have fresh state is derived once per
    candidate set and view. The engines holding a prompt's first block come from
    ``states.holders`` (kept as KV events arrive; a view without it is scanned), so only
    they are asked about the next blocks, one set lookup per block per candidate still
    matching (bench/bench_router.py: with the hashes given, about 35 us at 64 engines
    holding a few thousand blocks each, 65 us at 512, on a shared machine).
    """

    name = RoutingPolicy.KV_AWARE

    def __init__(
        self,
        states: StateView,
        *,
        load_factor: float | None = DEFAULT_LOAD_FACTOR,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        prefix_index_blocks: int = DEFAULT_INDEX_BLOCKS,
    ) -> None:
        if not load_weight >= 0:  # also rejects NaN
            raise ValueError(f"load_weight must be >= 0, got {load_weight!r}")
        self.load_factor = _check_load_factor(load_factor)
        self.load_weight = float(load_weight)
        self.prefix_index_blocks = _check_index_blocks(prefix_index_blocks)
        self._states = states
        # EngineStates keeps who holds each first block asked about; another view: scanned.
        self._holders: Callable[[int], Iterable[str]] | None = getattr(states, "holders", None)
        self._estimate = _PrefixIndex()  # what this router sent: for engines without state
        self._balance = LoadBalancedPolicy()
        self._prepared = _PerCandidateSet(_by_block_size)
        # Per candidate group: (group, view, [(candidate, blocks)] fresh, those not, their ids).
        self._splits: dict[int, _Split] = {}
        self.fallbacks = 0
        """Candidates scored from this router's estimate (no fresh reported state)."""

    def choose(self, candidates: Sequence[Candidate], request: PickRequest) -> Choice:
        """The candidate with the best score under its bound, else the least loaded."""
        groups, (capacity, cap) = self._prepared(candidates)
        least = self._balance.least_loaded(candidates)
        score_of = _scorer(cap)
        tokens = request.prompt_tokens
        scale = (
            math.inf
            if self.load_factor is None or len(candidates) == 1
            else _bound_scale(candidates, self.load_factor, capacity)
        )
        weight = self.load_weight
        best, best_score, best_cached = least, -math.inf, 0
        hashes_of: dict[int, LazyBlockHashes] = {}
        estimated: set[str] = set()
        view = self._states.fresh_view()
        known = request.block_hashes or {}
        for size, group in groups.items():
            hashes = hashes_of[size] = LazyBlockHashes(tokens, size, known.get(size))
            if not len(hashes):
                continue
            cached, estimated_here = self._cached(group, hashes, view)
            estimated |= estimated_here
            cost = weight * len(hashes)
            for candidate, blocks in cached.items():
                weighs = candidate.capacity if cap is None else min(candidate.capacity, cap)
                if candidate.load >= scale * weighs:
                    continue  # over its bound
                score = blocks - cost * candidate.load / weighs
                if score > best_score or (
                    score == best_score and score_of(candidate) < score_of(best)
                ):
                    best, best_score, best_cached = candidate, score, blocks * size
        self.fallbacks += len(estimated)
        unmatched = -weight * len(hashes_of[least.block_size]) * least.load / _weight(least, cap)
        if best_cached and best_score > unmatched:  # else no cache is worth its load
            chosen, policy = best, RoutingPolicy.KV_AWARE
        else:
            chosen, policy, best_cached = least, RoutingPolicy.LOAD_BALANCED, 0
        if chosen.engine_id in estimated or chosen.engine_id not in view:
            # No state tells what it holds: remember what we send it (today's estimate).
            limit = chosen.record.endpoint.capabilities.total_kv_blocks or self.prefix_index_blocks
            hashes = hashes_of.get(chosen.block_size) or LazyBlockHashes(
                tokens, chosen.block_size, known.get(chosen.block_size)
            )
            self._estimate.record(
                chosen.engine_id, min(limit, self.prefix_index_blocks), hashes.all()
            )
        return Choice(chosen, policy, best_cached)

    def _split(self, group: Sequence[Candidate], view: Mapping[str, Container[int]]) -> _Split:
        """The group's fresh candidates (with blocks), the others, their ids, fresh places."""
        kept = self._splits.get(id(group))
        if kept is None or kept[0] is not group or kept[1] is not view:
            if len(self._splits) >= _KEPT_SETS:
                self._splits.clear()
            fresh = [(c, blocks) for c in group if (blocks := view.get(c.engine_id)) is not None]
            stale = [c for c in group if c.engine_id not in view]
            ids = frozenset(c.engine_id for c in stale)
            places = {c.engine_id: index for index, (c, _) in enumerate(fresh)}
            kept = self._splits[id(group)] = (group, view, fresh, stale, ids, places)
        return kept

    def _cached(
        self,
        group: Sequence[Candidate],
        hashes: LazyBlockHashes,
        view: Mapping[str, Container[int]],
    ) -> tuple[dict[Candidate, int], frozenset[str]]:
        """Leading blocks each candidate holds (those holding at least one); the ids estimated."""
        _, _, fresh, stale, ids, places = self._split(group, view)
        cached: dict[Candidate, int] = {}
        depth = 0
        holders_of = self._holders
        if holders_of is not None and fresh:
            # The first block's holders are kept as KV events arrive: only they are asked
            # about the next blocks (in the group's order, as the full scan keeps them).
            first = hashes.get(0)
            held = () if first is None else holders_of(first)
            fresh = [fresh[i] for i in sorted(places[e] for e in held if e in places)]
            depth = 1
            chain = hashes.hashes
            if fresh and len(chain) == len(hashes):
                # Every hash known (given, or hashed already): each holder's run of the next
                # blocks in one C loop, not a Python step per block. Stable by run length:
                # the order (and so the tie-breaking) of the walk below.
                rest = chain[1:]
                runs = [
                    (c, 1 + len(list(takewhile(blocks.__contains__, rest)))) for c, blocks in fresh
                ]
                runs.sort(key=_RUN)
                cached.update(runs)
                fresh = []
        while fresh:
            block_hash = hashes.get(depth)
            if block_hash is None:
                break
            still = [pair for pair in fresh if block_hash in pair[1]]
            if depth and len(still) < len(fresh):
                for candidate, blocks in fresh:
                    if block_hash not in blocks:
                        cached[candidate] = depth
            fresh = still
            depth += 1
        for candidate, _ in fresh:
            cached[candidate] = depth
        if stale:
            estimate, holders = self._estimate.longest(_lazy_iter(hashes), ids)
            for candidate in stale:
                if candidate.engine_id in holders:
                    cached[candidate] = estimate
        return {c: n for c, n in cached.items() if n}, ids

    def forget(self, engine_id: str) -> None:
        """Drop what this router estimated ``engine_id`` holds."""
        self._estimate.forget(engine_id)


_Split = tuple[
    Sequence[Candidate],
    Mapping[str, Container[int]],
    list[tuple[Candidate, Container[int]]],
    list[Candidate],
    frozenset[str],
    dict[str, int],
]


def _lazy_iter(hashes: LazyBlockHashes) -> Iterator[int]:
    index = 0
    while (block_hash := hashes.get(index)) is not None:
        yield block_hash
        index += 1


def _by_block_size(
    candidates: Sequence[Candidate],
) -> tuple[dict[int, tuple[Candidate, ...]], tuple[int, int | None]]:
    """The candidates per block size, and their weights."""
    groups: dict[int, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.block_size, []).append(c)
    return {size: tuple(g) for size, g in groups.items()}, _weights(candidates)


def _check_index_blocks(prefix_index_blocks: object) -> int:
    if isinstance(prefix_index_blocks, bool) or not isinstance(prefix_index_blocks, int):
        raise TypeError("prefix_index_blocks must be an integer")
    if prefix_index_blocks <= 0:
        raise ValueError(f"prefix_index_blocks must be positive, got {prefix_index_blocks}")
    return prefix_index_blocks
