"""Rollout fleets: paused engines and weight versions, against real etcd.

A trainer refits rollout engines one at a time (``paused``, then the new ``weight_version``
and ``ready`` in one write) while a router with ``weight_version="latest"`` keeps picking.
"""

from __future__ import annotations

import base64
import json
import signal
import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    EndpointEvent,
    EndpointWatcher,
    EngineStatus,
    EventType,
    InferenceEngineEndpoint,
    InvalidRecordError,
    Metrics,
    NoEngineAvailableError,
    RecordDecodeError,
    RegistrationState,
    Router,
    RoutingSnapshot,
    RoutingTable,
    Settings,
    pause,
    register_engine,
    resume,
)
from discovery._etcd.connection import Connection
from discovery._reads.store import Change, EngineStore
from discovery._records.codec import KeySpace, encode
from discovery._records.record import EngineRecord
from discovery.cli._commands import format_event

from .helpers import (
    STAND_IN,
    Launcher,
    Registrar,
    etcdctl,
    get_kv,
    make_endpoint,
    raw_call,
    run_cli,
    wait_for,
)
from .test_endpoint import megatron_from_dict

READY, PAUSED = EngineStatus.READY, EngineStatus.PAUSED


# -- the rollout: a fleet refitted one engine at a time ------------------------------------


class _SeenTable(RoutingTable):
    """A table that remembers, per thread, the snapshot it last handed out.

    The router reads the table's snapshot once per pick, so on the picking thread
    ``seen()`` right after a pick is the exact table state that pick chose from.
    """

    def __init__(self, watcher: EndpointWatcher) -> None:
        super().__init__(watcher, own_watcher=True)
        self._seen = threading.local()

    def snapshot(self) -> RoutingSnapshot:
        snapshot = super().snapshot()
        self._seen.snapshot = snapshot
        return snapshot

    def seen(self) -> RoutingSnapshot:
        return self._seen.snapshot


def _etcd_at(settings: Settings, revision: int) -> dict[str, EngineRecord]:
    """The engines etcd held at ``revision`` (etcdctl get --rev), decoded."""
    prefix = settings.keyspace.prefix
    result = etcdctl(
        settings.endpoints, "get", "--prefix", prefix, "--rev", str(revision), "-w", "json"
    )
    assert result.returncode == 0, result.stderr
    records = {}
    for kv in json.loads(result.stdout).get("kvs") or []:
        record = settings.keyspace.decode(
            base64.b64decode(kv["key"]), base64.b64decode(kv["value"])
        )
        records[record.engine_id] = record
    return records


def _state(snapshot: RoutingSnapshot) -> dict[str, tuple[EngineStatus, int | None]]:
    return {engine_id: (r.status, r.weight_version) for engine_id, r in snapshot.items()}


def test_a_fleet_refitted_one_engine_at_a_time_under_a_latest_router(settings: Settings) -> None:
    """4 engines on version 7; a trainer pauses each in turn, then puts it back ready on
    version 8 in one write (two through the operator functions, two through the engine's
    own registration). A router with ``latest`` picks and releases all along."""
    ids = [f"r{i}" for i in range(4)]
    table = _SeenTable(EndpointWatcher(settings)).start()
    snapshots: list[RoutingSnapshot] = []
    table.subscribe(lambda _batch, snapshot: snapshots.append(snapshot))
    router = Router(table, weight_version="latest")
    regs = {
        engine_id: register_engine(
            make_endpoint(i),
            engine_id=engine_id,
            labels={"pool": "rollout"},
            weight_version=7,
            ttl=10,
            settings=settings,
        )
        for i, engine_id in enumerate(ids)
    }
    picks: list[tuple[RoutingSnapshot, EngineRecord]] = []
    failures: list[tuple[RoutingSnapshot, NoEngineAvailableError]] = []
    handles = []
    stop = threading.Event()

    def picker() -> None:
        while not stop.is_set():
            try:
                handle = router.pick(list(range(64)), 16)
            except NoEngineAvailableError as exc:
                failures.append((table.seen(), exc))
                continue
            picks.append((table.seen(), handle.record))
            handles.append(handle)
            stop.wait(0.001)  # the request's life (pacing, not synchronisation)
            handle.release()

    def picks_at(revision: int) -> int:
        return sum(1 for snapshot, _ in picks if snapshot.revision >= revision)

    thread = threading.Thread(target=picker)
    try:
        start = table.wait_until(
            lambda s: set(s) == set(ids) and all(r.ready for r in s.values()), timeout=20
        )
        thread.start()
        wait_for(lambda: picks_at(start.revision) >= 20, message="picks on version 7")
        for i, engine_id in enumerate(ids):
            reg = regs[engine_id]
            # The trainer: from outside (pause/resume) for some engines, the engine's own
            # calls for the others; either way the second step is one write.
            if i % 2 == 0:
                assert pause(engine_id, settings=settings).status is PAUSED
            else:
                reg.pause()
            paused = table.wait_until(lambda s, e=engine_id: s[e].status is PAUSED, timeout=10)
            wait_for(lambda r=paused.revision: picks_at(r) >= 20, message="picks while paused")
            # ...the new weights are loaded...
            if i % 2 == 0:
                assert resume(engine_id, 8, settings=settings).weight_version == 8
            else:
                reg.resume(weight_version=8)
            refit = table.wait_until(
                lambda s, e=engine_id: s[e].ready and s[e].weight_version == 8, timeout=10
            )
            wait_for(lambda r=refit.revision: picks_at(r) >= 20, message="picks after the refit")
        # Every registrar adopted the outside changes (and wrote its own ones).
        wait_for(
            lambda: all(r.status is READY and r.weight_version == 8 for r in regs.values()),
            message="the registrars on version 8",
        )
    finally:
        stop.set()
        thread.join(10)
        for reg in regs.values():
            reg.close()
        table.stop()

    assert not thread.is_alive()
    assert not failures, failures[:3]
    assert handles and all(handle.released for handle in handles)
    assert set(router.in_flight().values()) <= {0}
    versions_picked = set()
    for snapshot, record in picks:
        assert snapshot[record.engine_id] is record, "the pick's record is the table's"
        assert record.status is READY, f"picked {record.engine_id} while {record.status}"
        newest = max(r.weight_version for r in snapshot.values() if r.ready)
        assert record.weight_version == newest, (
            f"picked {record.engine_id} on v{record.weight_version} at revision "
            f"{snapshot.revision}, when an engine on v{newest} was ready"
        )
        versions_picked.add(record.weight_version)
    assert versions_picked == {7, 8}
    # No reader saw an engine ready on the new status but the old version: each engine went
    # (ready, 7) -> (paused, 7) -> (ready, 8), one write each (then stopping, when closed).
    everything = sorted({s.revision: s for s in [*snapshots, *(s for s, _ in picks)]}.items())
    for engine_id in ids:
        seen: list[Any] = []
        for _, snapshot in everything:
            state = _state(snapshot).get(engine_id)
            if state is not None and (not seen or seen[-1] != state):
                seen.append(state)
        if seen[-1] == (EngineStatus.STOPPING, 8):
            seen.pop()
        assert seen == [(READY, 7), (PAUSED, 7), (READY, 8)], (engine_id, seen)
    # The table was etcd at every revision it (or a pick) saw.
    assert len(everything) >= 9
    for revision, snapshot in everything:
        assert dict(snapshot.items()) == _etcd_at(settings, revision), f"at revision {revision}"


# -- pause / resume from outside, across a lost lease ---------------------------------------


def _revoked_and_back(settings: Settings, key: str, kv: dict) -> dict:
    """Revoke the record's lease (a lost lease); the record as its registrar writes it back."""
    assert etcdctl(settings.endpoints, "lease", "revoke", f"{kv['lease']:x}").returncode == 0
    return wait_for(
        lambda: (new := get_kv(settings.endpoints, key)) and new["lease"] != kv["lease"] and new,
        message="the record on a new lease",
    )


def _listed(settings: Settings, engine_id: str) -> list[str]:
    listed = run_cli(settings, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split()[:3] == ["ENGINE", "STATUS", "VERSION"]
    return next(line.split() for line in listed.stdout.splitlines() if line.startswith(engine_id))


def test_pause_and_resume_through_the_cli_survive_a_lost_lease(settings: Settings) -> None:
    registrar = Registrar(settings, "op", ttl=3, extra=("--weight-version", "7"))
    key = settings.keyspace.key("op")
    try:
        kv = wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        assert json.loads(kv["value"])["weight_version"] == 7
        assert _listed(settings, "op")[:3] == ["op", "ready", "v7"]

        result = run_cli(settings, "pause", "op")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "engine 'op' is paused v7"
        wait_for(lambda: "status ready -> paused, changed from outside" in registrar.output(),
                 message="the registrar to adopt the pause")  # fmt: skip
        # The lease is lost: the record comes back, still paused, on the same version.
        kv = _revoked_and_back(settings, key, kv)
        stored = json.loads(kv["value"])
        assert (stored["status"], stored["weight_version"]) == ("paused", 7)
        assert _listed(settings, "op")[:3] == ["op", "paused", "v7"]

        result = run_cli(settings, "resume", "op", "--weight-version", "8")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "engine 'op' is ready v8"
        wait_for(
            lambda: (
                "status paused -> ready, weight_version 7 -> 8, changed from outside"
                in registrar.output()
            ),
            message="the registrar to adopt the resume",
        )
        kv = _revoked_and_back(settings, key, kv)
        stored = json.loads(kv["value"])
        assert (stored["status"], stored["weight_version"]) == ("ready", 8)

        # Backwards only with --force.
        result = run_cli(settings, "resume", "op", "--weight-version", "6")
        assert result.returncode == 2
        assert "weight_version would go backwards from 8 (stored) to 6" in result.stderr
        assert json.loads(get_kv(settings.endpoints, key)["value"])["weight_version"] == 8
        assert run_cli(settings, "pause", "op").stdout.strip() == "engine 'op' is paused v8"
        result = run_cli(settings, "resume", "op", "--weight-version", "6", "--force")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "engine 'op' is ready v6"
        wait_for(lambda: "weight_version 8 -> 6, changed from outside" in registrar.output(),
                 message="the registrar to adopt the rollback")  # fmt: skip
        kv = _revoked_and_back(settings, key, kv)
        stored = json.loads(kv["value"])
        assert (stored["status"], stored["weight_version"]) == ("ready", 6)

        assert run_cli(settings, "resume", "nobody").returncode == 1
        assert run_cli(settings, "pause", "nobody").returncode == 1
        assert run_cli(settings, "resume", "op", "--weight-version", "-1").returncode == 2
        assert registrar.process.poll() is None, registrar.output()
    finally:
        registrar.stop()


def test_pause_leaves_a_draining_engine_and_resume_a_starting_one(settings: Settings) -> None:
    with (
        register_engine(make_endpoint(0), engine_id="leaving", settings=settings) as leaving,
        register_engine(
            make_endpoint(1), engine_id="warming", status="starting", settings=settings
        ),
    ):
        leaving.drain(60)
        assert pause("leaving", settings=settings).status is EngineStatus.DRAINING
        assert resume("warming", 3, settings=settings).status is EngineStatus.STARTING
        assert pause("warming", settings=settings).status is PAUSED
        assert resume("warming", 3, settings=settings).weight_version == 3
        assert pause("nobody", settings=settings) is None
        assert resume("nobody", settings=settings) is None


def test_a_launched_engine_registers_on_its_weight_version_and_pauses_from_outside(
    settings: Settings,
) -> None:
    """``discovery launch --weight-version``: Megatron sends no pause event, so a rollout
    framework pauses the launched engine through ``discovery pause``; the launcher's
    registrar adopts it."""
    launcher = Launcher(settings, "launched", STAND_IN, "--weight-version", "5", "--ttl", "5")
    try:
        kv = wait_for(lambda: get_kv(settings.endpoints, launcher.key), 60, "the ready engine")
        assert json.loads(kv["value"])["weight_version"] == 5
        assert run_cli(settings, "pause", "launched").stdout.strip() == (
            "engine 'launched' is paused v5"
        )
        wait_for(lambda: "status ready -> paused, changed from outside" in launcher.output(),
                 message="the launcher's registrar to adopt the pause")  # fmt: skip
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.wait() == 0, launcher.output()
        assert get_kv(settings.endpoints, launcher.key) is None
    finally:
        launcher.stop()


# -- the engine's own calls ------------------------------------------------------------------


def _stored(settings: Settings, engine_id: str) -> dict[str, Any]:
    kv = get_kv(settings.endpoints, settings.keyspace.key(engine_id))
    assert kv is not None
    return {**json.loads(kv["value"]), "mod_revision": kv["mod_revision"]}


def test_the_registration_api_pauses_resumes_and_keeps_both_across_a_lost_lease(
    settings: Settings,
) -> None:
    with register_engine(
        make_endpoint(), engine_id="own", weight_version=3, ttl=3, settings=settings
    ) as reg:
        assert reg.weight_version == 3 and reg.health().weight_version == 3
        reg.pause()
        assert reg.status is PAUSED
        stored = _stored(settings, "own")
        assert (stored["status"], stored["weight_version"]) == ("paused", 3)

        lease = reg.lease_id
        assert etcdctl(settings.endpoints, "lease", "revoke", f"{lease:x}").returncode == 0
        wait_for(
            lambda: reg.lease_id != lease and reg.state is RegistrationState.REGISTERED,
            message="registered again",
        )
        stored = _stored(settings, "own")
        assert (stored["status"], stored["weight_version"]) == ("paused", 3)

        reg.resume(weight_version=4)
        stored = _stored(settings, "own")
        assert (stored["status"], stored["weight_version"]) == ("ready", 4)
        # Backwards: refused before anything is written, the record as it was.
        with pytest.raises(InvalidRecordError, match=r"from 4 \(stored\) to 2"):
            reg.resume(weight_version=2)
        with pytest.raises(InvalidRecordError, match=r"from 4 \(stored\) to 3"):
            reg.set_status("paused", weight_version=3)
        assert _stored(settings, "own") == stored
        assert (reg.status, reg.weight_version) == (READY, 4)
        reg.resume(weight_version=2, force=True)
        assert _stored(settings, "own")["weight_version"] == 2
        # Both in one write, whatever the status.
        reg.set_status("paused", weight_version=5)
        after = _stored(settings, "own")
        assert (after["status"], after["weight_version"]) == ("paused", 5)
        reg.resume()  # the version stays
        after = _stored(settings, "own")
        assert (after["status"], after["weight_version"]) == ("ready", 5)


def _outside_write(settings: Settings, key: str, **changes: Any) -> None:
    """Change the stored value on its lease, as a trainer would (compare-and-swap)."""
    with Connection(settings) as conn:
        found = raw_call(conn, lambda _: conn.get(key))
        value = {**json.loads(found.value), **changes}
        result = raw_call(
            conn,
            lambda _: conn.update(
                key, json.dumps(value).encode(), found.lease, mod_revision=found.mod_revision
            ),
        )
        assert result.succeeded


def test_a_lower_version_is_refused_against_a_higher_one_the_registrar_had_not_seen(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version rule is checked against the value the compare-and-swap compares: an
    outside write of version 9 the registrar has not seen yet (its watch is held back
    here) refuses the engine's version 8, and the stored 9 stays."""
    key = settings.keyspace.key("racy")
    with register_engine(
        make_endpoint(), engine_id="racy", weight_version=7, ttl=30, settings=settings
    ) as reg:
        monkeypatch.setattr(reg, "observed", lambda kv, revision: None)  # a slow watch
        _outside_write(settings, key, weight_version=9)
        assert reg.weight_version == 7  # not seen
        with pytest.raises(InvalidRecordError, match=r"from 9 \(stored\) to 8"):
            reg.resume(weight_version=8)
        assert _stored(settings, "racy")["weight_version"] == 9
        assert reg.weight_version == 9  # what it found is adopted
        # A status change without a version keeps the version found (never lowers it).
        _outside_write(settings, key, weight_version=10)
        reg.pause()
        stored = _stored(settings, "racy")
        assert (stored["status"], stored["weight_version"]) == ("paused", 10)
        # With force, the engine's version goes on top (a rollback).
        _outside_write(settings, key, weight_version=11)
        reg.resume(weight_version=8, force=True)
        stored = _stored(settings, "racy")
        assert (stored["status"], stored["weight_version"]) == ("ready", 8)
        monkeypatch.undo()
        # The operator's resume checks the value it compares on, too.
        with pytest.raises(InvalidRecordError, match=r"from 8 \(stored\) to 7"):
            resume("racy", 7, settings=settings)
        assert resume("racy", 7, settings=settings, force=True).weight_version == 7


# -- bad versions, Megatron's reader ------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, "7", True, 1.5, 7.0, 2**63, [7]], ids=repr)
def test_bad_weight_versions_are_refused(bad: Any, settings: Settings) -> None:
    message = "weight_version must be an integer from 0 to 2\\*\\*63 - 1"
    with pytest.raises(InvalidRecordError, match=message):
        EngineRecord("e1", make_endpoint(), weight_version=bad)
    with pytest.raises(InvalidRecordError, match=message):
        register_engine(make_endpoint(), engine_id="bad", weight_version=bad, settings=settings)
    with pytest.raises(InvalidRecordError, match=message):
        resume("bad", bad, settings=settings)
    value = json.loads(encode(EngineRecord("e1", make_endpoint())))
    with pytest.raises(RecordDecodeError, match=message):
        stored = json.dumps({**value, "weight_version": bad}).encode()
        KeySpace().decode(KeySpace().key("e1"), stored)
    with register_engine(make_endpoint(), engine_id="good", settings=settings) as reg:
        with pytest.raises(InvalidRecordError, match=message):
            reg.resume(weight_version=bad)
        assert reg.weight_version is None
    assert get_kv(settings.endpoints, settings.keyspace.key("bad")) is None


def test_megatron_from_dict_loads_a_paused_versioned_record(settings: Settings) -> None:
    endpoint = make_endpoint(3)
    with register_engine(
        endpoint, engine_id="refit", status="paused", weight_version=8, settings=settings
    ):
        kv = get_kv(settings.endpoints, settings.keyspace.key("refit"))
    value = json.loads(kv["value"])
    assert (value["status"], value["weight_version"]) == ("paused", 8)
    bare = json.loads(json.dumps(endpoint.to_dict()))
    assert megatron_from_dict(value) == megatron_from_dict(bare)  # Megatron's rules
    assert InferenceEngineEndpoint.from_dict(value) == endpoint  # our Megatron-equal record


def test_the_version_is_shown_by_watch_and_in_its_jsonl() -> None:
    record = EngineRecord("w1", make_endpoint(), status="paused", weight_version=12)
    event = EndpointEvent(EventType.UPDATED, KeySpace().key("w1"), 5, record)
    assert " paused v12 rev=5" in format_event(event, "text")
    assert json.loads(format_event(event, "jsonl"))["weight_version"] == 12
    assert event.weight_version == 12
    unset = EndpointEvent(
        EventType.ADDED, KeySpace().key("w1"), 6, EngineRecord("w1", make_endpoint())
    )
    assert " ready rev=6" in format_event(unset, "text")
    assert json.loads(format_event(unset, "jsonl"))["weight_version"] is None


# -- version-aware routing (a table fed by hand: no etcd) ------------------------------------


class _Fleet:
    """A RoutingTable fed by hand, one revision per call."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.table = RoutingTable(EngineStore(), metrics=metrics)
        self.revision = 0

    def set(self, *engines: tuple[Any, ...], **caps: Any) -> None:
        """``(engine id "eN", version[, status])`` for each engine that changes."""
        self.revision += 1
        changes = []
        for engine_id, version, *status in engines:
            record = EngineRecord(
                engine_id,
                make_endpoint(int(engine_id[1:]), **caps),
                weight_version=version,
                status=status[0] if status else READY,
            )
            changes.append(Change(f"/k/{engine_id}", engine_id, self.revision, record))
        self.table.store.apply(changes)


def _picked(router: Router, count: int = 12, **options: Any) -> set[str]:
    chosen = set()
    for _ in range(count):
        with router.pick([1] * 8, 8, **options) as handle:
            chosen.add(handle.engine_id)
    return chosen


def test_latest_keeps_the_highest_version_among_the_ready_candidates() -> None:
    fleet = _Fleet()
    fleet.set(("e0", 7), ("e1", 7), ("e2", 7))
    router = Router(fleet.table, policy="round_robin", weight_version="latest")
    assert _picked(router) == {"e0", "e1", "e2"}
    fleet.set(("e0", 8, "paused"))  # a paused engine on a newer version does not count
    assert _picked(router) == {"e1", "e2"}
    fleet.set(("e0", 8))
    assert _picked(router) == {"e0"}
    assert _picked(Router(fleet.table, policy="round_robin")) == {"e0", "e1", "e2"}
    assert _picked(router, max_version_lag=1) == {"e0", "e1", "e2"}  # replaces the router's
    # The highest version among the candidates that fit: e0 is too short for this request.
    fleet.set(("e0", 8), context_length=64)
    assert _picked(router, count=1) == {"e0"}
    with router.pick([1] * 100, 8) as handle:
        assert handle.weight_version == 7 and handle.engine_id in {"e1", "e2"}


def test_min_weight_version_and_max_version_lag() -> None:
    fleet = _Fleet()
    fleet.set(("e0", 5), ("e1", 6), ("e2", 7), ("e3", 8))
    router = Router(fleet.table, policy="round_robin", min_weight_version=7)
    assert _picked(router) == {"e2", "e3"}
    lagging = Router(fleet.table, policy="round_robin", max_version_lag=2)
    assert _picked(lagging) == {"e1", "e2", "e3"}
    assert _picked(lagging, max_version_lag=0) == {"e3"}
    assert _picked(lagging, weight_version="latest") == {"e3"}
    both = Router(fleet.table, policy="round_robin", weight_version="latest", max_version_lag=3)
    assert _picked(both) == {"e3"}  # latest is lag 0: the smaller lag applies
    assert _picked(router, min_weight_version=6, max_version_lag=1) == {"e2", "e3"}
    with pytest.raises(NoEngineAvailableError) as info:
        router.pick([1] * 8, 8, min_weight_version=9)
    assert str(info.value) == (
        "no engine is on weight_version >= 9 (min_weight_version): the 4 candidates "
        "(status, labels and fit passed) are on v5 (1), v6 (1), v7 (1), v8 (1)"
    )


def test_engines_without_a_version_count_as_older_than_every_version() -> None:
    fleet = _Fleet()
    fleet.set(("e0", None), ("e1", None))
    latest = Router(fleet.table, policy="round_robin", weight_version="latest")
    lagging = Router(fleet.table, policy="round_robin", max_version_lag=1)
    floor = Router(fleet.table, policy="round_robin", min_weight_version=0)
    # A fleet that does not use versions routes as before under latest / max_version_lag...
    assert _picked(latest) == _picked(lagging) == {"e0", "e1"}
    # ...but never passes a floor.
    with pytest.raises(NoEngineAvailableError, match=r"are on no version \(2\)$"):
        floor.pick([1] * 8, 8)
    fleet.set(("e2", 0))  # once one candidate has a version, the others are older
    assert _picked(latest) == _picked(lagging) == _picked(floor) == {"e2"}
    fleet.set(("e2", 0, "paused"))  # ...as long as it is a candidate
    assert _picked(latest) == {"e0", "e1"}
    fleet.set(("e0", None, "paused"), ("e1", None, "paused"))
    with pytest.raises(NoEngineAvailableError, match=r"is ready \(3 paused\)$"):
        latest.pick([1], 1)


def test_version_options_are_checked_and_key_the_pool_cache() -> None:
    fleet = _Fleet()
    fleet.set(("e0", 1), ("e1", 2))
    for options, error in [
        ({"weight_version": "newest"}, ValueError),
        ({"weight_version": 3}, ValueError),
        ({"min_weight_version": -1}, ValueError),
        ({"min_weight_version": True}, TypeError),
        ({"min_weight_version": 1.0}, TypeError),
        ({"max_version_lag": -2}, ValueError),
        ({"max_version_lag": "1"}, TypeError),
    ]:
        with pytest.raises(error):
            Router(fleet.table, **options)
        with pytest.raises(error):
            Router(fleet.table).pick([1], 1, **options)
    router = Router(fleet.table, policy="round_robin")
    # The same request, alternately with and without a version option: never a stale pool.
    for _ in range(3):
        assert _picked(router, 4, weight_version="latest") == {"e1"}
        assert _picked(router, 4) == {"e0", "e1"}
        assert _picked(router, 4, min_weight_version=1) == {"e0", "e1"}
        assert _picked(router, 4, min_weight_version=2) == {"e1"}


# -- metrics ---------------------------------------------------------------------------------


def test_engines_are_counted_by_status_and_a_bounded_set_of_versions(settings: Settings) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    fleet = _Fleet(metrics)
    fleet.set(*((f"e{v}", v) for v in range(1, 7)), ("e7", 6, "paused"), ("e8", None))
    by_version = "discovery_routing_engines_by_version"

    def value(status: str, version: str) -> float | None:
        labels = {"selector": "", "status": status, "weight_version": version}
        return registry.get_sample_value(by_version, labels)

    # The 4 highest versions present have a label each; lower ones are 'older'.
    assert [value("ready", v) for v in ("3", "4", "5", "6")] == [1, 1, 1, 1]
    assert value("paused", "6") == 1 and value("paused", "5") == 0
    assert value("ready", "older") == 2 and value("ready", "none") == 1
    assert value("ready", "2") is None and value("ready", "1") is None
    labels = {
        sample.labels["weight_version"]
        for family in registry.collect()
        if family.name == by_version
        for sample in family.samples
    }
    assert labels == {"none", "older", "3", "4", "5", "6"}
    assert (
        registry.get_sample_value("discovery_routing_engines", {"selector": "", "status": "paused"})
        == 1
    )

    with register_engine(
        make_endpoint(), engine_id="m", weight_version=1, settings=settings, metrics=metrics
    ) as reg:
        reg.pause()
        status = "discovery_registration_status"
        assert registry.get_sample_value(status, {"engine_id": "m", "status": "paused"}) == 1
        assert registry.get_sample_value(status, {"engine_id": "m", "status": "ready"}) == 0
