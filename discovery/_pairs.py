"""Prefill/decode pairs: which engines can hand off to which (``Router.pick_pair``).

Megatron's rule (``_handoff.py``) is an equivalence: a prefill and a decode engine can hand
off exactly when their ``handoff_key`` is equal and not None. So the candidates of each
side are grouped by key once per candidate set, and a prefill engine is *viable* when some
decode candidate shares its key (and, with ``within`` required, the value of that label).
A pair is picked as two picks through the router's own machinery (every filter, fencing,
admission and its waiting, notifications): the prefill side among the viable prefill
engines by the router's policy (cached prefix), then the decode side among the chosen
engine's partners by load, those within the same ``within`` value first when it is
preferred.

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

from ._handoff import HandoffKey, handoff_key
from ._policies import Candidate

__all__ = ["Pairing"]

DEFAULT_ALONE_BELOW = 512
"""Prompts shorter than this (two 256-token blocks) go to an aggregated engine alone, when
allowed: a hand-off's two hops cost more than such a prompt's prefill."""
DEFAULT_ALONE_SHARE = 0.9
"""An aggregated engine caching this share of the prompt's blocks takes it alone, when
allowed: it computes a tenth of the prompt, and nothing moves between engines."""


class Pairing(NamedTuple):
    """The decode candidates of one candidate set, by hand-off key."""

    by_key: dict[HandoffKey, tuple[Candidate, ...]]

    @classmethod
    def of(cls, decodes: Iterable[Candidate]) -> Pairing:
        """Group ``decodes`` by their hand-off key (those with none can pair with no one)."""
        groups: dict[HandoffKey, list[Candidate]] = {}
        for engine in decodes:
            key = handoff_key(engine.record)
            if key is not None:
                groups.setdefault(key, []).append(engine)
        return cls({key: tuple(group) for key, group in groups.items()})

    def partners(
        self, prefill: Candidate, within: str | None, required: bool
    ) -> tuple[tuple[Candidate, ...], tuple[Candidate, ...]]:
        """``prefill``'s partners: (those with the same ``within`` label value, all of them).

        With ``within`` required, both are the ones with the same value (none when the
        prefill engine lacks the label).
        """
        key = handoff_key(prefill.record)
        every = self.by_key.get(key, ()) if key is not None else ()
        if within is None:
            return every, every
        value = prefill.record.labels.get(within)
        near = tuple(e for e in every if value is not None and e.record.labels.get(within) == value)
        return near, near if required else every


def ids(engines: Sequence[Candidate]) -> frozenset[str]:
    """The engine ids of ``engines``."""
    return frozenset(e.engine_id for e in engines)
