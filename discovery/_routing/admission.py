"""Admission: an engine at capacity is no candidate, and a pick waits for room.

**Capacity.** An engine runs at most ``max_num_seqs * logical_data_parallel_size``
requests at once (``Candidate.capacity``, its record's figure); ``capacity=`` on the
router overrides it (a number for every engine, or a function of the record). The load
counted against it is the shared load view: this router's handles plus, where the engine
has a state relay, what the other routers hold there (or what the engine itself reports).

**Many routers.** A relayed load is up to a report interval old, so two routers that both
see the last free slot could both take it. To never run an engine above its capacity,
each of the ``R`` routers reporting to an engine's relay keeps to its share of the engine:
this router's own handles stay within ``floor(capacity / R)``, one more for the first
``capacity mod R`` routers in the relay's order (the shares add up to the capacity; at
least one each), and the whole relayed load within the capacity. Shares are exact when
every engine has at least ``R`` slots and the routers are settled (a router joining or
leaving changes them within a report interval); an idle router's share is not lent to
the others (what exactness costs).
Without a relay a router counts only its own handles: give each router its share with
``capacity=`` when several route to the same engines.

**Priorities.** ``priority`` is an integer, higher first, default 0. With ``reserve=r``,
picks of priority 0 or lower may fill an engine only up to ``(1 - r)`` of its capacity,
on the shared load view: above that utilisation they wait, and the top ``r`` is kept for
picks of priority 1 or more. Waiting picks are served highest priority first, then
first come first served.

**Waiting.** When no candidate has room, a pick waits up to ``wait`` seconds, in a queue
of at most ``max_waiting`` picks, and is served the moment room appears: a handle
released on this router, a lower load relayed by an engine, an engine ready or added, a
fence ending. Past its wait, or with the queue full, it raises ``OverloadedError`` naming
the capacity, the load and how long it waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from discovery._records.record import EngineRecord

__all__ = ["Admission"]


class Engine(Protocol):
    """What admission reads of a candidate (``_policies.Candidate``)."""

    engine_id: str
    record: EngineRecord
    capacity: int
    in_flight: int
    load: int
    routers: int
    rank: int


H = TypeVar("H")

DEFAULT_MAX_WAITING = 1024

Capacity = int | Callable[[EngineRecord], int]

_order = itertools.count()


@dataclass(eq=False)
class Waiter(Generic[H]):
    """One pick waiting for room: its arguments, then its outcome."""

    ask: Any
    """The pick's arguments (the router's own tuple)."""
    key: Hashable
    """Its candidate set: waiters of a set that had no room are not tried again at once."""
    priority: int
    started: float
    event: threading.Event | None = None
    """Set when served (a thread waiting in ``pick``)."""
    future: asyncio.Future[H] | None = None
    """Resolved when served (a coroutine waiting in ``apick``)."""
    handle: H | None = None
    order: int = field(default_factory=lambda: next(_order))

    def sort_key(self) -> tuple[int, int]:
        """Highest priority first, then first come."""
        return (-self.priority, self.order)


class Admission:
    """The capacity rule and the queue of waiting picks (see the module docs).

    Not thread-safe: its router calls it under its own lock.
    """

    def __init__(
        self,
        *,
        capacity: Capacity | None,
        wait: float,
        max_waiting: int,
        reserve: float,
    ) -> None:
        if not (capacity is None or callable(capacity)) and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(
                f"capacity must be a positive integer or a function of the record, got {capacity!r}"
            )
        if not 0 <= wait < math.inf:
            raise ValueError(f"wait must be >= 0 seconds and finite, got {wait!r}")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve must be within [0, 1), got {reserve!r}")
        self._capacity = capacity
        self._limits: dict[str, tuple[EngineRecord, int]] = {}
        self.wait = float(wait)
        """Seconds a pick waits for room by default."""
        self.max_waiting = max_waiting
        """Picks that may wait at once; one more is refused at once."""
        self.reserve = float(reserve)
        """Share of each engine's capacity kept for picks of priority 1 or more."""
        self.waiters: list[Waiter[Any]] = []
        """Picks waiting for room, in the order they are served."""

    def limit(self, engine: Engine) -> int:
        """The engine's capacity: the router's override, else its record's figure."""
        capacity = self._capacity
        if capacity is None:
            return engine.capacity
        if not callable(capacity):
            return capacity
        kept = self._limits.get(engine.engine_id)
        if kept is None or kept[0] is not engine.record:
            value = capacity(engine.record)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"capacity({engine.engine_id}) returned {value!r}, not a positive integer"
                )
            kept = self._limits[engine.engine_id] = (engine.record, value)
        return kept[1]

    def has_room(self, engine: Engine, priority: int) -> bool:
        """Whether ``engine`` takes one more request of ``priority`` from this router."""
        capacity = self.limit(engine)
        if engine.load + 1 > (capacity * (1 - self.reserve) if priority <= 0 else capacity):
            return False
        routers = engine.routers
        return routers <= 1 or engine.in_flight + 1 <= self.share(capacity, routers, engine.rank)

    @staticmethod
    def share(capacity: int, routers: int, rank: int) -> int:
        """A router's slots of an engine of ``capacity`` shared by ``routers``: at least one.

        An equal share, the remainder to the first ranks: every router computes the same
        split, and the shares add up to the capacity.
        """
        return max(1, capacity // routers + (rank < capacity % routers))

    def forget(self, engine_id: str) -> None:
        """The engine left: drop its cached capacity."""
        self._limits.pop(engine_id, None)

    def enqueue(self, waiter: Waiter[Any]) -> None:
        """Add ``waiter`` in its place (highest priority first, then first come)."""
        waiters = self.waiters
        key = waiter.sort_key()
        index = len(waiters)
        while index and waiters[index - 1].sort_key() > key:
            index -= 1
        waiters.insert(index, waiter)

    def remove(self, waiter: Waiter[Any]) -> None:
        """Take ``waiter`` out of the queue (gave up); no error if it is not there."""
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)
