"""Where the ``discovery`` command logs: stderr, as text or as one JSON object per line.

With ``--log-format json`` every line on stderr is one JSON object, not only our own log
records. Native code writes to file descriptor 2 below Python's logging: gRPC's C core
logs through absl (``I1202 12:00:00.000000 123 ssl_transport_security.cc:2563] Handshake
failed ...`` on a TLS failure). Its verbosity cannot be changed from here: grpcio 1.85
reads ``GRPC_VERBOSITY`` when it is imported, before the command line is parsed (measured:
setting it later changes nothing). So for the command's lifetime fd 2 becomes a pipe, and a
thread turns each line arriving there into a record of the ``stderr`` logger (absl's
severity letter gives the level, WARNING otherwise), formatted by the same JSON handler,
which writes to the real stderr. Nothing is silenced; ``--log-level`` filters these
records like any other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

log = logging.getLogger("discovery.cli")
native_log = logging.getLogger("stderr")
"""Lines that native code (or a stray print) wrote to stderr, in JSON mode."""

# absl's prefix: severity letter, then MMDD (``I1202 ...``).
_ABSL_LINE = re.compile(r"([IWEF])\d{4} ")
_ABSL_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# How long the relay may take to drain the pipe at exit: only a child process still
# holding the pipe (not one of ours: the demo waits for its engines) makes it wait.
_DRAIN_TIMEOUT = 2.0


def log_level(text: str) -> int:
    """The ``--log-level`` argument as a logging level."""
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)"
        )
    return level


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


@contextlib.contextmanager
def command_logging(args: argparse.Namespace) -> Iterator[None]:
    """Log to stderr at ``args.log_level`` in ``args.log_format`` while the block runs.

    In JSON mode, everything written to fd 2 meanwhile becomes JSON too, and an
    unexpected exception is logged as one JSON object before exiting with status 1.
    """
    root = logging.getLogger()
    root.setLevel(args.log_level)
    if args.log_format != "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.handlers[:] = [handler]
        yield
        return
    real_stderr = open(  # noqa: SIM115 - closed in finally, after the handler lets go
        os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace"
    )
    handler = logging.StreamHandler(real_stderr)
    handler.setFormatter(_JsonFormatter())
    root.handlers[:] = [handler]
    relay = _route_stderr()
    try:
        yield
    except Exception:
        log.exception("discovery %s failed unexpectedly", args.command)
        raise SystemExit(1) from None
    finally:
        sys.stderr.flush()
        os.dup2(real_stderr.fileno(), 2)  # drops the pipe's write end: the relay sees EOF
        relay.join(_DRAIN_TIMEOUT)
        handler.setStream(sys.stderr)  # fd 2 is the real stderr again
        real_stderr.close()


def _route_stderr() -> threading.Thread:
    """Point fd 2 at a pipe; return the started thread that logs each line from it."""
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    relay = threading.Thread(target=_relay, args=(read_fd,), name="discovery-stderr", daemon=True)
    relay.start()
    return relay


def _relay(read_fd: int) -> None:
    with open(read_fd, encoding="utf-8", errors="backslashreplace") as pipe:
        for line in pipe:
            text = line.rstrip("\n")
            if text:
                absl = _ABSL_LINE.match(text)
                level = _ABSL_LEVELS[absl.group(1)] if absl else logging.WARNING
                native_log.log(level, "%s", text)


def report_failure(args: argparse.Namespace, error: BaseException) -> None:
    """The command's last line: why it failed (plain text, or JSON in JSON mode)."""
    if args.log_format == "json":
        # Shown whatever --log-level says, like the plain line: handle() skips the level.
        message = ("discovery %s: %s", (args.command, error))
        log.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, *message, None))
    else:
        print(f"discovery {args.command}: {error}", file=sys.stderr)
