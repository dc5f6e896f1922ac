"""The router's picker: what a pick without per-call options reads, built per table state.

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

from discovery._reads.store import RoutingSnapshot
from discovery._routing.policies import Candidate, Policy, RoundRobinPolicy

__all__ = ["NO_PICKER", "Picker"]


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
