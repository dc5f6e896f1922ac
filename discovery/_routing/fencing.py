"""Passive failure fencing: an engine whose requests keep failing sits out for a while.

The router learns outcomes from its handles: ``release()`` is a success,
``release(failed=True)`` a failure (a ``with`` block left by an exception is neither).
``after`` consecutive failures fence the engine for ``seconds``; each further fence with
no success in between doubles that, up to ``max_seconds`` (Envoy's outlier ejection grows
the same way; Dynamo inhibits a failed instance for 5 s). A success resets both counts;
a fence already running still runs out. When a fence ends the engine gets requests again,
and its next failure before any success fences it again at once, for twice as long.
Failures reported while an engine is fenced (requests sent before) fence nothing.

Limit: at most ``floor(max_share * engines)`` engines are fenced at once, ``engines``
being those the router sees. A failing engine past that limit stays in rotation (Envoy's
max ejection percent), so a broken network or a bad client cannot empty the table.

Time comes from ``clock`` (seconds, monotonic), injectable for tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FenceBook"]

log = logging.getLogger(__name__)

DEFAULT_FENCE_AFTER = 3
DEFAULT_FENCE_SECONDS = 5.0
DEFAULT_FENCE_MAX_SECONDS = 300.0
DEFAULT_MAX_FENCED_SHARE = 0.5


@dataclass
class _Engine:
    failures: int = 0
    """Consecutive failed requests."""
    fences: int = 0
    """Fences since the last success: the backoff exponent."""


class FenceBook:
    """Failure counts and fences of the engines one router sees (see the module docs)."""

    def __init__(
        self,
        *,
        after: int | None = DEFAULT_FENCE_AFTER,
        seconds: float = DEFAULT_FENCE_SECONDS,
        max_seconds: float = DEFAULT_FENCE_MAX_SECONDS,
        max_share: float = DEFAULT_MAX_FENCED_SHARE,
        clock: Callable[[], float],
    ) -> None:
        if after is not None and (isinstance(after, bool) or not isinstance(after, int)):
            raise TypeError("fence_after must be an integer or None")
        if after is not None and after < 1:
            raise ValueError(f"fence_after must be >= 1 (or None: never fence), got {after}")
        if not 0 < seconds < math.inf:
            raise ValueError(f"fence_seconds must be positive and finite, got {seconds!r}")
        if not seconds <= max_seconds < math.inf:
            raise ValueError(
                f"fence_max_seconds must be finite and >= fence_seconds ({seconds}), "
                f"got {max_seconds!r}"
            )
        if not 0 <= max_share <= 1:
            raise ValueError(f"max_fenced_share must be within [0, 1], got {max_share!r}")
        if not callable(clock):
            raise TypeError("clock must be a callable returning seconds")
        self._after = after
        self._seconds = float(seconds)
        self._max_seconds = float(max_seconds)
        self.max_share = float(max_share)
        """The share of the engines that may be fenced at once."""
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self.fenced: dict[str, float] = {}
        """Fenced engine id -> clock time its fence ends."""
        self._next_end = math.inf

    def now(self) -> float:
        """The clock's time."""
        return self._clock()

    def limit(self, engines: int) -> int:
        """How many of ``engines`` may be fenced at once."""
        return math.floor(self.max_share * engines)

    def failures(self) -> dict[str, int]:
        """Consecutive failures of every engine that has any."""
        return {engine_id: s.failures for engine_id, s in self._engines.items() if s.failures}

    def failed(self, engine_id: str, engines: int) -> str:
        """Count a failure; returns ``"fenced"``, ``"limited"`` (fence refused) or ``""``."""
        state = self._engines.setdefault(engine_id, _Engine())
        state.failures += 1
        if self._after is None or state.failures < self._after or engine_id in self.fenced:
            return ""
        if len(self.fenced) >= self.limit(engines):
            if state.failures == self._after:  # once per failure streak, not per request
                log.warning(
                    "engine %s failed %d requests in a row but stays in rotation: %d of %d "
                    "engines are fenced already (max_fenced_share %.2f)",
                    engine_id,
                    state.failures,
                    len(self.fenced),
                    engines,
                    self.max_share,
                )
            return "limited"
        seconds = min(self._seconds * 2**state.fences, self._max_seconds)
        state.fences += 1
        end = self._clock() + seconds
        self.fenced[engine_id] = end
        self._next_end = min(self._next_end, end)
        log.warning(
            "engine %s fenced for %.1f s after %d failed requests in a row (fence %d)",
            engine_id,
            seconds,
            state.failures,
            state.fences,
        )
        return "fenced"

    def succeeded(self, engine_id: str) -> None:
        """Count a success: the engine's failure and fence counts start again from zero."""
        self._engines.pop(engine_id, None)

    def expire(self) -> bool:
        """Lift the fences that ran out; whether any did. Cheap when none is due."""
        if not self.fenced or self._next_end > (now := self._clock()):
            return False
        for engine_id in [e for e, end in self.fenced.items() if end <= now]:
            del self.fenced[engine_id]
            log.info("engine %s back in rotation: its fence ran out", engine_id)
        self._next_end = min(self.fenced.values(), default=math.inf)
        return True

    def forget(self, engine_id: str) -> bool:
        """Drop ``engine_id`` (it left the router's view); whether it was fenced."""
        self._engines.pop(engine_id, None)
        if self.fenced.pop(engine_id, None) is None:
            return False
        self._next_end = min(self.fenced.values(), default=math.inf)
        return True
