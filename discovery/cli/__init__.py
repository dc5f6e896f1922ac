"""``discovery`` command line: a thin argparse front end over the public API.

Exit status: 0 success, 1 runtime failure (etcd unavailable, conflict, denied),
2 bad input (flags, endpoint file, settings).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from discovery import ConfigurationError, DiscoveryError, InvalidRecordError

from ._args import (
    UsageError,
    add_endpoint_flags,
    add_launch_flags,
    add_metrics_flags,
    add_registration_flags,
    add_selector_flag,
    add_settings_flags,
    add_split_flag,
    add_weight_version_flag,
)
from ._commands import (
    EXIT_FAILURE,
    cmd_deregister,
    cmd_drain,
    cmd_launch,
    cmd_list,
    cmd_pause,
    cmd_register,
    cmd_resume,
    cmd_schema,
    cmd_serve,
    cmd_top,
    cmd_undrain,
    cmd_watch,
)
from ._demo import cmd_demo
from ._logging import command_logging, log_level, report_failure
from ._top import add_top_flags

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``discovery`` command."""
    parser = argparse.ArgumentParser(
        prog="discovery", description="Register and find inference engines in etcd."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    reg = commands.add_parser("register", help="register an engine until signalled")
    add_endpoint_flags(reg)
    add_registration_flags(reg)
    add_settings_flags(reg)
    add_metrics_flags(reg)
    reg.set_defaults(func=cmd_register)

    launch = commands.add_parser(
        "launch",
        help="start an engine command and register it from its ready message",
        usage="discovery launch [options] -- COMMAND ... {event_address} ...",
        description="Start COMMAND with the engine-event socket's address in place of "
        "{event_address}, register the engine from its ready message, and revoke the record "
        "when it exits. Exit status: the engine's (128 + N when killed by signal N); 0 when "
        "SIGTERM/SIGINT stopped it; 1 no valid ready message in time or registration refused; "
        "2 bad input; 124 the engine stalled and --stall-action is stop; 126/127 COMMAND "
        "cannot run / not found.",
    )
    add_launch_flags(launch)
    add_registration_flags(launch)
    add_settings_flags(launch)
    add_metrics_flags(launch)
    launch.set_defaults(func=cmd_launch)

    dereg = commands.add_parser("deregister", help="remove an engine's record by id")
    dereg.add_argument("engine_id")
    add_settings_flags(dereg)
    dereg.set_defaults(func=cmd_deregister)

    _add_status_commands(commands)

    lst = commands.add_parser("list", help="print the live engines")
    lst.add_argument(
        "-o",
        "--format",
        choices=("table", "json", "wide"),
        default="table",
        help="table (default), json (for scripts), or wide: the table with what each "
        "engine's state relay says (load, cached blocks; waits up to a few seconds for them)",
    )
    add_selector_flag(lst, "list only")
    add_split_flag(lst)
    add_settings_flags(lst)
    lst.set_defaults(func=cmd_list)

    top = commands.add_parser(
        "top",
        help="the live table in the terminal, redrawn in place (q quits, s sorts)",
        description="Show the engines (status, weight version, role, address, TTL left, load and "
        "cached blocks where relayed, labels) and how current the watcher is, redrawn as "
        "they change. Keys: q quits, s sorts by the next column. Without a terminal it "
        "prints one line per event, as `discovery watch` does.",
    )
    add_top_flags(top)
    add_settings_flags(top)
    top.set_defaults(func=cmd_top)

    watch = commands.add_parser("watch", help="print one line per change until signalled")
    watch.add_argument("--format", choices=("text", "jsonl"), default="text")
    add_selector_flag(watch, "watch only")
    add_settings_flags(watch)
    add_metrics_flags(watch)
    watch.set_defaults(func=cmd_watch)

    _add_serve_command(commands)

    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema (draft 2020-12) of the stored value (docs/record.md)",
    )
    # No etcd, nothing to log: only what main's logging set-up reads.
    schema.set_defaults(func=cmd_schema, log_level=logging.INFO, log_format="text")

    demo = commands.add_parser("demo", help="run the end-to-end demo (embedded etcd if none)")
    demo.add_argument("--engines", type=int, default=3)
    demo.add_argument("--ttl", type=float, default=3.0)
    add_settings_flags(demo)
    add_metrics_flags(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def _add_serve_command(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="Megatron's own OpenAI-compatible server over the whole fleet",
        description="Serve Megatron's OpenAI-compatible endpoints (completions, chat "
        "completions, health, profile; from the installed megatron-core, with its tokenizer "
        "and parsers) over every engine the fleet string names, replicas sharing one port as "
        "Megatron runs them. /health says how many engines are ready; no engine ready: 503 "
        "with Retry-After. SIGTERM stops taking connections and lets requests in flight "
        "finish. Exit status: 0 stopped, 1 etcd unreachable at start or every replica died, "
        "2 bad input or megatron-core / discovery[serve] missing.",
    )
    serve.add_argument(
        "fleet",
        help="the fleet: etcd[s]://HOST:PORT[,HOST:PORT...]/NAMESPACE[?selector=...&policy=...]"
        " (no hosts: $DISCOVERY_ETCD_ENDPOINTS; TLS and credentials from $DISCOVERY_*)",
    )
    serve.add_argument(
        "--tokenizer", required=True, help="the model's tokenizer (MegatronTokenizer's path)"
    )
    serve.add_argument(
        "--tokenizer-library", default="huggingface", help="its library (default huggingface)"
    )
    serve.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    serve.add_argument("--port", type=int, default=5000, help="port (default 5000, Megatron's)")
    serve.add_argument(
        "--replicas", type=int, default=4, help="server processes on the port (default 4)"
    )
    serve.add_argument(
        "--parsers", nargs="+", default=[], help="Megatron's response parsers, by name"
    )
    serve.add_argument("--chat-template", help="a chat template (a file, or the template)")
    serve.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds requests in flight have to finish (default 30)",
    )
    serve.add_argument(
        "--retry-after", type=int, default=1, metavar="S", help="Retry-After of a 503 (default 1)"
    )
    serve.add_argument("--verbose", action="store_true", help="Megatron's request logging")
    serve.add_argument(
        "--log-level", default="INFO", type=log_level, help="DEBUG, INFO, WARNING, ERROR"
    )
    serve.add_argument("--log-format", choices=("text", "json"), default="text")
    add_metrics_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _add_status_commands(commands: Any) -> None:
    """``drain``, ``undrain``, ``pause``, ``resume``: an engine's status, from outside."""
    drain = commands.add_parser(
        "drain", help="mark an engine draining: routers stop picking it, its requests finish"
    )
    drain.add_argument("engine_id")
    drain.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="its registrar revokes the lease after S seconds (default: drain until undrain)",
    )
    add_settings_flags(drain)
    drain.set_defaults(func=cmd_drain)

    undrain = commands.add_parser("undrain", help="put a draining engine back to ready")
    undrain.add_argument("engine_id")
    add_settings_flags(undrain)
    undrain.set_defaults(func=cmd_undrain)

    pause = commands.add_parser(
        "pause",
        help="mark an engine paused: routers stop picking it, it keeps its lease and id "
        "(a weight update)",
    )
    pause.add_argument("engine_id")
    add_settings_flags(pause)
    pause.set_defaults(func=cmd_pause)

    resume = commands.add_parser(
        "resume",
        help="put a paused engine back to ready, on a new weight version if given (one "
        "write; a ready engine takes the version)",
    )
    resume.add_argument("engine_id")
    add_weight_version_flag(resume, "the version of the weights it serves now")
    resume.add_argument(
        "--force", action="store_true", help="allow a lower weight version (a rollback)"
    )
    add_settings_flags(resume)
    resume.set_defaults(func=cmd_resume)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``discovery`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with command_logging(args):
        try:
            return int(args.func(args))
        except (UsageError, InvalidRecordError, ConfigurationError) as exc:
            report_failure(args, exc)
            return EXIT_USAGE
        except DiscoveryError as exc:
            report_failure(args, exc)
            return EXIT_FAILURE
