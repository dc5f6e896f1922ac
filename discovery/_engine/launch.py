"""``discovery launch``: start an engine, register it from its ready message, tie both lives.

    bind the event socket ─▶ start COMMAND in a process group of its own, and a guard ─▶
      "ready" frame          ─▶ registered (EngineEventReceiver, ``_engine/events.py``)
      the child exits        ─▶ lease revoked at once, what it left in its group killed,
                                exit with its status (killed by signal N: 128 + N)
      SIGTERM / SIGINT       ─▶ deregister, forward the signal to the group, wait
                                ``stop_timeout``, SIGKILL; exit 0 if it stopped on the signal
      no valid ready within ``ready_timeout``, or the registration refused
                             ─▶ stop the group the same way, exit 1
      silent past ``stall_timeout`` after it sent progress (a hung engine)
                             ─▶ ``stall_action`` "mark": the record is ``stalled`` until the
                                engine is heard from again; "stop": deregister at once, stop
                                the group the same way (SIGCONT too: a frozen engine must
                                wake to die), exit ``EXIT_STALLED`` (124, as ``timeout``
                                exits) so a supervisor restarts it
      the launcher SIGKILLed ─▶ its guard (``guard.py``) sees the pipe close and stops the
                                group the same way; the lease expires within its TTL

Every wakeup of the main thread comes through one pipe: CPython writes each caught signal's
number to it (whichever thread the OS hands the signal to), and the child's waiter thread
and the receiver write a 0 byte to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from discovery._engine.events import DEFAULT_STALL_TIMEOUT, EngineEventReceiver, ReceiverState
from discovery._errors import ConfigurationError
from discovery._writes.signals import StopSignals, drain_and_close

__all__ = ["EXIT_STALLED", "PLACEHOLDER", "STALL_ACTIONS", "launch"]

log = logging.getLogger(__name__)

PLACEHOLDER = "{event_address}"
EXIT_FAILURE = 1
EXIT_STALLED = 124  # what coreutils' timeout exits with: the command did not finish in time
STALL_ACTIONS = ("mark", "stop")
EXIT_CANNOT_EXECUTE = 126  # the shell's statuses for a command that cannot run
EXIT_NOT_FOUND = 127
_GUARD = Path(__file__).with_name("guard.py")


def exit_status(returncode: int) -> int:
    """A child's exit status the way a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def with_event_address(command: Sequence[str], address: str) -> list[str]:
    """``command`` with ``{event_address}`` replaced by ``address`` in every argument."""
    return [arg.replace(PLACEHOLDER, address) for arg in command]


def check_command(command: Sequence[str]) -> None:
    """Raise ConfigurationError unless ``command`` is non-empty and has the placeholder."""
    if not command:
        raise ConfigurationError(
            f"give the engine command after --, with {PLACEHOLDER} where it takes the "
            "engine-event address (Megatron: --dynamo-parent-event-address {event_address})"
        )
    if not any(PLACEHOLDER in arg for arg in command):
        raise ConfigurationError(
            f"the engine command has no {PLACEHOLDER}: put it where the engine takes the "
            "address of the engine-event socket (Megatron: --dynamo-parent-event-address "
            f"{PLACEHOLDER})"
        )


class _Guard:
    """A small process that stops the child's group if the launcher dies first."""

    def __init__(self, pgid: int, stop_timeout: float) -> None:
        read, self._write = os.pipe()
        try:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_GUARD), str(pgid), str(stop_timeout)],
                stdin=read,
            )
        except OSError as exc:
            log.warning("cannot start the guard process (%s): a SIGKILLed launcher leaves "
                        "the engine running", exc)  # fmt: skip
            self._process = None
        finally:
            os.close(read)

    def release(self) -> None:
        """The group is stopped: tell the guard to exit without acting, and reap it."""
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")
        os.close(self._write)
        if self._process is not None:
            self._process.wait()


def launch(
    command: Sequence[str],
    *,
    event_host: str | None = None,
    event_address: str | None = None,
    state_address: str | bool = True,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    stall_action: str = "mark",
    ready_timeout: float | None = None,
    stop_timeout: float = 20.0,
    drain_timeout: float = 0.0,
    **register: Any,
) -> int:
    """Run ``command`` as a registered engine until it exits or a stop signal; the exit status.

    ``event_host`` binds the engine-event socket on a random port (default 127.0.0.1);
    ``event_address`` (``tcp://HOST:PORT``) on a fixed one. ``state_address`` is where the
    engine's state is relayed to routers (see ``EngineEventReceiver``). An engine silent
    for ``stall_timeout`` s after it sent progress is marked ``stalled`` (``stall_action``
    "mark"), or deregistered and stopped with exit status ``EXIT_STALLED`` ("stop").
    On SIGTERM/SIGINT the engine is first marked ``draining`` for ``drain_timeout``
    seconds while it keeps serving (0: deregistered at once), then deregistered and
    stopped. ``register`` takes the keyword arguments of ``register_engine``. Call from
    the main thread: it installs SIGTERM/SIGINT handlers for its duration.
    """
    check_command(command)
    if stall_action not in STALL_ACTIONS:
        raise ConfigurationError(
            f"stall action must be one of {', '.join(STALL_ACTIONS)}, not {stall_action!r}"
        )
    for name, value in (("ready timeout", ready_timeout), ("stop timeout", stop_timeout)):
        if value is not None and not value > 0:
            raise ConfigurationError(f"{name} must be a positive number of seconds, got {value}")
    if not drain_timeout >= 0:
        raise ConfigurationError(f"drain timeout must be >= 0 seconds, got {drain_timeout}")
    receiver = EngineEventReceiver(
        host=event_host,
        address=event_address,
        state_address=state_address,
        stall_timeout=stall_timeout,
        **register,
    )
    wakeups = StopSignals()
    try:
        receiver.subscribe(lambda state: wakeups.note())
        argv = with_event_address(command, receiver.start())
        try:
            child = subprocess.Popen(argv, process_group=0)
        except OSError as exc:
            log.error("cannot start %s: %s", argv[0], exc.strerror or exc)
            return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE
        log.info("%s: engine started: pid %d, its own process group", receiver.engine_id, child.pid)
        return _Supervisor(
            child,
            receiver,
            wakeups,
            ready_timeout=ready_timeout,
            stop_timeout=stop_timeout,
            drain_timeout=drain_timeout,
            stop_when_stalled=stall_action == "stop",
        ).run()
    finally:
        receiver.close()
        wakeups.close()
        _log_summary(receiver)


def _log_summary(receiver: EngineEventReceiver) -> None:
    health = receiver.health()
    log.info(
        "%s: engine events: %d frames, %d ready, %d kv, %d progress, %d ignored, "
        "%d malformed, %d rejected; %d stalls",
        health.engine_id,
        health.frames,
        health.ready,
        health.kv,
        health.progress,
        health.ignored,
        health.malformed,
        health.rejected,
        health.stalls,
    )


class _Supervisor:
    """The main loop of one launch: waits on the wakeup pipe and decides."""

    def __init__(
        self,
        child: subprocess.Popen[bytes],
        receiver: EngineEventReceiver,
        wakeups: StopSignals,
        *,
        ready_timeout: float | None,
        stop_timeout: float,
        drain_timeout: float,
        stop_when_stalled: bool,
    ) -> None:
        self._child = child
        self._stop_when_stalled = stop_when_stalled
        self._drain_timeout = drain_timeout
        self._receiver = receiver
        self._wakeups = wakeups
        self._stop_timeout = stop_timeout
        self._ready_deadline = None if ready_timeout is None else time.monotonic() + ready_timeout
        self._ready_timeout = ready_timeout
        self._name = receiver.engine_id
        self._reaper = threading.Thread(target=self._reap, name="discovery-launch-child")
        self._reaper.start()

    def _reap(self) -> None:
        self._child.wait()
        self._wakeups.note()

    def run(self) -> int:
        guard = _Guard(self._child.pid, self._stop_timeout)
        try:
            return self._loop()
        finally:
            if self._child.returncode is None:  # an unexpected error: no engine left behind
                self._stop_child(signal.SIGTERM)
            self._reaper.join()  # its last note must reach the pipe before the pipe closes
            guard.release()

    def _loop(self) -> int:
        while True:
            waiting = self._receiver.state is ReceiverState.WAITING
            deadline = self._ready_deadline if waiting else None
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            signals = self._wakeups.wait(timeout)
            if self._child.returncode is not None:
                return self._child_exited()
            if signals:
                return self._stop_requested(signals[0])
            if self._receiver.state is ReceiverState.STALLED and self._stop_when_stalled:
                return self._stalled()
            if self._receiver.state is ReceiverState.FAILED:
                log.error("%s: stopping the engine: %s", self._name, self._receiver.error)
                self._stop_child(signal.SIGTERM)
                return EXIT_FAILURE
            if self._receiver.state is ReceiverState.WAITING and (
                deadline is not None and time.monotonic() >= deadline
            ):
                log.error(
                    "%s: no valid ready message within the ready timeout (%g s); stopping "
                    "the engine",
                    self._name,
                    self._ready_timeout,
                )
                self._stop_child(signal.SIGTERM)
                return EXIT_FAILURE

    def _child_exited(self) -> int:
        returncode = self._child.returncode
        assert returncode is not None
        self._receiver.close()  # revoke now: the record must not outlive the engine
        _kill_group(self._child.pid, signal.SIGKILL)  # what it left behind in its group
        log.info("%s: engine %s; deregistered", self._name, _describe(returncode))
        return exit_status(returncode)

    def _stalled(self) -> int:
        log.error(
            "%s: the engine is stalled and the stall action is stop: deregistering, then "
            "stopping it (exit status %d)",
            self._name,
            EXIT_STALLED,
        )
        self._receiver.close()  # the record goes first: no router waits on a hung engine
        returncode = self._stop_child(signal.SIGTERM)
        log.info("%s: engine %s; deregistered", self._name, _describe(returncode))
        return EXIT_STALLED

    def _stop_requested(self, sig: signal.Signals) -> int:
        # A registration in flight completes first: its record may already be visible.
        registration = self._receiver.stop_receiving()
        if registration is not None and self._drain_timeout > 0:
            log.info("%s: %s: draining for %g s", self._name, sig.name, self._drain_timeout)
            drain_and_close(registration, self._drain_timeout, self._drain_ends_early)
        log.info("%s: %s: deregistering, then stopping the engine", self._name, sig.name)
        self._receiver.close()
        returncode = self._stop_child(sig)
        log.info("%s: engine %s; deregistered", self._name, _describe(returncode))
        return 0 if returncode in (0, -sig) else exit_status(returncode)

    def _drain_ends_early(self, seconds: float) -> bool:
        """Wait out a drain; True (revoke now) on a second signal or the engine's exit."""
        return self._wakeups.signalled_within(
            seconds, or_when=lambda: self._child.returncode is not None
        )

    def _stop_child(self, sig: signal.Signals) -> int:
        """Signal the group, SIGKILL it after the stop timeout (or a second signal)."""
        _kill_group(self._child.pid, sig)
        _kill_group(
            self._child.pid, signal.SIGCONT
        )  # a frozen (SIGSTOPped) engine must run to stop
        deadline = time.monotonic() + self._stop_timeout
        while self._child.returncode is None and (remaining := deadline - time.monotonic()) > 0:
            if self._wakeups.wait(remaining):
                log.warning("%s: second stop signal: killing the engine now", self._name)
                break
        if self._child.returncode is None:
            log.warning("%s: engine still running: SIGKILL to its process group", self._name)
            _kill_group(self._child.pid, signal.SIGKILL)
            while self._child.returncode is None:
                self._wakeups.wait(None)
        _kill_group(self._child.pid, signal.SIGKILL)  # what it left behind in its group
        returncode = self._child.returncode
        assert returncode is not None
        return returncode


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
