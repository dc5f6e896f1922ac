"""The router's picker (what a pick without options reads, per table state) and pools.

The candidate sets a picker is built from live here too: a ``Pool`` and the weight-version
filter (``Versions``, ``by_version``).

gRPC's balancer/picker split: the ``Router`` (the balancer) rebuilds a ``Picker`` whenever
its view changes (a table batch, a fence, an unconfirmed engine, a waiting pick, a load
report) and a pick with no per-call option is one read of it: no ask is built, nothing is
filtered, copied or scanned. The picker holds the candidates of the router's own
selector, statuses and version options for a request that fits every one of them, and the
policy resolved for them. A pick uses it only when it is current: its snapshot is the
table's latest, no batch or load report is waiting to be read, and the request fits the
smallest ``context_length`` among the candidates; otherwise (and for every per-call
option) the pick takes the router's full path, which rebuilds the picker once it is done.

Built only while nothing else decides a pick: no engine is fenced or unconfirmed, no pick
waits for room, and the router has no split. Admission (``wait`` / ``capacity`` on the
router) stays on: the picked engine's room is checked as on the full path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from discovery._errors import NoEngineAvailableError
from discovery._reads.store import RoutingSnapshot
from discovery._routing.policies import Candidate, Policy, RoundRobinPolicy

__all__ = [
    "LATEST",
    "NO_PICKER",
    "NO_VERSIONS",
    "Picker",
    "Pool",
    "Versions",
    "by_version",
    "versions_present",
]


class Picker:
    """One table state's answer to a pick without options (immutable: rebuilt, not changed)."""

    __slots__ = ("admit", "candidates", "fits", "policy", "snapshot")

    def __init__(
        self,
        snapshot: RoutingSnapshot | None,
        candidates: tuple[Candidate, ...],
        policy: Policy,
        fits: int,
        admit: bool,
    ) -> None:
        self.snapshot = snapshot
        """The table snapshot it was built for (None: never current)."""
        self.candidates = candidates
        """The pool's own tuple: policies key what they derive on its identity."""
        self.policy = policy
        self.fits = fits
        """The tokens every candidate fits (the smallest ``context_length``)."""
        self.admit = admit
        """The router's admission is on: the engine chosen must have room."""


NO_PICKER = Picker(None, (), RoundRobinPolicy(), -1, False)
"""The picker of no state: a pick takes the router's full path (and rebuilds it)."""


# -- candidate sets: what the router filters the table into (a picker holds one) --------

LATEST = "latest"


class Versions(NamedTuple):
    """A pick's weight-version filter: a floor, and a lag behind the highest version."""

    minimum: int | None = None
    lag: int | None = None

    @classmethod
    def of(
        cls, weight_version: str | None, min_weight_version: int | None, lag: int | None
    ) -> Versions:
        if weight_version is not None and weight_version != LATEST:
            raise ValueError(f"weight_version must be None or 'latest', not {weight_version!r}")
        minimum = _non_negative("min_weight_version", min_weight_version)
        lag = _non_negative("max_version_lag", lag)
        if weight_version == LATEST:
            lag = 0
        return NO_VERSIONS if minimum is None and lag is None else cls(minimum, lag)


NO_VERSIONS = Versions()


class Pool:
    """The candidates of one (selector, fit) combination and the policy that routes them."""

    __slots__ = ("candidates", "policy")

    def __init__(self, candidates: tuple[Candidate, ...], policy: Policy) -> None:
        self.candidates = candidates
        self.policy = policy


def by_version(engines: tuple[Candidate, ...], versions: Versions) -> tuple[Candidate, ...]:
    """The candidates that pass the version filter; NoEngineAvailableError when none does.

    Only the floor (``min_weight_version``) can leave none: the lag is counted from the
    highest version among ``engines``, which always passes it.
    """
    minimum, lag = versions
    top = max((v for e in engines if (v := e.record.weight_version) is not None), default=None)
    floor = minimum
    if lag is not None and top is not None:
        floor = top - lag if floor is None else max(floor, top - lag)
    if floor is None:
        return engines
    kept = tuple(e for e in engines if (v := e.record.weight_version) is not None and v >= floor)
    if not kept:
        raise NoEngineAvailableError(
            f"no engine is on weight_version >= {minimum} (min_weight_version): "
            f"the {len(engines)} candidates (status, labels and fit passed) are on "
            f"{versions_present(engines)}"
        )
    return kept


def versions_present(engines: Iterable[Candidate]) -> str:
    """``v7 (3), v8 (1), no version (2)``: the versions of ``engines``, with counts."""
    counts: dict[int | None, int] = {}
    for engine in engines:
        version = engine.record.weight_version
        counts[version] = counts.get(version, 0) + 1
    versions = sorted(v for v in counts if v is not None)
    parts = [f"v{v} ({counts[v]})" for v in versions]
    if None in counts:
        parts.append(f"no version ({counts[None]})")
    return ", ".join(parts)


def _non_negative(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
