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

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from discovery._records.handoff import HandoffKey, handoff_key
from discovery._records.record import EngineRecord
from discovery._routing.policies import Candidate

__all__ = ["HandoffKeys", "Pairing"]

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
