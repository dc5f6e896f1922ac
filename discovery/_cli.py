"""``discovery`` command line: a thin argparse front end over the public API.

Exit status: 0 success, 1 runtime failure (etcd unavailable, conflict, denied),
2 bad input (flags, endpoint file, settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from ._codec import EngineRecord, validate_labels
from ._connection import Connection
from ._endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
)
from ._errors import ConfigurationError, DiscoveryError, InvalidRecordError
from ._metrics import Metrics
from ._registration import RegistrationState, register_engine
from ._settings import Settings
from ._watcher import EndpointEvent, EndpointWatcher

log = logging.getLogger("discovery.cli")

EXIT_FAILURE = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input on the command line; exits with status 2."""


# -- settings and logging -------------------------------------------------------------


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("etcd settings (flags win over DISCOVERY_* variables)")
    group.add_argument("--endpoints", help="comma-separated etcd URLs ($DISCOVERY_ETCD_ENDPOINTS)")
    group.add_argument("--root", help="key root ($DISCOVERY_ROOT, default /inference/v1)")
    group.add_argument("--namespace", help="namespace ($DISCOVERY_NAMESPACE, default 'default')")
    group.add_argument("--dial-timeout", type=float, help="seconds ($DISCOVERY_DIAL_TIMEOUT)")
    group.add_argument("--request-timeout", type=float, help="($DISCOVERY_REQUEST_TIMEOUT)")
    group.add_argument("--ca-cert", help="CA bundle file ($DISCOVERY_ETCD_CA_CERT)")
    group.add_argument("--cert", help="client certificate file ($DISCOVERY_ETCD_CERT)")
    group.add_argument("--key", help="client key file ($DISCOVERY_ETCD_KEY)")
    group.add_argument("--username", help="etcd user ($DISCOVERY_ETCD_USERNAME)")
    group.add_argument(
        "--password-file",
        help="file holding the etcd password ($DISCOVERY_ETCD_PASSWORD_FILE; "
        "or $DISCOVERY_ETCD_PASSWORD). Never given as a flag, so it stays out of ps.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from DISCOVERY_* variables, overridden by the flags given."""
    overrides = {
        name: getattr(args, name, None)
        for name in (
            "endpoints", "root", "namespace", "dial_timeout", "request_timeout",
            "ca_cert", "cert", "key", "username", "password_file",
        )
    }  # fmt: skip
    if overrides["password_file"]:  # the flag wins over $DISCOVERY_ETCD_PASSWORD too
        environ = {k: v for k, v in os.environ.items() if k != "DISCOVERY_ETCD_PASSWORD"}
        return Settings.from_env(environ, **overrides)
    return Settings.from_env(**overrides)


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


def _setup_logging(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        raise UsageError(f"--log-level {args.log_level!r} is not a logging level")
    root.setLevel(level)


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics (needs prometheus-client)")
    group.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    group.add_argument(
        "--metrics-addr", default="127.0.0.1", help="bind address (default 127.0.0.1)"
    )


def metrics_from_args(args: argparse.Namespace) -> Metrics | None:
    """A Metrics served over HTTP when --metrics-port is given, else None."""
    if args.metrics_port is None:
        return None
    try:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415
    except ImportError:
        raise UsageError(
            "--metrics-port needs prometheus-client: pip install 'discovery[metrics]'"
        ) from None
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    start_http_server(args.metrics_port, addr=args.metrics_addr, registry=registry)
    log.info("serving metrics on http://%s:%d/metrics", args.metrics_addr, args.metrics_port)
    return metrics


class _StopSignals:
    """From construction on, catch SIGTERM and SIGINT; ``wait()`` returns once one came.

    A plain ``Event.wait()`` in the main thread can sleep through a signal: the OS may
    hand it to one of gRPC's threads, and Python only runs handlers when the main thread
    runs bytecode. CPython writes every caught signal to the wakeup fd from whichever
    thread receives it, so a read on that fd always wakes up.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        for sig in self._SIGNALS:
            signal.signal(sig, lambda *_: None)  # caught (not fatal); handled by wait()
        signal.set_wakeup_fd(write_fd)

    def wait(self) -> None:
        """Block until SIGTERM or SIGINT arrives."""
        while os.read(self._read_fd, 1)[0] not in self._SIGNALS:
            pass


# -- register / deregister ----------------------------------------------------------------

# The required integer capabilities, each a --flag (the others have their own flags).
_CAPABILITY_FLAGS = tuple(
    f.name
    for f in dataclasses.fields(InferenceEngineCapabilities)
    if f.default is dataclasses.MISSING and f.name != "enable_prefix_caching"
)


def _parse_labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--label {pair!r} must look like key=value")
        labels[key] = value
    return labels


def _endpoint_from_args(args: argparse.Namespace) -> tuple[InferenceEngineEndpoint, dict[str, Any]]:
    """The endpoint and the metadata (engine_id, labels) found in the file, if any."""
    if args.endpoint_file:
        try:
            with open(args.endpoint_file, encoding="utf-8") as handle:
                value = json.load(handle)
        except OSError as exc:
            raise UsageError(
                f"--endpoint-file: cannot read {args.endpoint_file!r}: {exc.strerror}"
            ) from None
        except ValueError as exc:
            raise UsageError(f"--endpoint-file {args.endpoint_file!r} is not JSON: {exc}") from None
        try:
            endpoint = InferenceEngineEndpoint.from_dict(value)
        except KeyError as exc:
            raise UsageError(f"--endpoint-file: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--endpoint-file: {exc}") from None
        meta = {k: value[k] for k in ("engine_id", "labels") if k in value}
        return endpoint, meta
    missing = [f"--{n.replace('_', '-')}" for n in _CAPABILITY_FLAGS if getattr(args, n) is None]
    if args.coordinator_address is None:
        missing.insert(0, "--coordinator-address")
    if missing:
        raise UsageError(f"give --endpoint-file, or all of: {', '.join(missing)}")
    policy = args.prefix_caching_coordinator_policy
    try:
        capabilities = InferenceEngineCapabilities(
            **{name: getattr(args, name) for name in _CAPABILITY_FLAGS},
            enable_prefix_caching=args.enable_prefix_caching,
            logical_data_parallel_size=args.logical_data_parallel_size,
            prefix_caching_coordinator_policy=(
                PrefixCachingCoordinatorPolicy(policy) if policy else None
            ),
        )
        return InferenceEngineEndpoint(args.coordinator_address, capabilities), {}
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _cmd_register(args: argparse.Namespace) -> int:
    endpoint, meta = _endpoint_from_args(args)
    labels = {**(meta.get("labels") or {}), **_parse_labels(args.label)}
    engine_id = args.engine_id or meta.get("engine_id")
    settings = settings_from_args(args)
    stop = _StopSignals()
    metrics = metrics_from_args(args)
    registration = register_engine(
        endpoint,
        metrics=metrics,
        engine_id=engine_id,
        ttl=args.ttl,
        labels=labels,
        settings=settings,
        replace=args.replace,
    )
    log.info(
        "registered %s at %s (lease %016x, ttl %d s)",
        registration.engine_id,
        registration.key,
        registration.lease_id,
        registration.ttl,
    )
    registration.subscribe(lambda state: _log_state(registration.engine_id, state))
    stop.wait()
    registration.close()
    log.info("deregistered %s; exiting", registration.engine_id)
    return 0


def _log_state(engine_id: str, state: RegistrationState) -> None:
    if state is RegistrationState.REGISTERED:
        log.info("%s registered again after losing its lease", engine_id)


def _add_registration_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that registers an engine (register, launch)."""
    parser.add_argument("--engine-id", help="default: {hostname}-{pid}-{random}")
    parser.add_argument("--ttl", type=float, default=10.0, help="lease TTL in seconds (default 10)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--replace", action="store_true", help="take over a live engine's id")
    _add_settings_flags(parser)
    _add_metrics_flags(parser)


def _cmd_launch(args: argparse.Namespace) -> int:
    from ._events import require_event_libraries  # noqa: PLC0415 - needs the launch extra
    from ._launch import launch  # noqa: PLC0415

    try:
        require_event_libraries()
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(
        command,
        event_host=args.event_host,
        ready_timeout=args.ready_timeout,
        stop_timeout=args.stop_timeout,
        engine_id=args.engine_id,
        ttl=args.ttl,
        labels=_parse_labels(args.label),
        settings=settings_from_args(args),
        replace=args.replace,
        metrics=metrics_from_args(args),
    )


def _cmd_deregister(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    key = settings.keyspace.key(args.engine_id)
    with Connection(settings) as conn:
        _, meta = conn.call(lambda c: c.get(key))
        if meta is None:
            print(f"no engine {args.engine_id!r} at {key}", file=sys.stderr)
            return EXIT_FAILURE
        if meta.lease_id:
            conn.call(lambda c: c.revoke_lease(meta.lease_id))
            how = f"revoked lease {meta.lease_id:016x}"
        else:
            conn.call(lambda c: c.delete(key))
            how = "deleted the key (it had no lease)"
    print(f"removed engine {args.engine_id!r} at {key}: {how}")
    return 0


# -- list / watch ---------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    keyspace = settings.keyspace
    rows = []
    with Connection(settings) as conn:
        revision, kvs = conn.list_prefix(keyspace.prefix)
        for kv in kvs:
            try:
                record = keyspace.decode(kv.key, kv.value)
            except InvalidRecordError as exc:
                print(f"warning: skipping {exc}", file=sys.stderr)
                continue
            ttl = (
                conn.call(lambda c, lease=kv.lease: c.get_lease_info(lease).TTL)
                if kv.lease
                else None
            )
            rows.append((record, kv, ttl))
    if args.format == "json":
        out = [
            {**record.to_value(), "key": kv.key.decode(), "lease": kv.lease, "ttl": ttl}
            for record, kv, ttl in rows
        ]
        print(json.dumps({"revision": revision, "engines": out}, indent=2))
        return 0
    print(_table(rows))
    return 0


def _table(rows: list[tuple[EngineRecord, Any, int | None]]) -> str:
    header = ("ENGINE", "ADDRESS", "CTX", "BLOCK", "KV BLOCKS", "SEQS", "POLICY", "TTL", "LABELS")
    lines = [header]
    for record, _, ttl in rows:
        caps = record.endpoint.capabilities
        policy = caps.prefix_caching_coordinator_policy
        lines.append(
            (
                record.engine_id,
                record.endpoint.coordinator_address,
                str(caps.context_length),
                str(caps.kv_cache_block_size),
                str(caps.total_kv_blocks),
                str(caps.max_num_seqs),
                str(policy) if policy else ("-" if caps.enable_prefix_caching else "off"),
                "-" if ttl is None else f"{ttl}s",
                ",".join(f"{k}={v}" for k, v in sorted(record.labels.items())) or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines
    ]
    return "\n".join(t.rstrip() for t in text) + f"\n({len(rows)} engines)"


def format_event(event: EndpointEvent, fmt: str) -> str:
    """One output line for ``discovery watch``."""
    if fmt == "jsonl":
        return json.dumps(event.to_dict(), separators=(",", ":"))
    labels = ",".join(f"{k}={v}" for k, v in sorted(event.labels.items()))
    return (
        f"{event.type.value:<8} {event.engine_id} {event.endpoint.coordinator_address} "
        f"rev={event.revision}{' ' + labels if labels else ''}"
    )


def _cmd_watch(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    selector = _parse_labels(args.selector)
    stop = _StopSignals()
    metrics = metrics_from_args(args)
    watcher = EndpointWatcher(settings, selector=validate_labels(selector), metrics=metrics)
    watcher.start()

    def emit(event: EndpointEvent) -> None:
        print(format_event(event, args.format), flush=True)

    watcher.subscribe(emit)
    stop.wait()
    watcher.stop()
    return 0


# -- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``discovery`` command."""
    parser = argparse.ArgumentParser(
        prog="discovery", description="Register and find inference engines in etcd."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    reg = commands.add_parser("register", help="register an engine until signalled")
    reg.add_argument("--endpoint-file", help="JSON endpoint, same format as the stored value")
    reg.add_argument("--coordinator-address")
    for name in _CAPABILITY_FLAGS:
        reg.add_argument(f"--{name.replace('_', '-')}", type=int)
    reg.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False
    )
    reg.add_argument("--logical-data-parallel-size", type=int, default=1)
    reg.add_argument(
        "--prefix-caching-coordinator-policy",
        choices=[p.value for p in PrefixCachingCoordinatorPolicy],
    )
    _add_registration_flags(reg)
    reg.set_defaults(func=_cmd_register)

    launch = commands.add_parser(
        "launch",
        help="start an engine command and register it from its ready message",
        usage="discovery launch [options] -- COMMAND ... {event_address} ...",
        description="Start COMMAND with the engine-event socket's address in place of "
        "{event_address}, register the engine from its ready message, and revoke the record "
        "when it exits. Exit status: the engine's (128 + N when killed by signal N); 0 when "
        "SIGTERM/SIGINT stopped it; 1 no valid ready message in time or registration refused; "
        "2 bad input; 126/127 COMMAND cannot run / not found.",
    )
    launch.add_argument(
        "--event-host",
        default="127.0.0.1",
        help="address to bind the engine-event socket on (routable when rank zero is remote)",
    )
    launch.add_argument(
        "--ready-timeout",
        type=float,
        help="stop the engine when no valid ready message came within this many seconds",
    )
    launch.add_argument(
        "--stop-timeout",
        type=float,
        default=20.0,
        help="seconds between the forwarded stop signal and SIGKILL (default 20)",
    )
    launch.add_argument("command", nargs=argparse.REMAINDER, help="the engine command, after --")
    _add_registration_flags(launch)
    launch.set_defaults(func=_cmd_launch)

    dereg = commands.add_parser("deregister", help="remove an engine's record by id")
    dereg.add_argument("engine_id")
    _add_settings_flags(dereg)
    dereg.set_defaults(func=_cmd_deregister)

    lst = commands.add_parser("list", help="print the live engines")
    lst.add_argument("--format", choices=("table", "json"), default="table")
    _add_settings_flags(lst)
    lst.set_defaults(func=_cmd_list)

    watch = commands.add_parser("watch", help="print one line per change until signalled")
    watch.add_argument("--format", choices=("text", "jsonl"), default="text")
    watch.add_argument("--selector", action="append", default=[], metavar="KEY=VALUE")
    _add_settings_flags(watch)
    _add_metrics_flags(watch)
    watch.set_defaults(func=_cmd_watch)

    demo = commands.add_parser("demo", help="run the end-to-end demo (embedded etcd if none)")
    demo.add_argument("--engines", type=int, default=3)
    demo.add_argument("--ttl", type=float, default=3.0)
    _add_settings_flags(demo)
    _add_metrics_flags(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo  # noqa: PLC0415 - the demo imports the embedded launcher

    return run_demo(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``discovery`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _setup_logging(args)
        return int(args.func(args))
    except UsageError as exc:
        print(f"discovery {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidRecordError, ConfigurationError) as exc:
        print(f"discovery {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DiscoveryError as exc:
        print(f"discovery {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
