"""Stops an engine's process group when ``discovery launch`` dies without stopping it.

``discovery launch`` runs this file as a script, ``python -I -S guard.py PGID STOP_TIMEOUT``,
with its standard input the read end of a pipe that only the launcher holds. A byte on it
means the launcher is done (the group is already stopped): exit. End of file without one
means the launcher died (SIGKILL, the OOM killer): send SIGTERM to the group, wait up to
STOP_TIMEOUT seconds for it to empty, then SIGKILL it. SIGTERM first because a torchrun
child stops the workers it started in sessions of their own only when it may run its
handler. Standard library only: it starts fast and imports nothing of the launcher's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

_POLL = 0.05  # a process group has no descriptor to wait on


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pgid: int, stop_timeout: float) -> None:
    """SIGTERM the group, wait up to ``stop_timeout`` s for it to empty, then SIGKILL it."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + stop_timeout
    while time.monotonic() < deadline:
        time.sleep(_POLL)
        if not _group_exists(pgid):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """Wait for the launcher to finish or die; in the second case stop the group."""
    pgid, stop_timeout = int(argv[0]), float(argv[1])
    # A Ctrl-C or SIGTERM sent to the launcher's whole process group reaches the guard
    # too; the launcher handles it, and the guard must outlive it in case it cannot.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if not os.read(0, 1):
        stop_group(pgid, stop_timeout)


if __name__ == "__main__":
    main(sys.argv[1:])
