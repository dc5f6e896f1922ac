"""The one retry policy of the package: jittered exponential backoff.

Every place that tries again after a failure waits ``Backoff.delay(attempt)``: the etcd
port's ``call`` (through tenacity, for which a ``Backoff`` is a wait strategy), the
list-watch loop (``_etcd/reflector.py``) and a session's repair (``_writes/session.py``). Attempt
``n`` (0 for the first retry) waits a time drawn uniformly from ``[d / 2, d]`` with ``d =
min(maximum, initial x 2^n)`` ("equal jitter": never less than half the nominal delay,
so clients that failed together do not come back together). What differs between the
callers is only the two numbers, named below with the reason for each:

========== ======= ======= ==========================================================
policy     initial maximum why
========== ======= ======= ==========================================================
``CALL``   0.05 s  1 s     one request: a member restarting or an election, seconds
``WATCH``  0.1 s   3 s     a stream: etcd down for longer costs one attempt per 3 s
``REPAIR`` 0.1 s   0.5 s   a lost lease: its records must be back within ~1 s of etcd
========== ======= ======= ==========================================================

The list-watch loop starts again from attempt 0 after a stream that lived
``HEALTHY_AFTER`` seconds, and waits at most a quarter election timeout after
``NoLeaderError`` (a partitioned member: another member answers at once).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tenacity import RetryCallState

__all__ = ["CALL", "HEALTHY_AFTER", "REPAIR", "WATCH", "Backoff"]

HEALTHY_AFTER = 10.0
"""A stream that lived this long (seconds) restarts its backoff from attempt 0."""


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential backoff (see the module docs)."""

    initial: float
    """The nominal first delay, in seconds."""
    maximum: float
    """The largest nominal delay, in seconds."""

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0 for the first retry)."""
        nominal = min(self.maximum, self.initial * 2 ** min(attempt, 32))
        return random.uniform(nominal / 2, nominal)

    def __call__(self, state: RetryCallState) -> float:
        """The delay as a tenacity wait strategy (tenacity counts attempts from 1)."""
        return self.delay(state.attempt_number - 1)


CALL = Backoff(initial=0.05, maximum=1.0)
WATCH = Backoff(initial=0.1, maximum=3.0)
REPAIR = Backoff(initial=0.1, maximum=0.5)
