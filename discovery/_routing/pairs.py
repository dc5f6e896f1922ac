"""Prefill/decode pairs: which engines can hand off to which (``Router.pick_pair``).

Megatron's rule (``_records/handoff.py``) is an equivalence: a prefill and a decode engine can hand
off exactly when their ``handoff_key`` is equal and not None. So the candidates of each
side are grouped by key once per candidate set, and a prefill engine is *viable* when some
decode candidate shares its key (and, with ``within`` required, the value of that label).
A pair is picked through the router's own machinery (every filter, fencing, admission and
its waiting, notifications), both sides in one pass under its lock when both have room:
the prefill side among the viable prefill engines by the router's policy (cached prefix),
then the decode side among the chosen engine's partners by load, those within the same
``within`` value first when it is preferred. When none of those has room, the prefill side
is picked again among the engines whose value has a partner with room (a pair kept
together wins over the best cache); only without one does the pair leave the value. A side
without room waits as a pick does, the sides then one after the other.

Skipping the prefill hop (conditional disaggregation) means sending the request to an
engine that computes the prompt itself: a Megatron decode engine cannot
(``inference_state_handoff.py``: "cannot schedule prompt prefill requests"), so the one
engine is an aggregated one, and only when the caller allows it (``allow_aggregated``):
when the prompt is shorter than ``alone_below`` tokens, or an aggregated candidate's
relayed cache holds at least ``alone_share`` of the prompt's complete blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from discovery._errors import NoEngineAvailableError, OverloadedError
from discovery._records.handoff import EngineRole, HandoffKey, handoff_key, handoff_problem
from discovery._records.record import EngineRecord
from discovery._routing.full_path import FullPath
from discovery._routing.handles import PickHandle, PickPair
from discovery._routing.policies import Candidate, Policy, RoutingPolicy
from discovery._routing.pools import MAX_POOLS, Ask, policy_argument
from discovery._state.blockhash import block_hashes

__all__ = ["HandoffKeys", "PairPicker", "Pairing"]

DEFAULT_ALONE_BELOW = 512
"""Prompts shorter than this (two 256-token blocks) go to an aggregated engine alone, when
allowed: a hand-off's two hops cost more than such a prompt's prefill."""
DEFAULT_ALONE_SHARE = 0.9
"""An aggregated engine caching this share of the prompt's blocks takes it alone, when
allowed: it computes a tenth of the prompt, and nothing moves between engines."""


class HandoffKeys:
    """``handoff_key`` of each record, computed once per record (a pick reads every one).

    Records are immutable and the table keeps the same object until the engine's record
    changes, so an engine's key is kept with the record it was computed from. Keys of
    engines gone are dropped all at once when they outnumber those of a pick's engines.
    """

    __slots__ = ("_keys",)

    _KEEP = 1024
    """Entries kept whatever the fleet's size, before old ones are dropped."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[EngineRecord, HandoffKey | None]] = {}

    def __call__(self, record: EngineRecord) -> HandoffKey | None:
        """``handoff_key(record)``, from the cache when ``record`` is the one it was for."""
        known = self._keys.get(record.engine_id)
        if known is not None and known[0] is record:
            return known[1]
        key = handoff_key(record)
        self._keys[record.engine_id] = (record, key)
        return key

    def trim(self, engines: int) -> None:
        """Drop every key when there are more than twice ``engines`` (and ``_KEEP``)."""
        if len(self._keys) > max(self._KEEP, 2 * engines):
            self._keys.clear()


class Pairing(NamedTuple):
    """The decode candidates of one candidate set, by hand-off key (and ``within`` value)."""

    by_key: dict[HandoffKey, tuple[Candidate, ...]]
    near: dict[tuple[HandoffKey, str], tuple[Candidate, ...]]
    """By key and the value of the ``within`` label (empty without one)."""
    within: str | None
    keys: HandoffKeys

    @classmethod
    def of(cls, decodes: Iterable[Candidate], keys: HandoffKeys, within: str | None) -> Pairing:
        """Group ``decodes`` by their hand-off key (those with none can pair with no one)."""
        groups: dict[HandoffKey, list[Candidate]] = {}
        near: dict[tuple[HandoffKey, str], list[Candidate]] = {}
        for engine in decodes:
            key = keys(engine.record)
            if key is None:
                continue
            groups.setdefault(key, []).append(engine)
            value = None if within is None else engine.record.labels.get(within)
            if value is not None:
                near.setdefault((key, value), []).append(engine)
        return cls(
            {key: tuple(group) for key, group in groups.items()},
            {pair: tuple(group) for pair, group in near.items()},
            within,
            keys,
        )

    def partners(
        self, prefill: Candidate, required: bool
    ) -> tuple[tuple[Candidate, ...], tuple[Candidate, ...]]:
        """``prefill``'s partners: (those with the same ``within`` label value, all of them).

        With ``within`` required, both are the ones with the same value (none when the
        prefill engine lacks the label).
        """
        key = self.keys(prefill.record)
        if key is None:
            return (), ()
        every = self.by_key.get(key, ())
        if self.within is None:
            return every, every
        value = prefill.record.labels.get(self.within)
        near = () if value is None else self.near.get((key, value), ())
        return near, near if required else every


def ids(engines: Sequence[Candidate]) -> frozenset[str]:
    """The engine ids of ``engines``."""
    return frozenset(e.engine_id for e in engines)


PREFILL = frozenset({EngineRole.PREFILL})
DECODE = frozenset({EngineRole.DECODE})
AGGREGATED = frozenset({EngineRole.AGGREGATED})


class PairPicker(FullPath):
    """The router's pair picks: both sides through its full path, under one lock."""

    _handoff_keys: HandoffKeys  # a pair's sides, by hand-off key (under the lock)
    # Per candidate set (by id, the set held so the id stays its own), as policies keep
    # theirs: picks with and without ``pair_within`` alternate without rebuilding.
    _pairings: dict[tuple[int, str | None], tuple[tuple[Candidate, ...], Pairing]]
    _viable: dict[tuple[int, int, bool], tuple[tuple[Candidate, ...], Pairing, frozenset[str]]]

    def pick_pair(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        selector: Mapping[str, str] | None = None,
        weight_version: Literal["latest"] | None = None,
        min_weight_version: int | None = None,
        max_version_lag: int | None = None,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
        session_key: str | bytes | int | None = None,
        pair_within: str | None = None,
        require_within: bool = False,
        exclude_prefill: Collection[str] | None = None,
        exclude_decode: Collection[str] | None = None,
        keep_prefill: PickHandle | None = None,
        keep_decode: PickHandle | None = None,
        decode_policy: RoutingPolicy | str | Policy = RoutingPolicy.LOAD_BALANCED,
        allow_aggregated: bool = False,
        alone_below: int = DEFAULT_ALONE_BELOW,
        alone_share: float | None = DEFAULT_ALONE_SHARE,
        wait: float | None = None,
        priority: int = 0,
        images: bool = False,
    ) -> PickPair:
        """Choose a prefill and a decode engine that can hand off, for one request.

        Every filter of ``pick`` applies to each side (``selector``, versions, fit,
        fencing, admission with ``wait`` and ``priority``); the sides are Megatron's roles,
        and only engines whose ``handoff_key`` is equal are paired. The prefill engine is
        chosen by the router's policy (by cached prefix: ``auto`` follows what the prefill
        engines advertise, ``kv_aware`` where they relay their caches), the decode engine
        by ``decode_policy`` (default by load). ``pair_within``: a label (a rack, an NVLink
        domain) both should share: preferred (when the prefill engine's value has no
        partner with room, the prefill side is picked again where one has; see
        ``discovery._routing.pairs``), or required with ``require_within``.
        ``session_key`` keeps a session on the same engines of both sides. A re-pick after
        one side was lost keeps the other: ``keep_prefill`` / ``keep_decode`` (a held
        handle), ``exclude_prefill`` / ``exclude_decode`` (engine ids). With
        ``allow_aggregated``, an aggregated engine serves the request alone (no hand-off)
        when the prompt is shorter than ``alone_below`` tokens or its relayed cache holds at
        least ``alone_share`` of the prompt's blocks, or when no pair can be made (see
        ``discovery._routing.pairs``). Raises NoEngineAvailableError (naming why no pair can be
        made) or OverloadedError as ``pick`` does. ``images``: as for ``pick``, the prefill
        side by load (the decode side by ``decode_policy``, by load by default), and an
        aggregated engine serves it alone by ``alone_below`` only, never by its cache.
        """
        if keep_prefill is not None and keep_decode is not None:
            raise ValueError("keep_prefill and keep_decode: keep at most one side")
        for kept in (keep_prefill, keep_decode):
            if kept is not None and (kept._router is not self or kept.released):
                raise ValueError(f"{kept!r} is no handle held on this router")
        ask, timeout = self._ask(
            prompt_tokens,
            max_tokens,
            selector=selector,
            weight_version=weight_version,
            min_weight_version=min_weight_version,
            max_version_lag=max_version_lag,
            block_hashes=block_hashes,
            exclude=None,
            wait=wait,
            priority=priority,
            session_key=session_key,
            images=images,
        )
        deadline = time.monotonic() + timeout
        prefill_ask = ask._replace(roles=PREFILL, exclude=frozenset(exclude_prefill or ()))
        decode_ask = ask._replace(
            roles=DECODE,
            exclude=frozenset(exclude_decode or ()),
            policy=self._policy_instance(decode_policy),
        )
        prefill, decode = keep_prefill, keep_decode
        with self._lock:
            self._refresh_locked()
            alone = self._alone_locked(ask, allow_aggregated, alone_below, alone_share)
            if alone is None:
                try:
                    prefill_ask, pairing = self._sides_locked(
                        prefill_ask, decode_ask, pair_within, require_within, keep_decode
                    )
                except NoEngineAvailableError:
                    alone = self._alone_locked(ask, allow_aggregated, None, None)
                    if alone is None:
                        raise
                else:
                    if ask.split is None:  # a split draws each side's group as a pick does
                        prefill, decode = self._pair_now_locked(
                            prefill_ask,
                            decode_ask,
                            pairing,
                            require_within,
                            keep_prefill=keep_prefill,
                            keep_decode=keep_decode,
                        )
        if alone is not None:
            return PickPair(None, self._pick_ask(alone, timeout))
        for handle in (prefill, decode):
            if handle is not None and handle is not keep_prefill and handle is not keep_decode:
                self._picked(handle)
        if prefill is not None and decode is not None:
            return PickPair(prefill, decode)
        # A side waits for room: one after the other, each side as a pick.
        prefill = prefill or self._pick_ask(prefill_ask, timeout)
        try:
            with self._lock:
                self._refresh_locked()
                side = self._side_locked(decode_ask)
                near, every = self._partners_locked(
                    self._pairing_locked(side, pair_within), prefill, require_within
                )
            # The pool's own tuple reaches the policy unfiltered (its caches key on it).
            if decode_ask.exclude or len(every) < len(side):
                decode_ask = decode_ask._replace(only=ids(every))
            decode = keep_decode or self._decode_locked_or_wait(decode_ask, near, every, deadline)
        except BaseException:
            if keep_prefill is None:
                prefill.release()  # no outcome: the engine did nothing
            raise
        return PickPair(prefill, decode)

    def _pair_now_locked(
        self,
        prefill_ask: Ask,
        decode_ask: Ask,
        pairing: Pairing,
        required: bool,
        *,
        keep_prefill: PickHandle | None,
        keep_decode: PickHandle | None,
    ) -> tuple[PickHandle | None, PickHandle | None]:
        """Both sides in one pass, each held if it has room now: (prefill, decode).

        A side without room is None (the prefill side's None leaves the decode side None):
        ``pick_pair`` then picks it as ``pick`` does, waiting for room.
        """
        if self._admission.waiters:
            self._serve_locked()  # those waiting come first
        if keep_prefill is None:
            try:
                prefill = self._try_locked(prefill_ask, None)
            except NoEngineAvailableError:
                self._metrics.no_engine()
                raise
            if prefill is None or keep_decode is not None:
                return prefill, keep_decode
        else:
            prefill = keep_prefill
        try:
            near, every = self._partners_locked(pairing, prefill, required)
            if len(near) < len(every):  # preferred: within the label first
                decode = self._try_locked(decode_ask, None, near) if near else None
                if decode is not None:
                    return prefill, decode
                if keep_prefill is None:
                    nearer = self._nearer_locked(prefill_ask, decode_ask, pairing)
                    if nearer is not None:
                        self._unpick_locked(prefill)
                        return nearer
            return prefill, self._try_locked(decode_ask, None, every)
        except BaseException:
            if keep_prefill is None:
                self._unpick_locked(prefill)
            raise

    def _nearer_locked(
        self, prefill_ask: Ask, decode_ask: Ask, pairing: Pairing
    ) -> tuple[PickHandle, PickHandle] | None:
        """A pair within one value of the label, the prefill side picked again (preferred).

        For when the prefill engine picked has no partner with room within its own value:
        the prefill side among the engines that have one; None when none with room has one.
        A pair kept together wins over the best prefill engine's cache: the caller asked
        for it, and a hand-off out of the rack moves the whole prompt's KV across it.
        """
        has_room, priority = self._admission.has_room, decode_ask.priority
        roomy = {
            pair: group
            for pair, group in pairing.near.items()
            if not decode_ask.admit or any(has_room(e, priority) for e in group)
        }
        if not roomy:
            return None
        within, keys, only = pairing.within, pairing.keys, prefill_ask.only
        assert within is not None  # near is empty without it
        partners: dict[Candidate, tuple[Candidate, ...]] = {}  # prefill engine -> near ones
        for engine in self._side_locked(prefill_ask):
            if only is None or engine.engine_id in only:
                key, value = keys(engine.record), engine.record.labels.get(within)
                if key is not None and value is not None and (key, value) in roomy:
                    partners[engine] = roomy[key, value]
        prefill = self._try_locked(prefill_ask, None, tuple(partners)) if partners else None
        if prefill is None:
            return None
        decode = self._try_locked(decode_ask, None, partners[prefill._engine])
        assert decode is not None  # one had room, and nothing was taken since
        return prefill, decode

    def _unpick_locked(self, handle: PickHandle) -> None:
        """Take back a handle never given out: no outcome, no notice."""
        handle._released = True
        handle._until = self._losses
        handle._engine._release()
        self._held -= 1
        if self._admission.waiters:
            self._serve_locked()  # its room

    def _decode_locked_or_wait(
        self,
        ask: Ask,
        near: Sequence[Candidate],
        every: Sequence[Candidate],
        deadline: float,
    ) -> PickHandle:
        """The decode side: a partner within the label first, if one has room now."""
        if near and len(near) < len(every):
            with contextlib.suppress(OverloadedError):
                return self._pick_ask(ask._replace(only=ids(near)), 0.0)
        return self._pick_ask(ask, max(0.0, deadline - time.monotonic()))

    def _policy_instance(self, policy: RoutingPolicy | str | Policy) -> Policy:
        if isinstance(policy, str) and policy in self._builtins:
            return self._builtins[RoutingPolicy(policy)]  # no ABC check: the common case
        chosen = policy_argument(policy)
        if isinstance(chosen, Policy):
            return chosen
        if chosen not in self._builtins:
            raise ValueError(f"policy {chosen.value!r} cannot choose one side of a pair")
        return self._builtins[chosen]

    def _sides_locked(
        self,
        prefill_ask: Ask,
        decode_ask: Ask,
        within: str | None,
        required: bool,
        keep_decode: PickHandle | None,
    ) -> tuple[Ask, Pairing]:
        """The prefill side's pick, and the decode candidates by hand-off key.

        The prefill side: the prefill engines some decode candidate can take (those of
        ``keep_decode``'s engine when it is kept).
        """
        prefills = self._side_locked(prefill_ask)
        decodes = (
            (keep_decode._engine,) if keep_decode is not None else self._side_locked(decode_ask)
        )
        self._handoff_keys.trim(len(prefills) + len(decodes))
        pairing = self._pairing_locked(decodes, within)
        viable = self._viable_locked(prefills, pairing, required)
        if not viable:
            raise NoEngineAvailableError(
                f"no pair can hand off: none of the {len(prefills)} prefill candidates has a "
                f"compatible decode candidate among {len(decodes)}"
                + (f" with the same {within!r} label" if within and required else "")
                + (f" ({handoff_problem(prefills[0].record, decodes[0].record)})"
                   if prefills and decodes else "")
            )  # fmt: skip
        if len(viable) < len(prefills):  # else no filter: the policy sees the pool's tuple
            prefill_ask = prefill_ask._replace(only=viable)
        return prefill_ask, pairing

    @staticmethod
    def _partners_locked(
        pairing: Pairing, prefill: PickHandle, required: bool
    ) -> tuple[tuple[Candidate, ...], tuple[Candidate, ...]]:
        """The decode candidates ``prefill``'s engine can hand off to: (near, all)."""
        near, every = pairing.partners(prefill._engine, required)
        if not every:
            raise NoEngineAvailableError(
                f"no decode candidate can take {prefill.engine_id}'s hand-off now"
            )
        return near, every

    def _pairing_locked(self, decodes: tuple[Candidate, ...], within: str | None) -> Pairing:
        """``decodes`` grouped by hand-off key: kept while the pool's tuple is the same."""
        kept = self._pairings.get((id(decodes), within))
        if kept is not None and kept[0] is decodes:
            return kept[1]
        if len(self._pairings) >= MAX_POOLS:
            self._pairings.clear()
        pairing = Pairing.of(decodes, self._handoff_keys, within)
        self._pairings[id(decodes), within] = (decodes, pairing)
        return pairing

    def _viable_locked(
        self, prefills: tuple[Candidate, ...], pairing: Pairing, required: bool
    ) -> frozenset[str]:
        """The ids of ``prefills`` with a partner in ``pairing``: kept as the pairing is."""
        key = (id(prefills), id(pairing), required)
        kept = self._viable.get(key)
        if kept is not None and kept[0] is prefills and kept[1] is pairing:
            return kept[2]
        if len(self._viable) >= MAX_POOLS:
            self._viable.clear()
        viable = ids([p for p in prefills if pairing.partners(p, required)[1]])
        self._viable[key] = (prefills, pairing, viable)
        return viable

    def _alone_locked(
        self, ask: Ask, allowed: bool, below: int | None, share: float | None
    ) -> Ask | None:
        """The ask for one aggregated engine serving the request alone, or None (a pair).

        ``below`` and ``share`` None: alone whenever an aggregated engine is a candidate.
        """
        if not allowed:
            return None
        alone = ask._replace(roles=AGGREGATED)
        try:
            engines = self._side_locked(alone)
        except NoEngineAvailableError:
            return None
        length = len(ask.prompt_tokens)
        if (below is None and share is None) or (below is not None and length < below):
            return alone
        states = self._states
        if share is None or states is None or ask.images:
            return None  # an image request is cached nowhere
        best, held = None, 0.0
        # The prompt hashed once per block size, for every engine here and for the pick.
        known = dict(ask.block_hashes or {})
        for engine in engines:
            blocks = length // engine.block_size
            if not blocks or not engine.record.state_address:
                continue
            hashes = known.get(engine.block_size)
            if hashes is None:
                hashes = known[engine.block_size] = block_hashes(
                    ask.prompt_tokens, engine.block_size
                )
            cached = states.cached_prefix(engine.engine_id, hashes) or 0
            if cached / blocks > held:
                best, held = engine, cached / blocks
        if best is None or held < share:
            return None
        return alone._replace(only=frozenset({best.engine_id}), block_hashes=known)
