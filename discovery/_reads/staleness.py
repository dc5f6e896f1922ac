"""How current a watcher's view is: the age of its last proof, and when that is stale.

A watcher proves its view current each time a member that has a Raft leader answers it:
every response on its watch stream, which is opened leader-required (gRPC metadata
``hasleader: true``, etcd's ``WithRequireLeader``) - events, or the answer to the progress
request the stream sends after ``progress_interval`` seconds of quiet - and every
(linearizable) list of the prefix. A member cut off from the majority loses its leader
within 1-2 election timeouts; etcd then refuses new leader-required streams on it and ends
the open ones 2-3 election timeouts later, so the watcher moves to a member that has a
leader. If none answers, no proof arrives and the staleness grows.

``stale`` means the staleness exceeds ``stale_after``, by default
``progress_interval + 3 x election_timeout`` (4 s with etcd's default 1 s election timeout):
a healthy watcher gets a proof every progress interval, and a failover or a leader
election among the majority (new leader-required streams are refused until it ends, up to
2 election timeouts) fits in the rest. While not stale, the view holds every change the
majority committed more than ``staleness + 5 x election_timeout`` ago (the last term: how
long a cut-off member may still answer before etcd ends its stream).

The watcher keeps serving its last table while stale (fail-static); this module logs the
transitions: a WARNING when the view goes stale, an INFO when it is current again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Freshness", "default_stale_after"]

log = logging.getLogger(__name__)

_MAX_TICK = 1.0


def default_stale_after(progress_interval: float, election_timeout: float) -> float:
    """The default stale threshold (see the module docs)."""
    return progress_interval + 3 * election_timeout


class Freshness:
    """The time of a watcher's last proof of being current, and its stale transitions.

    ``proved()`` is called by the watch loop; ``start()`` runs a small monitor thread that
    logs when the view goes stale (nobody else is awake to notice a silence).
    """

    def __init__(self, name: str, stale_after: float, describe: Callable[[], str]) -> None:
        self.name = name
        self.stale_after = stale_after
        self.proven_at = time.monotonic()
        """``time.monotonic()`` of the last proof (of the start, before the first one)."""
        self._describe = describe
        self._lock = threading.Lock()
        self._stale_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._begun = False

    def age(self) -> float:
        """Seconds since the last proof."""
        return max(0.0, time.monotonic() - self.proven_at)

    @property
    def stale(self) -> bool:
        """Whether the last proof is older than ``stale_after``."""
        return self.age() > self.stale_after

    @property
    def running(self) -> bool:
        """Whether the watcher is between begin() and stop()."""
        return self._begun and not self._stop.is_set()

    def proved(self) -> None:
        """A member with a leader answered: the view is current now."""
        self.proven_at = time.monotonic()
        if self._stale_since is not None:  # lock-free on the hot path
            self._check()

    def begin(self) -> None:
        """Count from now: the watcher has started (its monitor may start later)."""
        self.proven_at = time.monotonic()
        self._begun = True

    def start(self) -> None:
        """Start the monitor (and count from now, unless begun). Idempotent."""
        with self._lock:
            if self._thread is not None:
                return
            if not self._begun:
                self.begin()
            self._thread = threading.Thread(
                target=self._monitor, name="discovery-watch-staleness", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the monitor and join it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _monitor(self) -> None:
        tick = min(_MAX_TICK, self.stale_after / 4)
        while not self._stop.wait(tick):
            self._check()

    def _check(self) -> None:
        with self._lock:
            now = time.monotonic()
            age = max(0.0, now - self.proven_at)
            since = self._stale_since
            if (age > self.stale_after) == (since is not None) or self._stop.is_set():
                return
            self._stale_since = None if since is not None else self.proven_at + self.stale_after
        if since is not None:
            log.info("watch of %s is current again (was stale for %.1f s)", self.name, now - since)
        else:
            log.warning(
                "watch of %s is stale: no etcd member with a leader answered for %.1f s (%s); "
                "serving the last table until one does",
                self.name,
                age,
                self._describe(),
            )
