"""Callbacks on background threads, one at a time, in order.

A slow or failing handler never stalls the thread that produced the event (a watch
stream or the lease keeper).

A dispatcher may also run a loop (``drive``): a watcher's list-watch loop, each step of
which (one response applied to the store) may queue calls. Its two threads then take
turns (leader and follower): one runs the loop; after a step that queued calls, while no
thread is running calls, the thread that made the step hands the loop to the other one
and runs the calls itself. So a call starts without waiting for another thread to wake
up, and the loop never waits for a call: a thread never runs a call while it runs the
loop. While a thread runs calls, the loop's steps only queue theirs (in order, behind).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs submitted calls in submission order, one at a time, on threads started lazily.

    One thread; two while it also runs a loop (``drive``, see the module docs).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._calls: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._loop: Iterator[object] | None = None
        self._leader: int | None = None  # the thread running the loop (its ident)
        self._running = False  # a thread is running calls
        self._stopped = False
        self.failures = 0

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn(*args)``; dropped once the dispatcher is stopped."""
        with self._cv:
            if self._stopped:
                return
            self._calls.append((fn, args))
            # The loop's own thread runs them after its step (or leaves them to the other).
            if not self._running and self._leader != threading.get_ident():
                self._wake_locked()

    def drive(self, loop: Iterator[object], thread_name: str) -> None:
        """Run ``loop`` (one ``next`` per step, until it ends) on this dispatcher's threads.

        Its steps may submit calls: they run on the other thread (module docs). Once.
        """
        with self._cv:
            if self._loop is not None or self._stopped:
                raise RuntimeError(f"{self._name} runs a loop already, or is stopped")
            self._name = thread_name
            self._loop = loop
            self._wake_locked()

    def leading(self) -> bool:
        """Whether the calling thread is running this dispatcher's loop."""
        return self._leader == threading.get_ident()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Run what is queued, then end the threads (not from inside a handler).

        A loop being run is not stopped here: its threads end after it ends.
        """
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    # -- the threads ---------------------------------------------------------------------

    def _wake_locked(self) -> None:
        """Get a thread to look for work: an idle one, or a new one (at most two)."""
        if self._idle:
            self._cv.notify()
        elif len(self._threads) < (2 if self._loop is not None else 1):
            thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._threads.append(thread)
            thread.start()
        # Else both are busy: the one running calls will see these too.

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cv:
                while True:
                    if self._loop is not None and self._leader is None:
                        self._leader, lead = me, True
                        break
                    if self._calls and not self._running:
                        self._running, lead = True, False
                        break
                    if self._stopped and self._loop is None:
                        return
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
            if not lead or self._lead():
                self._run_calls()

    def _lead(self) -> bool:
        """Run the loop until a step queues calls that no thread runs; whether to run them."""
        loop = self._loop
        assert loop is not None
        while True:
            try:
                next(loop)
                ended = False
            except StopIteration:
                ended = True
            except Exception:
                log.exception("%s: loop failed", self._name)
                ended = True
            with self._cv:
                if ended:
                    self._loop = self._leader = None
                    self._cv.notify_all()  # idle threads may end now
                elif not self._calls or self._running:
                    continue  # nothing to run, or the other thread runs them
                else:
                    self._leader = None  # the other thread takes the loop over
                    self._wake_locked()
                if not self._calls or self._running:
                    return False
                self._running = True
                return True

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    self._running = False
                    return
                fn, args = self._calls.popleft()
            try:
                fn(*args)
            except Exception:
                self.failures += 1
                log.exception("%s: handler %r failed", self._name, fn)


def run_inline(fn: Callable[..., object], *args: object) -> None:
    """Call ``fn(*args)`` on this thread, logging (never raising) what it raises.

    For a listener that asked to run on the watch thread itself: its failure must not end
    the watch.
    """
    try:
        fn(*args)
    except Exception:
        log.exception("inline listener %r failed", fn)


F = TypeVar("F", bound=Callable[..., object])


class Listeners(Generic[F]):
    """A thread-safe set of callbacks; ``add()`` returns the function that removes one.

    Copy on write: a change replaces the tuple under the lock, so a read (one per event
    on the watch path) takes no lock and copies nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: tuple[F, ...] = ()

    def add(self, callback: F) -> Callable[[], None]:
        """Add ``callback``; call the returned function to remove it (idempotent)."""
        with self._lock:
            self._items = (*self._items, callback)

        def remove() -> None:
            with self._lock:
                if callback in self._items:
                    items = list(self._items)
                    items.remove(callback)
                    self._items = tuple(items)

        return remove

    def __iter__(self) -> Iterator[F]:
        """The callbacks at this moment (an immutable tuple: safe outside any lock)."""
        return iter(self._items)

    def current(self) -> tuple[F, ...]:
        """The callbacks at this moment, without a copy."""
        return self._items

    def __bool__(self) -> bool:
        return bool(self._items)
