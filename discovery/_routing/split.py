"""Weighted splits: traffic shared among groups of engines by label selectors (canaries).

``Split({"track=stable": 95, "track=canary": 5})`` (``Router(split=...)``, or per pick):
each pick first draws a group, then the router's policy chooses within it (the group's
selector is added to the pick's). Picks without a session key draw by smooth weighted round
robin (nginx's): over any run of picks every group's share is exact to within one pick, so
a 95/5 split is 95/5. A session key draws its group by weighted rendezvous hashing (each
group's score ``weight / -ln(u)``, ``u`` the key's uniform draw for that group): a session
stays in its group (a conversation never moves between builds), and a group's share of
the keys is its weight's. A group with no candidate for a pick (none of its engines ready,
fitting, unfenced...) gives its share to the others for that pick, and the router counts it
(``discovery_router_split_empty_total{group}``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from discovery._records.selector import Selector, SelectorLike, selector_of
from discovery._routing.policies import _MASK64, _MIX, _digest

__all__ = ["Split"]

_PERSON = b"discovery/split"


class Split:
    """Groups of engines (label selectors) with weights; immutable and hashable."""

    __slots__ = ("_hash", "_seeds", "groups")

    def __init__(self, groups: Mapping[SelectorLike, float] | Iterable[tuple[SelectorLike, float]]):
        pairs = groups.items() if isinstance(groups, Mapping) else groups
        parsed: list[tuple[Selector, float]] = []
        for selector, weight in pairs:
            group = selector_of(selector)
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise TypeError(f"split: the weight of {str(group)!r} must be a number")
            if not 0 < weight < math.inf:
                raise ValueError(
                    f"split: the weight of {str(group)!r} must be positive, got {weight!r}"
                )
            if not group:
                raise ValueError(
                    "split: a group needs a selector (the empty one selects everything)"
                )
            if any(group == seen for seen, _ in parsed):
                raise ValueError(f"split: the group {str(group)!r} is given twice")
            parsed.append((group, float(weight)))
        if not parsed:
            raise ValueError("split: give at least one group")
        self.groups: tuple[tuple[Selector, float], ...] = tuple(parsed)
        """The groups and their weights, in the order given."""
        self._seeds = tuple(_digest(str(group).encode(), _PERSON) for group, _ in parsed)
        self._hash = hash(self.groups)

    def rendezvous(self, key: int, among: Iterable[int]) -> int:
        """The group (index) a session key draws among the groups ``among``."""

        def score(index: int) -> float:
            u = ((((key ^ self._seeds[index]) * _MIX) & _MASK64) + 1) / (_MASK64 + 2)
            return self.groups[index][1] / -math.log(u)

        return max(among, key=score)

    def shares(self) -> dict[str, float]:
        """Each group's share of the picks (its weight over the total), by selector text."""
        total = sum(weight for _, weight in self.groups)
        return {str(group): weight / total for group, weight in self.groups}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Split) and other.groups == self.groups

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        inside = ", ".join(f"{str(g)!r}: {w:g}" for g, w in self.groups)
        return f"Split({{{inside}}})"


class Rotation:
    """Smooth weighted round robin over a split's groups (one per router and split)."""

    __slots__ = ("_current", "_split")

    def __init__(self, split: Split) -> None:
        self._split = split
        self._current = [0.0] * len(split.groups)

    def next(self, among: list[int]) -> int:
        """The next group (index) among ``among``: each gains its weight, the top pays all."""
        current, groups = self._current, self._split.groups
        total = 0.0
        for index in among:
            current[index] += groups[index][1]
            total += groups[index][1]
        chosen = max(among, key=current.__getitem__)
        current[chosen] -= total
        return chosen


def split_of(split: Split | Mapping[SelectorLike, float] | None) -> Split | None:
    """``split`` as a Split (None stays None)."""
    if split is None or isinstance(split, Split):
        return split
    return Split(split)
