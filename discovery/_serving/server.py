"""``serve_fleet``: Megatron's OpenAI-compatible server over the whole fleet, in one call.

The parent process checks what is needed (``missing``: megatron-core, the ``serve`` extra),
reads the fleet string and lists the fleet once (etcd down is an error here, before
anything listens), binds the one listening socket, and starts ``replicas`` processes that
share it, as Megatron's ``start_text_gen_server`` does (``discovery._serving.replica``:
each its own event loop, ``FleetInferenceClient`` and hypercorn). With ``metrics`` it
follows the fleet in a table of its own for the Prometheus port (the engines by status,
the watch's freshness). A stop signal (``stop``) is passed to every replica as SIGTERM:
they stop taking connections and finish what is in flight (``grace``). A replica that
exits by itself is logged; the server ends, with status 1, when none is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from discovery._errors import ConfigurationError
from discovery._metrics import MetricsHooks
from discovery._reads.table import watch_table
from discovery._reads.watcher import list_engines
from discovery._routing.inference_client import parse_fleet
from discovery._serving.options import ServeOptions, missing

__all__ = ["serve_fleet"]

log = logging.getLogger(__name__)

StopWait = Callable[[float], bool]
"""``stop(timeout)``: whether a stop was asked for within ``timeout`` seconds."""


def serve_fleet(
    options: ServeOptions, stop: StopWait, *, metrics: MetricsHooks | None = None
) -> int:
    """Serve ``options.fleet`` until ``stop`` says so; 0 then, 1 if every replica died.

    ``ConfigurationError`` when megatron-core or the ``serve`` extra is missing or an
    option is wrong; ``EtcdUnavailableError`` when etcd does not answer the first listing.
    """
    problem = missing()
    if problem:
        raise ConfigurationError(f"discovery serve needs {problem}")
    if options.replicas < 1:
        raise ConfigurationError(f"--replicas must be 1 or more, got {options.replicas}")
    address = parse_fleet(options.fleet)
    settings = address.settings()
    listing = list_engines(settings, selector=address.selector)
    ready = sum(e.record.status.value == "ready" for e in listing.engines)
    log.info("the fleet has %d engines, %d ready", len(listing.engines), ready)
    with contextlib.ExitStack() as cleanup:
        if metrics is not None:
            cleanup.enter_context(watch_table(settings, selector=address.selector, metrics=metrics))
        listener = cleanup.enter_context(_listening(options.host, options.port))
        replicas = [_replica(options, listener) for _ in range(options.replicas)]
        cleanup.callback(_stop, replicas, options.grace)
        log.info(
            "serving %s on http://%s:%d with %d replicas",
            options.fleet,
            options.host,
            listener.getsockname()[1],
            len(replicas),
        )
        while not stop(0.2):
            for child in [c for c in replicas if c.poll() is not None]:
                log.error("replica %d exited with status %d", child.pid, child.returncode)
                replicas.remove(child)
            if not replicas:
                return 1
    return 0


@contextlib.contextmanager
def _listening(host: str, port: int) -> Iterator[socket.socket]:
    """The socket every replica accepts on (each listens on it), as Megatron binds it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(f"cannot listen on {host}:{port}: {exc}") from exc
        sock.setblocking(False)
        sock.set_inheritable(True)
        yield sock
    finally:
        sock.close()


def _replica(options: ServeOptions, listener: socket.socket) -> subprocess.Popen[bytes]:
    fd = listener.fileno()
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "discovery._serving.replica"),
            *(options.to_json(), str(fd), str(os.getpid())),
        ],
        pass_fds=[fd],
    )


def _stop(replicas: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each replica, then wait for them to finish their requests (``grace``)."""
    for child in replicas:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace + 5
    for child in replicas:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("replica %d did not stop in %.0f s: killed", child.pid, grace + 5)
            child.kill()
            child.wait()
