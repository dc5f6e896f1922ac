"""Shared test helpers: condition waits (never sleeps), sample records, subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

from discovery import (
    EndpointEvent,
    EtcdPort,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    KvLayout,
    PrefixCachingCoordinatorPolicy,
    Settings,
)
from discovery._etcd.connection import Connection
from discovery.testing.embedded import EtcdCluster, EtcdMember

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


def make_layout(**overrides: Any) -> KvLayout:
    """A plausible engine's KV layout (a 32-layer GQA model on TP 2); ``overrides`` win."""
    values: dict[str, Any] = {
        "tp_size": 2,
        "pp_size": 1,
        "num_layers_global": 32,
        "num_kv_heads_global": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
    }
    values.update(overrides)
    return KvLayout(**values)


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


class ChildLog:
    """A file that child processes write their output to, read by the test while they run.

    A file, not a pipe: a chatty child must never block on a full pipe. Read with
    ``pread``, which leaves alone the file offset the children write at: a seek to the
    start let a child's line land over earlier lines (it lost the launcher's "engine
    started" line once in CI).
    """

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()

    def read(self) -> str:
        fd = self.file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        self.file.close()


class Registrar:
    """A ``discovery register`` subprocess, stopped by pid at the end of the test.

    Its record's coordinator address is ``tcp://{engine_id}:5555`` unless
    ``coordinator_address`` is given; ``env`` adds variables to its environment.
    """

    def __init__(
        self,
        settings: Settings,
        engine_id: str,
        ttl: float = 3.0,
        extra=(),
        *,
        coordinator_address: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self._log = ChildLog()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-X",
                "faulthandler",  # a hang shows every thread's stack (see wait)
                "-m",
                "discovery",
                "register",
                "--engine-id",
                engine_id,
                "--coordinator-address",
                coordinator_address or f"tcp://{engine_id}:5555",
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
            env={**cli_env(settings), **(env or {})},
            stdout=self._log.file,
            stderr=subprocess.STDOUT,
        )

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit status; on a hang, fail with the output and every thread's stack."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)  # faulthandler prints all threads
            self.process.wait(10)
            raise AssertionError(
                f"{self.engine_id} still running {timeout} s later:\n{self.output()[-8000:]}"
            ) from None

    def output(self) -> str:
        return self._log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._log.close()


# The stand-in engine (discovery/testing/stand_in_engine.py) as ``discovery launch``'s COMMAND.
STAND_IN = [
    sys.executable,
    "-m",
    "discovery.testing.stand_in_engine",
    "--dynamo-parent-event-address",
    "{event_address}",
]


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its new parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


class Launcher:
    """A ``discovery launch`` process; everything it started is killed by pid at the end.

    ``env`` adds variables to its environment; ``wrapper`` is a command prefix it runs
    under (``ip netns exec NAME``: it execs, so the process is still the launcher).
    """

    def __init__(
        self,
        settings: Settings,
        engine_id: str,
        command: list[str],
        *flags: str,
        env: Mapping[str, str] | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.engine_id = engine_id
        self.key = settings.keyspace.key(engine_id)
        self._log = ChildLog()
        launch = [sys.executable, "-m", "discovery", "launch", "--engine-id", engine_id, *flags]
        self.process = subprocess.Popen(
            [*wrapper, *launch, "--", *command],
            env={**cli_env(settings), **(env or {})},
            stdout=self._log.file,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self._log.read()

    def child_pid(self, timeout: float = 10.0) -> int:
        found = wait_for(
            lambda: re.search(r"engine started: pid (\d+)", self.output()),
            timeout=timeout,
            message="the launcher's 'engine started' line",
        )
        return int(found.group(1))

    def guard_pid(self) -> int:
        """The guard process: the launcher's child that runs guard.py."""
        launcher = self.process.pid

        def find() -> int | None:
            for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
                with contextlib.suppress(FileNotFoundError):  # a child that just ended
                    if "guard.py" in Path(f"/proc/{child}/cmdline").read_text():
                        return int(child)
            return None

        return wait_for(find, message="the guard process")

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        pids = [int(p) for p in re.findall(r"engine started: pid (\d+)", self.output())]
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for pid in pids:  # the engine's group, in case the test failed before it ended
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)  # a frozen group dies of SIGKILL all the same
                os.killpg(pid, signal.SIGKILL)
        self._log.close()


def etcdctl(endpoints: Sequence[str], *args: str) -> subprocess.CompletedProcess:
    from discovery.testing.embedded import find_binary  # noqa: PLC0415

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


class WatchLog:
    """Every event of an EndpointWatcher, with the monotonic time it arrived."""

    def __init__(self, settings: Settings, connection: EtcdPort | None = None) -> None:
        from discovery import EndpointWatcher  # noqa: PLC0415

        self._cond = threading.Condition()
        self.events: list[tuple[float, EndpointEvent]] = []
        self.watcher = EndpointWatcher(settings, connection=connection).start()
        self.watcher.subscribe(self._add)

    def _add(self, event: EndpointEvent) -> None:
        with self._cond:
            self.events.append((time.monotonic(), event))
            self._cond.notify_all()

    def kinds(self, engine_id: str) -> list[str]:
        with self._cond:
            return [e.type.value for _, e in self.events if e.engine_id == engine_id]

    def wait(self, engine_id: str, kind: str, timeout: float = 10.0) -> tuple[float, EndpointEvent]:
        """The first ``kind`` event of ``engine_id``: (arrival time, event)."""

        def found() -> tuple[float, EndpointEvent] | None:
            return next(
                (
                    (at, e)
                    for at, e in self.events
                    if e.engine_id == engine_id and e.type.value == kind
                ),
                None,
            )

        with self._cond:
            if not self._cond.wait_for(found, timeout):
                raise AssertionError(f"no {kind} event for {engine_id} within {timeout} s")
            return found()

    def stop(self) -> None:
        self.watcher.stop()


class TcpForwarder:
    """A TCP relay from a local port to ``target`` that records what crosses the wire.

    What a sniffer between the client and etcd would see: ``sent()`` is every byte the
    clients sent towards ``target``, ``connections`` how many connections were made.
    ``close()`` (or leaving the ``with`` block) ends every connection and thread.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self._closed = False
        self._sent = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def sent(self) -> bytes:
        with self._lock:
            return bytes(self._sent)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self.connections += 1
                self._sockets += [client, upstream]
                pumps = [
                    threading.Thread(target=self._pump, args=args, daemon=True)
                    for args in ((client, upstream, True), (upstream, client, False))
                ]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    with self._lock:
                        self._sent += data
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # a side closed: the other pump ends too

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):  # already closed by its peer
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() or recv()
            sock.close()
        for thread in threads:
            thread.join(10)
        assert not any(t.is_alive() for t in threads), "forwarder thread left running"

    def __enter__(self) -> TcpForwarder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


class RankZero:
    """Megatron's side of the engine-event socket, as its EngineEventReporter sets it up."""

    def __init__(self, address: str) -> None:
        import zmq  # noqa: PLC0415 - the launch extra

        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, kind: str, payload: object) -> None:
        import msgpack  # noqa: PLC0415

        self.sock.send(msgpack.packb([kind, payload], use_bin_type=True))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def close(self) -> None:
        self.sock.close()
        self.context.term()


def fake_engine(
    *,
    max_sequence_length: Any = 8192,
    block_size_tokens: Any = 256,
    pool_size: Any = 1001,
    max_requests: Any = 64,
    max_tokens: Any = 4096,
    enable_prefix_caching: Any = True,
    policy: Any = None,
    tokenizer: Any = None,
) -> SimpleNamespace:
    """What ``from_engine`` reads of Megatron's ``DynamicInferenceEngine``."""
    context = SimpleNamespace(
        max_sequence_length=max_sequence_length,
        block_size_tokens=block_size_tokens,
        kv_block_allocator=SimpleNamespace(pool_size=pool_size),
        max_requests=max_requests,
        max_tokens=max_tokens,
        enable_prefix_caching=enable_prefix_caching,
        config=SimpleNamespace(prefix_caching_coordinator_policy=policy),
    )
    if tokenizer is None:
        tokenizer = SimpleNamespace(bos=1)
    return SimpleNamespace(context=context, controller=SimpleNamespace(tokenizer=tokenizer))
