"""Connection settings: from keyword arguments or ``DISCOVERY_*`` environment variables.

Building a Settings object checks everything that can be checked without a network:
URLs, TLS files, credential pairs, timeouts, and that a password would not cross a
plaintext connection unless asked for. It never opens a connection.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeGuard
from urllib.parse import urlsplit

from discovery._errors import ConfigurationError, InvalidRecordError
from discovery._records.codec import DEFAULT_NAMESPACE, DEFAULT_ROOT, KeySpace

__all__ = ["ENV_PREFIX", "ETCD_MAX_REQUEST_BYTES", "Settings"]

log = logging.getLogger(__name__)

ENV_PREFIX = "DISCOVERY_"
ETCD_MAX_REQUEST_BYTES = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)
DEFAULT_ENDPOINT = "http://127.0.0.1:2379"

# Settings field -> (environment variable after ENV_PREFIX, what it means): declared once,
# read by from_env and rendered by settings_table() (the documentation's settings page).
_VARIABLES = {
    "endpoints": ("ETCD_ENDPOINTS", "comma-separated `http(s)://host:port` (or `host:port`)"),
    "root": ("ROOT", "key root"),
    "namespace": ("NAMESPACE", "namespace"),
    "dial_timeout": (
        "DIAL_TIMEOUT",
        "seconds a one-shot call keeps retrying an unreachable cluster",
    ),
    "request_timeout": ("REQUEST_TIMEOUT", "seconds per RPC"),
    "election_timeout": (
        "ELECTION_TIMEOUT",
        "the etcd cluster's election timeout in seconds (its `--election-timeout` / 1000): "
        "sets when a watcher counts as stale",
    ),
    "ca_cert": ("ETCD_CA_CERT", "CA bundle for `https://` endpoints (system roots if unset)"),
    "cert": ("ETCD_CERT", "client certificate (with `DISCOVERY_ETCD_KEY`)"),
    "key": ("ETCD_KEY", "the client certificate's key (with `DISCOVERY_ETCD_CERT`)"),
    "username": ("ETCD_USERNAME", "etcd user (with a password or a password file)"),
    "password": ("ETCD_PASSWORD", "the user's password; wins over the password file"),
    "password_file": (
        "ETCD_PASSWORD_FILE",
        "file holding the password (a mounted secret); read again at every authentication, "
        "so rotation needs no restart",
    ),
    "allow_insecure_auth": (
        "ALLOW_INSECURE_AUTH",
        "`1` (or `true`, `yes`, `on`): send the username and password over `http://` "
        "endpoints, unencrypted",
    ),
    "member_sync": (
        "MEMBER_SYNC",
        "`0` (or `false`, `no`, `off`): keep the configured endpoints instead of following "
        "the cluster's membership; turn it off behind an etcd gRPC proxy or a load balancer",
    ),
    "member_sync_interval": (
        "MEMBER_SYNC_INTERVAL",
        "seconds between refreshes of the endpoints from etcd's member list (there is one "
        "after every failover too); `0`: after failovers only",
    ),
    "max_request_bytes": (
        "ETCD_MAX_REQUEST_BYTES",
        "the members' `--max-request-bytes`: batched writes (a session's repair, bulk "
        "commands) are split to stay under it, and a refusal names it",
    ),
}
_ENV_NAMES = {name: suffix for name, (suffix, _) in _VARIABLES.items()}
_SWITCHES = ("allow_insecure_auth", "member_sync")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Set once the opt-in to credentials over http:// has been logged: one warning per process.
_insecure_auth_warned = threading.Event()


@dataclass(frozen=True, kw_only=True, repr=False)
class Settings:
    """Where etcd is, how to reach it, and which part of its keyspace is ours.

    ``endpoints`` accepts ``http://host:port``, ``https://host:port`` or ``host:port``
    (http), as a sequence or one comma-separated string. ``https`` endpoints use TLS,
    verified against ``ca_cert`` (system roots when it is None); ``cert``/``key`` add a
    client certificate. ``dial_timeout`` bounds how long a one-shot call keeps retrying
    an unreachable cluster; ``request_timeout`` bounds each RPC. ``election_timeout`` is
    the etcd cluster's own (its ``--election-timeout``, in seconds; etcd's default 1 s):
    it sets how long a watcher may go without hearing from a member that has a leader
    before it calls itself stale. ``password_file`` is an
    alternative to ``password``: the file is read again every time the client
    authenticates, so a rotated secret is picked up without a restart.

    ``member_sync`` (on by default) makes the connection follow the cluster's membership:
    it replaces its endpoints with the client URLs of etcd's member list every
    ``member_sync_interval`` seconds (0: never periodically) and after every failover,
    so members added and removed at runtime are found and left. The default, 5 s, is
    etcd's own pace: it adds a member only once every member has been connected for 5 s
    (its strict reconfiguration check), so a refresh every 5 s learns a new member before
    the last member a connection knows can be replaced, however fast an operator rotates
    them (tests/test_failure_catalogue.py, member-rotation: with 30 s, a rotation done in
    16 s left a watcher on the last original member blind for good). Turn it off when the
    endpoints are an etcd gRPC proxy or a load balancer: that address is the one to keep.

    A username with ``http://`` endpoints is refused: etcd's Authenticate call would
    carry the password in clear. ``allow_insecure_auth=True`` accepts that (a local
    test etcd, say) and logs one warning per process.
    """

    endpoints: Sequence[str] = (DEFAULT_ENDPOINT,)
    root: str = DEFAULT_ROOT
    namespace: str = DEFAULT_NAMESPACE
    dial_timeout: float = 5.0
    request_timeout: float = 5.0
    election_timeout: float = 1.0
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    allow_insecure_auth: bool = False
    member_sync: bool = True
    member_sync_interval: float = 5.0
    max_request_bytes: int = ETCD_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        """Normalise and check every field; raise ConfigurationError on the first problem."""
        endpoints = self.endpoints
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        if not isinstance(endpoints, Sequence) or not all(isinstance(e, str) for e in endpoints):
            raise ConfigurationError(
                "endpoints must be a comma-separated string or a sequence of strings"
            )
        normalised = tuple(parse_endpoint(e) for e in endpoints if e.strip())
        if not normalised:
            raise ConfigurationError("endpoints: at least one etcd endpoint is required")
        object.__setattr__(self, "endpoints", normalised)
        secure = {url.startswith("https://") for url in normalised}
        if len(secure) > 1:
            raise ConfigurationError("endpoints: mix of http:// and https:// endpoints")
        try:
            KeySpace(self.root, self.namespace)
        except InvalidRecordError as exc:
            raise ConfigurationError(str(exc)) from exc
        for name in ("dial_timeout", "request_timeout", "election_timeout"):
            object.__setattr__(self, name, positive_seconds(name, getattr(self, name)))
        interval = self.member_sync_interval
        if isinstance(interval, bool) or not (interval == 0 or _is_positive_seconds(interval)):
            raise ConfigurationError(
                "member_sync_interval must be a positive number of seconds, or 0 (no "
                "periodic refresh)"
            )
        object.__setattr__(self, "member_sync_interval", float(interval))
        if not isinstance(self.member_sync, bool):
            raise ConfigurationError("member_sync must be True or False")
        limit = self.max_request_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(
                f"max_request_bytes must be a positive whole number of bytes, got {limit!r}"
            )
        self._check_tls(tls=secure == {True})
        if self.password is not None and self.password_file is not None:
            raise ConfigurationError("give password or password_file, not both")
        has_password = self.password is not None or self.password_file is not None
        if (self.username is None) == has_password:
            raise ConfigurationError("username and password must be given together")
        if self.username == "":
            raise ConfigurationError("username must not be empty")
        self._check_auth_channel(tls=secure == {True})
        self.read_password()  # an unreadable password file fails now, not at first use

    def _check_tls(self, *, tls: bool) -> None:
        for name in ("ca_cert", "cert", "key"):
            path = getattr(self, name)
            if path is None:
                continue
            if not tls:
                raise ConfigurationError(
                    f"{name} is set but the endpoints use http://; use https://"
                )
            if not os.path.isfile(path):
                raise ConfigurationError(f"{name}: file {path!r} does not exist")
        if (self.cert is None) != (self.key is None):
            raise ConfigurationError("cert and key must be given together (client certificate)")

    def _check_auth_channel(self, *, tls: bool) -> None:
        if not isinstance(self.allow_insecure_auth, bool):
            raise ConfigurationError("allow_insecure_auth must be True or False")
        if self.username is None or tls:
            return
        endpoints = ", ".join(self.endpoints)
        if not self.allow_insecure_auth:
            raise ConfigurationError(
                f"refusing to send the password of etcd user {self.username!r} unencrypted "
                f"to {endpoints}: use https:// endpoints, or accept the risk with "
                f"allow_insecure_auth ({ENV_PREFIX}{_ENV_NAMES['allow_insecure_auth']}=1, "
                "--allow-insecure-auth)"
            )
        if not _insecure_auth_warned.is_set():
            _insecure_auth_warned.set()
            log.warning(
                "allow_insecure_auth: the password of etcd user %r crosses the network "
                "unencrypted to %s; use https:// endpoints outside tests",
                self.username,
                endpoints,
            )

    def read_password(self) -> str | None:
        """The password: ``password``, or the current content of ``password_file``."""
        if self.password_file is None:
            return self.password
        try:
            with open(self.password_file, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError as exc:
            raise ConfigurationError(
                f"password_file ({ENV_PREFIX}{_ENV_NAMES['password_file']}): cannot read "
                f"{self.password_file!r} ({exc.strerror})"
            ) from None

    @property
    def secure(self) -> bool:
        """Whether the endpoints use TLS."""
        return self.endpoints[0].startswith("https://")

    @property
    def keyspace(self) -> KeySpace:
        """The key layout for this root and namespace."""
        return KeySpace(self.root, self.namespace)

    def with_namespace(self, namespace: str) -> Settings:
        """Return a copy of these settings for another namespace."""
        return replace(self, namespace=namespace)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``DISCOVERY_*`` variables; keyword arguments win over them.

        ``DISCOVERY_ETCD_PASSWORD_FILE`` names a file holding the password (a mounted
        secret), read at every authentication; ``DISCOVERY_ETCD_PASSWORD`` (or a
        ``password`` argument) wins over it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, suffix in _ENV_NAMES.items():
            raw = env.get(ENV_PREFIX + suffix)
            if raw is None or raw == "":
                continue
            values[name] = _parse_env(name, suffix, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "password" in values:
            values.pop("password_file", None)
        return cls(**values)

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "password" and value is not None:
                value = "***"
            parts.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(parts)})"


def positive_seconds(name: str, value: object, *, finite: bool = True) -> float:
    """``value`` as seconds if it is a positive (``finite``) number, else ConfigurationError."""
    if not _is_positive_seconds(value, finite=finite):
        raise ConfigurationError(f"{name} must be a positive number of seconds")
    return float(value)


def _is_positive_seconds(value: object, *, finite: bool = True) -> TypeGuard[int | float]:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and value > 0
        and (not finite or math.isfinite(value))
    )


def env_names() -> dict[str, str]:
    """Every environment variable Settings.from_env reads, by settings field."""
    return {field: ENV_PREFIX + suffix for field, suffix in _ENV_NAMES.items()}


def settings_table() -> str:
    """The table of every ``DISCOVERY_*`` variable: its meaning and default, as declared."""
    defaults = {f.name: f.default for f in fields(Settings)}
    rows = ["| variable | meaning | default |", "|---|---|---|"]
    for name, (suffix, meaning) in _VARIABLES.items():
        rows.append(f"| `{ENV_PREFIX}{suffix}` | {meaning} | {_shown(defaults[name])} |")
    return "\n".join(rows)


def _shown(default: object) -> str:
    """A default as the table shows it: none blank, switches on/off, 5.0 as 5."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ", ".join(f"`{d}`" for d in default)
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"`{default}`"


def parse_endpoint(text: str) -> str:
    """``text`` as ``http(s)://host:port`` (http and 2379 if not given), or ConfigurationError."""
    raw = text.strip()
    raw = raw if "://" in raw else f"http://{raw}"
    if "@" in raw:
        # Never echo credentials someone put in a URL: show only what follows the last '@'
        # (a password may itself hold '@', '/' or ':', so no URL parser can be trusted here).
        raise ConfigurationError(
            f"endpoint {'***@' + raw.rpartition('@')[2]!r}: credentials do not belong in the "
            "URL; use username/password"
        )
    shown = repr(raw)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"endpoint {shown} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigurationError(f"endpoint {shown}: scheme must be http or https")
    if not parts.hostname:
        raise ConfigurationError(f"endpoint {shown} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigurationError(f"endpoint {shown}: only scheme://host:port is allowed")
    if port == 0:
        raise ConfigurationError(f"endpoint {shown}: port must be 1-65535")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port or 2379}"


def _parse_env(name: str, suffix: str, raw: str) -> str | float | bool:
    if name == "max_request_bytes":
        try:
            return int(raw)
        except ValueError:
            raise ConfigurationError(
                f"{ENV_PREFIX}{suffix}={raw!r} is not a whole number of bytes"
            ) from None
    if name in _SWITCHES:
        if raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise ConfigurationError(
            f"{ENV_PREFIX}{suffix}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)"
        )
    if not name.endswith(("timeout", "interval")):
        return raw
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(
            f"{ENV_PREFIX}{suffix}={raw!r} is not a number of seconds"
        ) from None
