"""README's first command: the demo runs to completion quickly and leaves nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

# The demo runs in a process of its own.
pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parent.parent


def _processes_mentioning(marker: str, where: str = "cmdline") -> list[str]:
    """Processes with ``marker`` in their command line (or environment: ``where``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / where).read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(f"{entry.name}: {cmdline}")
    return found


def test_demo_runs_under_a_minute_and_leaves_nothing_running(tmp_path: Path) -> None:
    namespace = f"demo-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    env["TMPDIR"] = str(tmp_path)  # the embedded etcd's data directory lands here
    started = time.monotonic()
    result = subprocess.run(
        ["./dev", "demo", "--namespace", namespace],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 60, elapsed
    out = result.stdout
    assert "started an embedded etcd" in out
    assert "3 engines: demo-engine-0, demo-engine-1, demo-engine-2" in out
    hard = re.search(r"demo-engine-0 removed (\d+\.\d+) s after SIGKILL", out)
    soft = re.search(r"demo-engine-1 removed (\d+\.\d+) s after SIGTERM", out)
    crash = re.search(r"demo-engine-2 removed (\d+\.\d+) s after SIGKILL", out)
    assert hard and soft and crash, out
    assert 2.0 <= float(hard.group(1)) <= 3 + 2  # the lease had to expire
    assert float(soft.group(1)) < 0.5  # the lease was revoked
    assert float(crash.group(1)) < 1.0  # the engine died: its launcher revoked the lease
    picks = r"30 picks: ((?:demo-engine-\d x\d+(?:, )?)+)"
    stalled = re.search(r"demo-engine-1 stalled (\d+\.\d+) s after SIGSTOP .*; " + picks, out)
    back = re.search(r"demo-engine-1 ready again (\d+\.\d+) s after SIGCONT; " + picks, out)
    assert stalled and back, out
    # Silence counts from the engine's last frame, up to a progress interval (0.5 s)
    # before the SIGSTOP; the mark comes within the stall timeout + 1 s.
    assert 2.0 - 0.5 <= float(stalled.group(1)) <= 2.0 + 1.0
    assert "demo-engine-1" not in stalled.group(2)  # skipped while stalled
    assert float(back.group(1)) < 1.0 and "demo-engine-1 x" in back.group(2)
    # The engines play Megatron's roles (0 aggregated, 1 prefill, 2 decode): a pair, and a
    # short prompt on the aggregated engine alone.
    assert re.search(r"added +demo-engine-1 \S+ ready prefill rev=", out), out
    assert re.search(r"added +demo-engine-2 \S+ ready decode rev=", out), out
    assert (
        "a pair for a 1024-token prompt: demo-engine-1 (prefill) -> demo-engine-2 (decode): "
        "nixl, one model, TP 2 to TP 1 (Megatron reshards)"
    ) in out
    assert "a 16-token prompt, aggregated engines allowed: demo-engine-0 alone" in out
    assert "etcdctl --endpoints http://127.0.0.1:" in out and "get --prefix" in out
    assert "nothing left running" in out
    assert _processes_mentioning(namespace) == []
    assert _processes_mentioning(str(tmp_path)) == []
    # Engines, launchers and guards inherit the demo's environment: none may be left.
    assert _processes_mentioning(f"TMPDIR={tmp_path}", where="environ") == []
    assert not any(tmp_path.glob("discovery-etcd-*")), "etcd data directory left behind"
