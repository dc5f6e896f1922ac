"""TLS, client certificates and etcd authentication against real etcd (issue 6)."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from discovery import (
    ConfigurationError,
    EndpointWatcher,
    EtcdUnavailableError,
    PermissionDeniedError,
    RegistrationState,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.embedded import EtcdCluster, ServerTLS

from .conftest import _checked_cluster
from .helpers import TcpForwarder, cli_env, make_endpoint, wait_for

# Every test runs an etcd of its own (TLS, auth, JWT), some the CLI too.
pytestmark = pytest.mark.external

SECRET = "s3cr3t-Marker-7f1c"  # a password no log, repr or message may ever show


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("discovery-client")
    files = Pki(
        *(
            base / name
            for name in (
                "ca.pem",
                "server.pem",
                "server.key",
                "client.pem",
                "client.key",
                "other-ca.pem",
            )
        )
    )
    ca.cert_pem.write_to_path(files.ca)
    server.cert_chain_pems[0].write_to_path(files.server_cert)
    server.private_key_pem.write_to_path(files.server_key)
    client.cert_chain_pems[0].write_to_path(files.client_cert)
    client.private_key_pem.write_to_path(files.client_key)
    other.cert_pem.write_to_path(files.other_ca)
    return files


@pytest.fixture
def etcd_tls(pki: Pki) -> Iterator[EtcdCluster]:
    tls = ServerTLS(
        ca_cert=str(pki.ca),
        cert=str(pki.server_cert),
        key=str(pki.server_key),
        client_cert_auth=True,
        client_cert=str(pki.client_cert),
        client_key=str(pki.client_key),
    )
    with _checked_cluster(EtcdCluster(1, tls=tls)) as cluster:
        yield cluster


def _tls_settings(cluster: EtcdCluster, pki: Pki, **overrides) -> Settings:
    values = dict(
        endpoints=cluster.endpoints,
        ca_cert=str(pki.ca),
        cert=str(pki.client_cert),
        key=str(pki.client_key),
        namespace="tls",
        dial_timeout=3,
    )
    values.update(overrides)
    return Settings(**values)


def test_tls_with_client_certificates(etcd_tls: EtcdCluster, pki: Pki) -> None:
    settings = _tls_settings(etcd_tls, pki)
    assert settings.endpoints[0].startswith("https://")
    with watch_table(settings) as table:
        with register_engine(make_endpoint(), engine_id="secure", ttl=5, settings=settings):
            table.wait_until(lambda snap: "secure" in snap, timeout=5)
        table.wait_until(lambda snap: "secure" not in snap, timeout=5)


def test_wrong_ca_is_refused_clearly_not_hung(etcd_tls: EtcdCluster, pki: Pki) -> None:
    settings = _tls_settings(etcd_tls, pki, ca_cert=str(pki.other_ca), dial_timeout=1)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="TLS failed") as caught:
        register_engine(make_endpoint(), settings=settings)
    assert time.monotonic() - started < 5
    assert "handshake" in str(caught.value).lower() or "certificate" in str(caught.value).lower()


def test_an_http_endpoint_against_a_tls_member_says_so(etcd_tls: EtcdCluster, pki: Pki) -> None:
    plain = etcd_tls.endpoints[0].replace("https://", "http://")
    settings = Settings(endpoints=[plain], namespace="tls", dial_timeout=1)
    with pytest.raises(EtcdUnavailableError) as caught:
        register_engine(make_endpoint(), settings=settings)
    assert f"{plain} answers with TLS, not plaintext: use https://" in str(caught.value)
    with pytest.raises(EtcdUnavailableError, match="answers with TLS"):
        EndpointWatcher(settings).start()


def test_missing_client_certificate_is_refused(etcd_tls: EtcdCluster, pki: Pki) -> None:
    settings = _tls_settings(etcd_tls, pki, cert=None, key=None, dial_timeout=1)
    with pytest.raises(EtcdUnavailableError):
        EndpointWatcher(settings).start()


# -- authentication and least privilege --------------------------------------------------


def _ctl(cluster: EtcdCluster, *args: str, user: str | None = "root:" + SECRET) -> str:
    extra = ["--user", user] if user else []
    result = cluster.etcdctl(*extra, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _setup_auth(cluster: EtcdCluster) -> None:
    """Auth on; engine-a may write namespace a, engine-b namespace b, router-a may only read a."""
    _ctl(cluster, "user", "add", f"root:{SECRET}", user=None)
    _ctl(cluster, "user", "grant-role", "root", "root", user=None)
    for ns in ("a", "b"):
        prefix = f"/inference/v1/{ns}/engines/"
        _ctl(cluster, "role", "add", f"engine-{ns}", user=None)
        _ctl(
            cluster,
            "role",
            "grant-permission",
            f"engine-{ns}",
            "readwrite",
            prefix,
            "--prefix=true",
            user=None,
        )
        _ctl(cluster, "user", "add", f"engine-{ns}:{SECRET}", user=None)
        _ctl(cluster, "user", "grant-role", f"engine-{ns}", f"engine-{ns}", user=None)
    _ctl(cluster, "role", "add", "router-a", user=None)
    _ctl(
        cluster,
        "role",
        "grant-permission",
        "router-a",
        "read",
        "/inference/v1/a/engines/",
        "--prefix=true",
        user=None,
    )
    _ctl(cluster, "user", "add", f"router-a:{SECRET}", user=None)
    _ctl(cluster, "user", "grant-role", "router-a", "router-a", user=None)
    _ctl(cluster, "auth", "enable", user=None)


@pytest.fixture
def etcd_auth() -> Iterator[EtcdCluster]:
    with _checked_cluster(EtcdCluster(1)) as cluster:
        _setup_auth(cluster)
        yield cluster


_JWT_TTL = 2


@pytest.fixture
def etcd_jwt(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Auth with JWT tokens that expire after _JWT_TTL seconds, whatever happens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = tmp_path / "jwt.key", tmp_path / "jwt.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    token = f"jwt,pub-key={public},priv-key={private},sign-method=RS256,ttl={_JWT_TTL}s"
    with _checked_cluster(EtcdCluster(1, extra_args=["--auth-token", token])) as cluster:
        _setup_auth(cluster)
        yield cluster


def _token_expiry(metadata) -> float:
    payload = dict(metadata)["token"].split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["exp"]


def _auth_settings(cluster: EtcdCluster, user: str | None, namespace: str = "a", **kw) -> Settings:
    """Credentials for ``user`` on the plaintext test etcd: opted in to, explicitly."""
    password = SECRET if user else None
    return Settings(
        endpoints=cluster.endpoints,
        namespace=namespace,
        username=user,
        password=password,
        dial_timeout=kw.pop("dial_timeout", 3),
        allow_insecure_auth=True,
        **kw,
    )


def test_engine_user_writes_its_namespace_only(etcd_auth: EtcdCluster) -> None:
    with register_engine(
        make_endpoint(), engine_id="e1", ttl=5, settings=_auth_settings(etcd_auth, "engine-a")
    ) as reg:
        assert reg.state is RegistrationState.REGISTERED
    assert _ctl(etcd_auth, "get", "--prefix", "/inference/v1/a/engines/") == ""  # revoked
    started = time.monotonic()
    with pytest.raises(PermissionDeniedError, match="permission denied"):
        register_engine(
            make_endpoint(),
            engine_id="e1",
            settings=_auth_settings(etcd_auth, "engine-a", namespace="b"),
        )
    assert time.monotonic() - started < 2  # refused at once, not retried
    assert _ctl(etcd_auth, "get", "--prefix", "/inference/v1/b/").strip() == ""
    leases = _ctl(etcd_auth, "lease", "list")
    assert "found 0 leases" in leases  # the lease granted for the refused write was revoked


def test_router_user_reads_and_watches_but_cannot_write(etcd_auth: EtcdCluster) -> None:
    router = _auth_settings(etcd_auth, "router-a")
    with pytest.raises(PermissionDeniedError):
        register_engine(make_endpoint(), engine_id="nope", settings=router)
    with (
        watch_table(router) as table,
        register_engine(
            make_endpoint(), engine_id="e2", ttl=5, settings=_auth_settings(etcd_auth, "engine-a")
        ),
    ):
        table.wait_until(lambda snap: "e2" in snap, timeout=5)
    with pytest.raises(PermissionDeniedError):
        EndpointWatcher(_auth_settings(etcd_auth, "router-a", namespace="b")).start()


@pytest.mark.parametrize("user", [None, "wrong"])
def test_unauthenticated_or_wrong_password_is_refused_clearly(etcd_auth: EtcdCluster, user) -> None:
    settings = Settings(
        endpoints=etcd_auth.endpoints,
        namespace="a",
        dial_timeout=3,
        username=user,
        password="not-it" if user else None,
        allow_insecure_auth=True,
    )
    started = time.monotonic()
    with pytest.raises(PermissionDeniedError) as caught:
        register_engine(make_endpoint(), settings=settings)
    assert time.monotonic() - started < 2
    assert "user name is empty" in str(caught.value) or "authentication failed" in str(caught.value)


def test_expired_tokens_do_not_freeze_watch_or_keepalive(etcd_jwt: EtcdCluster) -> None:
    """Streams reopened after the token expired must authenticate again (upstream #1227)."""
    engine = _auth_settings(etcd_jwt, "engine-a", dial_timeout=10)
    router = _auth_settings(etcd_jwt, "router-a", dial_timeout=10)
    with (
        watch_table(router) as table,
        register_engine(make_endpoint(), engine_id="survivor", ttl=6, settings=engine) as reg,
    ):
        table.wait_until(lambda snap: "survivor" in snap, timeout=5)
        tokens = [table.watcher._conn._current().metadata, reg._conn._current().metadata]
        expiry = max(_token_expiry(token) for token in tokens)
        wait_for(lambda: time.time() > expiry + 0.5, timeout=_JWT_TTL + 5, message="token expiry")
        keepalive = reg.health().last_keepalive
        etcd_jwt.restart(etcd_jwt.members[0], kill=True)  # every stream reconnects
        # The registration keeps its lease alive with a fresh token...
        wait_for(
            lambda: reg.health().last_keepalive != keepalive,
            timeout=8,
            message="a keepalive after re-authenticating",
        )
        # ...and the watch resumes with one too: a new engine still shows up.
        with register_engine(make_endpoint(1), engine_id="newcomer", ttl=6, settings=engine):
            table.wait_until(lambda snap: "newcomer" in snap, timeout=10)
        assert reg.health().losses == 0
        assert table.watcher._conn._current().metadata != tokens[0]  # it did re-authenticate
        # Unary calls with the expired token authenticate again too.
        reg.update(labels={"after": "expiry"})
        table.wait_until(lambda snap: snap["survivor"].labels == {"after": "expiry"}, timeout=5)
        assert reg._conn._current().metadata != tokens[1]


def test_no_secret_in_logs_reprs_errors_or_cli_output(
    etcd_auth: EtcdCluster, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = _auth_settings(etcd_auth, "engine-a")
    texts = [repr(settings), str(settings)]
    with register_engine(make_endpoint(), engine_id="quiet", ttl=5, settings=settings) as reg:
        texts += [repr(reg), repr(reg.health())]
    for bad in (
        _auth_settings(etcd_auth, "engine-a", namespace="b"),
        dataclasses.replace(_auth_settings(etcd_auth, "engine-a"), password=SECRET + "x"),
        Settings(
            endpoints=["http://127.0.0.1:9"],
            username="u",
            password=SECRET,
            dial_timeout=0.5,
            allow_insecure_auth=True,
        ),
    ):
        with pytest.raises(Exception) as caught:
            register_engine(make_endpoint(), engine_id="x", settings=bad)
        texts.append(str(caught.value))
        texts.append(repr(caught.value))
    with pytest.raises(ConfigurationError) as refused:  # plaintext without the opt-in
        Settings(endpoints=etcd_auth.endpoints, username="engine-a", password=SECRET)
    texts += [str(refused.value), repr(refused.value)]
    password_file = tmp_path / "password"
    password_file.write_text(SECRET + "\n")
    env = cli_env(Settings(endpoints=etcd_auth.endpoints, namespace="a"))
    env.update(
        DISCOVERY_ETCD_USERNAME="engine-a",
        DISCOVERY_ETCD_PASSWORD_FILE=str(password_file),
        DISCOVERY_ALLOW_INSECURE_AUTH="1",
    )
    for args in (
        ["list"],
        ["list", "--log-level", "DEBUG"],
        ["deregister", "ghost"],
        ["list", "--namespace", "b", "--dial-timeout", "1"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "discovery", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        texts += [result.stdout, result.stderr]
    texts += [record.getMessage() for record in caplog.records]
    leaks = [text for text in texts if SECRET in text]
    assert not leaks, leaks[:3]
    assert any("(2 engines)" in t or "(0 engines)" in t for t in texts)  # the CLI did run


def test_rotated_password_file_is_picked_up_without_a_restart(
    etcd_auth: EtcdCluster, tmp_path: Path
) -> None:
    password_file = tmp_path / "engine-a"
    password_file.write_text(SECRET + "\n")
    settings = Settings(
        endpoints=etcd_auth.endpoints,
        namespace="a",
        username="engine-a",
        password_file=str(password_file),
        dial_timeout=5,
        allow_insecure_auth=True,
    )
    with register_engine(make_endpoint(), engine_id="rotating", ttl=5, settings=settings) as reg:
        new_password = SECRET + "-2"
        password_file.write_text(new_password + "\n")  # the mounted secret changes first
        result = etcd_auth.etcdctl(
            "--user",
            f"root:{SECRET}",
            "user",
            "passwd",
            "engine-a",
            "--interactive=false",
            input_text=new_password,
        )
        assert result.returncode == 0, result.stderr
        # The old token is gone; the next write authenticates again with the new file.
        reg.update(labels={"rotated": "yes"})
        lease = reg.lease_id
    assert _ctl(etcd_auth, "get", "--prefix", "/inference/v1/a/engines/") == ""  # revoked
    assert f"{lease:016x}" not in _ctl(etcd_auth, "lease", "list")


# -- no password over a plaintext connection (issue 18) ----------------------------------


def test_no_password_crosses_a_plaintext_connection_without_the_opt_in(
    etcd_auth: EtcdCluster, tmp_path: Path
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    port = int(etcd_auth.endpoints[0].rsplit(":", 1)[1])
    with TcpForwarder(("127.0.0.1", port)) as wire:
        command = [
            sys.executable, "-m", "discovery", "list",
            "--endpoints", wire.endpoint, "--namespace", "a", "--dial-timeout", "3",
            "--username", "engine-a", "--password-file", str(password_file),
        ]  # fmt: skip

        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*command, *extra], env=env, capture_output=True, text=True, timeout=30
            )

        refused = run()
        assert refused.returncode == 2, refused.stderr
        assert wire.endpoint in refused.stderr and "--allow-insecure-auth" in refused.stderr
        assert wire.connections == 0  # refused before connecting: nothing crossed the wire
        assert SECRET not in refused.stderr + refused.stdout

        allowed = run("--allow-insecure-auth")
        assert allowed.returncode == 0, allowed.stderr
        assert "(0 engines)" in allowed.stdout
        # The forwarder does see a password sent in clear, so the refusal above is proven.
        assert wire.connections > 0 and SECRET.encode() in wire.sent()
        warnings = [line for line in allowed.stderr.splitlines() if "allow_insecure_auth" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0], allowed.stderr
        assert wire.endpoint in warnings[0]
        assert SECRET not in allowed.stderr + allowed.stdout


# -- JSON logs stay JSON, gRPC's own lines included (issue 18) ---------------------------


def test_json_log_format_keeps_every_stderr_line_json_when_tls_fails(
    etcd_tls: EtcdCluster, pki: Pki, tmp_path: Path
) -> None:
    endpoint_file = tmp_path / "engine.json"
    endpoint_file.write_text(json.dumps(make_endpoint().to_dict()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISCOVERY_", "GRPC_"))}
    command = [
        sys.executable, "-m", "discovery", "register", "--endpoint-file", str(endpoint_file),
        "--endpoints", etcd_tls.endpoints[0], "--ca-cert", str(pki.other_ca),
        "--cert", str(pki.client_cert), "--key", str(pki.client_key), "--dial-timeout", "1",
    ]  # fmt: skip

    def run(log_format: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--log-format", log_format],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    result = run("json")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    not_json = [line for line in lines if not _is_json_object(line)]
    assert lines and not not_json, not_json
    records = [json.loads(line) for line in lines]
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records), records
    # Our own warning about the failure is there...
    assert any(
        r["level"] == "WARNING"
        and r["logger"] == "discovery._etcd.connection"
        and "CERTIFICATE_VERIFY_FAILED" in r["message"]
        for r in records
    ), records
    # ...and so is gRPC's C-core line (grpcio 1.85 logs every failed handshake): routed.
    assert any(r["logger"] == "stderr" and "Handshake failed" in r["message"] for r in records)
    assert records[-1]["level"] == "ERROR" and records[-1]["logger"] == "discovery.cli"
    assert records[-1]["message"].startswith("discovery register: etcd unavailable at https://")

    text = run("text")  # text mode as it always was: the last line plain
    assert text.returncode == 1
    assert text.stderr.splitlines()[-1].startswith("discovery register: etcd unavailable at")


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
