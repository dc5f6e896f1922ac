"""A real Prometheus server for the tests: Debian's ``prometheus`` binary, on loopback.

``prometheus_problem()`` says why the Prometheus tests cannot run here (None when they
can): the ``prometheus`` or ``promtool`` binary is missing (``apt-get install
prometheus``; .ci/prometheus.sh installs it in CI). Tests that need them are marked
``prometheus``; conftest skips them with that reason, and in CI (``CI=true``) a skipped
one fails the run (tests/test_fixtures.py).

``PrometheusServer`` writes its own configuration (scrape and evaluation every second,
the given rule files, static targets per job), keeps its TSDB in a temporary directory,
listens on a free port of 127.0.0.1, and is stopped by its pid (SIGTERM, then SIGKILL)
with its directory removed, even when the test fails.

``shorten(rules)`` is the one substitution the live tests make to the production rules:
every duration of a ``for:`` and of a range selector is divided by 60 (minutes become
seconds: ``for: 1m`` is ``for: 1s``, ``[15m]`` is ``[15s]``), so that an alert that
waits a minute in production waits a second against a server that scrapes every second.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from discovery.testing.embedded import _free_ports

from .helpers import wait_for

# node id -> outcome of each Prometheus test run so far (conftest records them).
PROMETHEUS_OUTCOMES: dict[str, str] = {}

INTERVAL = "1s"
"""Scrape and evaluation interval of the test server."""

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION = re.compile(r"(?:\d+(?:ms|[smhdwy]))+")
_PART = re.compile(r"(\d+)(ms|[smhdwy])")
# A `for:` value, or the duration(s) of a range selector / subquery: [15m], [1h:1m].
_FOR = re.compile(r"^([ \t]*for:[ \t]*)(\S+)[ \t]*$", re.M)
_RANGE = re.compile(r"\[((?:\d+(?:ms|[smhdwy]))+)(?::((?:\d+(?:ms|[smhdwy]))+))?\]")


def prometheus_problem() -> str | None:
    """Why the Prometheus tests cannot run here, or None when they can."""
    missing = [name for name in ("prometheus", "promtool") if shutil.which(name) is None]
    if missing:
        return (
            f"no {' or '.join(missing)} binary: apt-get install prometheus "
            "(.ci/prometheus.sh does it in CI)"
        )
    return None


def seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``, ``15s``, ``500ms``) in seconds."""
    if not _DURATION.fullmatch(duration):
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS[unit] for n, unit in _PART.findall(duration))


def _duration(value: float) -> str:
    millis = round(value * 1000)
    assert millis > 0, value
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def shorten(text: str, factor: int = 60) -> tuple[str, int]:
    """``text`` (a rules file) with every ``for:`` and range duration divided by ``factor``.

    Returns the new text and how many durations were changed.
    """
    changed = 0

    def scale(duration: str) -> str:
        nonlocal changed
        changed += 1
        return _duration(seconds(duration) / factor)

    def for_line(match: re.Match[str]) -> str:
        return match.group(1) + scale(match.group(2))

    def range_selector(match: re.Match[str]) -> str:
        step = f":{scale(match.group(2))}" if match.group(2) else ""
        return f"[{scale(match.group(1))}{step}]"

    text = _FOR.sub(for_line, text)
    return _RANGE.sub(range_selector, text), changed


class PrometheusError(AssertionError):
    """The server did not start, or an API call failed."""


class PrometheusServer:
    """One Prometheus process scraping ``targets`` (job -> ["host:port", ...])."""

    def __init__(self, rule_files: list[Path], targets: dict[str, list[str]]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="discovery-prometheus-"))
        self.port = _free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        rules = []
        for index, path in enumerate(rule_files):
            copy = self.directory / f"rules-{index}-{path.name}"
            shutil.copy(path, copy)
            rules.append(str(copy))
        config = {
            "global": {
                "scrape_interval": INTERVAL,
                "scrape_timeout": INTERVAL,
                "evaluation_interval": INTERVAL,
            },
            "rule_files": rules,
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(hosts)}]}
                for job, hosts in targets.items()
            ],
        }
        self.config = self.directory / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = self.directory / "prometheus.log"

    def start(self) -> PrometheusServer:
        binary = shutil.which("prometheus")
        assert binary, prometheus_problem()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    # The console templates are Debian's (/etc/prometheus); none needed.
                    f"--web.console.templates={self.directory}",
                    f"--web.console.libraries={self.directory}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            wait_for(self._ready, timeout=60, message="Prometheus ready", interval=0.1)
        except AssertionError:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise PrometheusError(f"prometheus exited {self.process.returncode}:\n{self.logs()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server by its pid and remove its directory (idempotent)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the HTTP API ------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise PrometheusError(f"{url}: HTTP {exc.code}: {detail}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{url}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The active alerts (pending or firing) called ``name``."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def state(self, name: str) -> str:
        """``firing``, ``pending`` or ``inactive`` (the worst of its alerts)."""
        states = {a["state"] for a in self.alerts(name)}
        return next((s for s in ("firing", "pending") if s in states), "inactive")

    def rule_names(self) -> dict[str, str]:
        """Every loaded rule: name -> ``alerting`` / ``recording``."""
        return {
            rule["name"]: rule["type"]
            for group in self.api("rules")["groups"]
            for rule in group["rules"]
        }

    def targets_up(self) -> dict[str, int]:
        """job -> how many of its targets are up."""
        up: dict[str, int] = {}
        for target in self.api("targets")["activeTargets"]:
            job = target["labels"]["job"]
            up[job] = up.get(job, 0) + (target["health"] == "up")
        return up


@contextlib.contextmanager
def prometheus_server(rule_files: list[Path], targets: dict[str, list[str]]):
    server = PrometheusServer(rule_files, targets)
    try:
        yield server.start()
    finally:
        server.stop()


def stop_process(process: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM by pid, then SIGKILL; reaped either way."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


__all__ = [
    "PROMETHEUS_OUTCOMES",
    "PrometheusServer",
    "prometheus_problem",
    "prometheus_server",
    "seconds",
    "shorten",
    "stop_process",
]
