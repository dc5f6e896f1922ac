"""``discovery top`` in a real pseudo-terminal (pexpect), and ``discovery list -o``.

top redraws the whole screen every quarter of a second (rich's Live on the alternate
screen); the tests read what it draws: an engine shows within 1 s of its registration and
goes within 1 s of its removal, ``q`` exits 0, ``--selector`` filters, ``--sort`` and the
``s`` key order the rows, an engine under ``discovery launch`` shows its relayed load and
cached blocks, and without a terminal top prints ``watch``'s lines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from discovery import Settings, register_engine

from .helpers import ChildLog, cli_env, make_endpoint, run_cli, wait_for

REPO = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")
COLUMNS = (
    "ENGINE",
    "STATUS",
    "VERSION",
    "ROLE",
    "ADDRESS",
    "TTL",
    "LOAD",
    "CACHED",
    "LABELS",
    "WHY",
)


class Top:
    """A ``discovery top`` in a pseudo-terminal, and what it last drew."""

    def __init__(self, settings: Settings, *args: str) -> None:
        self.title = re.escape(settings.keyspace.prefix)
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "discovery", "top", *args],
            env={**cli_env(settings), "TERM": "xterm-256color"},
            dimensions=(30, 200),
            encoding="utf-8",
            codec_errors="replace",
            timeout=30,
            cwd=str(REPO),
        )

    def expect(self, pattern: str, timeout: float) -> float:
        """Wait for ``pattern`` in what top draws from now on; the seconds it took."""
        started = time.monotonic()
        self.child.expect(pattern, timeout=timeout)
        return time.monotonic() - started

    def frame(self) -> list[str]:
        """The next whole screen top draws (lines without escape codes), after what it drew
        until now."""
        while True:  # skip what is drawn already
            try:
                self.child.read_nonblocking(1 << 20, timeout=0.05)
            except pexpect.TIMEOUT:
                break
        self.child.expect(self.title, timeout=10)
        self.child.expect(self.title, timeout=10)
        text = ANSI.sub("", self.child.before).replace("\r", "")
        return [line.rstrip() for line in text.split("\n") if line.strip()]

    def rows(self) -> dict[str, list[str]]:
        """Engine id -> its cells, from the next screen."""
        lines = self.frame()
        start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ENGINE", "STATUS"])
        return {line.split()[0]: line.split() for line in lines[start + 1 :] if "tcp://" in line}

    def quit(self) -> int:
        self.child.send("q")
        self.child.expect(pexpect.EOF, timeout=15)
        self.child.close()
        assert self.child.signalstatus is None
        return self.child.exitstatus

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def top_factory() -> Iterator:
    started: list[Top] = []

    def start(settings: Settings, *args: str) -> Top:
        top = Top(settings, *args)
        started.append(top)
        return top

    yield start
    for top in started:
        top.close()


def test_top_shows_an_engine_within_a_second_of_its_registration_and_drops_it_within_a_second(
    settings: Settings, top_factory
) -> None:
    top = top_factory(settings)
    top.expect(r" 0 engines ", timeout=30)  # drawing, the watcher's listing done
    reg = register_engine(
        make_endpoint(3), engine_id="top-1", ttl=6, labels={"model": "m"}, settings=settings
    )
    try:
        shown = top.expect(r"top-1", timeout=1)
        rows = wait_for(lambda: (r := top.rows()) and r["top-1"][5] != "-" and r, 5, "its TTL")
        _, status, version, role, address, ttl, load, cached, labels, why = rows["top-1"]
        assert (status, version, address) == ("ready", "-", reg.endpoint.coordinator_address)
        assert role == "-"  # aggregated, the absent role
        assert (load, cached, labels) == ("-", "-", "model=m")  # no state relay
        assert why == "candidate"
        assert 0 <= int(ttl.removesuffix("s")) <= 6
        title = top.frame()[0]
        assert "1 engines (1 ready)" in title and "watcher connected, current" in title
    finally:
        reg.close()  # the key is gone when close returns
    gone = top.expect(r" 0 engines ", timeout=1)
    assert "top-1" not in "\n".join(top.frame())
    assert top.quit() == 0
    print(f"top showed the engine {shown:.3f} s after it registered, dropped it {gone:.3f} s after")


def test_top_filters_by_selector_sorts_and_cycles_the_sort_key(
    settings: Settings, top_factory
) -> None:
    regs = [
        register_engine(make_endpoint(i), engine_id=name, labels=labels, settings=settings, **kw)
        for i, (name, labels, kw) in enumerate(
            (
                (
                    "a-draining",
                    {"model": "a"},
                    {"status": "draining", "weight_version": 3, "role": "prefill"},
                ),
                ("b-ready", {"model": "a"}, {"weight_version": 5, "role": "decode"}),
                ("c-other", {"model": "b"}, {}),
            )
        )
    ]
    try:
        # A set-based selector (c-other is model b), short: the title fills the 200 columns.
        top = top_factory(settings, "--selector", "model != b", "--sort", "status")
        top.expect(r" 2 engines ", timeout=30)
        assert list(top.rows()) == ["b-ready", "a-draining"]  # ready before draining
        title = top.frame()[0]
        assert "[model!=b]" in title and "sort: status" in title
        top.child.send("s")  # the next key: role, prefill before decode
        wait_for(lambda: "sort: role" in top.frame()[0], 5, "the sort key to change")
        rows = top.rows()
        assert list(rows) == ["a-draining", "b-ready"]
        assert (rows["a-draining"][3], rows["b-ready"][3]) == ("prefill", "decode")
        top.child.send("s")  # version, newest first
        wait_for(lambda: "sort: version" in top.frame()[0], 5, "sort by version")
        assert list(top.rows()) == ["b-ready", "a-draining"]
        top.child.send("ssss")  # ttl, load, cached, address
        wait_for(lambda: "sort: address" in top.frame()[0], 5, "sort by address")
        top.child.send("s")
        wait_for(lambda: "sort: engine" in top.frame()[0], 5, "sort by engine")
        assert list(top.rows()) == ["a-draining", "b-ready"]
        assert top.quit() == 0
    finally:
        for reg in regs:
            reg.close()


def _launch(settings: Settings, engine_id: str, log: ChildLog) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "discovery", "launch", "--engine-id", engine_id,
            "--label", "model=relay", "--ttl", "5",
            "--", sys.executable, "-m", "discovery.testing.stand_in_engine",
            "--dynamo-parent-event-address", "{event_address}", "--kv-events", "6",
        ],
        env=cli_env(settings),
        stdout=log.file,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_top_and_list_wide_show_the_load_and_cached_blocks_an_engine_relays(
    settings: Settings, top_factory
) -> None:
    log = ChildLog()
    launcher = _launch(settings, "relayed", log)
    plain = register_engine(make_endpoint(1), engine_id="plain", settings=settings)
    try:
        top = top_factory(settings, "--sort", "cached")
        rows = wait_for(
            lambda: (r := top.rows()) and "relayed" in r and r["relayed"][7].isdigit() and r,
            timeout=30,
            message="the relayed engine's cached blocks",
        )
        assert list(rows) == ["relayed", "plain"]  # most cached blocks first
        _, status, _, _, _, _, load, cached, labels, _ = rows["relayed"]
        assert (status, load, labels) == ("ready", "0", "model=relay")
        assert int(cached) > 0
        assert rows["plain"][6:8] == ["-", "-"]
        assert top.quit() == 0

        wide = run_cli(settings, "list", "-o", "wide")
        assert wide.returncode == 0, wide.stderr
        header, *lines = wide.stdout.splitlines()[:-1]
        assert header.split()[-5:] == ["LOAD", "CACHED", "STATE", "RELAY", "LABELS"]
        cells = {line.split()[0]: line.split() for line in lines}
        assert cells["relayed"][-4] == "0" and int(cells["relayed"][-3]) > 0
        assert cells["relayed"][-2].startswith("tcp://127.0.0.1:")
        assert cells["plain"][-4:-1] == ["-", "-", "-"]
        selected = run_cli(settings, "list", "-o", "json", "--selector", "model=relay")
        assert selected.returncode == 0, selected.stderr
        listed = json.loads(selected.stdout)["engines"]
        assert [e["engine_id"] for e in listed] == ["relayed"]
        assert listed[0]["state_address"] == cells["relayed"][-2]
        table = run_cli(settings, "list", "--format", "table")
        assert table.returncode == 0 and "LOAD" not in table.stdout and "relayed" in table.stdout
    finally:
        plain.close()
        launcher.terminate()
        try:
            launcher.wait(20)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait(10)
        print(log.read()[-3000:])
        log.close()


def test_without_a_terminal_top_prints_one_line_per_event(settings: Settings) -> None:
    log = ChildLog()
    top = subprocess.Popen(
        [sys.executable, "-m", "discovery", "top"],
        env=cli_env(settings),
        stdout=log.file,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    reg = register_engine(make_endpoint(2), engine_id="piped", settings=settings)
    try:

        def lines() -> list[list[str]]:
            return [line.split()[:2] for line in log.read().splitlines() if " piped " in line]

        wait_for(lambda: lines() == [["added", "piped"]], 30, "the added line")
        reg.close()
        # Announced as it goes: marked stopping, then removed.
        gone = [["added", "piped"], ["updated", "piped"], ["removed", "piped"]]
        wait_for(lambda: lines() == gone, 10, "removed")
        assert "\x1b" not in log.read()
        top.terminate()
        assert top.wait(10) == 0
    finally:
        reg.close()
        if top.poll() is None:
            top.kill()
            top.wait(10)
        log.close()
