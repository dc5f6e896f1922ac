"""deploy/compose end to end with Docker: deploy/README.md's quick start, command by command.

The commands are read from section 1 of deploy/README.md and run as written, with bash,
in a copy of the checkout (certificates, passwords and wheels land in a temporary
directory), under a Compose project name and a published port of the test's own.
``docker compose`` is Compose v2 where the docker CLI has it, else Debian's
``docker-compose`` 1.29 (a shell function stands in for ``docker compose``); the compose
file must work with both. After each command the test checks what the README says it
does, reading the router's table from ``docker compose logs -f router``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from discovery.testing.embedded import _free_ports, find_binary

from .deploy_checks import PREFIX, roles_let_through
from .helpers import wait_for

# The test's own bounds add up to more than pytest's default 300 s: `up -d` alone may wait
# for etcd 3 x 120 s (compose.yaml's etcd-roles), the router's table 240 s.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
README = REPO / "deploy" / "README.md"
TTL = 10  # the engines' --ttl in compose.yaml
ENGINES = {"engine-a", "engine-b"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LIST = "docker compose run --rm --no-deps router discovery list"
ETCDCTL = "etcdctl --endpoints"
# What the quick start brings up, from nothing, on a loaded 2-core machine.
UP_TIMEOUT = 240
MEMBERS = ("etcd-0", "etcd-1", "etcd-2")


def quick_start() -> list[str]:
    """The shell commands of deploy/README.md section 1, in order, continuation lines joined."""
    text = README.read_text()
    section = text[text.index("## 1. Try it") : text.index("## 2. Kubernetes")]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        commands += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return commands


def bare(command: str) -> str:
    """A command without its comment and with single spaces, to recognise it."""
    return " ".join(re.sub(r"\s+#\s.*$", "", command).split())


def compose_cli() -> str:
    """Shell text that makes ``docker compose`` work: v2 as it is, else docker-compose."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return ""
    if not shutil.which("docker-compose"):
        pytest.fail("neither `docker compose` (v2) nor docker-compose (v1.29) is installed")
    return (
        'docker() { if [ "$1" = compose ]; then shift; docker-compose "$@"; '
        'else command docker "$@"; fi; }\n'
    )


class Router:
    """The router's table, from the JSON lines of ``docker compose logs -f router``."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            # "router-1  | {...}" (v2) or "router_1  | {...}" (v1, coloured even in a pipe)
            _, bar, payload = ANSI.sub("", line).partition("| {")
            if bar:
                with self._lock:
                    self.events.append(json.loads("{" + payload))

    def table(self) -> set[str]:
        """Engine ids listed now."""
        listed: set[str] = set()
        with self._lock:
            for event in self.events:
                if event["type"] == "removed":
                    listed.discard(event["engine_id"])
                else:
                    listed.add(event["engine_id"])
        return listed

    def removals(self) -> list[dict]:
        """The ``removed`` events so far, in order."""
        with self._lock:
            return [e for e in self.events if e["type"] == "removed"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Demo:
    """The quick start's shell: a copy of the checkout, the test's project name and port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cwd = root
        self.project = f"discovery-test-{os.getpid()}"
        self.port = _free_ports(1)[0]
        self.prelude = compose_cli()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("DISCOVERY_", "ETCDCTL_"))},
            "COMPOSE_PROJECT_NAME": self.project,
            "DEMO_ETCD_PORT": str(self.port),
            "PATH": f"{Path(find_binary('etcdctl')).parent}{os.pathsep}{os.environ['PATH']}",
        }
        self.router: Router | None = None

    def popen(self, command: str) -> subprocess.Popen[str]:
        # etcdctl's --user root takes the password from ETCDCTL_PASSWORD (README).
        root = self.root / "deploy" / "compose" / "secrets" / "root"
        if root.exists():
            self.env["ETCDCTL_PASSWORD"] = root.read_text().strip()
        return subprocess.Popen(
            ["bash", "-c", self.prelude + command],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def follow_router(self, command: str) -> None:
        """Start ``docker compose logs -f router``; it runs until the test ends."""
        self.router = Router(self.popen(command))

    def table(self) -> set[str]:
        assert self.router is not None
        return self.router.table()

    def removals(self) -> list[dict]:
        assert self.router is not None
        return self.router.removals()

    def run(self, command: str, timeout: float = 450) -> str:
        """Run a command to its end; fail the test on a non-zero status. Its output."""
        process = self.popen(command)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            pytest.fail(f"`{command}` did not finish in {timeout} s:\n{out}\n{self.diagnosis()}")
        if process.returncode != 0:
            pytest.fail(f"`{command}` exited {process.returncode}:\n{out}\n{self.diagnosis()}")
        return out

    def diagnosis(self) -> str:
        """The etcd members' states and health checks and the setup's logs, for a failure."""
        lines = []
        for service in MEMBERS:
            ids = self.popen(f"docker compose ps -aq {service}").communicate(timeout=60)[0]
            for container in ids.split():
                inspected = subprocess.run(
                    ["docker", "inspect", container], capture_output=True, text=True, check=False
                ).stdout
                found = json.loads(inspected)[0] if inspected.strip() else {}
                state = found.get("State", {})
                health = state.get("Health") or {}
                lines.append(
                    f"{service}: {state.get('Status')}, started {state.get('StartedAt')}, "
                    f"{found.get('RestartCount')} restarts, health {health.get('Status')} "
                    f"(failing streak {health.get('FailingStreak')})"
                )
                for probe in health.get("Log") or []:
                    output = probe["Output"].strip().replace("\n", " | ")
                    lines.append(f"  {probe['Start']} exit {probe['ExitCode']}: {output}")
        services = " ".join([*MEMBERS, "etcd-roles"])
        logs = self.popen(f"docker compose logs --no-color --timestamps --tail 40 {services}")
        out = logs.communicate(timeout=60)[0]
        return "\n".join([*lines, out])

    def container(self, service: str) -> dict:
        """docker inspect of the service's container."""
        ids = self.run(f"docker compose ps -aq {service}").split()  # -a: v2 lists running ones only
        assert len(ids) == 1, ids
        out = subprocess.run(
            ["docker", "inspect", ids[0]], capture_output=True, text=True, check=True
        ).stdout
        return json.loads(out)[0]

    def listed(self) -> set[str]:
        """The engines ``discovery list`` shows, run as the router user."""
        out = self.run(LIST)
        return {line.split()[0] for line in out.splitlines() if line.startswith("engine-")}

    def etcdctl_as(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        """etcdctl from the host as ``user`` (root, or an engine / router user)."""
        certs = self.root / "deploy" / "certs" / "out"
        client = "admin" if user == "root" else user.split("-", maxsplit=1)[0]
        password = (self.root / "deploy" / "compose" / "secrets" / user).read_text().strip()
        command = [find_binary("etcdctl"), "--endpoints", f"https://127.0.0.1:{self.port}"]
        command += ["--cacert", str(certs / "ca.pem"), "--cert", str(certs / f"{client}.pem")]
        command += ["--key", str(certs / f"{client}-key.pem"), "--dial-timeout", "5s"]
        env = {**self.env, "ETCDCTL_USER": user, "ETCDCTL_PASSWORD": password}
        return subprocess.run(
            [*command, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    def left_behind(self) -> list[str]:
        """Containers, networks and volumes of the project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        left = []
        for kind in ("container ls -a", "network ls", "volume ls"):
            out = subprocess.run(
                ["docker", *kind.split(), "-q", "--filter", label],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            left += [f"{kind.split()[0]} {name}" for name in out.split()]
        return left

    def down(self) -> None:
        """Whatever happened: the project's containers, networks and volumes go."""
        if self.router is not None:
            self.router.stop()
        subprocess.run(
            ["bash", "-c", self.prelude + "docker compose down -v --remove-orphans -t 5"],
            cwd=self.root / "deploy" / "compose",
            env=self.env,
            capture_output=True,
            timeout=300,
            check=False,
        )


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """A copy of what a fresh checkout has that the quick start uses."""
    root = tmp_path / "checkout"
    generated = shutil.ignore_patterns("out", "secrets", "__pycache__")
    shutil.copytree(REPO / "deploy", root / "deploy", ignore=generated)
    shutil.copytree(REPO / "discovery", root / "discovery", ignore=generated)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    demo = Demo(root)
    try:
        yield demo
    finally:
        demo.down()
    assert demo.left_behind() == []


def test_the_quick_start_runs_as_documented(demo: Demo) -> None:
    outputs: dict[str, str] = {}  # recognised command -> its output

    def both_engines_listed() -> None:
        wait_for(lambda: demo.table() == ENGINES, UP_TIMEOUT, "both engines in the table")

    def clean_stop_removes_it() -> None:
        # SIGTERM: `discovery register` revoked its lease and exited 0, so the record is
        # gone at once, well within the TTL bound.
        assert demo.container("engine-b")["State"]["ExitCode"] == 0
        wait_for(lambda: "engine-b" not in demo.table(), TTL, "engine-b removed")

    def back(engine: str) -> Callable[[], None]:
        return lambda: wait_for(lambda: engine in demo.table(), 60, f"{engine} added again")

    def crash_expires_with_the_lease() -> None:
        assert demo.container("engine-a")["State"]["ExitCode"] == 137
        # No revoke: etcd expires the lease within the TTL (plus its expiry sweep).
        wait_for(lambda: "engine-a" not in demo.table(), TTL + 5, "engine-a expired")

    def listed_by_the_router_user() -> None:
        assert "(2 engines)" in outputs[LIST], outputs[LIST]

    def a_member_down_keeps_both_engines() -> None:
        removals = demo.removals()
        # Longer than the TTL: the engines' keepalives reach the other two members.
        until = time.monotonic() + 1.5 * TTL
        while time.monotonic() < until:
            now = demo.removals()
            if now != removals:
                logs = demo.run("docker compose logs --no-color --tail 40 engine-a engine-b router")
                pytest.fail(f"removed with a member down: {now[len(removals) :]}\n{logs}")
            time.sleep(0.2)
        assert demo.table() == ENGINES

    def member_back() -> None:
        health = lambda: demo.container("etcd-0")["State"]["Health"]["Status"]  # noqa: E731
        wait_for(lambda: health() == "healthy", 90, "etcd-0 healthy again", interval=1)

    def keys_and_roles() -> None:
        keys = {PREFIX.format(ns="default") + e for e in ENGINES}
        assert set(outputs[ETCDCTL].split()) == keys
        got = demo.etcdctl_as("root", "get", PREFIX.format(ns="default") + "engine-a", "-w=json")
        lease = format(json.loads(got.stdout)["kvs"][0]["lease"], "x")
        assert roles_let_through(demo.etcdctl_as, "default", "other", lease) == []
        assert demo.listed() == ENGINES  # the refused revoke left engine-a alone

    def nothing_left() -> None:
        assert demo.left_behind() == []

    checks: dict[str, Callable[[], None]] = {
        "docker compose logs -f router": both_engines_listed,
        "docker compose stop engine-b": clean_stop_removes_it,
        "docker compose start engine-b": back("engine-b"),
        "docker compose kill -s KILL engine-a": crash_expires_with_the_lease,
        "docker compose up -d engine-a": back("engine-a"),
        LIST: listed_by_the_router_user,
        "docker compose kill etcd-0": a_member_down_keeps_both_engines,
        "docker compose start etcd-0": member_back,
        ETCDCTL: keys_and_roles,
        "docker compose down -v": nothing_left,
    }
    checked = []
    for command in quick_start():
        key = next((k for k in checks if bare(command).startswith(k)), bare(command))
        if key.startswith("cd "):
            demo.cwd = demo.cwd / key.removeprefix("cd ")
        elif key == "docker compose logs -f router":
            demo.follow_router(command)
        else:
            outputs[key] = demo.run(command)
        if key in checks:
            checks[key]()
            checked.append(key)
    assert checked == list(checks), "deploy/README.md section 1 lost a command this test checks"
