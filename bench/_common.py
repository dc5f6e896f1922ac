"""Helpers shared by the benchmarks: machine facts, percentiles, etcd, RESULTS.md, targets.

Every benchmark is one script, runnable as ``.venv/bin/python bench/<name>.py``. Each
prints a compact table, appends a dated section to bench/RESULTS.md and writes its raw
figures to bench/out/<name>.json (read by bench/run_all.py for the plot and the summary).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# Runs from a checkout; DISCOVERY_BENCH_PACKAGE points at another copy of the package (the
# directory holding discovery/), e.g. a prototype, to compare it on the same benchmarks.
sys.path.insert(0, os.environ.get("DISCOVERY_BENCH_PACKAGE") or str(ROOT))

from discovery import (  # noqa: E402 - after the path tweak
    EngineRecord,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
    RoutingTable,
)
from discovery._store import EngineStore, Entry  # noqa: E402
from discovery.embedded import EtcdCluster, find_binary  # noqa: E402

RESULTS = BENCH / "RESULTS.md"
OUT = BENCH / "out"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- machine and versions ---------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def etcd_version() -> str:
    out = subprocess.run(
        [find_binary("etcd"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    for line in out.splitlines():
        if line.startswith("etcd Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def machine_line() -> str:
    return (
        f"Machine: {os.cpu_count()} cores, {cpu_model()}, Linux {platform.release()}; "
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"etcd {etcd_version()}, grpcio {_version('grpcio')}, "
        f"python3-etcd3 {_version('python3-etcd3')}, protobuf {_version('protobuf')}."
    )


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


# -- targets -------------------------------------------------------------------------------


@dataclass
class Target:
    """One target of issue 7: ``value`` against ``limit`` (lower is better)."""

    name: str
    value: float
    limit: float
    unit: str

    @property
    def ok(self) -> bool:
        return self.value <= self.limit

    def line(self) -> str:
        verdict = "met" if self.ok else "MISSED"
        return f"target {self.name}: {self.value:.3g} {self.unit} <= {self.limit:g}: {verdict}"


# -- output ----------------------------------------------------------------------------------


def append_results(title: str, body: str, *, notes: str = "") -> None:
    """Append a dated section (machine, versions, load, the table) to RESULTS.md."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = [f"\n## {title}, {stamp}\n", machine_line(), ""]
    if notes:
        section += [notes.strip(), ""]
    section += ["```", body.rstrip(), f"load average after the run: {load_average()}", "```", ""]
    with RESULTS.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(section))


def write_json(name: str, data: dict) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.json"
    payload = {**data, "targets": [asdict(t) for t in data.get("targets", [])]}
    path.write_text(json.dumps(payload, default=float))
    return path


def read_json(name: str) -> dict | None:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- etcd ----------------------------------------------------------------------------------


@contextlib.contextmanager
def etcd_cluster(size: int = 1, **kwargs) -> Iterator[EtcdCluster]:
    """A private etcd cluster on free loopback ports, always stopped (by pid) at the end."""
    cluster = EtcdCluster(size, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def etcd_metrics(url: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of each named metric (over its label sets) from etcd's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in totals:
            totals[metric] += float(line.rsplit(" ", 1)[1])
    return totals


class CpuMeter:
    """CPU share of a set of processes over a window (1.0 = one core busy)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._t0 = time.monotonic()
        self._c0 = sum(proc_cpu_seconds(p) for p in self.pids)

    def share(self) -> float:
        used = sum(proc_cpu_seconds(p) for p in self.pids) - self._c0
        return used / (time.monotonic() - self._t0)


# -- records ---------------------------------------------------------------------------------


def make_endpoint(index: int) -> InferenceEngineEndpoint:
    """A realistic endpoint: prefix caching on, distinct address and KV size per index."""
    return InferenceEngineEndpoint(
        f"tcp://10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}:5555",
        InferenceEngineCapabilities(
            context_length=8192,
            kv_cache_block_size=256,
            total_kv_blocks=4000 + index % 1000,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            bos_token_id=1,
            enable_prefix_caching=True,
            logical_data_parallel_size=1,
            prefix_caching_coordinator_policy=PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK,
        ),
    )


LABELS = {"model": "llama-3-8b", "zone": "a", "pool": "prefill"}


def memory_table(engines: int, **capabilities: int) -> RoutingTable:
    """A RoutingTable of ``engines`` alike engines ``engine-000``..., fed in memory (no etcd).

    They advertise ``first_prefix_block``; ``capabilities`` sets ``context_length``,
    ``kv_cache_block_size``, ``total_kv_blocks`` and ``max_num_seqs``.
    """
    caps = InferenceEngineCapabilities(
        max_num_batched_tokens=8192,
        bos_token_id=1,
        enable_prefix_caching=True,
        prefix_caching_coordinator_policy=PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK,
        **capabilities,
    )
    table = RoutingTable(EngineStore())
    entries = {}
    for i in range(engines):
        address = f"tcp://10.0.{i // 250}.{i % 250}:5555"
        record = EngineRecord(f"engine-{i:03d}", InferenceEngineEndpoint(address, caps))
        entries[record.engine_id] = Entry(f"/k/{record.engine_id}", record, 1)
    table.store.replace(entries, 1)
    return table


def table_text(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A compact fixed-width table."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    return "\n".join(line.rstrip() for line in lines)
