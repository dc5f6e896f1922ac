"""Every flag of the ``discovery`` command, defined once; and what they build.

Commands (``_commands.py``) and the demo (``_demo.py``) take their flags from here; the
demo also turns settings back into flags for the engine launchers it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from discovery import (
    EngineRecord,
    EngineRole,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    InvalidRecordError,
    KeySpace,
    KvLayout,
    KvTransferBackend,
    Metrics,
    PrefixCachingCoordinatorPolicy,
    RecordDecodeError,
    Selector,
    Settings,
    Split,
    launch,
)

from ._logging import log_level

log = logging.getLogger("discovery.cli")


class UsageError(Exception):
    """Bad input on the command line; exits with status 2."""


# -- etcd settings ---------------------------------------------------------------------

# Settings field -> its flag; each flag's help names the DISCOVERY_* variable it overrides.
_SETTINGS_FLAGS = {
    "endpoints": ("--endpoints", "comma-separated etcd URLs ($DISCOVERY_ETCD_ENDPOINTS)"),
    "root": ("--root", "key root ($DISCOVERY_ROOT, default /inference/v1)"),
    "namespace": ("--namespace", "namespace ($DISCOVERY_NAMESPACE, default 'default')"),
    "dial_timeout": ("--dial-timeout", "seconds ($DISCOVERY_DIAL_TIMEOUT)"),
    "request_timeout": ("--request-timeout", "($DISCOVERY_REQUEST_TIMEOUT)"),
    "election_timeout": (
        "--election-timeout",
        "etcd's election timeout in seconds: when a watcher counts as stale "
        "($DISCOVERY_ELECTION_TIMEOUT, default 1)",
    ),
    "ca_cert": ("--ca-cert", "CA bundle file ($DISCOVERY_ETCD_CA_CERT)"),
    "cert": ("--cert", "client certificate file ($DISCOVERY_ETCD_CERT)"),
    "key": ("--key", "client key file ($DISCOVERY_ETCD_KEY)"),
    "username": ("--username", "etcd user ($DISCOVERY_ETCD_USERNAME)"),
    "password_file": (
        "--password-file",
        "file holding the etcd password ($DISCOVERY_ETCD_PASSWORD_FILE; "
        "or $DISCOVERY_ETCD_PASSWORD). Never given as a flag, so it stays out of ps.",
    ),
    "allow_insecure_auth": (
        "--allow-insecure-auth",
        "send the etcd password over http:// endpoints, unencrypted "
        "($DISCOVERY_ALLOW_INSECURE_AUTH; refused without it)",
    ),
    "member_sync": (
        "--no-member-sync",
        "keep the configured endpoints instead of following the cluster's membership: "
        "for an etcd gRPC proxy or a load balancer ($DISCOVERY_MEMBER_SYNC=0)",
    ),
    "member_sync_interval": (
        "--member-sync-interval",
        "seconds between refreshes of the endpoints from etcd's member list, 0: only after "
        "a failover ($DISCOVERY_MEMBER_SYNC_INTERVAL, default 5)",
    ),
}
_FLOAT_SETTINGS = ("dial_timeout", "request_timeout", "election_timeout", "member_sync_interval")
_SWITCH_SETTINGS = ("allow_insecure_auth",)
_OFF_SWITCH_SETTINGS = ("member_sync",)  # on by default: the flag turns it off


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """The etcd settings flags, and the logging flags every command takes."""
    group = parser.add_argument_group("etcd settings (flags win over DISCOVERY_* variables)")
    for name, (flag, text) in _SETTINGS_FLAGS.items():
        if name in _SWITCH_SETTINGS:  # absent: None, so $DISCOVERY_* decides
            group.add_argument(flag, help=text, action="store_true", default=None)
        elif name in _OFF_SWITCH_SETTINGS:
            group.add_argument(flag, help=text, action="store_false", default=None, dest=name)
        else:
            group.add_argument(flag, help=text, type=float if name in _FLOAT_SETTINGS else str)
    parser.add_argument(
        "--log-level", default="INFO", type=log_level, help="DEBUG, INFO, WARNING, ERROR"
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from DISCOVERY_* variables, overridden by the flags given."""
    overrides = {name: getattr(args, name, None) for name in _SETTINGS_FLAGS}
    if overrides["password_file"]:  # the flag wins over $DISCOVERY_ETCD_PASSWORD too
        environ = {k: v for k, v in os.environ.items() if k != "DISCOVERY_ETCD_PASSWORD"}
        return Settings.from_env(environ, **overrides)
    return Settings.from_env(**overrides)


def etcd_configured(args: argparse.Namespace) -> bool:
    """Whether the command line or $DISCOVERY_ETCD_ENDPOINTS names an etcd."""
    return bool(args.endpoints or os.environ.get("DISCOVERY_ETCD_ENDPOINTS"))


def settings_argv(settings: Settings) -> list[str]:
    """Flags that make another ``discovery`` process use ``settings`` (no password)."""
    argv = []
    for name, (flag, _) in _SETTINGS_FLAGS.items():
        value = getattr(settings, name)
        if name in _SWITCH_SETTINGS:
            argv += [flag] if value else []
        elif name in _OFF_SWITCH_SETTINGS:
            argv += [] if value else [flag]
        elif value is not None:
            argv += [flag, ",".join(value) if name == "endpoints" else str(value)]
    return argv


# -- metrics -----------------------------------------------------------------------------


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-addr."""
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


# -- an engine's endpoint and registration ------------------------------------------------

# The required integer capabilities, each a --flag (the others have their own flags).
_CAPABILITY_FLAGS = tuple(
    f.name
    for f in dataclasses.fields(InferenceEngineCapabilities)
    if f.default is dataclasses.MISSING and f.name != "enable_prefix_caching"
)


def add_endpoint_flags(parser: argparse.ArgumentParser) -> None:
    """--endpoint-file, or the coordinator address and one flag per capability."""
    parser.add_argument("--endpoint-file", help="JSON endpoint, same format as the stored value")
    parser.add_argument("--coordinator-address")
    for name in _CAPABILITY_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument("--logical-data-parallel-size", type=int, default=1)
    parser.add_argument(
        "--prefix-caching-coordinator-policy",
        choices=[p.value for p in PrefixCachingCoordinatorPolicy],
    )


def add_registration_flags(parser: argparse.ArgumentParser) -> None:
    """Engine id, TTL, labels and takeover: how an endpoint is registered."""
    parser.add_argument("--engine-id", help="default: {hostname}-{pid}-{random}")
    parser.add_argument("--ttl", type=float, default=10.0, help="lease TTL in seconds (default 10)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--replace", action="store_true", help="take over a live engine's id")
    add_weight_version_flag(parser, "the version of the weights the engine serves")
    add_handoff_flags(parser)
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="on the first SIGTERM/SIGINT mark the engine draining for S seconds, then "
        "revoke; a second signal revokes at once (default 0: revoke at once)",
    )


def add_handoff_flags(parser: argparse.ArgumentParser) -> None:
    """--role, --kv-transfer-backend and --kv-layout: what a prefill/decode hand-off needs."""
    group = parser.add_argument_group(
        "prefill/decode hand-off (which engines a router pairs; see docs/prefill-decode.md)"
    )
    group.add_argument(
        "--role",
        choices=[role.value for role in EngineRole],
        help="the engine's role (default aggregated; under launch, a role the engine's ready "
        "message names wins)",
    )
    group.add_argument(
        "--kv-transfer-backend",
        choices=[backend.value for backend in KvTransferBackend],
        help="how the engine's KV moves to or from its partner: the backend its launcher "
        "chose (Megatron's default is nixl)",
    )
    group.add_argument(
        "--kv-layout",
        type=_kv_layout,
        metavar="KEY=VALUE,...",
        help="the engine's KV layout: tp_size, pp_size, num_layers_global (attention layers), "
        "num_kv_heads_global (GQA: query groups), head_dim, dtype (bfloat16, float16, "
        "float32); optional num_ssm_layers_global, num_speculative_tokens (default 0)",
    )


def _kv_layout(text: str) -> KvLayout:
    try:
        return KvLayout.parse(text)
    except InvalidRecordError as exc:  # argparse would print "invalid value" alone
        raise argparse.ArgumentTypeError(str(exc)) from None


def handoff_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-off keyword arguments of ``register_engine`` given on the command line."""
    given = {
        "role": args.role,
        "kv_transfer_backend": args.kv_transfer_backend,
        "kv_layout": args.kv_layout,
    }
    return {name: value for name, value in given.items() if value is not None}


def add_weight_version_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """--weight-version V: a non-negative integer (the record checks its range)."""
    parser.add_argument("--weight-version", type=int, metavar="V", help=f"{text} (an integer >= 0)")


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The event socket, the timeouts and the engine command of ``discovery launch``."""
    defaults = inspect.signature(launch).parameters
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--event-host",
        help="address to bind the engine-event socket on, a random port (routable when rank "
        "zero is remote; default 127.0.0.1)",
    )
    where.add_argument(
        "--event-address",
        metavar="tcp://HOST:PORT",
        help="bind the engine-event socket on this fixed port instead, for engines another "
        "launcher starts (Slurm, Kubernetes): pass the same address to the engine",
    )
    relay = parser.add_mutually_exclusive_group()
    relay.add_argument(
        "--state-address",
        metavar="tcp://HOST:PORT",
        help="where to relay the engine's live state (cached blocks, load) to routers "
        "(default: the event host, a random port; PORT * for a random one)",
    )
    relay.add_argument(
        "--no-state-relay",
        dest="state_address",
        action="store_false",
        help="relay no engine state (routers then estimate it from their own traffic)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        help="seconds of silence after which an engine that sends progress heartbeats is "
        f"marked stalled (default {defaults['stall_timeout'].default:g}; 0: never)",
    )
    parser.add_argument(
        "--stall-action",
        default=defaults["stall_action"].default,
        help="mark: the record is stalled until the engine is heard from again (default); "
        "stop: deregister, stop the engine and exit 124 so a supervisor restarts it",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        help="stop the engine when no valid ready message came within this many seconds",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=20.0,
        help="seconds between the forwarded stop signal and SIGKILL (default 20)",
    )
    parser.add_argument(
        "engine_command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the engine command, after --",
    )


def parse_labels(pairs: Sequence[str]) -> dict[str, str]:
    """``--label key=value`` pairs as a dict."""
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--label {pair!r} must look like key=value")
        labels[key] = value
    return labels


def add_selector_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """--selector: a label selector in Kubernetes' syntax, repeatable (all must hold)."""
    parser.add_argument(
        "--selector",
        action="append",
        default=[],
        metavar="SELECTOR",
        help=f"{what} the engines this label selector matches, in Kubernetes' syntax: "
        "'model=m', 'env in (a,b)', 'tier notin (x)', 'zone!=z', 'gpu', '!canary', comma-"
        "separated or the flag repeated (all must hold)",
    )


def add_split_flag(parser: argparse.ArgumentParser) -> None:
    """--split SELECTOR:WEIGHT, repeatable: a router's weighted split, to show."""
    parser.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="SELECTOR:WEIGHT",
        help="a group of a weighted split ('track=stable:95' '--split track=canary:5'): "
        "shows each group's share and candidates, as a router with this split draws them",
    )


def split_from_args(args: argparse.Namespace) -> Split | None:
    """The --split flags as a Split (None without any); UsageError naming a bad one."""
    groups = []
    for text in args.split:
        group, colon, weight = text.rpartition(":")
        try:
            if not colon:
                raise ValueError("no ':WEIGHT'")
            groups.append((Selector.parse(group), float(weight)))
        except ValueError as exc:
            raise UsageError(
                f"--split {text!r}: {exc} (SELECTOR:WEIGHT, e.g. 'track=canary:5')"
            ) from None
    try:
        return Split(groups) if groups else None
    except ValueError as exc:
        raise UsageError(f"--split: {exc}") from None


def selector_from_args(args: argparse.Namespace) -> Selector:
    """The --selector flags as one Selector (InvalidSelectorError, exit 2, if malformed)."""
    selector = Selector()
    for text in args.selector:
        selector &= Selector.parse(text)
    return selector


def endpoint_from_args(
    args: argparse.Namespace,
) -> tuple[InferenceEngineEndpoint | _FileEndpoint, dict[str, Any]]:
    """The endpoint and the metadata (engine_id, labels) found in the file, if any.

    An endpoint file's keys this version does not know (top level, and inside
    ``capabilities``) are registered too, as the library keeps them (``endpoint_parts``).
    """
    if args.endpoint_file:
        return _endpoint_from_file(args.endpoint_file)
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


@dataclasses.dataclass(frozen=True)
class _FileEndpoint:
    """An endpoint file's record with Megatron's ``to_dict()``: its unknown keys are kept."""

    record: EngineRecord

    def to_dict(self) -> dict[str, Any]:
        """The file's endpoint with the keys this version does not know."""
        value = self.record.endpoint.to_dict()
        value["capabilities"].update(self.record.extra_capabilities)
        return {**value, **self.record.extra}


def _endpoint_from_file(path: str) -> tuple[_FileEndpoint, dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except OSError as exc:
        raise UsageError(f"--endpoint-file: cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"--endpoint-file {path!r} is not JSON: {exc}") from None
    # Read as a stored value is (every problem named, unknown keys kept): the record's
    # engine_id and labels are used, its other metadata is the registration's to write.
    engine_id = value.get("engine_id") if isinstance(value, dict) else None
    keys = KeySpace()
    try:
        key = keys.key(engine_id if isinstance(engine_id, str) else "endpoint-file")
        record = keys.decode(key, json.dumps(value).encode())
    except RecordDecodeError as exc:
        raise UsageError(f"--endpoint-file: {exc.reason}") from None
    except InvalidRecordError as exc:
        raise UsageError(f"--endpoint-file: {exc}") from None
    meta: dict[str, Any] = {"labels": dict(record.labels)}
    if engine_id is not None:
        meta["engine_id"] = record.engine_id
    return _FileEndpoint(record), meta
