"""Deregistering on SIGTERM/SIGINT, for applications that ask for it.

The library never installs signal handlers by itself; ``discovery register`` does.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Protocol

__all__ = ["deregister_on_signals"]


class _Closable(Protocol):
    def close(self) -> None: ...


def deregister_on_signals(
    *closables: _Closable, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
) -> Callable[[], None]:
    """Close ``closables`` (revoking leases) on SIGTERM/SIGINT, then behave as before.

    After closing, do what the previous handler did: call it, or exit (SIGTERM: status
    128 + signum; SIGINT: KeyboardInterrupt). Must be called from the main thread.
    Returns a function that restores the previous handlers.

    Python runs handlers in the main thread, between bytecodes, and the OS may deliver a
    signal to any thread (gRPC has several): a main thread parked in an uninterruptible
    wait (``Event.wait()`` without a timeout, ``signal.pause()``) may never run it. An
    asyncio loop, a serving loop, or waits with a timeout are fine.
    """
    previous: dict[int, object] = {}

    def handle(signum: int, frame: FrameType | None) -> None:
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
