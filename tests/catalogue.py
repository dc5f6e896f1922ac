"""The failure catalogue's harness: failures other routers shipped, replayed on real etcd.

Used by ``tests/test_failure_catalogue.py`` (the short form: one run per scenario, in
``./dev test``) and ``bench/bench_failures.py`` (the long form: every scenario, several
runs, its figures in bench/RESULTS.md and the tables of docs/failures.md and README). One
run of one scenario::

    engines: stand-in engines (discovery/testing/stand_in_engine.py, with a request port) under
      `discovery launch`, or `discovery register` processes (the engine is the registrar's
      process: its request port is its metrics port), on loopback or an engine host in a
      network namespace of its own
        -> etcd -> the router's table (a store sink timestamps each event as it is
           applied) -> Router
    client: a thread that picks continuously (round robin, PICK_INTERVAL apart), sends
      each request to the engine's coordinator address (an HTTP GET that must answer within
      ANSWER_TIMEOUT: a dead engine refuses, a frozen or hung one never answers) and
      releases its handle with failed=True when it gets no answer, so fencing acts;
      every pick is recorded (its start, engine, answered, when the router answered)
    the scenario: applies its failure at a known time (``Run.fail``), ends it if it ends
      (``Run.recover``: heal, SIGCONT, etcd answering again)
    a checker: compares the table with etcd (a listing at one revision, through its own
      connection) every CHECK_INTERVAL from the failure on, and again from the recovery
      on (what the table showed while the fault lasted is the fault, not lag)

The figures of a run (``Figures``), the same for every scenario:

* ``evict``: s from the failure to the router no longer picking the victim (the table's
  event: removed, or a status other than ready); ``evict_after_recovery``: the same from
  the end of the fault (a watch reconnect: from the moment the stream could resume);
* ``back``: s from the recovery until every engine the fault hit is picked again (present
  and ready; 0 when it never left), ``absent``: the longest time the router picked one of
  them not at all (from the client's picks: a router that keeps an engine whose record
  went, unconfirmed after a mass lease loss, still picks it), ``readds``: the most
  ``added`` events one of them had after the failure (exactly once: 1);
* ``failed_picks``: picks of the victim after the failure that got no answer (fencing
  bounds them by the fence threshold), ``after_evict``: picks of the victim while it was
  evicted (never; a pick of an engine the router kept unconfirmed is the router's choice,
  not a stale view), ``failed_requests``: unanswered requests to any engine after the
  failure, ``collateral``: evictions of engines the fault did not touch;
* ``lost`` / ``duplicate`` / ``stale`` at the end: engines in etcd the table misses,
  engines twice (two entries with one coordinator address, in the table or in etcd, or an
  event the table's history cannot explain), table entries etcd does not hold (or holds at
  another revision); ``converge``: the longest the table differed from etcd after the
  recovery (resolution CHECK_INTERVAL);
* ``extra``: a scenario's own figures (the router restart's times to a complete table and
  engine state, the rotation's time to see a new member's engine).

Each scenario has limits (``Scenario.limits``): the targets of the issue, lower is better.
Everything a run starts is stopped by pid when it ends (``Run`` is a context manager).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import itertools
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from discovery import (
    Connection,
    EndpointEvent,
    EngineStates,
    EngineStatus,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    EventType,
    InferenceEngineEndpoint,
    NoEngineAvailableError,
    RecordDecodeError,
    RequestTooLargeError,
    Router,
    RoutingTable,
    Session,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.embedded import EtcdCluster, EtcdMember
from discovery.testing.embedded_netns import EngineHost, PartitionableCluster

from .helpers import (
    STAND_IN,
    Launcher,
    Registrar,
    connected_member,
    etcdctl,
    make_endpoint,
    raw_call,
    wait_for,
)

TTL = 3.0  # the engines' lease TTL, where the scenario allows a short one
STALL = 2.0  # the launcher's stall timeout in the hung-engine scenarios
ELECTION = 1.0  # etcd's election timeout (the members' default)
FENCE_AFTER = 3  # the router's fence threshold (its default)
# One fence covers the longest eviction bound here (TTL + 5 election timeouts, a watcher's
# member cut off), so a dead engine gets FENCE_AFTER picks, not one more per fence end.
FENCE_SECONDS = 10.0
ANSWER_TIMEOUT = 1.0  # a request unanswered this long failed (plus its own hold time)
PICK_INTERVAL = 0.01  # the client's pace: 100 requests a second per worker
CHECK_INTERVAL = 0.1  # the checker's pace
SETTLE = 1.0  # the client keeps picking this long after the outcome, to catch late picks


# -- the engines ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal(pid: int, sig: signal.Signals, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


class Engine:
    """One engine of a run: a stand-in under ``discovery launch``, or a ``discovery
    register`` process that is its own engine (its request port is its metrics port)."""

    def __init__(self, engine_id: str, process: Launcher | Registrar) -> None:
        self.engine_id = engine_id
        self._process = process

    def engine_pid(self) -> int:
        """The engine's process: the stand-in, or the registrar."""
        if isinstance(self._process, Launcher):
            return self._process.child_pid()
        return self._process.process.pid

    def host_pids(self) -> list[tuple[int, bool]]:
        """Every process of the engine's host: (pid, a process group)."""
        if isinstance(self._process, Launcher):
            launcher = self._process
            return [
                (launcher.process.pid, False),
                (launcher.guard_pid(), False),
                (launcher.child_pid(), True),
            ]
        return [(self._process.process.pid, False)]

    def kill(self) -> None:
        """SIGKILL the engine process (under launch, its launcher lives on)."""
        _signal(self.engine_pid(), signal.SIGKILL)

    def signal_engine(self, sig: signal.Signals) -> None:
        _signal(self.engine_pid(), sig)

    def freeze_host(self) -> None:
        """SIGSTOP every process of the host (the launcher first: it never sees the rest)."""
        for pid, group in self.host_pids():
            _signal(pid, signal.SIGSTOP, group)

    def thaw_host(self) -> None:
        for pid, group in self.host_pids():
            _signal(pid, signal.SIGCONT, group)

    def kill_host(self) -> None:
        """The host dies: frozen first, so no process of it sees another die and acts."""
        pids = self.host_pids()
        for pid, group in pids:
            _signal(pid, signal.SIGSTOP, group)
        for pid, group in pids:
            _signal(pid, signal.SIGKILL, group)

    def terminate(self) -> None:
        """SIGTERM to the launcher or registrar (a Kubernetes pod stop)."""
        self._process.process.send_signal(signal.SIGTERM)

    def output(self) -> str:
        return self._process.output()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            for pid, group in self.host_pids() if self._process.process.poll() is None else []:
                _signal(pid, signal.SIGCONT, group)  # a frozen host still dies below
        self._process.stop()


# -- the client -----------------------------------------------------------------------------


def send(address: str, hold: float = 0.0, timeout: float = ANSWER_TIMEOUT) -> bool:
    """One request to the engine at ``address`` (``tcp://host:port``): answered in time?"""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=hold + timeout)
    try:
        connection.request("GET", f"/?hold={hold:g}")
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


@dataclass(frozen=True)
class Pick:
    """One request of the client: when it was picked, where it went, whether it answered."""

    at: float
    engine_id: str | None  # None: no engine available
    answered: bool
    chosen: float  # when the router had answered: it read its view before this
    done: float
    kept: bool = False  # the engine's record was gone: the router kept it (unconfirmed)


class Client:
    """``workers`` threads picking, sending and releasing (failed=True without an answer)."""

    def __init__(
        self, router: Router, table: RoutingTable, *, workers: int = 1, hold: float = 0.0
    ) -> None:
        self._router = router
        self._table = table
        self._hold = hold
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.picks: list[Pick] = []
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"catalogue-client-{i}")
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            at = time.monotonic()
            try:
                handle = self._router.pick([rng.randrange(32_000) for _ in range(8)], 8)
            except NoEngineAvailableError:
                now = time.monotonic()
                self._record(Pick(at, None, False, now, now))
            else:
                chosen = time.monotonic()
                kept = handle.engine_id not in self._table
                answered = send(handle.endpoint.coordinator_address, self._hold)
                handle.release(failed=not answered)
                done = time.monotonic()
                self._record(Pick(at, handle.engine_id, answered, chosen, done, kept))
            self._stop.wait(PICK_INTERVAL)  # the workload's pace

    def _record(self, pick: Pick) -> None:
        with self._lock:
            self.picks.append(pick)

    def answered(self, engine_id: str, after: float) -> bool:
        with self._lock:
            return any(
                p.engine_id == engine_id and p.answered and p.at >= after for p in self.picks
            )

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self._threads), "client thread left running"


# -- the router's view --------------------------------------------------------------------


def _pickable(record: Any) -> bool:
    return record is not None and record.status is EngineStatus.READY


class TableLog:
    """Every batch a table's store applied, and what it implies.

    A store sink runs under the store's lock, as the batch is applied: a pick that started
    after an event's time saw it, and one that had its answer before did not.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[tuple[float, EndpointEvent]] = []
        self._present: set[str] = set()
        self.anomalies = 0
        """Events the table's history cannot explain: added while present, and so on."""

    def attach(self, table: RoutingTable) -> Callable[[], None]:
        """Follow ``table`` (a new view: what it holds is new to it)."""
        with self._cond:
            self._present = set()
        return table.store.add_sink(self)

    def deliver(self, events: Sequence[EndpointEvent]) -> None:
        """Log one batch (the store's sink protocol)."""
        now = time.monotonic()
        with self._cond:
            for event in events:
                present = event.engine_id in self._present
                if (event.type is EventType.ADDED) == present:
                    self.anomalies += 1  # added while present, or updated / removed while absent
                if event.type is EventType.REMOVED:
                    self._present.discard(event.engine_id)
                else:
                    self._present.add(event.engine_id)
                self.events.append((now, event))
            self._cond.notify_all()

    def close(self) -> None:
        """The store closed (the store's sink protocol): nothing follows."""

    def _changes(self, engine_id: str, after: float) -> Iterator[tuple[float, bool]]:
        """(time, pickable) of each event of ``engine_id`` at or after ``after``."""
        for at, event in self.events:
            if at >= after and event.engine_id == engine_id:
                pickable = event.type is not EventType.REMOVED and _pickable(event.record)
                yield at, pickable

    def evicted(self, engine_id: str, after: float) -> float | None:
        """When the router stopped picking ``engine_id`` (first time at or after ``after``)."""
        with self._cond:
            return next((at for at, ok in self._changes(engine_id, after) if not ok), None)

    def returned(self, engine_id: str, after: float) -> float | None:
        """When ``engine_id`` was pickable again, after an eviction at ``after``."""
        with self._cond:
            return next((at for at, ok in self._changes(engine_id, after) if ok), None)

    def count(self, engine_id: str, kind: EventType, after: float) -> int:
        with self._cond:
            return sum(
                1
                for at, e in self.events
                if at >= after and e.engine_id == engine_id and e.type is kind
            )

    def wait(self, condition: Callable[[], Any], timeout: float) -> Any:
        """``condition()`` once it is truthy (re-checked at every batch), or None at timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (value := condition()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, 0.2))
            return value


@dataclass
class Diff:
    """The table against etcd at one moment."""

    lost: int = 0
    stale: int = 0
    duplicate: int = 0
    error: str | None = None  # etcd could not be listed

    @property
    def equal(self) -> bool:
        return self.error is None and not (self.lost or self.stale or self.duplicate)


def _duplicates(addresses: Iterable[str]) -> int:
    seen: set[str] = set()
    twice = 0
    for address in addresses:
        twice += address in seen
        seen.add(address)
    return twice


class Checker:
    """Compares a table with etcd (its own connection); measures how long they differ."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.conn = Connection(settings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._table: Callable[[], RoutingTable | None] | None = None
        self.longest = 0.0
        """The longest the table differed from etcd while watched (s)."""
        self._since: float | None = None

    def compare(self, table: RoutingTable) -> Diff:
        snapshot = table.snapshot()  # first: a listing taken after is never older
        try:
            _, kvs = self.conn.call(
                lambda: self.conn.list_prefix(self._settings.keyspace.prefix), timeout=2
            )
        except Exception as exc:
            return Diff(error=f"{type(exc).__name__}: {exc}")
        stored: dict[str, tuple[str, int]] = {}
        addresses = []
        for kv in kvs:
            key = kv.key.decode()
            engine_id = key.rsplit("/", 1)[1]
            try:
                self._settings.keyspace.decode(key, kv.value)
            except RecordDecodeError:
                continue  # no reader accepts it: no engine (the poisoned-record scenario)
            stored[engine_id] = (key, kv.mod_revision)
            with contextlib.suppress(ValueError, KeyError):
                addresses.append(json.loads(kv.value)["coordinator_address"])
        held = {
            engine_id: (entry.key, entry.mod_revision)
            for engine_id, entry in snapshot._entries.items()
        }
        return Diff(
            lost=len(stored.keys() - held.keys()),
            stale=sum(1 for e, v in held.items() if stored.get(e) != v),
            duplicate=_duplicates(r.endpoint.coordinator_address for r in snapshot.values())
            + _duplicates(addresses),
        )

    def watch(self, table: Callable[[], RoutingTable | None]) -> None:
        """From now on, measure every stretch during which ``table()`` differs from etcd
        (None: no router is up, nothing to compare)."""
        self._table = table
        self._since = time.monotonic()  # unknown until the first comparison: counted
        self._thread = threading.Thread(target=self._run, name="catalogue-checker")
        self._thread.start()

    def _run(self) -> None:
        assert self._table is not None
        while not self._stop.is_set():
            now = time.monotonic()
            table = self._table()
            if table is None:
                self._since = None
            elif self.compare(table).equal:
                if self._since is not None:
                    self.longest = max(self.longest, now - self._since)
                self._since = None
            elif self._since is None:
                self._since = now
            self._stop.wait(CHECK_INTERVAL)

    def settle(self, table: RoutingTable, timeout: float) -> Diff:
        """The comparison once equal, or the last one at the deadline; stops watching."""
        deadline = time.monotonic() + timeout
        while not (diff := self.compare(table)).equal and time.monotonic() < deadline:
            self._stop.wait(CHECK_INTERVAL)
        self.stop()
        if self._since is not None:  # still differing at the end: counted to the end
            self.longest = max(self.longest, time.monotonic() - self._since)
        return diff

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def close(self) -> None:
        self.stop()
        self.conn.close()


# -- a run ------------------------------------------------------------------------------------


@dataclass
class Env:
    """What a scenario runs against: the router's settings (endpoints, a namespace of the
    run's own) and, for scenarios that disturb etcd, the private cluster to disturb."""

    settings: Settings
    cluster: EtcdCluster | None = None


@dataclass
class Figures:
    """A run's figures (see the module docs); None: not measured (did not happen)."""

    scenario: str
    evict: float | None = None
    evict_after_recovery: float | None = None
    back: float | None = None
    absent: float | None = None
    readds: int = 0
    failed_picks: int = 0
    after_evict: int = 0
    failed_requests: int = 0
    collateral: int = 0
    lost: int = 0
    duplicate: int = 0
    stale: int = 0
    converge: float = 0.0
    picks: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        if name in self.extra:
            return self.extra[name]
        value = getattr(self, name, None)
        return None if value is None else float(value)

    def missed(self, limits: Mapping[str, float], slack: float = 0.0) -> list[str]:
        """Every figure above its limit (timings get ``slack`` s more), or not measured."""
        missed = []
        for name, limit in limits.items():
            value = self.value(name)
            allowed = limit + (slack if name in TIMINGS else 0)
            if value is None or value > allowed:
                shown = "not measured" if value is None else f"{value:.3g}"
                missed.append(f"{name} {shown} > {allowed:g}")
        return missed

    def line(self) -> str:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        extra = " ".join(f"{k}={fmt(v)}" for k, v in self.extra.items())
        return (
            f"{self.scenario}: evict={fmt(self.evict)} (after recovery "
            f"{fmt(self.evict_after_recovery)}) back={fmt(self.back)} absent={fmt(self.absent)} "
            f"readds={self.readds} failed_picks={self.failed_picks} "
            f"after_evict={self.after_evict} failed_requests={self.failed_requests} "
            f"collateral={self.collateral} lost={self.lost} duplicate={self.duplicate} "
            f"stale={self.stale} converge={self.converge:.2f} picks={self.picks} {extra}"
        ).rstrip()


# Figures in seconds (the rest are counts).
TIMINGS = frozenset(
    {
        "evict",
        "evict_after_recovery",
        "back",
        "absent",
        "converge",
        "add_seen",
        "gone",
        "table_complete",
        "states_complete",
        "told_after_evict",
        "victim_evict",
        "late_seen",
        "refused",
        "published",
        "session_back",
    }
)


class Run:
    """One run of one scenario: its engines, router, client, checker and figures."""

    def __init__(self, scenario: Scenario, env: Env) -> None:
        self.scenario = scenario
        self.env = env
        self.settings = env.settings
        self.engines: dict[str, Engine] = {}
        self.victim: Engine | None = None
        self.affected: list[str] = []
        self.failure_at: float | None = None
        self.recovered_at: float | None = None
        self.extra: dict[str, float] = {}
        self.departed: list[str] = []  # engines the scenario ends on purpose (no collateral)
        self.log = TableLog()
        self.table: RoutingTable | None = None
        self.router: Router | None = None
        self.states: EngineStates | None = None
        self.client: Client | None = None
        self._clients: list[Client] = []
        self._stack = contextlib.ExitStack()
        self.checker = Checker(env.settings)
        self._stack.callback(self.checker.close)
        self._routing = contextlib.ExitStack()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_router()
        self._stack.close()

    @property
    def cluster(self) -> EtcdCluster:
        assert self.env.cluster is not None, f"{self.scenario.name} needs a private cluster"
        return self.env.cluster

    # -- engines -------------------------------------------------------------------------------

    def launch(
        self,
        engine_id: str,
        *flags: str,
        ttl: float = TTL,
        settings: Settings | None = None,
        env: Mapping[str, str] | None = None,
        host: EngineHost | None = None,
    ) -> Engine:
        """A stand-in engine (its request port on loopback, or on ``host``) under launch."""
        command = [*STAND_IN, "--serve-port", "0"]
        if host is not None:
            command += ["--serve-host", host.address]
        launcher = Launcher(
            settings or self.settings,
            engine_id,
            command,
            "--ttl",
            f"{ttl:g}",
            *flags,
            env=env,
            wrapper=host.wrapper if host is not None else (),
        )
        return self._add(Engine(engine_id, launcher))

    def register(
        self,
        engine_id: str,
        ttl: float = TTL,
        settings: Settings | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Engine:
        """A ``discovery register`` process that is the engine: it answers on its metrics port."""
        port = free_port()
        registrar = Registrar(
            settings or self.settings,
            engine_id,
            ttl,
            ["--metrics-port", str(port)],
            coordinator_address=f"tcp://127.0.0.1:{port}",
            env=env,
        )
        return self._add(Engine(engine_id, registrar))

    def _add(self, engine: Engine) -> Engine:
        self.engines[engine.engine_id] = engine
        self._stack.callback(engine.stop)
        return engine

    # -- the router ------------------------------------------------------------------------------

    def route(
        self,
        settings: Settings | None = None,
        *,
        workers: int = 1,
        hold: float = 0.0,
        states: bool = False,
    ) -> RoutingTable:
        """Start the router: a table (its events logged), a Router, the client."""
        table = watch_table(settings or self.settings)
        self._routing.callback(self.log.attach(table))
        self._routing.callback(table.stop)
        table.start()
        self.table = table
        if states:
            self.states = EngineStates(table).start()
            self._routing.callback(self.states.stop)
        self.router = Router(
            table,
            policy="round_robin",
            fence_after=FENCE_AFTER,
            fence_seconds=FENCE_SECONDS,
            states=self.states,
        )
        self.client = Client(self.router, table, workers=workers, hold=hold)
        self._clients.append(self.client)
        self._routing.callback(self.client.stop)
        return table

    def stop_router(self) -> None:
        """Stop the client, the router's engine states and its table (a router going down)."""
        self._routing.close()
        self._routing = contextlib.ExitStack()
        self.table = self.router = self.states = self.client = None

    def ready(self, *engines: Engine, timeout: float = 60.0) -> None:
        """Wait until every engine (default: all) is in the table, ready, and answered."""
        assert self.table is not None and self.client is not None
        table, client = self.table, self.client
        for engine in engines or tuple(self.engines.values()):
            engine_id = engine.engine_id
            wait_for(
                lambda e=engine_id: _pickable(table.get(e)),
                timeout=timeout,
                message=f"{engine_id} ready in the router's table",
            )
            now = time.monotonic()
            wait_for(
                lambda e=engine_id, now=now: client.answered(e, now),
                timeout=30,
                message=f"an answered request to {engine_id}",
            )

    # -- the failure ----------------------------------------------------------------------------

    def fail(
        self, victim: Engine | None, action: Callable[[], object], affected: Sequence[str] = ()
    ) -> float:
        """Apply the failure now (its time is taken just before ``action``)."""
        self.victim = victim
        self.affected = list(affected) or ([victim.engine_id] if victim is not None else [])
        self.failure_at = self.recovered_at = time.monotonic()
        action()
        self.checker.watch(self._table)
        return self.failure_at

    def _table(self) -> RoutingTable | None:
        return self.table

    def recover(self, action: Callable[[], object] = lambda: None) -> float:
        """End the fault; the recovery's time is taken once ``action`` returned."""
        action()
        self.recovered_at = time.monotonic()
        # What the table showed before the recovery is no lag: measured from here on.
        self.checker.stop()
        self.checker = Checker(self.settings)
        self._stack.callback(self.checker.close)
        self.checker.watch(self._table)
        return self.recovered_at

    def lasted(self, seconds: float) -> None:
        """Let the fault last ``seconds`` from the failure (its length, not a synchronisation)."""
        assert self.failure_at is not None
        end = self.failure_at + seconds
        wait_for(lambda: time.monotonic() >= end, timeout=seconds + 1, message="the fault")

    def evicted(self, timeout: float) -> float | None:
        """When the router stopped picking the victim (None: not within ``timeout``)."""
        assert self.victim is not None and self.failure_at is not None
        victim, since = self.victim.engine_id, self.failure_at
        return self.log.wait(lambda: self.log.evicted(victim, since), timeout)

    def back(self, timeout: float, settle: float = 0.0) -> bool:
        """Wait until every affected engine is pickable after the recovery; then ``settle``
        s more, in which a late eviction would show."""
        assert self.table is not None and self.recovered_at is not None
        table = self.table
        ok = bool(
            self.log.wait(lambda: all(_pickable(table.get(e)) for e in self.affected), timeout)
        )
        if ok and settle:
            self._pause(settle)
        return ok

    def _pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        wait_for(lambda: time.monotonic() >= end, timeout=seconds + 1, message="a settle")

    # -- figures ----------------------------------------------------------------------------------

    def finish(self, settle: float = SETTLE, timeout: float = 15.0) -> Figures:
        """Let the client run ``settle`` s more, stop it, compare the table with etcd."""
        assert self.failure_at is not None and self.recovered_at is not None
        assert self.table is not None
        self._pause(settle)
        if self.client is not None:
            self.client.stop()
        diff = self.checker.settle(self.table, timeout)
        return self._figures(diff)

    def _figures(self, diff: Diff) -> Figures:
        assert self.failure_at is not None and self.recovered_at is not None
        failure, recovered = self.failure_at, self.recovered_at
        figures = Figures(self.scenario.name, extra=dict(self.extra))
        picks = [p for c in self._clients for p in c.picks if p.at >= failure]
        figures.picks = len(picks)
        figures.failed_requests = sum(
            1 for p in picks if p.engine_id is not None and not p.answered
        )
        victim = self.victim.engine_id if self.victim is not None else None
        if victim is not None:
            evicted = self.log.evicted(victim, failure)
            back = self.log.returned(victim, evicted) if evicted is not None else None
            mine = [p for p in picks if p.engine_id == victim]
            figures.failed_picks = sum(1 for p in mine if not p.answered)
            if evicted is not None:
                figures.evict = evicted - failure
                figures.evict_after_recovery = evicted - recovered
                # A pick the router made of an engine it kept (unconfirmed) was its choice.
                figures.after_evict = sum(
                    1
                    for p in mine
                    if p.at >= evicted and (back is None or p.chosen < back) and not p.kept
                )
        if self.scenario.returns:
            backs = []
            for engine_id in self.affected:
                gone = self.log.evicted(engine_id, failure)
                again = self.log.returned(engine_id, gone) if gone is not None else None
                if gone is None:
                    backs.append(0.0)
                elif again is not None:
                    backs.append(max(0.0, again - recovered))
            if len(backs) == len(self.affected):
                figures.back = max(backs)
                figures.absent = max(_unpicked(e, picks, failure) for e in self.affected)
            figures.readds = max(
                (self.log.count(e, EventType.ADDED, failure) for e in self.affected), default=0
            )
        untouched = [
            e
            for e in self.engines
            if e not in self.affected and e != victim and e not in self.departed
        ]
        figures.collateral = sum(self.log.count(e, EventType.REMOVED, failure) for e in untouched)
        figures.lost, figures.stale = diff.lost, diff.stale
        figures.duplicate = diff.duplicate + self.log.anomalies
        if diff.error is not None:
            figures.lost = figures.stale = -1  # unknown: etcd did not answer; fails a limit
            figures.extra["etcd_unlisted"] = 1.0
        figures.converge = self.checker.longest
        return figures


def _unpicked(engine_id: str, picks: Sequence[Pick], since: float) -> float:
    """The longest time from ``since`` on that the router picked ``engine_id`` not at all."""
    if not picks:
        return 0.0
    times = sorted(p.chosen for p in picks if p.engine_id == engine_id and p.chosen >= since)
    edges = [since, *times, max(p.chosen for p in picks)]
    return max(b - a for a, b in itertools.pairwise(edges))


# -- the scenarios -------------------------------------------------------------------------------


# Limits every scenario has: fencing bounds the picks of a failing engine, an evicted one is
# never picked, nothing else is evicted, the table ends equal to etcd.
COMMON = {
    "failed_picks": FENCE_AFTER,
    "after_evict": 0,
    "collateral": 0,
    "lost": 0,
    "duplicate": 0,
    "stale": 0,
}


@dataclass(frozen=True)
class Scenario:
    """One failure, the public report it replays, how it is played and its limits."""

    name: str
    replays: str
    failure: str
    etcd: str  # "shared" (any etcd), "single" (a private member), "three", "netns", "auth"
    play: Callable[[Run], Figures]
    limits: Mapping[str, float]
    returns: bool = False  # the engines the fault hit come back
    alive: bool = False  # the victim serves throughout: being unpicked is the cost, not a goal
    short: bool = True  # in the test's short form
    knob: str = ""  # what an operator sets to tighten the bound

    def all_limits(self) -> dict[str, float]:
        return {**COMMON, **self.limits}


def _pair(
    run: Run, victim: Engine | None = None, *flags: str, **launch: Any
) -> tuple[Engine, Engine]:
    """A victim (launched with ``flags``, unless given) and a healthy peer, routed and
    answering."""
    victim = victim or run.launch("victim", *flags, **launch)
    peer = run.launch("peer")
    run.route()
    run.ready()
    return victim, peer


HELD = 50  # requests held on the victim when it dies: each must be told


class Held:
    """``HELD`` handles held on ``victim``, each timestamping when it is told it is lost."""

    def __init__(self, run: Run, victim: Engine) -> None:
        assert run.router is not None
        others = [e for e in run.engines if e != victim.engine_id]
        self.victim = victim.engine_id
        self._router = run.router
        self._lock = threading.Lock()
        self.told: list[float] = []
        self.handles = [run.router.pick([1], 1, exclude=others) for _ in range(HELD)]
        for handle in self.handles:
            handle.on_lost(self._told)

    def _told(self, _: object) -> None:
        at = time.monotonic()
        with self._lock:
            self.told.append(at)

    def figures(self, run: Run, evicted: float | None) -> None:
        """``told_after_evict``: the last handle told, from the eviction; ``retry_victim``:
        retries (one per handle, excluding the engine it was lost on) that picked it."""
        wait_for(lambda: len(self.told) == HELD, timeout=15, message="every held handle told")
        if evicted is not None:
            run.extra["told_after_evict"] = max(0.0, max(self.told) - evicted)
        retries = [self._router.pick([1], 1, exclude={self.victim}) for _ in self.handles]
        run.extra["retry_victim"] = float(sum(r.engine_id == self.victim for r in retries))
        for handle in [*self.handles, *retries]:
            handle.release()


def _death(run: Run, victim: Engine | None = None) -> Figures:
    """The victim SIGKILLed with ``HELD`` requests held on it: each is told, none retried there."""
    victim, _ = _pair(run, victim)
    held = Held(run, victim)
    run.fail(victim, victim.kill)
    held.figures(run, run.evicted(timeout=TTL + 10))
    return run.finish()


def launch_death(run: Run) -> Figures:
    return _death(run)


def register_death(run: Run) -> Figures:
    return _death(run, run.register("victim"))


def host_death(run: Run) -> Figures:
    victim, _ = _pair(run)
    run.fail(victim, victim.kill_host)
    run.evicted(timeout=TTL + 10)
    return run.finish()


def host_freeze(run: Run) -> Figures:
    victim, _ = _pair(run)
    run.fail(victim, victim.freeze_host)
    try:
        run.evicted(timeout=TTL + 10)
        run.lasted(TTL + 1.5)  # past the TTL: the registration knows its lease is lost
    finally:
        run.recover(victim.thaw_host)
    run.back(timeout=10, settle=1)
    return run.finish()


def _hung(run: Run, stop: signal.Signals, resume: signal.Signals) -> Figures:
    victim, _ = _pair(run, None, "--stall-timeout", f"{STALL:g}")
    wait_for(
        lambda: "watching for stalls" in victim.output(),
        timeout=15,
        message="the launcher's first progress heartbeat",
    )
    run.fail(victim, lambda: victim.signal_engine(stop))
    try:
        run.evicted(timeout=STALL + 10)
        run.lasted(STALL + 1.0)
    finally:
        run.recover(lambda: victim.signal_engine(resume))
    run.back(timeout=10, settle=0.5)
    return run.finish()


def hung_frozen(run: Run) -> Figures:
    return _hung(run, signal.SIGSTOP, signal.SIGCONT)


def hung_silent(run: Run) -> Figures:
    return _hung(run, signal.SIGUSR1, signal.SIGUSR2)


def lost_lease(run: Run) -> Figures:
    victim, _ = _pair(run)
    key = run.settings.keyspace.key(victim.engine_id)
    conn = run.checker.conn
    lease = conn.call(lambda: conn.get(key)).lease  # type: ignore[union-attr]

    def revoke() -> None:
        conn.call(lambda: conn.revoke(lease))

    run.fail(victim, revoke)
    run.evicted(timeout=10)
    run.back(timeout=TTL + 10, settle=1)
    return run.finish()


def drain(run: Run) -> Figures:
    victim = run.launch("victim", "--drain-timeout", "2")
    run.launch("peer")
    run.route(workers=4, hold=0.3)
    run.ready()
    assert run.client is not None
    client = run.client
    failed = run.fail(victim, victim.terminate)
    run.evicted(timeout=10)

    def removed() -> float | None:
        return next(
            (
                at
                for at, e in run.log.events
                if at >= failed and e.engine_id == "victim" and e.type is EventType.REMOVED
            ),
            None,
        )

    gone = run.log.wait(removed, timeout=15)
    if gone is not None:
        run.extra["gone"] = gone - failed
    run.extra["in_flight"] = float(
        sum(1 for p in client.picks if p.engine_id == "victim" and p.at < failed < p.done)
    )
    return run.finish()


def _outage(seconds: float) -> Callable[[Run], Figures]:
    def outage(run: Run) -> Figures:
        victim, peer = _pair(run, None, ttl=10)
        member = run.cluster.members[0]
        assert member.process is not None
        process = member.process
        run.fail(
            victim,
            lambda: process.send_signal(signal.SIGSTOP),
            affected=[victim.engine_id, peer.engine_id],
        )
        try:
            run.lasted(seconds)
        finally:
            run.recover(lambda: process.send_signal(signal.SIGCONT))
        run.back(timeout=30, settle=3)
        return run.finish()

    outage.__name__ = f"outage_{seconds:g}"
    return outage


# -- scenarios on a private 3-member cluster -------------------------------------------------


def _router_member(run: Run) -> EtcdMember:
    """The member the router's watcher talks to, made a follower (its loss costs no election)."""
    assert run.table is not None and run.table.watcher is not None
    cluster = run.cluster
    member = connected_member(cluster, run.table.watcher._conn)  # type: ignore[arg-type]
    if cluster.leader() is member:
        cluster.move_leader(next(m for m in cluster.members if m is not member))
    return member


def _elsewhere(run: Run, member: EtcdMember) -> tuple[Settings, dict[str, str]]:
    """Settings (and environment) for engines that never talk to ``member``."""
    others = [m.client_url for m in run.cluster.members if m is not member]
    settings = Settings(endpoints=others, namespace=run.settings.namespace, dial_timeout=10)
    return settings, {"DISCOVERY_MEMBER_SYNC": "0"}


def _watch_gap(compact: bool) -> Callable[[Run], Figures]:
    """The router's member freezes, the victim's record goes (and the history is compacted),
    then the member dies: the watch resumes on another member after a gap with a delete."""

    def watch_gap(run: Run) -> Figures:
        run.route()
        assert run.table is not None and run.table.watcher is not None
        watcher = run.table.watcher
        member = _router_member(run)
        settings, env = _elsewhere(run, member)
        victim = run.launch("victim", settings=settings, env=env)
        run.launch("peer", settings=settings, env=env)
        run.ready()
        reconnects, relists = watcher.health().reconnects, watcher.health().relists
        assert member.process is not None
        member.process.send_signal(signal.SIGSTOP)  # the router's stream goes quiet
        try:
            run.fail(victim, victim.kill)  # its launcher revokes the lease at once
            conn = Connection(settings)
            try:
                key = run.settings.keyspace.key(victim.engine_id)
                wait_for(lambda: conn.call(lambda: conn.get(key)) is None, message="deleted")
                if compact:
                    revision = raw_call(conn, lambda c: c.get_response(key)).header.revision
                    raw_call(conn, lambda c: c.compact(revision, physical=True))
                    # Each member applies the compaction on its own: the router's resume
                    # must meet it wherever it lands, or it resumes without a relist.
                    held = str(run.table.revision)
                    others = [m for m in run.cluster.members if m is not member]
                    wait_for(
                        lambda: all(
                            "compacted" in etcdctl([m.client_url], "get", "--rev", held, key).stderr
                            for m in others
                        ),
                        timeout=10,
                        message="the compaction applied on every other member",
                    )
            finally:
                conn.close()
            quiet = watcher.health().reconnects == reconnects
        finally:
            run.recover(lambda: member.stop(kill=True))  # a frozen member dies: stream ends
        run.evicted(timeout=15)
        health = watcher.health()
        # 1 when the run did not test what it says: a resume after the gap (and a relist).
        run.extra["no_resume"] = float(not (quiet and health.reconnects > reconnects))
        if compact:
            run.extra["no_relist"] = float(health.relists <= relists)
        member.start()
        run.cluster.wait_healthy(members=[member])
        return run.finish()

    watch_gap.__name__ = "watch_compaction" if compact else "watch_gap_delete"
    return watch_gap


def leader_loss(run: Run) -> Figures:
    run.route()
    member = connected_member(run.cluster, run.table.watcher._conn)  # type: ignore[union-attr, arg-type]
    run.cluster.move_leader(member)  # the router's member is the leader: both go at once
    victim = run.register("victim")
    run.launch("peer")
    run.ready()

    def both() -> None:
        victim.kill()
        member.stop(kill=True)

    run.fail(victim, both)
    try:
        run.evicted(timeout=TTL + 15)
    finally:
        run.recover(lambda: (member.start(), run.cluster.wait_healthy(members=[member])))
    return run.finish()


def watcher_member_cut(run: Run) -> Figures:
    cluster = run.cluster
    assert isinstance(cluster, PartitionableCluster)
    run.route()
    member = _router_member(run)
    settings, env = _elsewhere(run, member)
    victim = run.register("victim", settings=settings, env=env)
    run.launch("peer", settings=settings, env=env)
    run.ready()

    def cut() -> None:
        cluster.cut(member)
        victim.kill()

    run.fail(victim, cut)
    try:
        run.evicted(timeout=TTL + 5 * ELECTION + 15)
    finally:
        run.recover(lambda: cluster.heal(member))
    cluster.wait_healthy(members=[member])
    return run.finish()


def host_cut(run: Run) -> Figures:
    cluster = run.cluster
    assert isinstance(cluster, PartitionableCluster)
    host = cluster.add_host()
    victim, _ = _pair(run, None, host=host)
    run.fail(victim, host.cut)
    try:
        run.evicted(timeout=TTL + 10)
        run.lasted(TTL + 1.5)  # past the TTL: the registration knows its lease is lost
    finally:
        run.recover(host.heal)
    run.back(timeout=15, settle=1)
    return run.finish()


MASS = 4  # engines on the host the mass cut cuts off etcd


def _mass_host_cut(seconds: float | None, ttl: float) -> Callable[[Run], Figures]:
    """Every engine's host cut off etcd (its router still reaches it) for ``seconds``
    (default TTL + 5 s); one engine SIGKILLed once every lease has expired."""

    def mass_host_cut(run: Run) -> Figures:
        cluster = run.cluster
        assert isinstance(cluster, PartitionableCluster)
        host = cluster.add_host()
        relay = ("--state-address", f"tcp://{host.address}:*")  # routers reach the relay
        engines = [run.launch(f"e{i}", *relay, ttl=ttl, host=host) for i in range(MASS)]
        run.route(states=True)
        run.ready()
        assert run.router is not None and run.client is not None
        router, client = run.router, run.client
        *alive, victim = engines
        run.departed.append(victim.engine_id)
        failed = run.fail(None, host.cut, affected=[e.engine_id for e in alive])
        told: list[float] = []
        held = None
        try:
            wait_for(
                lambda: len(router.health().unconfirmed) == MASS,
                timeout=ttl + 15,
                message="every lease expired and every engine kept, unconfirmed",
            )
            # A request held on the victim (unconfirmed now): told when the router evicts it.
            held = router.pick([1], 1, exclude=[e.engine_id for e in alive])
            held.on_lost(lambda _: told.append(time.monotonic()))
            killed = time.monotonic()
            victim.kill()  # the engine alone: its launcher sees it exit, its relay says bye
            wait_for(lambda: told, timeout=15, message="the killed engine evicted")
            run.extra["victim_evict"] = told[0] - killed
            run.lasted(ttl + 5 if seconds is None else seconds)
        finally:
            run.recover(host.heal)
            if held is not None:
                held.release()
        run.back(timeout=30, settle=1)
        figures = run.finish()
        picks = [p for p in client.picks if p.at >= failed]
        survivors = {e.engine_id for e in alive}
        figures.extra["no_engine"] = float(sum(p.engine_id is None for p in picks))
        figures.extra["failed_alive"] = float(
            sum(not p.answered for p in picks if p.engine_id in survivors)
        )
        figures.extra["victim_failed"] = float(
            sum(not p.answered for p in picks if p.engine_id == victim.engine_id)
        )
        return figures

    mass_host_cut.__name__ = "mass_host_cut" if seconds is None else f"mass_host_cut_{seconds:g}"
    return mass_host_cut


def member_rotation(run: Run) -> Figures:
    cluster = run.cluster
    run.launch("steady")
    run.route()
    run.ready()
    key = run.settings.keyspace.key("steady")
    conn = run.checker.conn
    before = conn.call(lambda: conn.get(key))
    assert before is not None
    # The router's member last: its connection never fails over before the end, so only
    # the periodic member-list refresh can tell it about the new members in time. And an
    # idle client's member first: its refreshes must move off a member that is gone.
    assert run.table is not None and run.table.watcher is not None
    last = connected_member(cluster, run.table.watcher._conn)  # type: ignore[arg-type]
    others = [m for m in cluster.members if m is not last]
    idle = Connection(
        Settings(
            endpoints=[m.client_url for m in others],
            namespace=run.settings.namespace,
            dial_timeout=10,
        )
    )
    run._stack.callback(idle.close)
    idle.call(lambda: idle.get(key))
    first = next(m for m in others if m.client_url.endswith(idle.member_in_use))
    started = time.monotonic()
    for old in [first, *(m for m in others if m is not first), last]:
        cluster.add_member()
        cluster.remove_member(old)
    run.extra["rotation"] = time.monotonic() - started
    newest = Settings(
        endpoints=[cluster.members[-1].client_url],
        namespace=run.settings.namespace,
        dial_timeout=10,
    )
    reference, written = watch_table(newest), TableLog()  # what the new member has, when
    stop_reference = written.attach(reference)
    reference.start()
    try:
        late = run.register("late", settings=newest)

        def first_event(log: TableLog) -> float | None:
            return next((at for at, e in log.events if e.engine_id == "late"), None)

        at_etcd = written.wait(lambda: first_event(written), timeout=30)
        at_router = run.log.wait(lambda: first_event(run.log), timeout=30)
        # Both logs run in this process: the router's may even come first.
        run.extra["add_seen"] = max(0.0, at_router - at_etcd) if at_etcd and at_router else 60.0
        run.ready(late)
    finally:
        stop_reference()
        reference.stop()
    run.fail(late, late.kill)
    run.evicted(timeout=TTL + 10)
    kv = conn.call(lambda: conn.get(key))  # the checker's connection followed the rotation
    run.extra["steady_rewritten"] = float(
        kv is None or (kv.create_revision, kv.lease) != (before.create_revision, before.lease)
    )
    try:
        idle.call(lambda: idle.get(key), timeout=5)
        run.extra["idle_blind"] = 0.0
    except EtcdUnavailableError:
        run.extra["idle_blind"] = 1.0
    return run.finish()


def router_restart(run: Run) -> Figures:
    victim = run.launch("victim")
    for i in range(2):
        run.launch(f"peer{i}")
    run.route(states=True)
    run.ready()
    run.stop_router()
    run.fail(victim, victim.kill)  # dies while the router is down: never in its new table
    conn = run.checker.conn
    key = run.settings.keyspace.key(victim.engine_id)
    wait_for(lambda: conn.call(lambda: conn.get(key)) is None, message="the victim's record gone")
    started = time.monotonic()
    table = run.route(states=True)
    complete = wait_for(
        lambda: run.checker.compare(table).equal and time.monotonic(),
        timeout=10,
        interval=0.005,
        message="the new table equal to etcd",
    )
    run.extra["table_complete"] = complete - started
    assert run.states is not None
    try:
        run.states.wait_synced(list(table.snapshot()), timeout=10)
        run.extra["states_complete"] = time.monotonic() - started
    except TimeoutError:
        run.extra["states_complete"] = 60.0
    run.recover()
    return run.finish()


# A 1 MB value (over the 16 KiB a reader accepts) and one claiming 10**400 KV blocks (over
# the bound of 2**40), each written by hand, once, under the namespace.
POISONED = ("poisoned-huge", "poisoned-liar")


def _poisoned_values() -> dict[str, str]:
    values = {}
    for index, engine_id in enumerate(POISONED):
        endpoint = make_endpoint(100 + index).to_dict()
        value: dict[str, Any] = {"engine_id": engine_id, **endpoint}
        if engine_id == "poisoned-huge":
            value["padding"] = "x" * 1_000_000
        else:
            value["capabilities"]["total_kv_blocks"] = 10**400
        values[engine_id] = json.dumps(value)
    return values


class _Warnings(logging.Handler):
    """The router process's WARNINGs that name one of ``keys``, per key."""

    def __init__(self, keys: Sequence[str]) -> None:
        super().__init__(logging.WARNING)
        self.counts = dict.fromkeys(keys, 0)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for key in self.counts:
            if f"{key}'" in message:
                self.counts[key] += 1


def poisoned_record(run: Run) -> Figures:
    """Two lying records put by hand beside two engines: none accepted, none picked."""
    run.launch("victim")
    run.launch("peer")
    run.route()
    run.ready()
    assert run.table is not None
    keys = {e: run.settings.keyspace.key(e) for e in POISONED}
    warnings = _Warnings(list(keys.values()))
    logger = logging.getLogger("discovery")
    logger.addHandler(warnings)
    run._stack.callback(logger.removeHandler, warnings)
    conn, values = run.checker.conn, _poisoned_values()

    def poison() -> None:
        for engine_id, key in keys.items():
            raw_call(conn, lambda client, k=key, v=values[engine_id]: client.put(k, v))

    run.fail(None, poison)
    table, skipped = run.table, len(POISONED)
    assert table.watcher is not None
    watcher = table.watcher
    wait_for(lambda: watcher.health().skipped >= skipped, message="both values skipped")
    # A load-weighing router over the same table: the policy a 10**400 lie used to win.
    auto = Router(table, policy="auto")
    held = [auto.pick([1] * 64, 1) for _ in range(60)]
    auto_picks = sum(h.engine_id in keys for h in held)
    for handle in held:
        handle.release()
    run.recover()
    figures = run.finish()
    picks = [p for c in run._clients for p in c.picks if p.at >= (run.failure_at or 0)]
    figures.extra["accepted"] = float(
        sum(run.log.count(e, EventType.ADDED, run.failure_at or 0) for e in POISONED)
    )
    figures.extra["poisoned_picks"] = float(
        auto_picks + sum(1 for p in picks if p.engine_id in keys)
    )
    figures.extra["warnings"] = float(max(warnings.counts.values()))
    figures.extra["unwarned"] = float(min(warnings.counts.values()) == 0)
    return figures


AUTH_TOKEN_TTL = 2  # s: etcd's --auth-token-ttl here (its default is 300)
_AUTH_PASSWORD = "catalogue-only-password"  # a throwaway cluster's, never printed


def auth_cluster() -> EtcdCluster:
    """A private member whose auth tokens expire ``AUTH_TOKEN_TTL`` s after their last use."""
    return EtcdCluster(1, extra_args=["--auth-token-ttl", str(AUTH_TOKEN_TTL)])


def _ctl(cluster: EtcdCluster, *args: str, root: bool = True) -> None:
    user = ["--user", f"root:{_AUTH_PASSWORD}"] if root else []
    done = cluster.etcdctl(*user, *args)
    assert done.returncode == 0, f"etcdctl {args[:2]}: {done.stderr.strip()}"


def enable_auth(cluster: EtcdCluster, namespace: str) -> Settings:
    """Auth on (a root user), and root's settings in ``namespace`` (the checker's)."""
    _ctl(cluster, "user", "add", f"root:{_AUTH_PASSWORD}", root=False)
    _ctl(cluster, "user", "grant-role", "root", "root", root=False)
    _ctl(cluster, "auth", "enable", root=False)
    return _auth_settings(cluster.endpoints, namespace, "root")


def _auth_settings(endpoints: Sequence[str], namespace: str, user: str) -> Settings:
    return Settings(
        endpoints=list(endpoints),
        namespace=namespace,
        username=user,
        password=_AUTH_PASSWORD,
        allow_insecure_auth=True,  # plaintext loopback etcd: opted in to, explicitly
        dial_timeout=10,
    )


def auth_token_expiry(run: Run) -> Figures:
    """Engines (readwrite on their prefix) and a router (read only) whose tokens expire."""
    cluster, prefix = run.cluster, run.settings.keyspace.prefix
    for user, permission in (("engine", "readwrite"), ("router", "read")):
        _ctl(cluster, "role", "add", user)
        _ctl(cluster, "role", "grant-permission", user, permission, prefix, "--prefix=true")
        _ctl(cluster, "user", "add", f"{user}:{_AUTH_PASSWORD}")
        _ctl(cluster, "user", "grant-role", user, user)
    engine = {
        "DISCOVERY_ETCD_USERNAME": "engine",
        "DISCOVERY_ETCD_PASSWORD": _AUTH_PASSWORD,
        "DISCOVERY_ALLOW_INSECURE_AUTH": "1",
    }
    victim = run.register("victim", env=engine)
    run.register("peer", env=engine)
    table = run.route(_auth_settings(cluster.endpoints, run.settings.namespace, "router"))
    run.ready()
    assert table.watcher is not None
    router_conn = table.watcher._conn
    token = router_conn._current().metadata
    # Every token the engines and the router authenticated with expires meanwhile (three
    # TTLs; a token used only to open a stream is not renewed by it).
    run._pause(3 * AUTH_TOKEN_TTL)
    # A call on the router's connection (a relist, as after a compaction) meets its
    # expired token and authenticates again: the expiry happened, and is ridden out.
    _, listed = router_conn.call(lambda: router_conn.list_prefix(prefix))
    run.extra["token_kept"] = float(router_conn._current().metadata == token)
    run.extra["relist_short"] = float(len(listed) < len(run.engines))
    run.fail(victim, victim.kill)  # the router's watch, opened long ago, must see it
    run.evicted(timeout=TTL + 10)
    late = run.register("late", env=engine)  # the watch's delivery of a new record
    conn, key = run.checker.conn, run.settings.keyspace.key("late")
    written = wait_for(
        lambda: conn.call(lambda: conn.get(key)) is not None and time.monotonic(),
        timeout=30,
        interval=0.005,
        message="the late engine's record in etcd",
    )
    seen = run.log.wait(
        lambda: next((at for at, e in run.log.events if e.engine_id == "late"), None), 30
    )
    run.extra["late_seen"] = max(0.0, seen - written) if seen is not None else 60.0
    run.ready(late)
    run._pause(3 * AUTH_TOKEN_TTL)  # the peer's lease lives on across more expiries
    run.recover()
    return run.finish()


# -- etcd's own limits (issue 43): a full space quota, requests over --max-request-bytes -----


class _Served:
    """An engine in this process: a registration whose address answers the client's requests
    (a small HTTP server on loopback), so the test can change the record itself."""

    def __init__(self, run: Run, engine_id: str, **register: Any) -> None:
        self.engine_id = engine_id
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        run._stack.callback(self.server.server_close)
        run._stack.callback(self.server.shutdown)
        port = self.server.server_address[1]
        endpoint = InferenceEngineEndpoint(f"tcp://127.0.0.1:{port}", _CAPABILITIES)
        self.registration = register_engine(endpoint, engine_id=engine_id, **register)
        run._stack.callback(self.registration.close)


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass  # quiet


_CAPABILITIES = make_endpoint().capabilities


def _limited(run: Run, *args: str) -> None:
    """Restart the private member with ``args`` (etcd's limits), before anything runs."""
    cluster = run.cluster
    cluster.extra_args = (*cluster.extra_args, *args)
    cluster.restart(cluster.members[0], kill=False)


def _labels(size: int) -> dict[str, str]:
    """Labels of about ``size`` bytes (64 at most, as a record allows)."""
    count = min(64, size // 200 + 1)
    return {f"k{i:02d}": "v" * (size // count - 10) for i in range(count)}


def _timed(action: Callable[[], object], refusal: type[Exception]) -> float:
    """Seconds until ``action`` raised ``refusal`` (it must)."""
    started = time.monotonic()
    try:
        action()
    except refusal:
        return time.monotonic() - started
    raise AssertionError(f"{action} was not refused")


def nospace(run: Run) -> Figures:
    _limited(run, "--quota-backend-bytes", str(8 * 1024 * 1024))
    victim, peer = _pair(run)
    side = _Served(run, "side", ttl=TTL, settings=run.settings.with_namespace("side"))
    conn = run.checker.conn

    def fill() -> None:
        for i in itertools.count():
            try:
                conn.replace(f"/fill/{i}", b"x" * 100_000, 0)
            except EtcdNoSpaceError:
                return

    run.fail(victim, fill, affected=[victim.engine_id, peer.engine_id])
    changed = {"v": "1"}
    run.extra["refused"] = _timed(
        lambda: side.registration.update(labels=changed), EtcdNoSpaceError
    )
    try:
        run.lasted(3 * TTL)  # keepalives answered all along: nothing is lost
    finally:
        run.recover(lambda: _free_space(run.cluster))
    key = run.settings.with_namespace("side").keyspace.key("side")
    wait_for(
        lambda: (
            json.loads(conn.call(lambda: conn.get(key)).value).get("labels")  # type: ignore[union-attr]
            == changed
        ),
        timeout=10,
        message="the change made under NOSPACE published",
    )
    run.extra["published"] = time.monotonic() - run.recovered_at  # type: ignore[operator]
    run.back(timeout=10, settle=0.5)
    return run.finish()


def _free_space(cluster: EtcdCluster) -> None:
    """The runbook (docs/operations/etcd.md): delete, compact, defrag, disarm."""
    assert cluster.etcdctl("del", "--prefix", "/fill/").returncode == 0
    status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json").stdout)
    revision = status[0]["Status"]["header"]["revision"]
    for args in (("compact", str(revision)), ("defrag",), ("alarm", "disarm")):
        done = cluster.etcdctl(*args)
        assert done.returncode == 0, done.stderr


def oversized_update(run: Run) -> Figures:
    _limited(run, "--max-request-bytes", "8192")
    served = _Served(run, "victim", ttl=TTL, settings=run.settings)
    peer = run.launch("peer")
    run.route()
    run.ready(peer)
    assert run.table is not None
    table = run.table
    wait_for(lambda: _pickable(table.get("victim")), timeout=30, message="victim ready")
    reg = served.registration
    big = _labels(12_000)
    run.extra["refused"] = _timed(lambda: reg.update(labels=big), RequestTooLargeError)
    lease = reg.lease_id
    conn = run.checker.conn
    assert lease is not None
    # The figures' victim, by its id: an engine of this process, not one of run.engines.
    run.fail(cast(Engine, served), lambda: conn.call(lambda: conn.revoke(lease)))
    run.evicted(timeout=10)
    run.back(timeout=TTL + 10, settle=1)
    return run.finish()


def oversized_session_repair(run: Run) -> Figures:
    _pair(run)  # routed engines the repair must not disturb
    settings = run.settings.with_namespace("session")
    labels = _labels(15_800)
    with Session(ttl=int(TTL), settings=settings) as session:
        regs = [
            register_engine(
                InferenceEngineEndpoint(f"tcp://127.0.0.1:{10_000 + i}", _CAPABILITIES),
                engine_id=f"s{i:03d}",
                labels=labels,
                session=session,
            )
            for i in range(100)
        ]
        lease = session.lease_id
        assert lease is not None
        conn = run.checker.conn
        prefix = settings.keyspace.prefix
        run.fail(None, lambda: conn.call(lambda: conn.revoke(lease)))

        def all_back() -> bool:
            _, kvs = conn.list_prefix(prefix)
            return len(kvs) == len(regs) and all(kv.lease not in (0, lease) for kv in kvs)

        wait_for(all_back, timeout=TTL + 10, message="100 records of 16 KiB back", interval=0.05)
        run.extra["session_back"] = time.monotonic() - run.failure_at  # type: ignore[operator]
    run.recover()
    return run.finish()


def cluster_replaced(run: Run) -> Figures:
    """etcd's data wiped under the router and the engines (a disaster rebuild: revision back
    to 1, the same cluster id), one engine SIGKILLed just before (its record would have
    outlived it by its TTL): the two that serve throughout are written again, the dead one
    is gone, and the table is the new cluster's."""
    peers = [run.launch(f"peer{i}") for i in range(2)]
    dead = run.register("dead", ttl=10)
    run.route()
    run.ready()
    assert run.table is not None and run.table.watcher is not None
    watcher = run.table.watcher
    run.departed.append(dead.engine_id)
    dead.kill()
    run.fail(None, run.cluster.wipe, affected=[peer.engine_id for peer in peers])
    run.recover()
    run.back(timeout=TTL + 10, settle=1)
    figures = run.finish()
    # 1 when the run did not test what it says: the watcher found the new cluster. Read once
    # the table equals etcd (only a relist drops `dead`): the peers were never gone, so
    # back() passes at once, before a reconnect slowed by load has listed.
    figures.extra["no_reset"] = float(watcher.health().cluster_changes < 1)
    return figures


_FENCE = (
    "`fence_after` bounds the requests lost meanwhile (one fence covers the rest with "
    "`fence_seconds` >= the TTL + 0.5 s)"
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "launch-death",
            "vLLM production-stack #656 (ZombieIP)",
            "the engine process SIGKILLed under `discovery launch`",
            "shared",
            launch_death,
            {"evict": 0.1, "told_after_evict": 0.05, "retry_victim": 0},
            knob="nothing: `launch` revokes the lease as the engine exits",
        ),
        Scenario(
            "register-death",
            "Dynamo #1424 (32 of 100 requests failed before a dead worker's lease expired)",
            "a `discovery register` engine SIGKILLed (the registration in the engine's process)",
            "shared",
            register_death,
            {"evict": TTL + 0.5, "told_after_evict": 0.05, "retry_victim": 0},
            knob=f"the TTL (`--ttl`); {_FENCE}; or `discovery launch`: no TTL to wait",
        ),
        Scenario(
            "host-death",
            "smg #1531 (stale workers stay in the router)",
            "launcher, guard and engine SIGKILLed together",
            "shared",
            host_death,
            {"evict": TTL + 0.5},
            knob=f"the TTL; {_FENCE}",
        ),
        Scenario(
            "host-freeze",
            "vLLM production-stack #656 (ZombieIP)",
            "launcher and engine SIGSTOPped for TTL + 1.5 s, then SIGCONT",
            "shared",
            host_freeze,
            {"evict": TTL + 0.5, "back": 1.0, "readds": 1},
            returns=True,
            knob=f"the TTL; {_FENCE}",
        ),
        Scenario(
            "hung-frozen",
            "SGLang #32322 (stale workers stay in the router)",
            f"the engine alone SIGSTOPped (its launcher lives), stall timeout {STALL:g} s",
            "shared",
            hung_frozen,
            {"evict": STALL + 1.0, "back": 1.0},
            returns=True,
            knob="`discovery launch --stall-timeout` (default 10 s)",
        ),
        Scenario(
            "hung-silent",
            "SGLang #32322 (stale workers stay in the router)",
            f"the engine goes silent (SIGUSR1: no frame, no answer), stall timeout {STALL:g} s",
            "shared",
            hung_silent,
            {"evict": STALL + 1.0, "back": 1.0},
            returns=True,
            knob="`discovery launch --stall-timeout` (default 10 s)",
        ),
        Scenario(
            "host-cut",
            "Dynamo #7932 (DNS outages expire leases)",
            "the engine host's links to etcd cut (namespaces) for TTL + 1.5 s, then healed; "
            "its clients still reach it",
            "netns",
            host_cut,
            {"evict": TTL + 0.5, "back": 1.0, "readds": 1},
            returns=True,
            knob="the TTL: a longer one rides out a longer cut (and keeps a dead host longer)",
        ),
        Scenario(
            "mass-host-cut",
            "Dynamo #7932, #3493 (every lease lost together while every engine serves: the "
            "table empties)",
            f"the host of all {MASS} engines cut off etcd (namespaces) for TTL + 5 s, its "
            "clients still reach it; one engine SIGKILLed once every lease has expired",
            "netns",
            _mass_host_cut(None, TTL),
            {
                "no_engine": 0,
                "failed_alive": 0,
                "victim_evict": 1.0,
                "back": 1.0,
                "readds": 1,
            },
            returns=True,
            alive=True,
            knob="`Router(protect_threshold=, protect_window=, protect_grace=)`: more than half "
            "of the ready engines gone unannounced within 30 s are kept, unconfirmed, up to "
            "120 s; the first below the threshold are evicted meanwhile",
        ),
        Scenario(
            "mass-host-cut-30s",
            "Dynamo #7932 (TTL 10, 8-30 s outages; their fix: TTL 10 -> 60 s)",
            "as mass-host-cut with TTL 10 and a 30 s cut",
            "netns",
            _mass_host_cut(30.0, 10.0),
            {
                "no_engine": 0,
                "failed_alive": 0,
                "victim_evict": 1.0,
                "back": 1.0,
                "readds": 1,
            },
            returns=True,
            alive=True,
            short=False,
            knob="`protect_grace` (120 s) above the longest cut to ride out",
        ),
        Scenario(
            "watch-gap-delete",
            "vLLM production-stack #1091 (a DELETE missed during a watch reconnect: 22 h)",
            "the router's member frozen, the victim's record deleted, then the member killed",
            "three",
            _watch_gap(compact=False),
            {"evict_after_recovery": 1.0, "no_resume": 0},
            knob="`watch_table(heartbeat=)`: a silent stream is dropped after 2 x heartbeat "
            "(10 s); a broken one resumes at once",
        ),
        Scenario(
            "watch-compaction",
            "vLLM production-stack #1091, across a compaction",
            "as watch-gap-delete, the history compacted past the watcher's revision meanwhile",
            "three",
            _watch_gap(compact=True),
            {"evict_after_recovery": 1.0, "no_resume": 0, "no_relist": 0},
            knob="nothing: a resume from a compacted revision lists again, delivers the difference",
        ),
        Scenario(
            "outage-8",
            "Dynamo #7932 (8-30 s DNS outages expire leases; their fix: TTL 10 -> 60 s)",
            "etcd frozen (SIGSTOP) for 8 s, TTL 10; both engines serve throughout",
            "single",
            _outage(8),
            {"back": 1.0, "readds": 1, "failed_picks": 0},
            returns=True,
            alive=True,
            knob="the TTL: a lease outlives an outage shorter than its remaining TTL (2/3 TTL "
            "to TTL)",
        ),
        Scenario(
            "outage-15",
            "Dynamo #7932",
            "etcd frozen (SIGSTOP) for 15 s, TTL 10; both engines serve throughout",
            "single",
            _outage(15),
            {"back": 1.0, "readds": 1, "failed_picks": 0},
            returns=True,
            alive=True,
            short=False,
            knob="nothing: the router serves its last table while etcd is away (fail-static)",
        ),
        Scenario(
            "outage-30",
            "Dynamo #7932",
            "etcd frozen (SIGSTOP) for 30 s, TTL 10; both engines serve throughout",
            "single",
            _outage(30),
            {"back": 1.0, "readds": 1, "failed_picks": 0},
            returns=True,
            alive=True,
            short=False,
            knob="nothing: the router serves its last table while etcd is away (fail-static)",
        ),
        Scenario(
            "lost-lease",
            "Dynamo #3493 (a lost etcd lease does not recover)",
            "the victim's lease revoked behind its back; it serves throughout",
            "shared",
            lost_lease,
            {"back": TTL / 3 + 0.5, "readds": 1, "failed_picks": 0},
            returns=True,
            alive=True,
            knob="nothing: the registrar replaces a lost lease at once",
        ),
        Scenario(
            "drain",
            "Dynamo #13559 (drain aborts in-flight requests), #10704 (workers keep "
            "advertising), vLLM production-stack #601 (terminating pods still get traffic)",
            "SIGTERM to `discovery launch --drain-timeout 2`, 4 clients, 0.3 s requests",
            "shared",
            drain,
            {"evict": 0.5, "gone": 2 + 1.0, "failed_requests": 0},
            knob="`--drain-timeout` >= your longest request, within the platform's grace period",
        ),
        Scenario(
            "leader-loss",
            "the issue's own (no report named)",
            "the etcd leader (the router's member) and the victim SIGKILLed together",
            "three",
            leader_loss,
            {"evict": TTL + 3 * ELECTION + 0.5},
            knob="the TTL; etcd's `--election-timeout` (a new leader extends every lease by one)",
        ),
        Scenario(
            "watcher-member-cut",
            "the issue's own (no report named)",
            "the router's member cut from its peers (namespaces) as the victim dies",
            "netns",
            watcher_member_cut,
            {"evict": TTL + 5 * ELECTION + 0.5},
            knob="the TTL; etcd's `--election-timeout` (a member without a leader is left "
            "within about 5)",
        ),
        Scenario(
            "member-rotation",
            "ours: measured on main before part 1 (clients given the original URLs went blind)",
            "every etcd member replaced, one at a time (an idle client's first, the "
            "router's last); then an engine registers on the newest member and is SIGKILLed",
            "three",
            member_rotation,
            {"add_seen": 1.0, "evict": TTL + 1.0, "steady_rewritten": 0, "idle_blind": 0},
            knob="`DISCOVERY_MEMBER_SYNC_INTERVAL` (5 s) below the time between two replacements",
        ),
        Scenario(
            "cluster-replaced",
            "issue 43 (a wiped etcd member: the table held ghosts for ever, health said "
            "connected); Kubernetes client-go relists on a resource version too large",
            "the etcd member's data wiped and the member restarted on the same addresses "
            "(revision back to 1), one engine SIGKILLed just before; two serve throughout",
            "single",
            cluster_replaced,
            {"back": 2.0, "readds": 1, "failed_picks": 0, "no_reset": 0},
            returns=True,
            alive=True,
            knob="nothing: an answer from another cluster id, or behind the applied "
            "revision, replaces the table; registrars write their records again",
        ),
        Scenario(
            "router-restart",
            "the issue's own (no report named)",
            "the router stopped, an engine dies meanwhile, a new router starts",
            "shared",
            router_restart,
            {"failed_picks": 0, "table_complete": 1.0, "states_complete": 2.0},
            knob="nothing: one listing at one revision, then one snapshot per relay",
        ),
        Scenario(
            "poisoned-record",
            "the issue's own (a well-formed lie took 60 of 60 picks)",
            "a 1 MB record and one claiming 10**400 KV blocks written by hand under the "
            "namespace beside two engines",
            "shared",
            poisoned_record,
            {"accepted": 0, "poisoned_picks": 0, "warnings": 1, "unwarned": 0},
            knob="nothing: a value over 16 KiB or a capacity over 2**40 is refused like a "
            "malformed one (`discovery list` shows it refused, with why)",
        ),
        Scenario(
            "auth-token-expiry",
            "python-etcd3 #1227 (an expired auth token can hang a watch)",
            f"etcd with auth and {AUTH_TOKEN_TTL} s tokens (`--auth-token-ttl`): engines "
            "(readwrite) and a router (read only) run 3 token lifetimes, then the victim is "
            "SIGKILLed and a new engine registers",
            "auth",
            auth_token_expiry,
            {"evict": TTL + 0.5, "late_seen": 1.0, "token_kept": 0, "relist_short": 0},
            knob="nothing: an expired token is replaced at the next call or stream",
        ),
        Scenario(
            "nospace",
            "the issue's own (issue 43: NOSPACE surfaced as unavailable after the dial timeout)",
            "etcd's space quota filled (NOSPACE alarm) for 3 TTLs, then compact, defrag, "
            "alarm disarm; an engine changes its record meanwhile",
            "single",
            nospace,
            {
                "back": 0.0,
                "readds": 0,
                "failed_picks": 0,
                "refused": 0.5,
                "published": TTL / 3 + 0.5,
            },
            returns=True,
            alive=True,
            knob="the runbook (docs/operations/etcd.md): compact, defrag, alarm disarm",
        ),
        Scenario(
            "oversized-update",
            "the issue's own (issue 43: a refused update replaced the record; lost for good)",
            "an update over the members' --max-request-bytes, then the engine's lease revoked",
            "single",
            oversized_update,
            {"back": TTL / 3 + 0.5, "readds": 1, "failed_picks": 0, "refused": 0.5},
            returns=True,
            knob="`DISCOVERY_ETCD_MAX_REQUEST_BYTES` = the members' `--max-request-bytes`",
        ),
        Scenario(
            "oversized-session-repair",
            "the issue's own (issue 43: 0 of 100 records back, the repair over 1.5 MiB)",
            "the lease of a session holding 100 records of 16 KiB revoked",
            "single",
            oversized_session_repair,
            {"session_back": TTL / 3 + 0.5},
            knob="`DISCOVERY_ETCD_MAX_REQUEST_BYTES` = the members' `--max-request-bytes`",
        ),
    )
}

SHORT = [name for name, s in SCENARIOS.items() if s.short]


def play(scenario: Scenario, env: Env) -> Figures:
    """One run of ``scenario`` against ``env``; everything it started is stopped."""
    with Run(scenario, env) as run:
        return scenario.play(run)


# -- the tables (bench/bench_failures.py writes them; a test checks they are up to date) ----


TABLE_BEGIN, TABLE_END = "<!-- failures:begin -->\n", "<!-- failures:end -->"
RECORD = "bench/results/failures.json"  # the long form's figures, from the repository root
# Where each table goes (from the repository root): the catalogue's page, README's headline.
FULL_TABLE, HEADLINE_TABLE = "docs/failures.md", "README.md"


def unit(name: str) -> str:
    return "s" if name in TIMINGS else ""


LABELS = {
    "gone": "record gone",
    "failed_requests": "failed requests",
    "add_seen": "new member's engine seen",
    "steady_rewritten": "steady record rewritten",
    "idle_blind": "idle client blind",
    "table_complete": "table complete",
    "states_complete": "engine state complete",
    "told_after_evict": f"{HELD} held requests told",
    "retry_victim": "retries that picked it",
    "no_engine": "picks that found no engine",
    "failed_alive": "failed requests to live engines",
    "victim_evict": "an engine killed during the cut evicted in",
    "victim_failed": "its unanswered requests",
    "accepted": "lying records accepted",
    "poisoned_picks": "their picks",
    "warnings": "WARNINGs per record",
    "unwarned": "records not warned of",
    "late_seen": "an engine registered after the expiries seen in",
    "token_kept": "router's first token still in use",
    "relist_short": "relists after the expiry missing an engine",
}


def _cell(record: Mapping[str, Any], name: str) -> str:
    """The worst value of figure ``name`` over the runs, with its limit when it has one."""
    value, limits = record["worst"].get(name), record["limits"]
    seconds = name in TIMINGS
    shown = "never" if value is None else (f"{value:.2f} s" if seconds else f"{value:g}")
    if name in limits:
        ok = value is not None and value <= limits[name]
        bound = f"{limits[name]:g}{' s' if seconds else ''}"
        shown += f" (<= {bound}{'' if ok else ', **missed**'})"
    return shown


def _evict(record: Mapping[str, Any]) -> str:
    """The scenario's time to evict, in words: what it measures depends on the scenario."""
    scenario, limits = SCENARIOS[record["name"]], record["limits"]
    if scenario.alive:
        return f"serving: unpicked for {_cell(record, 'absent')}"
    if "evict" in limits:
        return _cell(record, "evict")
    if "evict_after_recovery" in limits:
        return f"{_cell(record, 'evict_after_recovery')} after the reconnect"
    return "-"


def _ends(record: Mapping[str, Any]) -> str:
    """Lost / duplicate / stale table entries at the end, worst run."""
    return " / ".join(f"{record['worst'].get(k) or 0:g}" for k in ("lost", "duplicate", "stale"))


def _footer(recorded: Mapping[str, Any]) -> str:
    return (
        f"Worst of {recorded['runs']} runs of each scenario, {recorded['date']}. "
        f"{recorded['machine']} Load average after the run: {recorded['load']}."
    )


def headline_table(recorded: Mapping[str, Any]) -> str:
    """README's table: each scenario's failure and its headline figures."""
    lines = [
        "| failure | time to evict | picks of the dead or hung engine: unanswered / after "
        "eviction | lost / duplicate / stale |",
        "|---|---|---|---|",
    ]
    for record in recorded["scenarios"]:
        scenario = SCENARIOS[record["name"]]
        picks = f"{_cell(record, 'failed_picks')} / {_cell(record, 'after_evict')}"
        lines.append(
            f"| **{scenario.name}**: {scenario.failure} | {_evict(record)} | {picks} "
            f"| {_ends(record)} |"
        )
    return "\n".join([*lines, "", _footer(recorded)])


def failure_table(recorded: Mapping[str, Any]) -> str:
    """The catalogue page's table: each scenario's description here, the long form's figures."""
    lines = [
        "| failure | replays | time to evict | picks of the dead or hung engine: unanswered "
        "/ after eviction | lost / duplicate / stale at the end | back after the fault "
        "ended | longest the table differed from etcd | what tightens it |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in recorded["scenarios"]:
        scenario, worst, limits = SCENARIOS[record["name"]], record["worst"], record["limits"]
        picks = f"{_cell(record, 'failed_picks')} / {_cell(record, 'after_evict')}"
        back = []
        if scenario.returns:
            back.append(f"{_cell(record, 'back')}, added again {worst.get('readds') or 0:g}x")
        back += [
            f"{LABELS.get(name, name)} {_cell(record, name)}"
            for name in limits
            if name in LABELS and not (name == "failed_requests" and scenario.name != "drain")
        ]
        errors = ""
        if record["errors"]:
            errors = f" (**{record['errors']} of {record['runs']} runs failed**)"
        lines.append(
            f"| **{scenario.name}**: {scenario.failure}{errors} | {scenario.replays} "
            f"| {_evict(record)} | {picks} | {_ends(record)} | {'; '.join(back) or '-'} "
            f"| {worst.get('converge') or 0:.1f} s | {scenario.knob} |"
        )
    return "\n".join([*lines, "", _footer(recorded)])


def write_table(text: str, table: str) -> str:
    """``text`` with ``table`` between its failure-table markers."""
    head, _, rest = text.partition(TABLE_BEGIN)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_BEGIN}{table}\n{TABLE_END}{tail}"


TABLES = {FULL_TABLE: failure_table, HEADLINE_TABLE: headline_table}
"""Each file holding a table, and the function that renders it from the record."""
