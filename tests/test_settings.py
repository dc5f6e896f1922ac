"""Connection settings: keyword arguments and DISCOVERY_* variables (pure, no network)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest

from discovery import ConfigurationError, KeySpace, Settings
from discovery._settings import env_names

from .helpers import run_python

PASSWORD = "Pw-marker-7f3a9c-do-not-leak"
HTTPS = "https://etcd-0.example:2379"


def all_messages(error: BaseException) -> str:
    """The text a traceback of ``error`` would show: the error and its displayed chain."""
    texts = []
    current: BaseException | None = error
    while current is not None:
        texts.append(f"{current!s} {current!r}")
        if current.__cause__ is not None:
            current = current.__cause__
        elif current.__suppress_context__:
            current = None
        else:
            current = current.__context__
    return "\n".join(texts)


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("ca_cert", "cert", "key"):
        path = tmp_path / f"{name}.pem"
        path.write_bytes(b"-----BEGIN DUMMY-----\n")
        files[name] = str(path)
    return files


# --- Defaults -----------------------------------------------------------------------------


def test_defaults() -> None:
    settings = Settings()
    assert settings.endpoints == ("http://127.0.0.1:2379",)
    assert settings.root == "/inference/v1"
    assert settings.namespace == "default"
    assert settings.dial_timeout == 5.0
    assert settings.request_timeout == 5.0
    assert settings.election_timeout == 1.0
    assert (settings.ca_cert, settings.cert, settings.key) == (None, None, None)
    assert (settings.username, settings.password) == (None, None)
    assert settings.secure is False
    assert settings.keyspace == KeySpace()
    assert settings.member_sync is True
    assert settings.member_sync_interval == 5.0


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().namespace = "other"  # type: ignore[misc]


def test_settings_take_keyword_arguments_only() -> None:
    with pytest.raises(TypeError):
        Settings(["http://a:1"])  # type: ignore[misc]


def test_keyspace_follows_root_and_namespace() -> None:
    settings = Settings(root="/org/v2", namespace="prod")
    assert settings.keyspace == KeySpace("/org/v2", "prod")
    assert settings.keyspace.prefix == "/org/v2/prod/engines/"


def test_with_namespace_returns_a_validated_copy() -> None:
    settings = Settings(endpoints="a:1", namespace="one")
    other = settings.with_namespace("two")
    assert (other.namespace, other.endpoints) == ("two", ("http://a:1",))
    assert settings.namespace == "one"
    with pytest.raises(ConfigurationError, match="namespace 'a/b'"):
        settings.with_namespace("a/b")


# --- Endpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        (["http://a:1", "http://b:2"], ("http://a:1", "http://b:2")),
        (("http://a:1",), ("http://a:1",)),
        ("http://a:1,http://b:2", ("http://a:1", "http://b:2")),
        (" a:1 , b:2 ,", ("http://a:1", "http://b:2")),
        (["a:1", " ", ""], ("http://a:1",)),
    ],
)
def test_endpoints_as_list_or_comma_string(endpoints: Any, expected: tuple[str, ...]) -> None:
    assert Settings(endpoints=endpoints).endpoints == expected


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("etcd-0:2379", "http://etcd-0:2379"),
        ("10.0.0.5:12379", "http://10.0.0.5:12379"),
        ("etcd-0", "http://etcd-0:2379"),
        ("http://etcd-0", "http://etcd-0:2379"),
        ("http://etcd-0:2379/", "http://etcd-0:2379"),
        ("https://etcd-0:2379", "https://etcd-0:2379"),
        ("http://[::1]:2379", "http://[::1]:2379"),
        ("[fe80::1]", "http://[fe80::1]:2379"),
    ],
)
def test_endpoint_is_normalised(endpoint: str, expected: str) -> None:
    assert Settings(endpoints=endpoint).endpoints == (expected,)


@pytest.mark.parametrize("endpoints", ["", " , ", [], [""]], ids=repr)
def test_at_least_one_endpoint_is_required(endpoints: Any) -> None:
    with pytest.raises(ConfigurationError, match="at least one etcd endpoint is required"):
        Settings(endpoints=endpoints)


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("http://:2379", "endpoint 'http://:2379' has no host"),
        ("http://", "endpoint 'http://' has no host"),
        (":2379", "endpoint 'http://:2379' has no host"),
        ("ftp://etcd:21", "endpoint 'ftp://etcd:21': scheme must be http or https"),
        ("unix://etcd", "scheme must be http or https"),
        ("http://etcd:2379/v3", "'http://etcd:2379/v3': only scheme://host:port is allowed"),
        ("http://etcd:2379?x=1", "only scheme://host:port is allowed"),
        ("http://etcd:2379#top", "only scheme://host:port is allowed"),
        ("etcd:abc", "endpoint 'http://etcd:abc' is not a URL: Port could not be cast"),
        ("http://etcd:99999", "endpoint 'http://etcd:99999' is not a URL: Port out of range"),
        ("http://etcd:0", "endpoint 'http://etcd:0': port must be 1-65535"),
    ],
)
def test_bad_endpoint_is_refused_with_a_clear_message(endpoint: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Settings(endpoints=endpoint)


@pytest.mark.parametrize("bad", [[2379], ["http://a:1", None], None, 5], ids=repr)
def test_non_string_endpoints_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="endpoints must be"):
        Settings(endpoints=bad)


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://user:secret@etcd:2379",
        "https://user:secret@etcd:2379",
        "user:secret@etcd:2379",
        "http://user:sec@ret@etcd:2379",
        "http://user:sec/ret@etcd:2379",
        "http://user:secret@etcd:bad",
        "http://secret@etcd:2379",
        "http://user:sec:ret@etcd:2379",
    ],
)
def test_endpoint_with_credentials_is_refused_without_echoing_them(endpoint: str) -> None:
    with pytest.raises(ConfigurationError, match="credentials do not belong in the URL") as info:
        Settings(endpoints=["http://other:2379", endpoint])
    text = all_messages(info.value)
    assert "sec" not in text
    assert "ret@" not in text
    assert "etcd" in text


def test_mixed_http_and_https_endpoints_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="mix of http:// and https:// endpoints"):
        Settings(endpoints=["http://a:2379", "https://b:2379"])


# --- TLS ----------------------------------------------------------------------------------


def test_https_with_all_tls_files(tls_files: dict[str, str]) -> None:
    settings = Settings(endpoints=[HTTPS, "https://etcd-1:2379"], **tls_files)
    assert settings.secure is True
    assert (settings.ca_cert, settings.cert, settings.key) == (
        tls_files["ca_cert"],
        tls_files["cert"],
        tls_files["key"],
    )


def test_https_without_tls_files_uses_system_roots() -> None:
    settings = Settings(endpoints=HTTPS)
    assert settings.secure is True
    assert settings.ca_cert is None


@pytest.mark.parametrize("name", ["ca_cert", "cert", "key"])
def test_tls_file_with_http_endpoints_is_refused(name: str, tls_files: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match=f"{name} is set but the endpoints use http://"):
        Settings(endpoints="http://a:2379", **{name: tls_files[name]})


@pytest.mark.parametrize("name", ["ca_cert", "cert", "key"])
def test_missing_tls_file_is_refused_naming_the_path(
    name: str, tls_files: dict[str, str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "nowhere" / f"{name}.pem")
    files = {**tls_files, name: missing}
    with pytest.raises(ConfigurationError, match=f"{name}: file {re.escape(repr(missing))}"):
        Settings(endpoints=HTTPS, **files)


def test_tls_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"ca_cert: file .* does not exist"):
        Settings(endpoints=HTTPS, ca_cert=str(tmp_path))


@pytest.mark.parametrize("only", ["cert", "key"])
def test_client_cert_and_key_must_be_given_together(only: str, tls_files: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="cert and key must be given together"):
        Settings(endpoints=HTTPS, **{only: tls_files[only]})


# --- Credentials --------------------------------------------------------------------------


def test_username_and_password() -> None:
    settings = Settings(endpoints=HTTPS, username="root", password=PASSWORD)
    assert (settings.username, settings.password) == ("root", PASSWORD)


@pytest.mark.parametrize("secret", ["password", "password_file"])
def test_credentials_over_plaintext_are_refused_naming_the_endpoints(
    secret: str, tmp_path: Path
) -> None:
    """etcd's Authenticate call would carry the password in clear (issue 18)."""
    (tmp_path / "pw").write_text(PASSWORD)
    value = PASSWORD if secret == "password" else str(tmp_path / "pw")
    endpoints = "http://etcd-0:2379,etcd-1:2379"
    with pytest.raises(ConfigurationError) as info:
        Settings(endpoints=endpoints, username="root", **{secret: value})
    message = str(info.value)
    assert "http://etcd-0:2379, http://etcd-1:2379" in message
    assert "unencrypted" in message and "user 'root'" in message
    for remedy in ("https://", "allow_insecure_auth", "DISCOVERY_ALLOW_INSECURE_AUTH=1"):
        assert remedy in message
    assert PASSWORD not in all_messages(info.value)


def test_allow_insecure_auth_accepts_credentials_over_plaintext() -> None:
    settings = Settings(username="root", password=PASSWORD, allow_insecure_auth=True)
    assert settings.allow_insecure_auth and not settings.secure
    assert "allow_insecure_auth=True" in repr(settings)


def test_allow_insecure_auth_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="allow_insecure_auth must be True or False"):
        Settings(allow_insecure_auth="yes")  # type: ignore[arg-type]


@pytest.mark.external  # a fresh interpreter
def test_allow_insecure_auth_warns_once_per_process_without_the_password() -> None:
    code = f"""
import logging
from discovery import Settings
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
for port in (2379, 2380, 2381):
    Settings(endpoints=f"http://etcd:{{port}}", username="root", password={PASSWORD!r},
             allow_insecure_auth=True)
Settings(endpoints={HTTPS!r}, username="root", password={PASSWORD!r})
print("built")
"""
    returncode, out, err = run_python(code, dict(os.environ))
    assert returncode == 0 and out == "built\n", err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("WARNING discovery._settings: allow_insecure_auth")
    assert "http://etcd:2379" in lines[0] and "'root'" in lines[0]
    assert PASSWORD not in err


@pytest.mark.parametrize(
    "credentials", [{"username": "root"}, {"password": PASSWORD}], ids=["username", "password"]
)
def test_username_and_password_must_be_given_together(credentials: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="username and password must be given together"):
        Settings(**credentials)


def test_empty_username_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="username must not be empty"):
        Settings(username="", password=PASSWORD)


# --- Timeouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dial_timeout", "request_timeout", "election_timeout"])
def test_timeouts_are_floats(name: str) -> None:
    assert getattr(Settings(**{name: 2}), name) == 2.0
    assert type(getattr(Settings(**{name: 2}), name)) is float
    assert getattr(Settings(**{name: 0.25}), name) == 0.25


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, True, False, "5", None, float("nan"), float("inf")], ids=repr
)
@pytest.mark.parametrize("name", ["dial_timeout", "request_timeout", "election_timeout"])
def test_bad_timeout_is_refused(name: str, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"^{name} must be a positive number of seconds$"):
        Settings(**{name: bad})


# --- Member sync --------------------------------------------------------------------------


def test_member_sync_can_be_turned_off_and_its_interval_set() -> None:
    settings = Settings(member_sync=False, member_sync_interval=2)
    assert settings.member_sync is False
    assert settings.member_sync_interval == 2.0
    assert type(settings.member_sync_interval) is float
    assert Settings(member_sync_interval=0).member_sync_interval == 0.0  # after failovers only


@pytest.mark.parametrize(
    "bad", [-1, -0.5, True, False, "30", None, float("nan"), float("inf")], ids=repr
)
def test_bad_member_sync_interval_is_refused(bad: Any) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"^member_sync_interval must be a positive number of seconds, or 0 \(no periodic",
    ):
        Settings(member_sync_interval=bad)


@pytest.mark.parametrize("bad", ["no", 0, 1, None], ids=repr)
def test_member_sync_must_be_a_bool(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^member_sync must be True or False$"):
        Settings(member_sync=bad)


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("on", True), ("0", False), (" False ", False)]
)
def test_from_env_reads_member_sync(raw: str, expected: bool) -> None:
    assert Settings.from_env({"DISCOVERY_MEMBER_SYNC": raw}).member_sync is expected


def test_from_env_bad_member_sync_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="DISCOVERY_MEMBER_SYNC='proxy' is not a boolean"):
        Settings.from_env({"DISCOVERY_MEMBER_SYNC": "proxy"})


@pytest.mark.parametrize(("raw", "expected"), [("0", 0.0), ("2.5", 2.5), ("60", 60.0)])
def test_from_env_reads_member_sync_interval(raw: str, expected: float) -> None:
    environ = {"DISCOVERY_MEMBER_SYNC_INTERVAL": raw}
    assert Settings.from_env(environ).member_sync_interval == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("30s", "DISCOVERY_MEMBER_SYNC_INTERVAL='30s' is not a number of seconds"),
        ("-1", "member_sync_interval must be a positive number of seconds, or 0"),
        ("inf", "member_sync_interval must be a positive number of seconds, or 0"),
    ],
)
def test_from_env_bad_member_sync_interval_is_refused(raw: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Settings.from_env({"DISCOVERY_MEMBER_SYNC_INTERVAL": raw})


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4096", None], ids=repr)
def test_bad_max_request_bytes_is_refused(bad: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=r"^max_request_bytes must be a positive whole number of bytes"
    ):
        Settings(max_request_bytes=bad)


def test_max_request_bytes_defaults_to_etcds_and_names_a_bad_variable() -> None:
    assert Settings().max_request_bytes == 1_572_864  # etcd's own --max-request-bytes
    with pytest.raises(ConfigurationError, match=r"DISCOVERY_ETCD_MAX_REQUEST_BYTES='1\.5MiB' is"):
        Settings.from_env({"DISCOVERY_ETCD_MAX_REQUEST_BYTES": "1.5MiB"})


# --- Root and namespace -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("root", "inference", "root 'inference' must start with '/'"),
        ("root", "/inference/", "root '/inference/' must start with '/' and not end with '/'"),
        ("root", "/a b", "'a b' is not allowed"),
        ("namespace", "a/b", "namespace 'a/b' is not allowed"),
        ("namespace", "", "namespace '' is not allowed"),
        ("namespace", "..", "namespace '..' is not allowed"),
    ],
)
def test_bad_root_or_namespace_is_a_configuration_error(field: str, bad: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Settings(**{field: bad})


# --- from_env -----------------------------------------------------------------------------

EVERY_VARIABLE = {
    "DISCOVERY_ETCD_ENDPOINTS",
    "DISCOVERY_ROOT",
    "DISCOVERY_NAMESPACE",
    "DISCOVERY_DIAL_TIMEOUT",
    "DISCOVERY_REQUEST_TIMEOUT",
    "DISCOVERY_ELECTION_TIMEOUT",
    "DISCOVERY_ETCD_CA_CERT",
    "DISCOVERY_ETCD_CERT",
    "DISCOVERY_ETCD_KEY",
    "DISCOVERY_ETCD_USERNAME",
    "DISCOVERY_ETCD_PASSWORD",
    "DISCOVERY_ETCD_PASSWORD_FILE",
    "DISCOVERY_ALLOW_INSECURE_AUTH",
    "DISCOVERY_MEMBER_SYNC",
    "DISCOVERY_MEMBER_SYNC_INTERVAL",
    "DISCOVERY_ETCD_MAX_REQUEST_BYTES",
}


def full_environ(tls_files: dict[str, str]) -> dict[str, str]:
    return {
        "DISCOVERY_ETCD_ENDPOINTS": "https://etcd-0:2379,https://etcd-1:2379",
        "DISCOVERY_ROOT": "/org/v2",
        "DISCOVERY_NAMESPACE": "prod",
        "DISCOVERY_DIAL_TIMEOUT": "7.5",
        "DISCOVERY_REQUEST_TIMEOUT": "3",
        "DISCOVERY_ELECTION_TIMEOUT": "2.5",
        "DISCOVERY_ETCD_CA_CERT": tls_files["ca_cert"],
        "DISCOVERY_ETCD_CERT": tls_files["cert"],
        "DISCOVERY_ETCD_KEY": tls_files["key"],
        "DISCOVERY_ETCD_USERNAME": "router",
        "DISCOVERY_ETCD_PASSWORD": PASSWORD,
        "DISCOVERY_ALLOW_INSECURE_AUTH": "0",
        "DISCOVERY_MEMBER_SYNC": "off",
        "DISCOVERY_MEMBER_SYNC_INTERVAL": "12",
        "DISCOVERY_ETCD_MAX_REQUEST_BYTES": "65536",
        "UNRELATED": "x",
    }


def test_env_names_lists_every_variable() -> None:
    assert set(env_names().values()) == EVERY_VARIABLE


def test_from_env_reads_every_variable(tls_files: dict[str, str]) -> None:
    settings = Settings.from_env(full_environ(tls_files))
    assert settings.endpoints == ("https://etcd-0:2379", "https://etcd-1:2379")
    assert (settings.root, settings.namespace) == ("/org/v2", "prod")
    assert (settings.dial_timeout, settings.request_timeout) == (7.5, 3.0)
    assert settings.election_timeout == 2.5
    assert (settings.ca_cert, settings.cert, settings.key) == (
        tls_files["ca_cert"],
        tls_files["cert"],
        tls_files["key"],
    )
    assert (settings.username, settings.password) == ("router", PASSWORD)
    assert settings.allow_insecure_auth is False
    assert (settings.member_sync, settings.member_sync_interval) == (False, 12.0)
    assert settings.max_request_bytes == 65536


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), (" YES ", True), ("on", True), ("0", False), ("off", False)],
)
def test_from_env_reads_allow_insecure_auth(raw: str, expected: bool) -> None:
    settings = Settings.from_env({"DISCOVERY_ALLOW_INSECURE_AUTH": raw})
    assert settings.allow_insecure_auth is expected


def test_from_env_allow_insecure_auth_opts_in_to_credentials_over_plaintext() -> None:
    environ = {"DISCOVERY_ETCD_USERNAME": "u", "DISCOVERY_ETCD_PASSWORD": PASSWORD}
    with pytest.raises(ConfigurationError, match="DISCOVERY_ALLOW_INSECURE_AUTH=1"):
        Settings.from_env(environ)
    environ["DISCOVERY_ALLOW_INSECURE_AUTH"] = "1"
    assert Settings.from_env(environ).allow_insecure_auth is True


def test_from_env_non_boolean_allow_insecure_auth_names_the_variable() -> None:
    with pytest.raises(
        ConfigurationError, match="DISCOVERY_ALLOW_INSECURE_AUTH='maybe' is not a boolean"
    ):
        Settings.from_env({"DISCOVERY_ALLOW_INSECURE_AUTH": "maybe"})


def test_from_env_reads_the_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    environ = {
        "DISCOVERY_ETCD_ENDPOINTS": HTTPS,
        "DISCOVERY_ETCD_USERNAME": "router",
        "DISCOVERY_ETCD_PASSWORD_FILE": str(secret),
    }
    settings = Settings.from_env(environ)
    assert settings.read_password() == PASSWORD
    assert settings.password is None and settings.password_file == str(secret)
    assert PASSWORD not in repr(settings)


def test_password_file_is_read_again_at_each_authentication(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("first\n")
    settings = Settings(endpoints=HTTPS, username="u", password_file=str(secret))
    assert settings.read_password() == "first"
    secret.write_text("rotated\n")
    assert settings.read_password() == "rotated"


def test_password_and_password_file_are_exclusive(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("x")
    with pytest.raises(ConfigurationError, match="not both"):
        Settings(username="u", password=PASSWORD, password_file=str(secret))


def test_from_env_password_wins_over_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file")
    environ = {
        "DISCOVERY_ETCD_ENDPOINTS": HTTPS,
        "DISCOVERY_ETCD_USERNAME": "router",
        "DISCOVERY_ETCD_PASSWORD": PASSWORD,
        "DISCOVERY_ETCD_PASSWORD_FILE": str(secret),
    }
    assert Settings.from_env(environ).password == PASSWORD


def test_from_env_unreadable_password_file_names_the_variable(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    environ = {
        "DISCOVERY_ETCD_ENDPOINTS": HTTPS,
        "DISCOVERY_ETCD_USERNAME": "u",
        "DISCOVERY_ETCD_PASSWORD_FILE": missing,
    }
    with pytest.raises(
        ConfigurationError,
        match=rf"\(DISCOVERY_ETCD_PASSWORD_FILE\): cannot read {re.escape(repr(missing))}",
    ):
        Settings.from_env(environ)


def test_from_env_with_empty_environ_gives_defaults() -> None:
    assert repr(Settings.from_env({})) == repr(Settings())


def test_from_env_ignores_empty_variables() -> None:
    environ = dict.fromkeys(EVERY_VARIABLE, "")
    assert repr(Settings.from_env(environ)) == repr(Settings())


def test_from_env_with_explicit_environ_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISCOVERY_NAMESPACE", "from-os")
    assert Settings.from_env({}).namespace == "default"
    assert Settings.from_env().namespace == "from-os"


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("endpoints", ["https://other:2379"]),
        ("root", "/override"),
        ("namespace", "staging"),
        ("dial_timeout", 1.5),
        ("request_timeout", 9.0),
        ("election_timeout", 3.0),
        ("username", "admin"),
        ("password", "override-password"),
        ("allow_insecure_auth", True),
        ("member_sync", True),
        ("member_sync_interval", 0.0),
    ],
)
def test_from_env_keyword_overrides_win(
    override: str, value: Any, tls_files: dict[str, str]
) -> None:
    settings = Settings.from_env(full_environ(tls_files), **{override: value})
    expected = tuple(value) if override == "endpoints" else value
    assert getattr(settings, override) == expected


@pytest.mark.parametrize("name", ["ca_cert", "cert", "key"])
def test_from_env_tls_overrides_win(name: str, tls_files: dict[str, str], tmp_path: Path) -> None:
    other = tmp_path / f"other-{name}.pem"
    other.write_bytes(b"dummy")
    settings = Settings.from_env(full_environ(tls_files), **{name: str(other)})
    assert getattr(settings, name) == str(other)


def test_from_env_password_override_wins_over_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file")
    environ = {
        "DISCOVERY_ETCD_ENDPOINTS": HTTPS,
        "DISCOVERY_ETCD_USERNAME": "u",
        "DISCOVERY_ETCD_PASSWORD_FILE": str(secret),
    }
    assert Settings.from_env(environ, password=PASSWORD).password == PASSWORD


def test_from_env_none_override_keeps_the_environment_value() -> None:
    settings = Settings.from_env({"DISCOVERY_NAMESPACE": "prod"}, namespace=None)
    assert settings.namespace == "prod"


@pytest.mark.parametrize("suffix", ["DIAL_TIMEOUT", "REQUEST_TIMEOUT", "ELECTION_TIMEOUT"])
@pytest.mark.parametrize("raw", ["soon", "5s", "1,5"])
def test_from_env_non_numeric_timeout_names_the_variable(suffix: str, raw: str) -> None:
    with pytest.raises(
        ConfigurationError, match=f"DISCOVERY_{suffix}={raw!r} is not a number of seconds"
    ):
        Settings.from_env({f"DISCOVERY_{suffix}": raw})


@pytest.mark.parametrize("raw", ["0", "-2", "nan", "inf"])
def test_from_env_non_positive_timeout_is_refused(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="dial_timeout must be a positive number"):
        Settings.from_env({"DISCOVERY_DIAL_TIMEOUT": raw})


# --- The password never leaks -------------------------------------------------------------


def test_password_is_not_in_repr_or_str() -> None:
    settings = Settings(endpoints=HTTPS, username="root", password=PASSWORD)
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(settings)
    assert "password='***'" in repr(settings)
    assert "username='root'" in repr(settings)


def test_password_from_env_is_not_in_repr(tls_files: dict[str, str]) -> None:
    settings = Settings.from_env(full_environ(tls_files))
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(settings)


def test_repr_without_password_says_none() -> None:
    assert "password=None" in repr(Settings())


@pytest.mark.parametrize(
    "bad",
    [
        {"endpoints": "ftp://etcd:21"},
        {"endpoints": "http://etcd:abc"},
        {"endpoints": ""},
        {"endpoints": ["http://a:1", "https://b:2"]},
        {"root": "no-slash"},
        {"namespace": "a/b"},
        {"dial_timeout": 0},
        {"request_timeout": -1},
        {"ca_cert": "/nonexistent/ca.pem"},
        {"endpoints": HTTPS, "cert": "/nonexistent/cert.pem", "key": "/nonexistent/key.pem"},
        {"username": None},
        {"username": ""},
        {"endpoints": "http://etcd:2379"},
        {"allow_insecure_auth": "yes"},
    ],
    ids=repr,
)
def test_password_is_not_in_any_configuration_error(bad: dict[str, Any]) -> None:
    values = {"username": "root", "password": PASSWORD, **bad}
    with pytest.raises(ConfigurationError) as info:
        Settings(**values)
    assert PASSWORD not in all_messages(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"DISCOVERY_DIAL_TIMEOUT": "soon"},
        {"DISCOVERY_REQUEST_TIMEOUT": "0"},
        {"DISCOVERY_ETCD_ENDPOINTS": "ftp://etcd:21"},
        {"DISCOVERY_NAMESPACE": "a b"},
        {"DISCOVERY_ETCD_CA_CERT": "/nonexistent/ca.pem"},
        {"DISCOVERY_ETCD_USERNAME": ""},
        {"DISCOVERY_ETCD_ENDPOINTS": "http://etcd:2379"},
        {"DISCOVERY_ALLOW_INSECURE_AUTH": "maybe"},
    ],
    ids=repr,
)
def test_password_from_env_is_not_in_any_configuration_error(bad: dict[str, str]) -> None:
    environ = {"DISCOVERY_ETCD_USERNAME": "root", "DISCOVERY_ETCD_PASSWORD": PASSWORD, **bad}
    with pytest.raises(ConfigurationError) as info:
        Settings.from_env(environ)
    assert PASSWORD not in all_messages(info.value)


def test_password_in_an_endpoint_url_is_not_in_the_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        Settings(endpoints=f"http://root:{PASSWORD}@etcd:2379")
    assert PASSWORD not in all_messages(info.value)


def test_configuration_error_is_a_value_error() -> None:
    assert issubclass(ConfigurationError, ValueError)
