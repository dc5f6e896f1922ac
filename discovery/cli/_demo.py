"""``discovery demo``: engines come and go, the routing table follows.

Starts an embedded etcd unless one is configured, starts a few stand-in engines each under
its own ``discovery launch`` (the engine announces itself with Megatron's ready message and
the launcher registers it), shows the live table, freezes one engine (SIGSTOP: its
launcher marks it ``stalled``, a router skips it, SIGCONT brings it back), picks a
prefill/decode pair (the engines play Megatron's roles) and a short prompt's aggregated
engine alone, kills one
launcher hard (SIGKILL: removed when its lease expires), stops one gracefully (SIGTERM: its
lease is revoked at once) and kills one engine process (its launcher revokes at once),
prints each removal's measured delay, and leaves nothing running.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from discovery import (
    EndpointEvent,
    EngineEventReceiver,
    EngineStatus,
    EventType,
    NoEngineAvailableError,
    PrefixCachingCoordinatorPolicy,
    Router,
    RoutingSnapshot,
    RoutingTable,
    Settings,
    watch_table,
)
from discovery.testing.stand_in_engine import default_endpoint, nested_ready

from ._args import (
    UsageError,
    etcd_configured,
    metrics_from_args,
    settings_argv,
    settings_from_args,
)
from ._commands import format_event

_POLICIES = tuple(PrefixCachingCoordinatorPolicy)
_START_TIMEOUT = 30.0
_STALL_TIMEOUT = 2.0
_PICKS = 30
_ROLES = ("aggregated", "prefill", "decode")
# One model's KV layout on every prefill and decode engine (tensor-parallel sizes may differ).
_LAYOUT = "pp_size=1,num_layers_global=32,num_kv_heads_global=8,head_dim=128,dtype=bfloat16"


def _say(started: float, text: str) -> None:
    # One write per line: the table's listener thread says things too.
    sys.stdout.write(f"[{time.monotonic() - started:6.2f}s] {text}\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _etcd(args: argparse.Namespace, started: float) -> Iterator[Settings]:
    if etcd_configured(args):
        settings = settings_from_args(args)
        _say(started, f"using etcd at {', '.join(settings.endpoints)}")
        yield settings
        return
    from discovery.testing.embedded import EtcdCluster  # noqa: PLC0415 - only the demo needs it

    with EtcdCluster(1) as cluster:
        _say(started, f"no etcd configured: started an embedded etcd at {cluster.endpoints[0]}")
        yield dataclasses.replace(settings_from_args(args), endpoints=cluster.endpoints)


def _engine_command(index: int, settings: Settings, ttl: float) -> list[str]:
    ready = default_endpoint(
        f"tcp://10.0.0.{index + 1}:5555",
        total_kv_blocks=4096 * (index + 1),
        max_num_seqs=64 * (index + 1),
        prefix_caching_coordinator_policy=_POLICIES[index % len(_POLICIES)],
    )
    role = _ROLES[index % len(_ROLES)]
    handoff: list[str] = []
    if role != "aggregated":
        # Megatron's engine service names its role in the nested ready message; the
        # backend and layout, which it does not announce, come from the launcher's flags.
        ready = nested_ready(ready, role)
        layout = f"tp_size={index % 2 + 1},{_LAYOUT}"
        handoff = ["--kv-transfer-backend", "nixl", "--kv-layout", layout]
    return [
        sys.executable, "-m", "discovery", "launch",
        "--engine-id", f"demo-engine-{index}",
        "--label", "model=llama-3-8b",
        *handoff,
        "--ttl", str(ttl),
        "--stall-timeout", str(_STALL_TIMEOUT),
        *settings_argv(settings),
        "--log-level", "WARNING",
        "--", sys.executable, "-m", "discovery.testing.stand_in_engine",
        "--dynamo-parent-event-address", "{event_address}",
        "--ready", json.dumps(ready),
    ]  # fmt: skip


def _engine_pid(launcher: subprocess.Popen[bytes]) -> int | None:
    """The pid of the engine a launcher started (Linux /proc), or None."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        for pid in children.split():
            if b"stand_in_engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    return None


def _describe_table(snapshot: RoutingSnapshot) -> str:
    names = ", ".join(sorted(snapshot)) or "(empty)"
    return f"table @rev {snapshot.revision}: {len(snapshot)} engines: {names}"


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    try:
        EngineEventReceiver.require_libraries()  # the engines run under discovery launch
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    started = time.monotonic()
    engines: list[subprocess.Popen[bytes]] = []
    removed: dict[str, float] = {}
    removed_cond = threading.Condition()
    if args.namespace is None:
        args.namespace = "demo"
    with _etcd(args, started) as settings:
        table = watch_table(settings, metrics=metrics_from_args(args))

        def show(events: Sequence[EndpointEvent], snapshot: RoutingSnapshot) -> None:
            for event in events:
                _say(started, format_event(event, "text"))
                if event.type is EventType.REMOVED:
                    with removed_cond:
                        removed[event.engine_id] = time.monotonic()
                        removed_cond.notify_all()
            _say(started, "  " + _describe_table(snapshot))

        table.subscribe(show)
        try:
            table.start()
            _say(started, f"watching {settings.keyspace.prefix}; starting {args.engines} engines")
            for index in range(args.engines):
                engines.append(subprocess.Popen(_engine_command(index, settings, args.ttl)))
            table.wait_until(lambda snap: len(snap) >= args.engines, timeout=_START_TIMEOUT)
            _print_inspection(settings, started)
            if len(engines) > 1:
                _show_a_stall(engines[1], "demo-engine-1", table, started)
            _show_a_pair(table, started)
            steps = [
                (
                    signal.SIGKILL,
                    False,
                    "its launcher, hard (no deregistration: the lease expires)",
                ),
                (signal.SIGTERM, False, "its launcher, gracefully (it revokes the lease)"),
                (signal.SIGKILL, True, "its engine process (the launcher revokes at once)"),
            ]
            for index, (sig, to_engine, how) in enumerate(steps[: len(engines)]):
                launcher = engines[index]
                pid = _engine_pid(launcher) if to_engine else launcher.pid
                if pid is None:
                    _say(started, f"cannot find demo-engine-{index}'s engine process: skipped")
                    continue
                _measure_removal(
                    launcher,
                    pid,
                    engine_id=f"demo-engine-{index}",
                    sig=sig,
                    how=how,
                    removed=removed,
                    cond=removed_cond,
                    started=started,
                    ttl=args.ttl,
                )
        finally:
            for process in engines:
                if process.poll() is None:
                    process.terminate()
            for process in engines:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
                if process.poll() is None:
                    process.kill()
                    process.wait()
            table.stop()
    _say(started, "demo finished: engines, watcher and embedded etcd stopped; nothing left running")
    return 0


def _picks(router: Router) -> str:
    picked: Counter[str] = Counter()
    for _ in range(_PICKS):
        with router.pick(list(range(16)), 16) as handle:
            picked[handle.engine_id] += 1
    return ", ".join(f"{engine_id} x{n}" for engine_id, n in sorted(picked.items()))


def _show_a_stall(
    launcher: subprocess.Popen[bytes], engine_id: str, table: RoutingTable, started: float
) -> None:
    """Freeze an engine: stalled and skipped within the stall timeout, back on SIGCONT."""
    pid = _engine_pid(launcher)
    if pid is None:
        _say(started, f"cannot find {engine_id}'s engine process: stall skipped")
        return
    router = Router(table, policy="round_robin")
    _say(started, f"{_PICKS} picks: {_picks(router)}")
    _say(started, f"sending SIGSTOP to {engine_id}'s engine: it hangs (a stuck collective)")
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        table.wait_until(
            lambda snap: snap[engine_id].status is EngineStatus.STALLED,
            timeout=_STALL_TIMEOUT + _START_TIMEOUT,
        )
        _say(
            started,
            f"{engine_id} stalled {time.monotonic() - frozen:.1f} s after SIGSTOP "
            f"(stall timeout {_STALL_TIMEOUT:g} s); {_PICKS} picks: {_picks(router)}",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    thawed = time.monotonic()
    table.wait_until(lambda snap: snap[engine_id].ready, timeout=_START_TIMEOUT)
    _say(
        started,
        f"{engine_id} ready again {time.monotonic() - thawed:.3f} s after SIGCONT; "
        f"{_PICKS} picks: {_picks(router)}",
    )


def _show_a_pair(table: RoutingTable, started: float) -> None:
    """A prefill engine and a decode engine that can hand off, and a short prompt alone."""
    router = Router(table)
    try:
        with router.pick_pair(list(range(1024)), 16) as pair:
            snapshot = table.snapshot()
            prefill, decode = (
                snapshot[h.engine_id] for h in (pair.prefill or pair.decode, pair.decode)
            )
            tp = [r.kv_layout.tp_size if r.kv_layout else "?" for r in (prefill, decode)]
            _say(
                started,
                f"a pair for a 1024-token prompt: {prefill.engine_id} ({prefill.role}) -> "
                f"{decode.engine_id} ({decode.role}): nixl, one model, TP {tp[0]} to TP "
                f"{tp[1]} (Megatron reshards)",
            )
        with router.pick_pair(list(range(16)), 16, allow_aggregated=True) as alone:
            _say(
                started,
                f"a 16-token prompt, aggregated engines allowed: {alone.decode.engine_id} "
                "alone (shorter than pick_pair's alone_below)",
            )
    except NoEngineAvailableError as exc:  # fewer than 3 engines: no pair to show
        _say(started, f"no pair: {exc}")


def _print_inspection(settings: Settings, started: float) -> None:
    try:
        from discovery.testing.embedded import find_binary  # noqa: PLC0415

        etcdctl = find_binary("etcdctl")
    except (ImportError, FileNotFoundError):
        etcdctl = "etcdctl"
    prefix = f"{settings.root}/{settings.namespace}/engines/"
    command = [etcdctl, "--endpoints", ",".join(settings.endpoints), "get", "--prefix", prefix]
    _say(started, "inspect the same keys with plain etcdctl (while the demo runs):")
    print("    " + shlex.join(command), flush=True)


def _measure_removal(
    launcher: subprocess.Popen[bytes],
    pid: int,
    *,
    engine_id: str,
    sig: signal.Signals,
    how: str,
    removed: dict[str, float],
    cond: threading.Condition,
    started: float,
    ttl: float,
) -> None:
    _say(started, f"sending {sig.name} to {engine_id}: {how}")
    sent = time.monotonic()
    os.kill(pid, sig)
    with cond:
        if not cond.wait_for(lambda: engine_id in removed, timeout=ttl + 10):
            raise TimeoutError(f"{engine_id} was not removed within {ttl + 10} s")
    delay = removed[engine_id] - sent
    _say(started, f"{engine_id} removed {delay:.3f} s after {sig.name} (lease TTL {ttl:g} s)")
    launcher.wait(10)
