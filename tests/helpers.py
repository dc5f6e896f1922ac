"""Shared test helpers: condition waits (never sleeps), sample records, subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from discovery import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
    Settings,
)
from discovery._connection import Connection
from discovery.embedded import EtcdCluster, EtcdMember

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, message: str = "condition", interval=0.02
) -> T:
    """Poll ``condition`` until it returns a truthy value; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)


# Megatron's InferenceEngineCapabilities fields, in order (wire_contract.md); restated
# here, not imported from the package, so the tests check the package against the contract.
MEGATRON_FIELDS = (
    "context_length",
    "kv_cache_block_size",
    "total_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "bos_token_id",
    "enable_prefix_caching",
    "logical_data_parallel_size",
    "prefix_caching_coordinator_policy",
)
INTEGER_FIELDS = (*MEGATRON_FIELDS[:6], "logical_data_parallel_size")
POSITIVE_FIELDS = (
    "context_length",
    "kv_cache_block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "logical_data_parallel_size",
)


def caps_kwargs(**overrides) -> dict:
    """The seven required capability fields of a plausible engine, plus overrides."""
    values = dict(
        context_length=8192,
        kv_cache_block_size=256,
        total_kv_blocks=1000,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        bos_token_id=1,
        enable_prefix_caching=True,
    )
    values.update(overrides)
    return values


FIRST_BLOCK = PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK


def make_endpoint(
    index: int = 0, policy: PrefixCachingCoordinatorPolicy | None = FIRST_BLOCK, **overrides
) -> InferenceEngineEndpoint:
    """Engine number ``index``: its own address and block count."""
    caps = caps_kwargs(
        total_kv_blocks=1000 + index,
        max_num_batched_tokens=8192,
        prefix_caching_coordinator_policy=policy,
    )
    caps.update(overrides)
    address = f"tcp://10.1.{index // 250}.{index % 250}:5555"
    return InferenceEngineEndpoint(address, InferenceEngineCapabilities(**caps))


def cli_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    env.update(
        DISCOVERY_ETCD_ENDPOINTS=",".join(settings.endpoints),
        DISCOVERY_ROOT=settings.root,
        DISCOVERY_NAMESPACE=settings.namespace,
    )
    return env


def run_cli(settings: Settings, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "discovery", *args],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Registrar:
    """A ``discovery register`` subprocess, stopped by pid at the end of the test."""

    def __init__(self, settings: Settings, engine_id: str, ttl: float = 3.0, extra=()) -> None:
        self.engine_id = engine_id
        # A file, not a pipe: a chatty child must never block on a full pipe.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "discovery",
                "register",
                "--engine-id",
                engine_id,
                "--coordinator-address",
                f"tcp://{engine_id}:5555",
                "--context-length",
                "4096",
                "--kv-cache-block-size",
                "128",
                "--total-kv-blocks",
                "100",
                "--max-num-seqs",
                "16",
                "--max-num-batched-tokens",
                "4096",
                "--bos-token-id",
                "1",
                "--ttl",
                str(ttl),
                *extra,
            ],
            env=cli_env(settings),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        return self.process.wait(timeout)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._log.close()


def etcdctl(endpoints: Sequence[str], *args: str) -> subprocess.CompletedProcess:
    from discovery.embedded import find_binary  # noqa: PLC0415

    return subprocess.run(
        [find_binary("etcdctl"), "--endpoints", ",".join(endpoints), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "ETCDCTL_API": "3"},
    )


def connected_member(cluster: EtcdCluster, conn: Connection) -> EtcdMember:
    """The member that ``conn`` is talking to now."""
    in_use = conn.member_in_use
    return next(m for m in cluster.members if m.client_url.endswith(in_use))


def raw_call(conn: Connection, op: Callable[[Any], T], timeout: float | None = None) -> T:
    """Run ``op`` on the adapter's python3-etcd3 client (puts, compaction: what the tests
    do to etcd behind the package's back), with the adapter's retries."""
    return conn.call(lambda: conn._attempt(op), timeout=timeout)


def get_kv(endpoints: Sequence[str], key: str) -> dict | None:
    """The key's JSON view from etcdctl (value decoded), or None when absent."""
    import base64  # noqa: PLC0415

    # A read fails while a cluster elects a leader: retry it, within a deadline.
    result = wait_for(
        lambda: (r := etcdctl(endpoints, "get", key, "-w", "json")).returncode == 0 and r,
        timeout=10,
        message=f"etcdctl get {key}",
    )
    kvs = json.loads(result.stdout).get("kvs") or []
    if not kvs:
        return None
    kv = kvs[0]
    kv["key"] = base64.b64decode(kv["key"]).decode()
    kv["value"] = base64.b64decode(kv["value"]).decode()
    return kv


def run_python(code: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str, str]:
    """Run ``code`` in a fresh interpreter; on a hang, fail with every thread's stack."""
    process = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # faulthandler prints all threads, then it dies
        out, err = process.communicate()
        raise AssertionError(f"hung for {timeout} s; threads:\n{err[-6000:]}") from None
    return process.returncode, out, err


def stall(cluster: EtcdCluster, seconds: float) -> None:
    """SIGSTOP the cluster's first member for ``seconds`` (a fault under test: a stall)."""
    process = cluster.members[0].process
    process.send_signal(signal.SIGSTOP)
    try:
        stalled = time.monotonic()
        wait_for(
            lambda: time.monotonic() - stalled >= seconds, timeout=seconds + 1, message="the stall"
        )
    finally:
        process.send_signal(signal.SIGCONT)


def losses_after_a_mass_loss(cluster: EtcdCluster, regs: Sequence[Any], ttl: float) -> Counter:
    """Stall etcd past ``ttl`` so every lease of ``regs`` is lost; wait until all are
    registered again, then two more TTLs (a second loss would be a cascade); return how
    many registrations were lost how many times. The deadlines only bound a hang, on a
    loaded machine: how fast it settles is for bench/bench_sessions.py."""
    from discovery import RegistrationState  # noqa: PLC0415

    stall(cluster, ttl + 1)
    wait_for(lambda: all(r.health().losses >= 1 for r in regs), timeout=60, message="losses")
    wait_for(
        lambda: all(r.state is RegistrationState.REGISTERED for r in regs),
        timeout=120,
        message="all registered again",
    )
    settled = time.monotonic()
    wait_for(lambda: time.monotonic() - settled > 2 * ttl, timeout=60, message="two TTLs")
    return Counter(r.health().losses for r in regs)
