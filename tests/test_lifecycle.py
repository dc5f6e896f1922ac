"""Engine lifecycle (issue 13): status, drain, operators, signals, routers; the logic on
the memory port and on real etcd (``store``), processes and signals on real etcd."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from discovery import (
    EndpointWatcher,
    EngineStatus,
    EventType,
    NoEngineAvailableError,
    RegistrationState,
    Router,
    RoutingTable,
    Settings,
    drain,
    register_engine,
    undrain,
    watch_table,
)
from discovery._writes.registration import _TRANSITIONS, Registration, _Event
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .conftest import Store
from .helpers import (
    Registrar,
    cli_env,
    etcdctl,
    get_kv,
    make_endpoint,
    run_cli,
    wait_for,
)

S = RegistrationState


def _status(settings: Settings, engine_id: str) -> str | None:
    kv = get_kv(settings.endpoints, settings.keyspace.key(engine_id))
    return None if kv is None else json.loads(kv["value"]).get("status", "ready")


def test_the_transition_table_is_the_state_machine() -> None:
    assert {new for new in _TRANSITIONS.values()} == {S.REGISTERED, S.LOST, S.CLOSED}
    assert not [pair for pair in _TRANSITIONS if pair[0] is S.CLOSED], "closed is final"
    for state in (S.REGISTERING, S.REGISTERED, S.LOST):
        assert _TRANSITIONS[(state, _Event.CLOSE)] is S.CLOSED
    # A loss while lost is no transition: each loss is counted (and reported) once.
    assert (S.LOST, _Event.LEASE_LOST) not in _TRANSITIONS
    assert (S.LOST, _Event.RECORD_LOST) not in _TRANSITIONS
    assert _TRANSITIONS[(S.LOST, _Event.WRITTEN)] is S.REGISTERED


def test_status_changes_are_updated_events_and_routers_pick_ready_engines(store: Store) -> None:
    with watch_table(**store.using()) as table:
        events: list[tuple[EventType, str, EngineStatus]] = []
        table.subscribe(
            lambda batch, _: events.extend((e.type, e.engine_id, e.status) for e in batch)
        )
        router = Router(table, policy="round_robin")
        with (
            register_engine(
                make_endpoint(0), engine_id="warm", status="starting", **store.using()
            ) as warm,
            register_engine(make_endpoint(1), engine_id="hot", **store.using()) as hot,
        ):
            table.wait_until(lambda snap: {"warm", "hot"} <= set(snap), timeout=10)
            assert table.get("warm").status is EngineStatus.STARTING
            assert json.loads(store.get(warm.key).value)["status"] == "starting"  # as stored
            assert {router.pick([1] * 8, 8).engine_id for _ in range(6)} == {"hot"}
            warm_up = Router(table, statuses=("starting",))  # a warm-up client's router
            with warm_up.pick([1] * 8, 8) as handle:
                assert handle.engine_id == "warm"
            router = Router(table, policy="round_robin")  # no handles left behind

            warm.set_status(EngineStatus.READY)
            table.wait_until(lambda snap: snap["warm"].ready, timeout=10)
            # Listeners run on the store's dispatcher thread, just after the table applies.
            wait_for(
                lambda: (EventType.UPDATED, "warm", EngineStatus.READY) in events,
                message="the updated event at the listener",
            )
            held = [router.pick([1] * 8, 8) for _ in range(2)]
            assert {h.engine_id for h in held} == {"warm", "hot"}

            hot.drain(60)
            snap = table.wait_until(lambda s: s["hot"].status is EngineStatus.DRAINING, timeout=10)
            left = (snap["hot"].drain_deadline - datetime.now(UTC)).total_seconds()
            assert 50 < left <= 60
            assert hot.status is EngineStatus.DRAINING and hot.state is S.REGISTERED
            assert {router.pick([1] * 8, 8).engine_id for _ in range(4)} == {"warm"}
            for handle in held:  # picked before the drain: still valid, released normally
                handle.release()
            assert router.in_flight()["hot"] == 0  # a draining engine's count stays visible
            warm.drain(60)
            table.wait_until(lambda s: s["warm"].status is EngineStatus.DRAINING, timeout=10)
            with pytest.raises(NoEngineAvailableError, match=r"is ready \(2 draining\)"):
                router.pick([1] * 8, 8)
            hot.set_status("ready")  # the engine's own explicit call undrains it
            table.wait_until(lambda s: s["hot"].ready and s["hot"].drain_deadline is None)


def test_drain_revokes_at_its_deadline(store: Store) -> None:
    with watch_table(**store.using()) as table:
        reg = register_engine(make_endpoint(), engine_id="leaving", **store.using())
        removed = threading.Event()
        table.subscribe(
            lambda batch, _: any(e.type is EventType.REMOVED for e in batch) and removed.set()
        )
        table.wait_until(lambda snap: "leaving" in snap, timeout=10)
        started = time.monotonic()
        reg.drain(1.0)
        table.wait_until(lambda snap: snap["leaving"].status is EngineStatus.DRAINING, timeout=5)
        assert reg.wait_for_state(S.CLOSED, timeout=10)
        assert time.monotonic() - started >= 1.0
        assert removed.wait(10)
        assert store.get(reg.key) is None
        reg.close()  # idempotent

        quick = register_engine(make_endpoint(), engine_id="quick", **store.using())
        quick.drain(0)  # nothing to wait for: revoked at once
        assert quick.state is S.CLOSED and store.get(quick.key) is None


class _SlowUpdate:
    """A port whose record updates are slow: whether ``registration`` began closing while
    one was in flight is noted in ``closed_under_write``."""

    def __init__(self, port: MemoryPort) -> None:
        self._port = port
        self.registration: Registration | None = None
        self.closed_under_write = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)

    def update(self, key: str, value: bytes, lease_id: int, *, mod_revision: int) -> Any:
        if self.registration is not None:
            # Long enough for a close started on another thread to be seen.
            closing = self.registration.wait_for_state(S.CLOSED, timeout=0.5)
            self.closed_under_write = self.closed_under_write or closing
        return self._port.update(key, value, lease_id, mod_revision=mod_revision)


def test_a_drain_of_0_closes_after_its_own_write(memory_etcd: MemoryEtcd) -> None:
    """drain(0) marks the record draining, then closes. Its deadline, due at once, is armed
    after that write: armed before, it closed the registration on a pool thread under the
    write, which then failed on the closed connection (drain raised "Channel closed!" on
    real etcd, a CI flake of test_drain_revokes_at_its_deadline)."""
    with MemoryPort(memory_etcd) as inner:
        port = _SlowUpdate(inner)
        settings = Settings(namespace="drain-0")
        quick = register_engine(
            make_endpoint(), engine_id="quick", settings=settings, connection=port
        )
        port.registration = quick
        quick.drain(0)
        assert not port.closed_under_write
        assert quick.state is S.CLOSED and inner.get(quick.key) is None


def test_a_bad_status_is_skipped_and_counted_then_the_registrar_writes_its_own(
    store: Store,
) -> None:
    with watch_table(**store.using()) as table:
        reg = register_engine(make_endpoint(), engine_id="broken", ttl=3, **store.using())
        table.wait_until(lambda snap: "broken" in snap, timeout=10)
        value = json.loads(store.get(reg.key).value)
        value["status"] = "hibernating"
        store.port.replace(reg.key, json.dumps(value).encode(), reg.lease_id)
        # Like any bad value: skipped and counted, and the engine leaves the table...
        table.wait_until(lambda snap: "broken" not in snap, timeout=10)
        assert table.watcher.health().skipped == 1
        # ...until its registrar, which saw the outside write, puts its own record back.
        table.wait_until(lambda snap: "broken" in snap and snap["broken"].ready, timeout=10)
        assert reg.state is S.REGISTERED and reg.health().losses == 0
        reg.close()


def _revoked_and_back(settings: Settings, key: str, kv: dict) -> dict:
    """Revoke the record's lease (a lost lease); the record as its registrar writes it back."""
    assert etcdctl(settings.endpoints, "lease", "revoke", f"{kv['lease']:x}").returncode == 0
    return wait_for(
        lambda: (new := get_kv(settings.endpoints, key)) and new["lease"] != kv["lease"] and new,
        message="the record on a new lease",
    )


def test_operator_drain_and_undrain_survive_a_lost_lease(settings: Settings) -> None:
    registrar = Registrar(settings, "op", ttl=3)
    key = settings.keyspace.key("op")
    try:
        kv = wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        result = run_cli(settings, "drain", "op")
        assert result.returncode == 0, result.stderr
        assert "engine 'op' is draining" in result.stdout
        wait_for(lambda: "ready -> draining, changed from outside" in registrar.output(),
                 message="the registrar to adopt the drain")  # fmt: skip

        # The lease is lost (an operator revokes it): the record comes back, still draining.
        kv = _revoked_and_back(settings, key, kv)
        assert json.loads(kv["value"])["status"] == "draining"
        listed = run_cli(settings, "list")
        assert any(line.split()[:2] == ["op", "draining"] for line in listed.stdout.splitlines())

        result = run_cli(settings, "undrain", "op")
        assert result.returncode == 0 and "engine 'op' is ready" in result.stdout
        wait_for(lambda: "draining -> ready, changed from outside" in registrar.output(),
                 message="the registrar to adopt the undrain")  # fmt: skip
        kv = _revoked_and_back(settings, key, kv)
        assert json.loads(kv["value"])["status"] == "ready"
        assert run_cli(settings, "undrain", "op").stdout.strip() == "engine 'op' is ready"

        # A drain with a deadline: `discovery list` shows it, the registrar revokes then.
        result = run_cli(settings, "drain", "op", "--timeout", "2")
        assert result.returncode == 0 and "is draining until 20" in result.stdout
        listed = json.loads(run_cli(settings, "list", "--format", "json").stdout)["engines"]
        assert listed[0]["status"] == "draining" and listed[0]["drain_deadline"].endswith("Z")
        assert registrar.wait(timeout=15) == 0, registrar.output()
        assert "drained and deregistered" in registrar.output()
        assert get_kv(settings.endpoints, key) is None
        assert run_cli(settings, "drain", "op").returncode == 1  # no such engine any more
    finally:
        registrar.stop()


def test_a_drain_survives_an_etcd_outage_longer_than_the_ttl(private_store: Store) -> None:
    store = private_store
    with register_engine(make_endpoint(), engine_id="outage", ttl=2, **store.using()) as reg:
        record = drain("outage", **store.using())
        assert record.status is EngineStatus.DRAINING and record.drain_deadline is None
        wait_for(lambda: reg.status is EngineStatus.DRAINING, message="the registrar to adopt it")
        store.down()
        assert reg.wait_for_state(S.LOST, timeout=10)
        store.up()
        assert reg.wait_for_state(S.REGISTERED, timeout=10)
        kv = wait_for(lambda: store.get(reg.key), message="the record back")
        assert json.loads(kv.value)["status"] == "draining"
        assert undrain("outage", **store.using()).status is EngineStatus.READY
        wait_for(lambda: reg.status is EngineStatus.READY, message="the registrar to adopt it")


def test_second_signal_revokes_at_once(settings: Settings) -> None:
    registrar = Registrar(settings, "twice", ttl=10, extra=("--drain-timeout", "60"))
    key = settings.keyspace.key("twice")
    try:
        wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        registrar.signal(signal.SIGTERM)
        wait_for(lambda: _status(settings, "twice") == "draining", message="draining")
        assert registrar.process.poll() is None  # still serving what it has
        registrar.signal(signal.SIGINT)
        assert registrar.wait(timeout=10) == 0, registrar.output()
        assert get_kv(settings.endpoints, key) is None
    finally:
        registrar.stop()


_LIBRARY_PROGRAM = """
import sys, time
from discovery import register_engine, deregister_on_signals, Settings
from tests.helpers import make_endpoint
reg = register_engine(make_endpoint(), engine_id=sys.argv[1], ttl=30, settings=Settings.from_env())
deregister_on_signals(reg, drain_timeout=float(sys.argv[2]))
print("ready", flush=True)
while True:  # an application's main loop, still serving during the drain
    time.sleep(0.05)
"""


def test_signal_helper_drains_then_revokes_then_exits_as_before(settings: Settings) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _LIBRARY_PROGRAM, "lib-drain", "1.5"],
        env=cli_env(settings),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_for(lambda: _status(settings, "lib-drain") == "draining", message="draining")
        assert process.wait(15) == 128 + signal.SIGTERM
        assert time.monotonic() - signalled >= 1.5
        assert get_kv(settings.endpoints, settings.keyspace.key("lib-drain")) is None
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


class _StampedTable(RoutingTable):
    """A table that notes, at apply time, each batch (under the store's lock)."""

    def __init__(self, watcher: EndpointWatcher) -> None:
        super().__init__(watcher, own_watcher=True)
        self.log: list[tuple[float, int, tuple, dict]] = []

    def deliver(self, batch) -> None:  # type: ignore[override]
        now = time.monotonic()
        snapshot = self.store.snapshot()
        self.log.append(
            (
                now,
                snapshot.revision,
                tuple((e.type, e.engine_id, e.status) for e in batch),
                {engine_id: record.status for engine_id, record in snapshot.items()},
            )
        )
        super().deliver(batch)


def test_rolling_restart_with_zero_failed_requests(settings: Settings) -> None:
    """3 engines (``discovery register --drain-timeout 2``), each replaced in turn (the new
    one first, then SIGTERM to the old one) while clients pick continuously and hold each
    handle 10-200 ms."""
    table = _StampedTable(EndpointWatcher(settings)).start()
    router = Router(table)
    engines = {f"e{i}": _drain_registrar(settings, f"e{i}") for i in range(3)}
    requests: list[tuple[str, int, float, float]] = []  # engine, revision before, picked, done
    failures: list[BaseException] = []
    handles = []
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            before = table.revision
            try:
                handle = router.pick(list(range(64)), 64)
            except NoEngineAvailableError as exc:
                failures.append(exc)
                continue
            handles.append(handle)
            picked = time.monotonic()
            stop.wait(rng.uniform(0.01, 0.2))  # the request's life
            done = time.monotonic()
            handle.release()
            requests.append((handle.engine_id, before, picked, done))

    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(3)]
    signalled: dict[str, float] = {}
    try:
        table.wait_until(lambda s: len(s) == 3 and all(r.ready for r in s.values()), timeout=20)
        for thread in clients:
            thread.start()
        for i in range(3):
            old, new = f"e{i}", f"e{i}-next"
            engines[new] = _drain_registrar(settings, new)
            table.wait_until(lambda s, new=new: new in s and s[new].ready, timeout=20)
            signalled[old] = time.monotonic()
            engines[old].signal(signal.SIGTERM)
            assert engines[old].wait(timeout=30) == 0, engines[old].output()
            table.wait_until(lambda s, old=old: old not in s, timeout=10)
        stop.set()
        for thread in clients:
            thread.join(10)
    finally:
        stop.set()
        for registrar in engines.values():
            registrar.stop()
        table.stop()

    assert not failures, failures[:3]
    assert requests and all(handle.released for handle in handles)
    assert len(requests) == len(handles)
    draining_at: dict[str, tuple[float, int]] = {}
    removed_at: dict[str, float] = {}
    for at, revision, batch, statuses in table.log:
        for kind, engine_id, status in batch:
            assert engine_id not in removed_at, f"{engine_id} came back after its removal"
            if status is EngineStatus.DRAINING and engine_id not in draining_at:
                draining_at[engine_id] = (at, revision)
            if kind is EventType.REMOVED:
                removed_at[engine_id] = at
        ready = [e for e, status in statuses.items() if status is EngineStatus.READY]
        assert ready, f"no ready engine at revision {revision}: {statuses}"
    assert set(draining_at) == set(removed_at) == {"e0", "e1", "e2"}
    for engine_id, (_, revision) in draining_at.items():
        # The drain lasted its 2 s (from the signal to the removal)...
        assert removed_at[engine_id] - signalled[engine_id] >= 2.0
        # ...no pick that began after the draining event reached the table chose it...
        late = [r for r in requests if r[0] == engine_id and r[1] >= revision]
        assert not late, f"{len(late)} picks of {engine_id} after it was draining"
    # ...and no request was still running on an engine when it was removed.
    for engine_id, _, _picked, done in requests:
        if engine_id in removed_at:
            assert done < removed_at[engine_id], f"a request on {engine_id} outlived it"
    assert set(table.snapshot()) == {"e0-next", "e1-next", "e2-next"}
    assert {e for e, *_ in requests} >= {"e0", "e1", "e2", "e2-next"}


def _drain_registrar(settings: Settings, engine_id: str) -> Registrar:
    return Registrar(settings, engine_id, ttl=5, extra=("--drain-timeout", "2"))
