"""Ending registrations on SIGTERM/SIGINT, with an optional drain, for those who ask.

The library never installs signal handlers by itself; ``discovery register`` does.

The drain sequence (``drain_timeout`` S > 0): the first signal marks every registration
``draining`` (routers stop picking it within milliseconds; requests already picked
finish), S seconds later the leases are revoked (the keys go) and the process goes on
as it would have without a drain. A second signal revokes at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol, runtime_checkable

from discovery._errors import DiscoveryError

__all__ = ["StopSignals", "deregister_on_signals", "drain_and_close"]

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_LOOK_AGAIN = b"\0"  # not a signal number


class StopSignals:
    """From construction on, SIGTERM and SIGINT are caught into a pipe the main thread waits on.

    A plain ``Event.wait()`` in the main thread can sleep through a signal: the OS may
    hand it to one of gRPC's threads, and Python only runs handlers when the main thread
    runs bytecode. CPython writes every caught signal's number to the wakeup fd from
    whichever thread receives it, so a wait on that pipe always wakes up; other threads
    wake it with ``note()``. Used by the ``discovery`` commands and ``launch()``.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._caught)
        self._previous_fd = signal.set_wakeup_fd(self._write)

    @staticmethod
    def _caught(signum: int, frame: FrameType | None) -> None:
        """Caught, not fatal: the number reaches the pipe through the wakeup fd."""

    def note(self) -> None:
        """Wake the main thread to look again (any thread)."""
        with contextlib.suppress(BlockingIOError):  # full: a wakeup is pending anyway
            os.write(self._write, _LOOK_AGAIN)

    def wait(self, timeout: float | None) -> list[signal.Signals]:
        """Block until a wakeup or ``timeout``; returns the stop signals caught."""
        readable, _, _ = select.select([self._read], [], [], timeout)
        if not readable:
            return []
        return [signal.Signals(b) for b in os.read(self._read, 512) if b in _STOP_SIGNALS]

    def signalled_within(
        self, seconds: float, *, or_when: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait up to ``seconds``: True as soon as a stop signal comes (or ``or_when()``)."""
        ends = time.monotonic() + seconds
        while (left := ends - time.monotonic()) > 0:
            if self.wait(left) or or_when():
                return True
        return False

    def close(self) -> None:
        """Restore the signal handlers and the wakeup fd as they were."""
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._read)
        os.close(self._write)


class _Closable(Protocol):
    def close(self) -> None: ...


@runtime_checkable
class _Drainable(Protocol):
    def drain(self, timeout: float) -> None: ...

    def close(self) -> None: ...


def drain_and_close(
    registration: _Drainable,
    drain_timeout: float,
    wait: Callable[[float], bool] | None = None,
) -> None:
    """End ``registration`` gracefully: ``draining`` for ``drain_timeout`` s, then closed.

    ``wait(seconds)`` blocks for up to ``seconds`` and returns True to end the drain
    early (``discovery register`` waits for a second signal there); by default the
    drain lasts its whole timeout. 0 closes at once. If etcd cannot take the
    ``draining`` mark, the drain still lasts its time (requests already routed finish).
    """
    if drain_timeout > 0:
        ends = time.monotonic() + drain_timeout
        try:
            registration.drain(drain_timeout)
        except DiscoveryError as exc:
            log.warning("could not mark the engine draining (%s); waiting anyway", exc)
        remaining = ends - time.monotonic()
        if remaining > 0:
            if wait is None:
                time.sleep(remaining)
            elif wait(remaining):
                log.info("second signal: ending the drain now")
    registration.close()


def deregister_on_signals(
    *closables: _Closable,
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    drain_timeout: float = 0.0,
) -> Callable[[], None]:
    """Close ``closables`` (revoking leases) on SIGTERM/SIGINT, then behave as before.

    After closing, do what the previous handler did: call it, or exit (SIGTERM: status
    128 + signum; SIGINT: KeyboardInterrupt). With ``drain_timeout`` S > 0, the first
    signal only drains every registration among ``closables`` (see the module docs) and
    returns, so the application keeps serving what it has; the closing happens S seconds
    later (the signal is raised again then), or at once on a second signal. Must be
    called from the main thread. Returns a function that restores the previous handlers.

    Python runs handlers in the main thread, between bytecodes, and the OS may deliver a
    signal to any thread (gRPC has several): a main thread parked in an uninterruptible
    wait (``Event.wait()`` without a timeout, ``signal.pause()``) may never run it. An
    asyncio loop, a serving loop, or waits with a timeout are fine.
    """
    previous: dict[int, object] = {}
    draining = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        if drain_timeout > 0 and not draining.is_set():
            draining.set()
            for closable in closables:
                if isinstance(closable, _Drainable):
                    try:
                        closable.drain(drain_timeout)
                    except DiscoveryError as exc:
                        log.warning("could not mark %r draining: %s", closable, exc)
            timer = threading.Timer(drain_timeout, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return
        for closable in closables:
            closable.close()
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)
        elif signum == signal.SIGINT and before != signal.SIG_IGN:
            raise KeyboardInterrupt
        elif before != signal.SIG_IGN:
            sys.exit(128 + signum)

    for sig in signals:
        previous[sig] = signal.signal(sig, handle)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    return restore
