"""The list-watch loop (client-go's Reflector), the one both etcd watches run on.

A ``Reflector`` keeps one consumer (its ``Target``) current with one range of etcd keys:

1. **List** the range at one revision R (``port.list_pages``: paged, every page at R) and
   hand the pages to ``target.replace``; the target is then current at R. A reflector
   started at a known revision (the record watch: its owner's own write) skips this.
2. **Watch** from the held revision, inclusive, and hand every response to
   ``target.apply`` with only the events newer than the held revision (the held
   revision's own changes come again and are dropped here: nothing is delivered twice).
   Not from the next revision: etcd before 3.5.16 drops the tombstone of a delete made at
   exactly the compaction revision (etcd-io/etcd#18089), and a watch resumed there would
   never see that delete; resumed at the held revision, such a compaction is a
   ``Compacted`` and a relist. A response without events is progress: the target hears
   of it too (a proof of being current).
3. **Stream error**, closed stream or silence (the port's watchdog drops a stream that
   stops answering progress requests): wait ``WATCH`` backoff (``_backoff.py``), at once
   after a stream that lived ``HEALTHY_AFTER`` s, at most a quarter election timeout
   after ``NoLeaderError`` (a partitioned member: another answers), then watch again from
   the held revision on whichever member the port picks.
4. **Compacted**: list again (step 1) at once, not after a backoff (etcd answered; a
   second one in a row backs off); the target computes the difference, deletions missed
   while away included.
5. **Another cluster** (a member's data wiped, a snapshot restored, a new cluster on the
   same addresses): an answer from another cluster id than the one listed, or at a
   revision below the one held (etcd would wait silently on a watch from its future), ends
   the stream; the loop lists again at once. A listing from another cluster id, or below
   the held revision (a linearizable read never is, on the same cluster), replaces the
   target's content (``replace(..., reset=True)``: never merged by revision) and the held
   revision with its own; one WARNING, ``cluster_changes`` in health, a relist metric of
   cause ``cluster_replaced``. A watch answer below the held revision from a member that
   is only behind is not that: the listing's first page says so, and the watch resumes.

The loop is a generator of steps, each ending after a delivery to the target (a listing,
or a response with events). It runs on a thread of its own, or on a dispatcher's threads
(``runner``: the engine watcher's store dispatcher), which run the calls the delivery
queued between two steps, on the thread that made the step, while the other thread takes
the loop over (``_dispatch.py``): no hop to another thread before a callback, and never a
callback on the thread reading the stream.

One health for both users (``ReflectorHealth``): state, reconnects, relists, the last
error and when etcd last answered. The reflector reports its connection state, reconnect
causes and relists to ``metrics`` (the engine watcher passes its own; the record watch
none).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from discovery._backoff import HEALTHY_AFTER, WATCH, Backoff
from discovery._dispatch import Dispatcher
from discovery._errors import ClosedError, DiscoveryError, EtcdError
from discovery._etcd.port import (
    Compacted,
    EtcdPort,
    KeyValue,
    NoLeaderError,
    Page,
    StreamSilentError,
    WatchResponse,
    WatchStream,
    explain,
)
from discovery._metrics import NO_METRICS, MetricsHooks

__all__ = ["Reflector", "ReflectorHealth", "Target", "WatcherState"]

log = logging.getLogger(__name__)

FIRST_PAGE = 100
"""Keys in a listing's first page: its decoding starts sooner, while etcd reads the next."""


class WatcherState(enum.StrEnum):
    """Connection state of a watcher."""

    STARTING = "starting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    STOPPED = "stopped"


class Target(Protocol):
    """What a reflector keeps current: a store, or a registrar's own records."""

    def replace(self, pages: Iterator[tuple[int, list[KeyValue]]], *, reset: bool = False) -> int:
        """Take a whole listing, page by page (each at one revision); return that revision.

        ``reset``: the listing comes from another cluster (or history) than what was
        delivered before: it replaces everything held, whatever the revisions say.
        """
        ...

    def apply(self, response: WatchResponse) -> None:
        """Take one response whose events are all newer than what was delivered before.

        ``response.events`` is empty for a progress notification. Called on the
        reflector's thread: must not block on etcd.
        """


@dataclass(frozen=True)
class ReflectorHealth:
    """A point-in-time view of a list-watch loop."""

    state: WatcherState
    revision: int
    """Every change up to this etcd revision was delivered."""
    newest: int
    """The newest etcd revision any response carried (``newest - revision``: the lag)."""
    last_error: str | None
    last_success: datetime | None
    """When etcd last answered (a response or a listing)."""
    reconnects: int
    relists: int
    cluster_changes: int = 0
    """Listings that found another etcd cluster (or history) and replaced the content."""


class Reflector:
    """Runs the list-watch loop of one key range on a thread of its own (module docs).

    ``name`` labels logs and metrics. ``heartbeat`` and ``progress_interval`` are the
    port's watch options: a quiet stream is asked for progress after
    ``progress_interval`` s and dropped after two silent ``heartbeat`` s. ``runner``: the
    dispatcher whose threads run the loop, taking turns with the calls its target queues
    on it (``_dispatch.py``); without one, the loop has a thread of its own.
    """

    def __init__(
        self,
        port: EtcdPort,
        key_range: str,
        target: Target,
        *,
        name: str,
        heartbeat: float,
        progress_interval: float,
        backoff: Backoff = WATCH,
        metrics: MetricsHooks | None = None,
        runner: Dispatcher | None = None,
    ) -> None:
        self._port = port
        self._range = key_range
        self._target = target
        self.name = name
        self._heartbeat = heartbeat
        self._progress_interval = progress_interval
        self._backoff = backoff
        self._metrics = metrics or NO_METRICS
        self._runner = runner
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = False
        self._loop_started = False
        self._thread: threading.Thread | None = None  # without a runner
        self._ended = threading.Event()  # the loop has ended
        self._stream: WatchStream | None = None
        self._needs_list = True
        self._state = WatcherState.STARTING
        self.revision = 0
        """Every change up to this revision was delivered to the target."""
        self._newest = 0
        self._last_error: str | None = None
        self.last_exception: BaseException | None = None
        """The last error the loop met (None until one happens)."""
        self._last_success = 0.0  # time.time() of the last answer; 0: none yet
        self._reconnects = 0
        self._relists = 0
        self._cluster_changes = 0
        self._cluster_id = 0  # of the cluster the held revision belongs to; 0: unknown
        self._checking = False  # a watch answer was behind: the next listing checks why
        self._listed = False
        self._listing = threading.Event()  # start() listed (list_here), or gave up
        self._listing_error: Exception | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(
        self,
        revision: int | None = None,
        *,
        thread_name: str,
        list_here: bool = False,
        starting: Callable[[], None] = lambda: None,
    ) -> None:
        """Start the loop: list first, or (``revision``) watch from a revision already held.

        ``list_here``: the first listing runs on the calling thread, and this returns once
        it is in the target (or failed: the loop then goes on as after any failed listing);
        the loop's thread starts once the first page is in (while etcd reads the next) and
        watches once the listing is in. ``starting()`` runs first on the loop's thread: what
        it starts does not hold up the listing. Idempotent; raises ClosedError once stopped.
        """
        with self._lock:
            if self._stop.is_set():
                raise ClosedError(f"watch of {self.name} is stopped")
            if self._started:
                return
            self._started = True
            if revision is not None:
                self.revision, self._needs_list = revision, False
            here = list_here and self._needs_list
        steps = self._steps(here, starting)
        if not here:
            self._start_loop(steps, thread_name)
            return
        try:
            pages = self._port.list_pages(self._range, first_page=FIRST_PAGE, timeout=0)
            self._relist(_after_first(pages, lambda: self._start_loop(steps, thread_name)))
        except Exception as exc:
            # The loop's thread reports it (health, metrics, log) and backs off.
            self._listing_error = self.last_exception = exc
        self._listing.set()
        self._start_loop(steps, thread_name)  # if no page came

    def _start_loop(self, steps: Iterator[None], thread_name: str) -> None:
        """Run ``steps`` on the runner's threads or a thread of the loop's own; once."""
        if self._loop_started:
            return
        self._loop_started = True
        if self._runner is None:
            self._thread = threading.Thread(
                target=deque, args=(steps, 0), name=thread_name, daemon=True
            )
            self._thread.start()
            return
        try:
            self._runner.drive(steps, thread_name)
        except RuntimeError:  # a stop() on another thread closed it meanwhile
            self._ended.set()
            raise ClosedError(f"watch of {self.name} is stopped") from None

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop and its stream, and wait for the loop to end. Idempotent."""
        self._stop.set()
        self._listing.set()  # a loop waiting for start()'s listing ends too
        stream = self._stream
        if stream is not None:
            stream.close()
        if self._started and not self._in_loop():
            self._ended.wait(timeout)
        with self._lock:
            self._state = WatcherState.STOPPED

    def _in_loop(self) -> bool:
        """Whether the calling thread runs the loop (a stop from inside a step)."""
        if self._runner is not None:
            return self._runner.leading()
        return threading.current_thread() is self._thread

    @property
    def stopped(self) -> bool:
        """Whether ``stop()`` was called."""
        return self._stop.is_set()

    def health(self) -> ReflectorHealth:
        """State, revisions, counters and the last error."""
        with self._lock:
            return ReflectorHealth(
                state=self._state,
                revision=self.revision,
                newest=self._newest,
                last_error=self._last_error,
                last_success=(
                    datetime.fromtimestamp(self._last_success, UTC) if self._last_success else None
                ),
                reconnects=self._reconnects,
                relists=self._relists,
                cluster_changes=self._cluster_changes,
            )

    # -- the loop ----------------------------------------------------------------------

    def _steps(self, listed_by_start: bool, starting: Callable[[], None]) -> Iterator[None]:
        """The loop, one step at a time: a step ends after each delivery to the target.

        Whoever runs it (a thread of its own, or a dispatcher taking turns with the calls
        the target queues on it) may run calls between steps: the loop reads no stream
        meanwhile, so they never run on the thread that reads it.
        """
        try:
            starting()
            attempt = 0
            compacted = False  # the last failure was a Compacted
            first = self._watch_after_start if listed_by_start else None
            while not self._stop.is_set():
                step, first = first or self._list_and_watch, None
                opened = time.monotonic()
                try:
                    yield from step()
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    self._interrupted(exc)
                    compacted, was_compacted = isinstance(exc, Compacted | _OtherCluster), compacted
                    if time.monotonic() - opened >= HEALTHY_AFTER:
                        attempt = 0
                        continue  # a stream that worked for a while: again at once
                    if compacted and not was_compacted:
                        continue  # etcd answered: list at once (a second time: backoff)
                    delay = self._backoff.delay(attempt)
                    if isinstance(exc, NoLeaderError):
                        # A partition or an election: another member (or this one, once it
                        # has a leader again) answers soon, and a refusal costs etcd little.
                        delay = min(delay, self._port.election_timeout / 4)
                    attempt += 1
                    self._stop.wait(delay)  # a stop ends the backoff at once
        finally:
            self._ended.set()

    def _watch_after_start(self) -> Iterator[None]:
        """The loop's first step when start() lists: its outcome, then list-and-watch."""
        self._listing.wait()
        if self._stop.is_set():
            return
        if self._listing_error is not None:
            raise self._listing_error
        yield from self._list_and_watch()

    def _list_and_watch(self) -> Iterator[None]:
        """List if needed, then watch until the stream ends (it always ends raising)."""
        if self._needs_list:
            self._relist(self._port.list_pages(self._range, first_page=FIRST_PAGE, timeout=0))
            yield
        stream = self._port.open_watch(
            self._range,
            self.revision,  # inclusive: see the module docs
            heartbeat=self._heartbeat,
            progress_interval=self._progress_interval,
        )
        self._stream = stream
        try:
            if self._stop.is_set():
                return
            for answer in stream:
                self._answered(answer.revision)
                if answer.cluster_id != self._cluster_id or answer.revision < self.revision:
                    self._check_cluster(answer.cluster_id, answer.revision)
                held = self.revision
                events = answer.events
                if events and events[0].kv.mod_revision <= held:
                    events = tuple(e for e in events if e.kv.mod_revision > held)
                    answer = WatchResponse(answer.revision, events)  # noqa: PLW2901
                self._target.apply(answer)
                if events:
                    self.revision = max(held, events[-1].kv.mod_revision)
                self._metrics.watcher_revision(self.name, self.revision, self._newest)
                if events:
                    yield
        except Compacted as exc:
            log.warning("watch of %s fell behind compaction (%s); listing again", self.name, exc)
            self._needs_list = True
            raise
        except _OtherCluster:
            self._needs_list = self._checking = True
            raise
        finally:
            self._stream = None
            stream.close()

    def _check_cluster(self, cluster_id: int, revision: int) -> None:
        """Raise ``_OtherCluster`` if a watch answer may come from another cluster."""
        if not self._cluster_id:
            self._cluster_id = cluster_id  # started at a known revision: the first answer
        if cluster_id != self._cluster_id:
            raise _OtherCluster(f"etcd cluster id {cluster_id:x}, not {self._cluster_id:x}")
        if revision < self.revision:
            raise _OtherCluster(f"etcd answered at revision {revision}, below {self.revision}")

    def _relist(self, pages: Iterator[Page]) -> None:
        first = next(pages, None)  # list_pages yields at least one page; None: a test's port
        checking, self._checking = self._checking, False
        changed = first is not None and (
            (first.cluster_id != self._cluster_id and bool(self._cluster_id))
            or first[0] < self.revision
        )
        if checking and not changed:
            # The watch answer was from a member behind: the watch resumes where it was.
            self._needs_list = False
            self._answered(first[0] if first is not None else 0)
            return
        if first is not None:
            if changed:
                self._cluster_changed(first)
            self._cluster_id = first.cluster_id
            pages = itertools.chain((first,), pages)
        revision = self._target.replace(self._answering(pages), reset=changed)
        self.revision = revision if changed else max(self.revision, revision)
        self._needs_list = False
        if self._listed:
            with self._lock:
                self._relists += 1
            cause = "cluster_replaced" if changed else "compaction"
            self._metrics.watcher_relist(self.name, cause)
        self._listed = True
        self._metrics.watcher_revision(self.name, self.revision, self._newest)

    def _cluster_changed(self, first: Page) -> None:
        if first.cluster_id != self._cluster_id:
            reason = f"another etcd cluster answered (cluster id {first.cluster_id:x}, was "
        else:
            reason = f"etcd's revision went back (cluster id {first.cluster_id:x}, as "
        reason += f"{self._cluster_id:x}; revision {first[0]}, {self.revision} applied)"
        with self._lock:
            self._cluster_changes += 1
            self._last_error = reason
        log.warning(
            "watch of %s: %s: its data was wiped or restored; replacing everything held "
            "with a fresh listing",
            self.name,
            reason,
        )

    def _answering(
        self, pages: Iterator[tuple[int, list[KeyValue]]]
    ) -> Iterator[tuple[int, list[KeyValue]]]:
        """The listing's pages, then etcd's answer reported (state, metrics).

        The target reads every page before it hands the listing on, so the answer is
        reported first: a watcher whose first snapshot is in says it is connected.
        """
        # One attempt per page (timeout=0): this loop's own backoff retries, and reports,
        # failures (a revision compacted between pages too).
        revision = 0
        for revision, kvs in pages:
            yield revision, kvs
        self._answered(revision)

    def _answered(self, revision: int) -> None:
        # Runs for every response: lock-free unless the state changes.
        self._last_success = time.time()
        self._newest = max(self._newest, revision)
        if self._state is WatcherState.CONNECTED:
            return
        with self._lock:
            if self._state is WatcherState.STOPPED:
                return
            self._state = WatcherState.CONNECTED
        self._metrics.watcher_connected(self.name, True)

    def _interrupted(self, exc: BaseException) -> None:
        reason = explain(exc)
        with self._lock:
            if self._state is not WatcherState.STOPPED:
                self._state = WatcherState.RECONNECTING
            self._last_error = reason
            self.last_exception = exc
            self._reconnects += 1
        self._metrics.watcher_connected(self.name, False)
        self._metrics.watcher_reconnect(self.name, _cause(exc))
        if not isinstance(exc, DiscoveryError):
            log.error("watch of %s failed; restarting", self.name, exc_info=exc)  # a bug of ours
        elif isinstance(exc, _OtherCluster):
            # The listing that follows says whether the cluster changed (its WARNING).
            log.info("watch of %s: %s; listing to check", self.name, reason)
        else:
            log.warning("watch of %s interrupted (%s); reconnecting", self.name, reason)


class _OtherCluster(EtcdError):
    """A watch answer from another cluster id, or below the held revision: list again."""


def _after_first(pages: Iterator[Page], then: Callable[[], None]) -> Iterator[Page]:
    """``pages``, with ``then()`` run once the first is in (the next one is on its way)."""
    for n, page in enumerate(pages):
        if n == 0:
            then()
        yield page


def _cause(exc: BaseException) -> str:
    """The reconnect cause a metric is labelled with."""
    if isinstance(exc, Compacted):
        return "compaction"
    if isinstance(exc, _OtherCluster):
        return "cluster_replaced"
    if isinstance(exc, StreamSilentError):
        return "timeout"
    if isinstance(exc, NoLeaderError):
        return "no_leader"
    return "stream_error"
