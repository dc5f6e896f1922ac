"""A pick's ask and its candidate sets: every filter a pick applies, in one place.

``Ask`` is one pick's arguments, checked (``Pools._ask``). ``Pools._pool_locked`` filters
the engines the router sees into the candidates of one combination of selector, fit,
versions and roles, and resolves the policy that routes them; a ``Pool`` is kept per
combination until the candidates change. ``Pools`` is the lowest layer of ``Router``
(``discovery._routing.router``): it declares the state every layer reads, which
``Router.__init__`` sets.

**Status, before anything else.** Only engines whose record status is among the router's
``statuses`` (default: ``ready``) are candidates: a ``starting`` engine takes nothing yet,
a ``draining`` or ``paused`` one nothing new. A handle already held on an engine that
starts draining or is paused stays valid and releases normally (its in-flight count stays
visible in ``in_flight()``).

**Candidates.** The router sees the engines of the table its ``selector`` matches
(Kubernetes' label selectors, ``discovery._records.selector``). Each pick then filters them, in
this order and in one place (``_pool_locked``):
fit (``len(prompt_tokens) + max_tokens <= context_length``), the per-call ``selector``
(matched the same way), weight versions (below), and fencing
(below). When fit, labels or ``min_weight_version`` leave nothing the pick raises
``NoEngineAvailableError`` naming the filter that emptied the set (and, for the version
filter, the versions present); it never picks at random. Fencing never empties a set.

**Weight versions** (a rollout fleet's ``weight_version``; no option: versions are not
looked at). ``min_weight_version=V`` keeps the candidates on version ``V`` or later.
``max_version_lag=K`` keeps those at most ``K`` versions behind the highest version among
the candidates, and ``weight_version="latest"`` is ``max_version_lag=0``: only the
engines on that highest version (given both, the smaller lag applies). "The candidates"
are the engines that passed the earlier filters (status, labels, fit), so the highest
version is that of a ready engine that could take this request: while a fleet is refitted,
the first engine ready on the new version takes every pick from the old ones, and a pick
never finds nothing while some ready engine fits. An engine without a version counts as
older than every version: ``min_weight_version`` never keeps it, and ``latest`` /
``max_version_lag`` keep it only when no candidate has a version (a fleet that does not
use versions routes as before). Given per pick, the three options replace the router's
for that pick (all three: give any one of them and the router's are not used).

**Policy** (``discovery._routing.policies``): a ``RoutingPolicy`` name, whose built-in policy the
router builds with its ``load_factor``, ``load_gap`` and ``prefix_index_blocks``, or a
``Policy`` instance of your own. ``auto`` (default) follows what the candidates
advertise: an engine's advertised policy is its ``prefix_caching_coordinator_policy``, or
``load_balanced`` when it has ``enable_prefix_caching=False`` or no policy. When every
candidate of a pick advertises the same policy (and, for the two prefix policies, the
same ``kv_cache_block_size``), that policy is used. Otherwise the candidates are never
hashed together: the pick is load-balanced over all of them and a warning naming the mix
is logged once per mix. Give such fleets distinct labels and route each with its own
selector to keep affinity. An explicit policy applies to every candidate, whatever it
advertises.

**Fencing** (``discovery._routing.fencing``): ``handle.release(failed=True)`` reports a failed
request; ``fence_after`` consecutive failures fence the engine for ``fence_seconds``,
doubled at each repeat without a success in between (up to ``fence_max_seconds``); a
success resets the counts. A fenced engine is no candidate until its fence ends. At most
``max_fenced_share`` of the engines the router sees are fenced at once, and when more than
that share of one pick's candidates (or all of them) are fenced, as can happen under a
narrow per-call selector, that pick ignores fencing (Envoy's panic mode). ``health()``
lists fenced and failing engines.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from discovery._errors import NoEngineAvailableError
from discovery._metrics import MetricsHooks
from discovery._reads.store import Batch, RoutingSnapshot
from discovery._reads.table import RoutingTable
from discovery._records.handoff import EngineRole
from discovery._records.record import EngineStatus
from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._routing.admission import Admission
from discovery._routing.fencing import FenceBook
from discovery._routing.handles import Listener, PickHandle
from discovery._routing.picker import NO_PICKER, NO_VERSIONS, Picker, Pool, Versions, by_version
from discovery._routing.policies import (
    Candidate,
    LoadTally,
    Policy,
    RoutingPolicy,
    session_hash,
)
from discovery._routing.protection import LossProtection
from discovery._routing.split import Split, split_of

if TYPE_CHECKING:
    from discovery._state.engine_states import EngineStates

__all__ = ["ALONE", "EVERYTHING", "MAX_POOLS", "Ask", "Pools", "check_block_hashes"]

log = logging.getLogger(__name__)

_CACHE_AFFINE = (RoutingPolicy.FIRST_PREFIX_BLOCK, RoutingPolicy.LONGEST_PREFIX)

MAX_POOLS = 256  # cached candidate sets per table version; bounds memory under odd selectors
_NO_IDS: frozenset[str] = frozenset()
EVERYTHING = selector_of(None)
ALONE = frozenset({EngineRole.AGGREGATED, EngineRole.PREFILL})
"""The roles that serve a request alone (a Megatron decode engine cannot compute a prompt)."""


class Ask(NamedTuple):
    """One pick's arguments, checked: what a waiting pick is served with later."""

    prompt_tokens: Sequence[int]
    max_tokens: int
    selector: Selector
    versions: Versions
    block_hashes: Mapping[int, Sequence[int]] | None
    exclude: frozenset[str]
    priority: int
    admit: bool
    """Admission applies: engines without room are no candidates."""
    session: int | None = None
    """The session key, hashed (``session_hash``): it decides the engine."""
    pin: str | None = None
    """The engine the pick must go to (``engine_id=``)."""
    fallback: bool = False
    """A pin that is no candidate falls back to an ordinary pick (else it raises)."""
    roles: frozenset[EngineRole] = frozenset()
    """The roles a candidate may have (``ALONE``, set by ``_ask``; one side of a pair)."""
    only: frozenset[str] | None = None
    """The engines that may take it (a pair's side: those that can hand off); None: any."""
    policy: Policy | None = None
    """The policy that chooses (a pair's side); None: the key's, else the router's."""
    split: Split | None = None
    """Groups to draw one from before choosing (``split=``); None once drawn, or none."""
    group: str | None = None
    """The split's group drawn (its selector's text), added to ``selector``."""
    images: bool = False
    """The request carries images: routed by load alone (``policy``), nothing hashed."""


class Pools:
    """The router's state, and the candidate sets of its picks (``Router``'s lowest layer).

    The attributes below are set by ``Router.__init__``; each layer above reads them.
    """

    # -- what the router was built with --
    _policy: RoutingPolicy | Policy
    _builtins: dict[RoutingPolicy, Policy]  # built eagerly: bad options fail at __init__
    _versions: Versions
    _split: Split | None
    _selector: Selector
    _statuses: frozenset[EngineStatus | str]
    _admission: Admission
    _admit: bool  # admission is on for every pick (``capacity`` or ``wait`` given)
    _fences: FenceBook
    _protection: LossProtection[Candidate]
    _states: EngineStates | None
    _table: RoutingTable
    _metrics: MetricsHooks
    _counting: bool  # metrics were given: else no metrics call per pick
    _lock: threading.Lock
    # -- what it derives from the table (under the lock) --
    _snapshot: RoutingSnapshot | None
    _engines: dict[str, Candidate]
    _ordered: tuple[Candidate, ...]  # by context_length, longest first
    _roles: bool  # some candidate is not aggregated (a prefill / decode fleet)
    _neg_context: list[int]  # ascending, for bisect
    _min_context: int
    _pools: dict[tuple[object, ...], Pool]
    _picker: Picker  # rebuilt by _refresh_locked (see discovery._routing.picker)
    _tally: LoadTally  # the total load of the picker's candidates, kept
    _load_changes: collections.deque[str] | None
    _batches: collections.deque[tuple[Batch, float]]
    _notices: list[tuple[PickHandle, Listener, str]]  # told after the lock
    _held: int  # unreleased handles, over every engine
    _losses: int  # engines that stopped being good targets, counted
    _next_check: float  # when a pick next looks at unconfirmed engines' evidence
    _warned: set[object]
    _plain: tuple[tuple[Any, ...], float] | None  # _plain_ask's, checked once

    def _plain_ask(self, prompt_tokens: Sequence[int], max_tokens: int) -> tuple[Ask, float]:
        """``_ask`` with no option (a caller picking per request): the rest checked once."""
        if type(max_tokens) is not int or max_tokens < 0 or self._plain is None:
            ask, timeout = self._ask(
                prompt_tokens,
                max_tokens,
                selector=None,
                weight_version=None,
                min_weight_version=None,
                max_version_lag=None,
                block_hashes=None,
                exclude=None,
                wait=None,
                priority=0,
            )
            self._plain = ask[2:], timeout
            return ask, timeout
        rest, timeout = self._plain
        # Per request: tuple.__new__ skips the NamedTuple's Python-level __new__, and a
        # concatenation is cheaper than unpacking ``rest``.
        return tuple.__new__(Ask, (prompt_tokens, max_tokens) + rest), timeout  # noqa: RUF005

    def _ask(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: SelectorLike | None,
        weight_version: Literal["latest"] | None,
        min_weight_version: int | None,
        max_version_lag: int | None,
        block_hashes: Mapping[int, Sequence[int]] | None,
        exclude: Collection[str] | None,
        wait: float | None,
        priority: int,
        session_key: str | bytes | int | None = None,
        engine_id: str | None = None,
        fallback: bool = False,
        split: Split | Mapping[SelectorLike, float] | None = None,
        images: bool = False,
    ) -> tuple[Ask, float]:
        """The pick's arguments, checked, and how long it may wait for room."""
        # type() is: the common case costs one comparison (bool is an int subclass: refused)
        if type(max_tokens) is not int and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
        ):
            raise TypeError("max_tokens must be an integer")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if block_hashes is not None:
            check_block_hashes(block_hashes, len(prompt_tokens))
        if type(priority) is not int and (
            isinstance(priority, bool) or not isinstance(priority, int)
        ):
            raise TypeError(f"priority must be an integer, not {type(priority).__name__}")
        if not exclude:
            excluded = _NO_IDS
        elif isinstance(exclude, str):
            raise TypeError("exclude must be a collection of engine ids, not a string")
        else:
            excluded = frozenset(exclude)
        versions = (
            self._versions
            if weight_version is None and min_weight_version is None and max_version_lag is None
            else Versions.of(weight_version, min_weight_version, max_version_lag)
        )
        if wait is None:
            admit = self._admit
            timeout = self._admission.wait if admit else 0.0
        elif 0 <= wait < math.inf:
            admit, timeout = True, wait
        else:
            raise ValueError(f"wait must be >= 0 seconds and finite, got {wait!r}")
        session = None if session_key is None or images else session_hash(session_key)
        if images:
            block_hashes = None  # nothing of the prompt is used: no cache will hold it
        if engine_id is not None and not isinstance(engine_id, str):
            raise TypeError(f"engine_id must be a string, not {type(engine_id).__name__}")
        ask = Ask(
            prompt_tokens,
            max_tokens,
            selector_of(selector),
            versions,
            block_hashes,
            excluded,
            priority,
            admit,
            session,
            engine_id,
            fallback,
            ALONE,
            split=self._split if split is None else split_of(split),
            policy=self._builtins[RoutingPolicy.LOAD_BALANCED] if images else None,
            images=images,
        )
        return ask, timeout

    def _fit_locked(self, need: int) -> int:
        """How many of the ordered candidates fit ``need`` tokens (they are a prefix)."""
        if need <= self._min_context:
            return len(self._ordered)
        return bisect.bisect_right(self._neg_context, -need)

    def _pool_locked(
        self,
        selector: Selector,
        prompt_len: int,
        max_tokens: int,
        versions: Versions = NO_VERSIONS,
        roles: frozenset[EngineRole] = ALONE,
    ) -> Pool:
        """The candidates of one pick: every filter runs here (role, fit, labels, versions...)."""
        need = prompt_len + max_tokens
        # Most requests fit every engine: no call (this runs per pick).
        fit = len(self._ordered) if need <= self._min_context else self._fit_locked(need)
        key = (selector, fit, versions, roles)
        pool = self._pools.get(key)
        if pool is None:
            engines = self._ordered[:fit]
            if roles is not ALONE or self._roles:  # else every engine serves alone
                engines = tuple(e for e in engines if e.record.role in roles)
            if selector:
                engines = tuple(e for e in engines if selector.matches(e.record.labels))
            if not engines:
                raise self._no_engine_locked(selector, prompt_len, max_tokens, roles)
            if versions is not NO_VERSIONS:
                engines = by_version(engines, versions)
            engines = self._unfenced_locked(engines, key)
            if len(self._pools) >= MAX_POOLS:
                self._clear_pools_locked()
            pool = self._pools[key] = Pool(engines, self._resolve_locked(engines))
        return pool

    def _side_locked(self, ask: Ask) -> tuple[Candidate, ...]:
        """One side's candidates: every filter but capacity (a pick waits for room)."""
        pool = self._pool_locked(
            ask.selector, len(ask.prompt_tokens), ask.max_tokens, ask.versions, ask.roles
        )
        if not ask.exclude:
            return pool.candidates  # the pool's own tuple: the pairing memo knows it
        return tuple(e for e in pool.candidates if e.engine_id not in ask.exclude)

    def _unfenced_locked(
        self, engines: tuple[Candidate, ...], key: object
    ) -> tuple[Candidate, ...]:
        fenced = self._fences.fenced
        if not fenced:
            return engines
        unfenced = tuple(e for e in engines if e.engine_id not in fenced)
        if unfenced and len(engines) - len(unfenced) <= self._fences.limit(len(engines)):
            return unfenced
        self._warn_once(
            (key, frozenset(fenced)),
            "%d of %d candidate engines are fenced, more than max_fenced_share %.2f: "
            "routing over all of them until fences end",
            len(engines) - len(unfenced),
            len(engines),
            self._fences.max_share,
        )
        return engines

    def _resolve_locked(self, engines: tuple[Candidate, ...]) -> Policy:
        """The policy a pool is routed with; ``auto`` logs a mix once."""
        if isinstance(self._policy, Policy):
            return self._policy
        if self._policy is not RoutingPolicy.AUTO:
            return self._builtins[self._policy]
        groups: dict[str, int] = {}
        for e in engines:
            name = e.advertised.value
            if e.advertised in _CACHE_AFFINE:
                name += f" ({e.block_size}-token blocks)"
            groups[name] = groups.get(name, 0) + 1
        if len(groups) == 1:
            advertised = engines[0].advertised
            if (
                advertised in _CACHE_AFFINE
                and RoutingPolicy.KV_AWARE in self._builtins
                and all(e.record.state_address for e in engines)
            ):
                # The engines ask for cache affinity and report their caches: the truth
                # serves it better than a guess.
                return self._builtins[RoutingPolicy.KV_AWARE]
            return self._builtins[advertised]
        self._warn_once(
            frozenset(groups),
            "auto: candidate engines advertise different routing (%s); load-balancing across "
            "them instead of mixing hash spaces. Label them apart to route each by its policy.",
            ", ".join(f"{name}: {count} engines" for name, count in sorted(groups.items())),
        )
        return self._builtins[RoutingPolicy.LOAD_BALANCED]

    def _no_engine_locked(
        self,
        selector: Selector,
        prompt_len: int,
        max_tokens: int,
        roles: frozenset[EngineRole] = ALONE,
    ) -> NoEngineAvailableError:
        total = len(self._snapshot or ())
        if not total and not self._engines:
            return NoEngineAvailableError(
                "the routing table is empty: no engine is registered in its namespace, or "
                "the table has not been started"
            )
        if not self._engines:
            return NoEngineAvailableError(
                f"none of the {total} engines in the table matches the router's selector "
                f"'{self._selector}'"
            )
        if not self._ordered:
            seen: dict[str, int] = {}
            for engine in self._engines.values():
                seen[engine.record.status] = seen.get(engine.record.status, 0) + 1
            return NoEngineAvailableError(
                f"none of the {len(self._engines)} engines the router sees is "
                f"{' or '.join(sorted(self._statuses))} "
                f"({', '.join(f'{n} {status}' for status, n in sorted(seen.items()))})"
            )
        playing = [e for e in self._ordered if e.record.role in roles]
        if not playing:
            by_role = Counter(str(engine.record.role) for engine in self._ordered)
            wanted = " or ".join(sorted(map(str, roles)))
            return NoEngineAvailableError(
                f"none of the {len(self._ordered)} candidate engines is {wanted} "
                f"({', '.join(f'{n} {role}' for role, n in sorted(by_role.items()))})"
                + ("; a decode engine takes requests only from pick_pair" if roles == ALONE else "")
            )
        matching = [e for e in playing if selector.matches(e.record.labels)]
        if not matching:
            return NoEngineAvailableError(
                f"none of the {len(self._engines)} engines the router sees matches the "
                f"selector '{selector}'"
            )
        return NoEngineAvailableError(
            f"no engine fits {prompt_len + max_tokens} tokens (prompt {prompt_len} + "
            f"max_tokens {max_tokens}): the largest context_length among the "
            f"{len(matching)} matching engines is {matching[0].context_length}"
        )

    def _clear_pools_locked(self) -> None:
        """The candidate sets changed (fences, engines): derive them again."""
        self._pools.clear()
        self._picker = NO_PICKER

    def _warn_once(self, key: object, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def check_block_hashes(block_hashes: Mapping[int, Sequence[int]], prompt_len: int) -> None:
    """One hash per complete block, for each block size given."""
    if not isinstance(block_hashes, Mapping):
        raise TypeError("block_hashes must map a block size to the prompt's block hashes")
    for size, hashes in block_hashes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"block_hashes: {size!r} is no block size (a positive integer)")
        if len(hashes) != prompt_len // size:
            raise ValueError(
                f"block_hashes[{size}] holds {len(hashes)} hashes; a prompt of {prompt_len} "
                f"tokens has {prompt_len // size} complete blocks of {size} tokens"
            )


def policy_argument(policy: RoutingPolicy | str | Policy) -> RoutingPolicy | Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        raise TypeError(f"policy must be an instance: pass {policy.__name__}(), not the class")
    try:
        return RoutingPolicy(policy)
    except ValueError:
        names = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(
            f"unknown routing policy {policy!r}; use one of {names} or a Policy instance"
        ) from None
