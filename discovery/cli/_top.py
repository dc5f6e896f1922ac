"""``discovery top``: the live routing table in a terminal, redrawn in place.

One connection serves a watched table (``watch_table``: every change within
milliseconds), ``EngineStates`` on that table (each relaying engine's load and cached
blocks; passive: it reports no load of its own), a passive ``Router`` on the table (never
picks; it says why each engine is or is not a candidate, and keeps the engines of a mass
lease loss as unconfirmed, as every router does) and ``LeaseTtls``, a thread that reads the
engines' remaining lease TTLs with ``list_engines(lease_ttls=True)`` every second (one
request per engine) and counts them down in between. rich's ``Live`` draws the screen;
the header says how current the watcher is. Keys: ``q`` quits (exit 0), ``s`` sorts by
the next column. SIGINT / SIGTERM also end it with 0.

Without a terminal (stdout not a TTY) it prints what ``discovery watch`` prints: one line
per event.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import sys
import termios
import threading
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from discovery import (
    Connection,
    EngineRecord,
    EngineRole,
    EngineStates,
    EngineStatus,
    EtcdPort,
    Router,
    RoutingSnapshot,
    RoutingTable,
    Selector,
    Settings,
    Split,
    StopSignals,
    WatcherHealth,
    list_engines,
    watch_table,
)

from ._args import UsageError, add_selector_flag, add_split_flag

if TYPE_CHECKING:
    from rich.console import RenderableType

SORT_KEYS = ("engine", "status", "role", "version", "ttl", "load", "cached", "address")
"""``--sort`` keys, in the order ``s`` cycles through them."""
_STATUS_ORDER = {status.value: index for index, status in enumerate(EngineStatus)}
_ROLE_ORDER = {role.value: index for index, role in enumerate(EngineRole)}
_STATUS_STYLE = {
    "ready": "green",
    "starting": "cyan",
    "draining": "yellow",
    "paused": "blue",
    "stalled": "bold red",
}
REFRESH = 0.25
"""Seconds between redraws (and key checks)."""
LOG_LINES = 3
"""Log lines shown under the table (the last ones)."""
TTL_EVERY = 1.0
"""Seconds between two readings of the lease TTLs."""


@dataclass(frozen=True)
class Row:
    """One engine as ``top`` and ``list -o wide`` show it."""

    engine_id: str
    status: str
    version: int | None
    role: str
    address: str
    ttl: float | None
    """Seconds left on its lease (None: not read yet, or no lease)."""
    labels: Mapping[str, str]
    load: int | None
    """Requests in flight on it, summed over the routers that report (relayed); else None."""
    cached: int | None
    """Block hashes it caches (relayed, synced and fresh); else None."""
    relay: str
    """Its state relay: ``-`` (none), ``synced``, ``syncing``, ``stale``."""
    why: str = "-"
    """Why it is or is not a candidate (``Router.explain``); ``-`` when not asked."""


def engine_rows(
    records: Mapping[str, EngineRecord],
    ttls: Mapping[str, float | None],
    states: EngineStates | None,
    router: Router | None = None,
) -> list[Row]:
    """The rows of ``records`` (engine id -> record), with TTLs, relayed state and reasons."""
    rows = []
    for engine_id, record in records.items():
        load = cached = None
        relay = "-"
        state = states.state(engine_id) if states is not None else None
        if states is not None and state is not None:
            fresh = states.fresh(engine_id)
            if fresh is not None:
                relay = "synced"
                load = int(fresh.get("in_flight", 0))
                cached = len(state.blocks)
            else:
                relay = "stale" if state.synced else "syncing"
        rows.append(
            Row(
                engine_id=engine_id,
                status=record.status.value,
                version=record.weight_version,
                role=str(record.role),
                address=record.endpoint.coordinator_address,
                ttl=ttls.get(engine_id),
                labels=record.labels,
                load=load,
                cached=cached,
                relay=relay,
                why="-" if router is None else router.explain(engine_id).reason,
            )
        )
    return rows


def _missing_last(value: float | None, descending: bool = False) -> tuple[bool, float]:
    if value is None:
        return (True, 0.0)
    return (False, -value if descending else value)


_SORTS: dict[str, Callable[[Row], Any]] = {
    "engine": lambda r: r.engine_id,
    "status": lambda r: (_STATUS_ORDER.get(r.status, len(_STATUS_ORDER)), r.engine_id),
    "role": lambda r: (_ROLE_ORDER.get(r.role, len(_ROLE_ORDER)), r.role, r.engine_id),
    "version": lambda r: (_missing_last(r.version, descending=True), r.engine_id),
    "ttl": lambda r: (_missing_last(r.ttl), r.engine_id),
    "load": lambda r: (_missing_last(r.load, descending=True), r.engine_id),
    "cached": lambda r: (_missing_last(r.cached, descending=True), r.engine_id),
    "address": lambda r: (r.address, r.engine_id),
}


def sort_rows(rows: Sequence[Row], key: str) -> list[Row]:
    """``rows`` sorted by ``key`` (one of ``SORT_KEYS``).

    By engine id, status, role (aggregated, prefill, decode, then roles this version does
    not know), version (newest first), TTL left (soonest first), load and cached blocks
    (most first), or address; ties by engine id.
    """
    return sorted(rows, key=_SORTS[key])


def cells(row: Row) -> list[str]:
    """The row's cells: ENGINE STATUS VERSION ROLE ADDRESS TTL LOAD CACHED LABELS WHY."""
    return [
        row.engine_id,
        row.status,
        "-" if row.version is None else f"v{row.version}",
        "-" if row.role == EngineRole.AGGREGATED else row.role,  # as list shows it
        row.address,
        "-" if row.ttl is None else f"{row.ttl:.0f}s",
        "-" if row.load is None else str(row.load),
        row.relay if row.cached is None and row.relay != "-" else _count(row.cached),
        ",".join(f"{k}={v}" for k, v in sorted(row.labels.items())) or "-",
        row.why,
    ]


HEADERS = (
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


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


class LeaseTtls:
    """The engines' lease TTLs, read every ``every`` seconds on a thread, counted down between.

    ``left(engine_id)`` is the TTL read last minus the time since; None before the first
    reading of that engine, or for a key without a lease.
    """

    def __init__(
        self,
        settings: Settings,
        connection: EtcdPort,
        selector: Selector,
        every: float = TTL_EVERY,
    ) -> None:
        self._settings = settings
        self._connection = connection
        self._selector = selector
        self._every = every
        self._read: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="discovery-top-ttls", daemon=True)
        self.error: str | None = None
        """Why the last reading failed, or None."""

    def __enter__(self) -> LeaseTtls:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(2.0)  # a daemon: a reading stuck on an unreachable etcd is left

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = list_engines(
                    self._settings,
                    selector=self._selector,
                    connection=self._connection,
                    lease_ttls=True,
                )
            except Exception as exc:  # shown in the header, tried again
                self.error = f"{type(exc).__name__}: {exc}"
            else:
                now = time.monotonic()
                self._read = {
                    e.engine_id: (e.ttl, now) for e in listing.engines if e.ttl is not None
                }
                self.error = None
            self._stop.wait(self._every)

    def left(self) -> dict[str, float | None]:
        """Engine id -> seconds left on its lease, as of now."""
        now = time.monotonic()
        return {
            engine_id: max(0.0, ttl - (now - at)) for engine_id, (ttl, at) in self._read.items()
        }


@dataclass
class View:
    """What ``top`` shows: the table and its companions, the selector, the sort key."""

    table: RoutingTable
    states: EngineStates
    router: Router
    ttls: LeaseTtls
    prefix: str
    selector: Selector
    sort: str
    log: deque[str]

    def title(self, snapshot: RoutingSnapshot, health: WatcherHealth) -> str:
        """The first line: where, how many, how current; the keys."""
        counts: dict[str, int] = {}
        for record in snapshot.values():
            counts[record.status.value] = counts.get(record.status.value, 0) + 1
        by_status = ", ".join(
            f"{counts[s.value]} {s.value}" for s in EngineStatus if s.value in counts
        )
        selector = str(self.selector)
        fresh = (
            f"STALE {health.staleness:.0f}s (last table served)"
            if health.stale
            else f"current ({health.staleness:.1f}s)"
        )
        unconfirmed = self.router.health().unconfirmed
        kept = (
            f"  {len(unconfirmed)} UNCONFIRMED (records gone {max(unconfirmed.values()):.0f}s)"
            if unconfirmed
            else ""
        )
        line = (
            f"{self.prefix}{f' [{selector}]' if selector else ''}  rev {snapshot.revision}  "
            f"{len(snapshot)} engines{f' ({by_status})' if by_status else ''}{kept}  "
            f"watcher {health.state.value}, {fresh}  sort: {self.sort}  [q] quit [s] sort"
        )
        return line + (f"  TTLs: {self.ttls.error}" if self.ttls.error else "")

    def screen(self) -> RenderableType:
        """The header line, the table, and the last log lines."""
        from rich.console import Group  # noqa: PLC0415 - only top needs rich
        from rich.table import Table  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415

        snapshot = self.table.snapshot()
        assert self.table.watcher is not None  # watch_table's table has its watcher
        health = self.table.watcher.health()
        records = {**snapshot, **self.router.engines()}  # and the unconfirmed ones
        rows = engine_rows(records, self.ttls.left(), self.states, self.router)
        rows = sort_rows(rows, self.sort)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for name in HEADERS:
            right = name in ("TTL", "LOAD", "CACHED")
            table.add_column(name, no_wrap=True, justify="right" if right else "left")
        for row in rows:
            engine, status, *rest = cells(row)
            table.add_row(engine, Text(status, style=_STATUS_STYLE.get(row.status, "")), *rest)
        title = Text(self.title(snapshot, health), style="bold red" if health.stale else "bold")
        shares = split_line(self.router)
        heads = (title, Text(shares)) if shares else (title,)
        return Group(*heads, table, *(Text(line, style="dim") for line in self.log))


def split_line(router: Router) -> str:
    """The router's split: each group's share and how many candidates it has now."""
    split = router.split
    if split is None:
        return ""
    candidates = [
        record
        for engine_id, record in router.engines().items()
        if router.explain(engine_id).candidate
    ]
    parts = []
    for group, share in split.shares().items():
        count = sum(Selector.parse(group).matches(r.labels) for r in candidates)
        parts.append(
            f"{group} {share:.0%} ({count} candidates)"
            if count
            else f"{group} {share:.0%} (EMPTY: its share goes to the others)"
        )
    return "split: " + ", ".join(parts)


class _LogTail(logging.Handler):
    """Keeps the last log lines for the screen (a handler on stderr would tear it)."""

    def __init__(self, lines: deque[str]) -> None:
        super().__init__()
        self.lines = lines
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record).splitlines()[0])


@contextlib.contextmanager
def _log_to(lines: deque[str]) -> Iterator[None]:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = [_LogTail(lines)]
    try:
        yield
    finally:
        root.handlers[:] = saved


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """``read(timeout)``: the keys typed within ``timeout`` seconds.

    stdin is in cbreak mode meanwhile (keys come one by one, Ctrl-C still signals); when
    stdin is no terminal there is nothing to read.
    """
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:

        def wait(timeout: float) -> str:
            time.sleep(timeout)  # the screen's pace; a stop signal ends the loop
            return ""

        yield wait
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:

        def read(timeout: float) -> str:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 64).decode(errors="replace") if ready else ""

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(
    settings: Settings,
    selector: Selector,
    sort: str,
    stop: StopSignals,
    split: Split | None = None,
) -> int:
    """Draw the table until ``q`` or a stop signal; returns the exit status (0)."""
    try:
        from rich.console import Console  # noqa: PLC0415
        from rich.live import Live  # noqa: PLC0415
    except ImportError:
        raise UsageError("discovery top needs rich: pip install 'discovery[top]'") from None
    log: deque[str] = deque(maxlen=LOG_LINES)
    with (
        _log_to(log),
        Connection(settings) as connection,
        watch_table(settings, selector=selector, connection=connection) as table,
        EngineStates(table) as states,
        LeaseTtls(settings, connection, selector) as ttls,
        _keys() as read_keys,
        Live(console=Console(), screen=True, auto_refresh=False) as live,
    ):
        # Passive: no states (it would report a load of its own to the relays), never picks.
        router = Router(table, selector=selector, split=split)
        view = View(table, states, router, ttls, settings.keyspace.prefix, selector, sort, log)
        while not stop.wait(0):
            live.update(view.screen(), refresh=True)
            typed = read_keys(REFRESH)
            if "q" in typed.lower():
                break
            for _ in range(typed.count("s")):
                view.sort = SORT_KEYS[(SORT_KEYS.index(view.sort) + 1) % len(SORT_KEYS)]
    return 0


def add_top_flags(parser: argparse.ArgumentParser) -> None:
    """--selector, --split and --sort."""
    add_selector_flag(parser, "show only")
    add_split_flag(parser)
    parser.add_argument(
        "--sort",
        choices=SORT_KEYS,
        default="engine",
        help="sort by this column (default engine; the s key cycles)",
    )
