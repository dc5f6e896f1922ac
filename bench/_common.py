"""Helpers shared by the benchmarks: machine facts, percentiles, etcd, targets, the page.

Every benchmark is one script, runnable as ``.venv/bin/python bench/bench_<name>.py``. Each
prints a compact table and writes its raw figures to bench/out/<name>.json (read by
bench/run_all.py for the plot and the summary). Unless told not to, it then records the run
(``record_results``): the dated section replaces bench/results/<name>.md (the one before it
moves to bench/history/<name>.md), its targets go to bench/results/<name>.targets.json, and
bench/RESULTS.md is rebuilt (``render_page``) from every benchmark's latest section and
target figures and the short note in bench/notes/<name>.md. The chaos soak
(tests/test_chaos.py) is not a script here: its section, bench/results/chaos.md, is pasted
by hand (the previous one moved to bench/history/chaos.md), then
``bench/run_all.py --page-only`` rebuilds the page.
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
from discovery._reads.store import EngineStore, Entry  # noqa: E402
from discovery.testing.embedded import EtcdCluster, find_binary  # noqa: E402

RESULTS = BENCH / "RESULTS.md"  # the page: generated, never edited by hand
SECTIONS = BENCH / "results"  # <name>.md: latest section; <name>.targets.json: its targets
HISTORY = BENCH / "history"  # <name>.md: the sections replaced, oldest first
NOTES = BENCH / "notes"  # <name>.md: what the figures say (hand-written, a few lines)
PAGE_ORDER = (
    "latency",
    "detection",
    "scale",
    "churn",
    "sync",
    "startup",
    "codec",
    "fanout",
    "sessions",
    "router",
    "hashing",
    "routing_quality",
    "pairs",
    "relay",
    "overload",
    "fleet",
    "failures",
    "chaos",
)
# Set (to "1") by run_all.py for a benchmark's second run, beside one CPU-burning process
# (``burners(1)``): its section and figures are recorded as <name>.busy, beside the idle ones.
BUSY_ENV = "DISCOVERY_BENCH_BUSY"
BUSY = ".busy"
PLOT = BENCH / "latency.png"  # drawn by run_all.py from these benchmarks' bench/out files:
PLOTTED = ("latency", "detection", "churn", "scale")
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
    at_least: bool = False  # the value must reach the limit (a throughput), not stay under

    @property
    def ok(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def verdict(self) -> str:
        return "met" if self.ok else "MISSED"

    def line(self) -> str:
        return f"target {self.name}: {self.measured} {self.unit} {self.bound}: {self.verdict}"

    @property
    def bound(self) -> str:
        return f"{'>=' if self.at_least else '<='} {_figure(self.limit, self.unit)}"

    @property
    def measured(self) -> str:
        """The value with enough digits that it reads apart from the limit ("1.48" vs "1.2")."""
        text = _figure(self.value, self.unit)
        digits = 3
        # Rounding must not make a miss look like the limit ("1 x <= 1 x: MISSED").
        while self.value != self.limit and text == _figure(self.limit, self.unit) and digits < 9:
            digits += 1
            text = _figure(self.value, self.unit, digits)
        return text


def _figure(value: float, unit: str, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures (whole numbers as they are, never 1e+03);
    a ratio ("x") always with 2 decimals."""
    if unit == "x":
        return f"{value:.{max(2, digits - 1)}f}"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"


# -- output ----------------------------------------------------------------------------------


LOAD = "load average after the run: "


def record_results(
    name: str, body: str, *, about: str = "", targets: Sequence[Target] = ()
) -> None:
    """Make this run benchmark ``name``'s section of RESULTS.md, and rebuild the page.

    The section (date, machine, ``about``: how it measures, the printed ``body``, the load
    average) replaces bench/results/<name>.md; the text it replaces is appended to
    bench/history/<name>.md. ``targets`` replace bench/results/<name>.targets.json.
    """
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    heading = f"## bench_{name}.py, {stamp}"
    if busy():
        heading = f"## bench_{name}.py with one CPU-burning process, {stamp}"
        name += BUSY
    section = [heading, "", machine_line(), ""]
    if about:
        section += [about.strip(), ""]
    section += ["```", body.rstrip(), LOAD + load_average(), "```"]
    latest = SECTIONS / f"{name}.md"
    if latest.exists():
        HISTORY.mkdir(exist_ok=True)
        history = HISTORY / f"{name}.md"
        title = f"# bench_{name}.py: earlier runs, oldest first\n"
        earlier = history.read_text(encoding="utf-8") if history.exists() else title
        previous = latest.read_text(encoding="utf-8")
        history.write_text(f"{earlier.rstrip()}\n\n{previous.rstrip()}\n", encoding="utf-8")
    SECTIONS.mkdir(exist_ok=True)
    latest.write_text("\n".join(section) + "\n", encoding="utf-8")
    figures = json.dumps([asdict(t) for t in targets], indent=1)
    (SECTIONS / f"{name}.targets.json").write_text(figures + "\n", encoding="utf-8")
    render_page()


def busy() -> bool:
    """Whether this run is the busy one (run_all.py runs a burner beside it)."""
    return os.environ.get(BUSY_ENV) == "1"


def recorded_targets(name: str) -> list[Target]:
    path = SECTIONS / f"{name}.targets.json"
    if not path.exists():
        return []
    return [Target(**t) for t in json.loads(path.read_text(encoding="utf-8"))]


def _page_section(name: str, section: str) -> list[str]:
    """A benchmark on the page: heading, figures, note, then load average and links.

    Its figures are shown once: a benchmark with targets has them in the summary table,
    one without shows its printout here. Every figure is in the whole section, linked.
    """
    lines = section.splitlines()
    start = lines.index("```")
    printout = lines[start + 1 : lines.index("```", start + 1)]
    loads = [line.removeprefix(LOAD) for line in printout if line.startswith(LOAD)]
    footer = [f"Load average after the run: {load}" for load in loads]
    footer.append(f"[whole section](results/{name}.md)")
    if (HISTORY / f"{name}.md").exists():
        footer.append(f"[earlier runs](history/{name}.md)")
    # Plots and notes are the idle run's (a busy run writes bench/out/<name>.busy.json).
    if name in PLOTTED and PLOT.exists():
        footer.append(f"[plot]({PLOT.name})")
    own = BENCH / f"{name}.png"  # a benchmark's own plot (latency.png is run_all.py's)
    if own.exists() and own != PLOT:
        footer.append(f"[plot]({own.name})")
    figures = [line for line in printout if not line.startswith(LOAD)]
    figures = [] if recorded_targets(name) else ["```", *figures, "```", ""]
    note = NOTES / f"{name}.md"
    # The note and the footer are one paragraph, with a line break (a trailing backslash).
    notes = [f"**Notes.** {note.read_text(encoding='utf-8').strip()}\\"] if note.exists() else []
    return [lines[0], "", *figures, *notes, " · ".join(footer), ""]


def render_page() -> None:
    """Rebuild RESULTS.md from bench/results/ (sections, targets) and bench/notes/."""

    def place(name: str) -> tuple[int, str]:  # a busy section right after its idle one
        base = name.removesuffix(BUSY)
        return (PAGE_ORDER.index(base) if base in PAGE_ORDER else len(PAGE_ORDER), name)

    names = sorted((path.stem for path in SECTIONS.glob("*.md")), key=place)
    sections = {name: (SECTIONS / f"{name}.md").read_text(encoding="utf-8") for name in names}
    machines: dict[str, list[str]] = {}
    for name, section in sections.items():
        for line in section.splitlines():
            if line.startswith("Machine: "):
                machines.setdefault(line.removeprefix("Machine: ").rstrip("."), []).append(name)
    page = [
        "# Benchmark results",
        "",
        "The latest run of each benchmark: every target first, then per benchmark a note on what",
        "its figures say (one without targets shows its printout there). A benchmark's whole",
        "latest section (method, machine, every figure) is in [results/](results/); earlier runs",
        "are in [history/](history/), never here. Generated, do not edit. To rerun everything",
        "and rewrite it: `.venv/bin/python bench/run_all.py`. A `bench/bench_<name>.py` run alone",
        "replaces its own section; `bench/run_all.py --page-only` only rebuilds the page (after",
        "editing a note in [notes/](notes/), say). run_all.py runs each benchmark twice: idle,",
        "then beside one CPU-burning process (rows marked *busy*; bench_megatron.py and",
        "bench_serve.py take both phases themselves, their targets say which).",
        "",
        *(f"Machine: {machine} ({', '.join(used)})." for machine, used in machines.items()),
        "",
        "## Targets",
        "",
        "| benchmark | target | limit | measured | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        for i, t in enumerate(recorded_targets(name)):
            cells = (
                f"[{name.replace(BUSY, ', *busy*')}](results/{name}.md)" if i == 0 else "",
                t.name,
                f"{t.bound} {t.unit}".strip(),
                f"{t.measured} {t.unit}".strip(),
                t.verdict if t.ok else f"**{t.verdict}**",
            )
            page.append(f"| {' | '.join(cells)} |")
    page.append("")
    for name, section in sections.items():
        page += _page_section(name, section)
    RESULTS.write_text("\n".join(page).rstrip() + "\n", encoding="utf-8")


def write_json(name: str, data: dict) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}{BUSY if busy() else ''}.json"
    payload = {**data, "targets": [asdict(t) for t in data.get("targets", [])]}
    path.write_text(json.dumps(payload, default=float))
    return path


def read_json(name: str) -> dict | None:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- etcd ----------------------------------------------------------------------------------


@contextlib.contextmanager
def burners(n: int) -> Iterator[list[int]]:
    """``n`` CPU-burning processes, stopped by pid on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


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


def memory_table(engines: int, *, state_relays: bool = False, **capabilities: int) -> RoutingTable:
    """A RoutingTable of ``engines`` alike engines ``engine-000``..., fed in memory (no etcd).

    They advertise ``first_prefix_block``; ``capabilities`` sets ``context_length``,
    ``kv_cache_block_size``, ``total_kv_blocks`` and ``max_num_seqs``. ``state_relays``:
    each record carries a ``state_address`` (nothing listens there: an ``EngineStates``
    started with ``connect=False`` follows them and is fed by hand).
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
        record = EngineRecord(
            f"engine-{i:03d}",
            InferenceEngineEndpoint(address, caps),
            state_address=f"tcp://10.1.{i // 250}.{i % 250}:5556" if state_relays else None,
        )
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
