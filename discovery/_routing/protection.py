"""Protection from mass lease loss: ready engines that lose their records together stay.

A record bound to a lease goes when its lease expires, whether the engine died or only its
host lost etcd (a DNS outage, a broken link between the engines' network and etcd's). When
every engine host is cut off etcd, every lease expires within a TTL or so, the table
empties, and every pick fails while the routers still reach every engine. This is the
mirror image of the ghost-free promise; Envoy (panic threshold) and Nacos (protect
threshold) guard against it, and so does the router:

* A removal counts only if the record was ``ready`` when it went (not draining, paused,
  stalled or ``stopping``). Whoever removes a record on purpose says so first: ``discovery
  launch`` when its engine exits, ``Registration.close()``, ``Session.close()`` and
  ``deregister`` write ``status: stopping`` just before the record goes, and a drain marks
  it ``draining``. Those removals evict at once, whatever their number: a fleet whose
  engines all exit together under ``discovery launch`` is emptied at once.
* When more than ``threshold`` (default half) of the router's ready engines lose their
  records so within ``window`` seconds (default 30: a cut expires every lease within a TTL
  and a third of one, so this covers TTLs up to about 90 s), those engines and every one
  lost so while any is protected stay routable as ``unconfirmed``. Below the threshold
  nothing changes: one dead engine among several is evicted the moment its record goes.
* An ``unconfirmed`` engine stops being routable on the first evidence that it is dead:
  its state relay says goodbye or stays silent past the states' ``stale_after`` (where it
  has one: the relay answers routers directly, not through etcd), a request on it fails
  (``release(failed=True)``), or ``grace`` seconds (default 120) pass without its record
  coming back. It is an ordinary engine again when its record comes back (its registrar
  writes it again once it reaches etcd).

Why it never keeps a ghost for long: a deliberate removal is never protected; an engine
known dead (relay gone or silent, a failed request) is evicted at once; and an engine
nothing can vouch for is kept at most ``grace`` seconds. Time comes from ``clock``.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

__all__ = ["LossProtection"]

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.5
DEFAULT_WINDOW = 30.0
DEFAULT_GRACE = 120.0

T = TypeVar("T")


class _Lost(NamedTuple, Generic[T]):
    engine_id: str
    since: float
    """Clock time the record went."""
    item: T
    """What the router keeps of the engine (its candidate)."""


class LossProtection(Generic[T]):
    """Which ready engines that lost their records are kept routable (see the module docs).

    Each engine comes with an item of the router's (its candidate), handed back when the
    engine is kept or evicted. Not thread-safe: its router calls it under its own lock.
    """

    def __init__(
        self,
        *,
        threshold: float | None = DEFAULT_THRESHOLD,
        window: float = DEFAULT_WINDOW,
        grace: float = DEFAULT_GRACE,
        clock: Callable[[], float],
    ) -> None:
        if threshold is not None and not 0 <= threshold < 1:
            raise ValueError(
                f"protect_threshold must be within [0, 1) (or None: never protect), "
                f"got {threshold!r}"
            )
        if not 0 < window < math.inf:
            raise ValueError(f"protect_window must be positive and finite, got {window!r}")
        if not 0 < grace < math.inf:
            raise ValueError(f"protect_grace must be positive and finite, got {grace!r}")
        self.threshold = threshold
        """More than this share of the ready engines lost in ``window`` is a mass loss."""
        self.window = float(window)
        """Seconds over which lost records are counted together."""
        self.grace = float(grace)
        """Seconds an unconfirmed engine stays routable at most."""
        self._clock = clock
        self._recent: collections.deque[_Lost[T]] = collections.deque()  # lost, not kept
        self.unconfirmed: dict[str, _Lost[T]] = {}
        """Unconfirmed engine id -> when its record went, and its item."""

    def lost(self, engines: Sequence[tuple[str, T]], ready: int) -> list[T]:
        """Ready engines' records went together, unannounced; ``ready``: those still there.

        ``engines`` are (engine id, item) pairs. Returns the items of the engines to keep
        as unconfirmed now (these, and those lost just before when together they pass the
        threshold); empty: evict these.
        """
        if self.threshold is None or not engines:
            return []
        now = self._clock()
        lost = [_Lost(engine_id, now, item) for engine_id, item in engines]
        if self.unconfirmed:  # a mass loss is under way: these are part of it
            self.unconfirmed.update((r.engine_id, r) for r in lost)
            return [r.item for r in lost]
        recent = self._recent
        while recent and recent[0].since < now - self.window:
            recent.popleft()
        recent.extend(lost)
        if len(recent) <= self.threshold * (ready + len(recent)):
            return []
        self.unconfirmed.update((r.engine_id, r) for r in recent)
        kept = [r.item for r in recent]
        recent.clear()
        log.warning(
            "%d of %d ready engines lost their records within %.0f s without saying they "
            "were stopping (more than %.0f%%): keeping them routable as unconfirmed for up "
            "to %.0f s, until their records come back or one is seen dead",
            len(kept),
            ready + len(kept),
            self.window,
            100 * self.threshold,
            self.grace,
        )
        return kept

    def back(self, engine_id: str) -> bool:
        """The engine's record is there again; whether it was unconfirmed."""
        for lost in self._recent:
            if lost.engine_id == engine_id:
                self._recent.remove(lost)
                break
        if self.unconfirmed.pop(engine_id, None) is None:
            return False
        if not self.unconfirmed:
            log.info("no engine is unconfirmed any more: the mass loss is over")
        return True

    def dead(self, engine_id: str, why: str) -> bool:
        """Evidence that an unconfirmed engine is dead; whether it was unconfirmed."""
        if engine_id not in self.unconfirmed:
            return False
        log.warning("unconfirmed engine %s evicted: %s", engine_id, why)
        return self.back(engine_id)

    def kept(self) -> Iterator[tuple[str, T]]:
        """Every unconfirmed engine's id and item."""
        return ((engine_id, lost.item) for engine_id, lost in self.unconfirmed.items())

    def expired(self) -> list[T]:
        """The items of unconfirmed engines kept for ``grace`` already, now forgotten."""
        if not self.unconfirmed:
            return []
        limit = self._clock() - self.grace
        over = [lost for lost in self.unconfirmed.values() if lost.since <= limit]
        for lost in over:
            self.dead(lost.engine_id, f"its record did not come back within {self.grace:.0f} s")
        return [lost.item for lost in over]

    def ages(self) -> dict[str, float]:
        """Unconfirmed engine id -> seconds since its record went."""
        now = self._clock()
        return {engine_id: now - lost.since for engine_id, lost in self.unconfirmed.items()}
