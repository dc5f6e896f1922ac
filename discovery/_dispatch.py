"""Callbacks on one background thread.

A slow or failing handler never stalls the thread that produced the event (a watch
stream or the lease keeper).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

_STOP = object()


class Dispatcher:
    """Runs submitted calls in submission order on one daemon thread, started lazily."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.failures = 0

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn(*args)``; dropped once the dispatcher is stopped."""
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, args))

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            fn, args = item
            try:
                fn(*args)
            except Exception:
                self.failures += 1
                log.exception("%s: handler %r failed", self._name, fn)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Run what is queued, then end the thread (not from inside a handler)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._queue.put(_STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


F = TypeVar("F", bound=Callable[..., object])


class Listeners(Generic[F]):
    """A thread-safe set of callbacks; ``add()`` returns the function that removes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[F] = []

    def add(self, callback: F) -> Callable[[], None]:
        """Add ``callback``; call the returned function to remove it (idempotent)."""
        with self._lock:
            self._items.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._items:
                    self._items.remove(callback)

        return remove

    def __iter__(self) -> Iterator[F]:
        """The callbacks at this moment (a copy: safe to iterate outside any lock)."""
        with self._lock:
            return iter(list(self._items))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._items)
