"""Protection from mass lease loss, retry hooks and reasons (issue 32), on tables fed by hand.

A removal is what etcd shows when a lease expires or is revoked: the record goes. What the
router knows is the record's last status: ``ready`` (nobody said anything: a lease that
expired, or a crash) or anything else (``stopping``, ``draining``: a witness said so).
The end-to-end scenarios (engine hosts cut off etcd in network namespaces, real SIGKILLs)
are the failure catalogue's ``mass-host-cut`` and ``mass-host-cut-30s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest

from discovery import (
    EngineStates,
    EngineStatus,
    EventType,
    NoEngineAvailableError,
    PickHandle,
    PrefixCachingCoordinatorPolicy,
    Router,
)
from discovery._records.record import EngineRecord
from discovery._state.kvstate import pack_hashes

from .helpers import make_endpoint, wait_for
from .test_router import Fleet

LB = PrefixCachingCoordinatorPolicy.LOAD_BALANCED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet_of(count: int, relays: bool = False) -> Fleet:
    fleet = Fleet()
    for i in range(count):
        record = EngineRecord(
            f"e{i}",
            make_endpoint(i, LB),
            state_address=f"tcp://127.0.0.1:{1000 + i}" if relays else None,
        )
        fleet.records[record.engine_id] = record
        fleet._deliver((EventType.ADDED, record))
    return fleet


def set_status(fleet: Fleet, engine_id: str, status: EngineStatus) -> None:
    record = dataclasses.replace(fleet.records[engine_id], status=status)
    fleet.records[engine_id] = record
    fleet._deliver((EventType.UPDATED, record))


def remove(fleet: Fleet, *engine_ids: str) -> None:
    """The records go in one revision (leases expiring together, or one by one)."""
    fleet._deliver(*((EventType.REMOVED, fleet.records.pop(e)) for e in engine_ids))


def come_back(fleet: Fleet, engine_id: str) -> None:
    record = EngineRecord(engine_id, make_endpoint(int(engine_id[1:]), LB))
    fleet.records[engine_id] = record
    fleet._deliver((EventType.ADDED, record))


def pickable(router: Router, count: int = 64) -> set[str]:
    handles = [router.pick([1], 1) for _ in range(count)]
    for handle in handles:
        handle.release()
    return {h.engine_id for h in handles}


def test_one_lease_lost_below_the_threshold_evicts_it_at_once() -> None:
    fleet = fleet_of(4)
    router = Router(fleet.table, policy="round_robin")
    held = router.pick([1], 1)
    remove(fleet, held.engine_id)
    assert held.engine_id not in pickable(router)
    assert held.lost == "removed: its record is gone"
    assert router.health().unconfirmed == {}
    # Two of four (half: not more than the threshold) also evict.
    remove(fleet, *sorted(fleet.records)[:1])
    assert len(pickable(router)) == 2


def test_a_mass_lease_loss_keeps_every_engine_routable_as_unconfirmed(caplog) -> None:
    clock = Clock()
    fleet = fleet_of(4)
    router = Router(fleet.table, policy="round_robin", clock=clock)
    held = router.pick([1], 1)
    remove(fleet, "e0")  # 1 of 4: evicted
    assert pickable(router) == {"e1", "e2", "e3"}
    clock.now += 5
    with caplog.at_level(logging.WARNING, logger="discovery._routing.protection"):
        remove(fleet, "e1", "e2")  # 3 of 4 within the window: a mass loss
        assert pickable(router) == {"e0", "e1", "e2", "e3"}
    assert "3 of 4 ready engines lost their records within 30 s" in caplog.text
    unconfirmed = router.health().unconfirmed
    assert sorted(unconfirmed) == ["e0", "e1", "e2"]
    assert unconfirmed["e0"] == pytest.approx(5.0)
    assert router.explain("e1").reason == "unconfirmed"
    assert "unconfirmed: its record went" in str(router.explain("e1"))
    # While it lasts, the last one is protected as soon as it goes: the table never empties.
    remove(fleet, "e3")
    assert pickable(router) == {"e0", "e1", "e2", "e3"}
    assert held.lost in (None, "removed: its record is gone")
    # A record that comes back makes an ordinary engine again.
    come_back(fleet, "e1")
    assert sorted(router.health().unconfirmed) == ["e0", "e2", "e3"]
    # A failed request on an unconfirmed engine is the evidence that it is dead.
    while (handle := router.pick([1], 1)).engine_id != "e2":
        handle.release()
    other = router.pick([1], 1, exclude={"e0", "e1", "e3"})
    handle.release(failed=True)
    assert other.lost == "unconfirmed, and a request on it failed"
    assert "e2" not in pickable(router)
    # The grace period ends the rest.
    clock.now += 121
    assert pickable(router) == {"e1"}
    assert router.health().unconfirmed == {}


class _PickDuring:
    """A sink ahead of the router's: while one removal is being delivered (the table's
    snapshot already shows it, the router's sink has not had it yet) another thread picks,
    as a frontend's request can at any moment."""

    def __init__(self, router: list[Router], engine_id: str) -> None:
        self._router, self._engine_id = router, engine_id
        self.picker: threading.Thread | None = None

    def deliver(self, batch) -> None:
        if self.picker is None and any(e.engine_id == self._engine_id for e in batch):
            done = threading.Event()

            def pick() -> None:
                self._router[0].pick([1], 1).release()
                done.set()

            self.picker = threading.Thread(target=pick)
            self.picker.start()
            # The pick must wait for the batch (never set then); without that wait it
            # would run here, before the router's sink has the batch.
            done.wait(0.5)

    def close(self) -> None:
        pass


def test_a_pick_during_a_removal_never_lets_an_engine_skip_the_protection() -> None:
    fleet = fleet_of(4)
    routers: list[Router] = []
    during = _PickDuring(routers, "e1")
    fleet.table.store.add_sink(during, replay=False)
    routers.append(Router(fleet.table, policy="round_robin"))
    assert pickable(routers[0]) == {"e0", "e1", "e2", "e3"}
    for engine_id in ("e0", "e1", "e2", "e3"):  # four leases expiring one revision apart
        remove(fleet, engine_id)
    assert during.picker is not None
    during.picker.join()
    assert sorted(routers[0].health().unconfirmed) == ["e0", "e1", "e2", "e3"]


def test_records_removed_on_purpose_are_never_protected() -> None:
    fleet = fleet_of(4)
    router = Router(fleet.table)
    held = router.pick([1], 1)
    for engine_id in ["e0", "e1"]:
        set_status(fleet, engine_id, EngineStatus.STOPPING)  # launch saw it exit; close()
    set_status(fleet, "e2", EngineStatus.DRAINING)
    set_status(fleet, "e3", EngineStatus.PAUSED)
    remove(fleet, "e0", "e1", "e2", "e3")
    with pytest.raises(NoEngineAvailableError, match="empty"):
        router.pick([1], 1)
    assert router.health().unconfirmed == {}
    assert held.lost is not None


def test_protection_can_be_turned_off() -> None:
    fleet = fleet_of(2)
    router = Router(fleet.table, protect_threshold=None)
    remove(fleet, "e0", "e1")
    with pytest.raises(NoEngineAvailableError):
        router.pick([1], 1)
    with pytest.raises(ValueError, match="protect_threshold"):
        Router(fleet.table, protect_threshold=1.0)
    with pytest.raises(ValueError, match="protect_grace"):
        Router(fleet.table, protect_grace=0)


def test_an_unconfirmed_engine_whose_relay_says_goodbye_or_goes_silent_is_evicted() -> None:
    fleet = fleet_of(3, relays=True)
    states = EngineStates(fleet.table, stale_after=60).start(connect=False)
    router = Router(fleet.table, policy="round_robin", states=states)
    handles = {}
    for engine_id in ["e0", "e1", "e2"]:
        states.feed(engine_id, ["hello", 1, 0, pack_hashes([]), {}])
        handles[engine_id] = router.pick([1], 1, exclude=set(fleet.records) - {engine_id})
    remove(fleet, "e0", "e1", "e2")
    assert pickable(router) == {"e0", "e1", "e2"}
    assert "e1" in states  # held: its relay is followed although the table lost it
    states.feed("e1", ["bye", 1])
    wait_for(lambda: handles["e1"].lost is not None, message="e1's handle told")
    assert handles["e1"].lost == "unconfirmed, and its state relay went silent"
    assert pickable(router) == {"e0", "e2"}
    come_back(fleet, "e0")  # e0 is back: ordinary again, whatever its relay says
    # Silence past stale_after is evidence too.
    states.stale_after = 1e-9
    wait_for(lambda: "e2" not in router.health().unconfirmed, message="e2 evicted as silent")
    assert pickable(router) == {"e0"}
    assert handles["e0"].lost is None
    states.stop()


def test_handles_learn_when_their_engine_stops_being_a_good_target() -> None:
    fleet = fleet_of(4)
    router = Router(fleet.table, policy="round_robin", fence_after=1)
    on = {e: router.pick([1], 1, exclude=set(fleet.records) - {e}) for e in fleet.records}
    told: list[tuple[str, str | None]] = []
    done = threading.Event()

    def tell(handle: PickHandle) -> None:
        told.append((handle.engine_id, handle.lost))
        done.set()

    on["e0"].on_lost(tell)
    set_status(fleet, "e0", EngineStatus.STALLED)
    assert done.wait(5)
    assert told == [("e0", "stalled: its launcher stopped hearing from it")]
    set_status(fleet, "e1", EngineStatus.DRAINING)
    router.health()  # caught up with the table
    assert on["e1"].lost is None  # a draining engine finishes what it has
    remove(fleet, "e1")  # its drain deadline: the record goes
    wait_for(lambda: on["e1"].lost == "removed: its record is gone", message="e1 told")
    router.pick([1], 1, exclude={"e0", "e1", "e3"}).release(failed=True)  # e2 fenced
    assert on["e2"].lost == "fenced: too many requests on it failed in a row"
    assert on["e3"].lost is None
    # Told once; a late listener hears at once; a released handle hears nothing more.
    late: list[PickHandle] = []
    on["e0"].on_lost(late.append)
    assert late == [on["e0"]]
    on["e3"].release()
    set_status(fleet, "e3", EngineStatus.STALLED)
    router.health()
    assert on["e3"].lost is None


def test_wait_lost_is_an_awaitable() -> None:
    fleet = fleet_of(2)
    router = Router(fleet.table, policy="round_robin")
    handle = router.pick([1], 1)

    async def main() -> str:
        waiting = asyncio.create_task(handle.wait_lost())
        await asyncio.sleep(0)
        assert not waiting.done()
        threading.Thread(target=remove, args=(fleet, handle.engine_id)).start()
        return await asyncio.wait_for(waiting, 10)

    assert asyncio.run(main()) == "removed: its record is gone"


def test_exclude_keeps_a_retry_off_the_engines_named() -> None:
    fleet = fleet_of(3)
    router = Router(fleet.table)
    assert {router.pick([1], 1, exclude={"e0"}).engine_id for _ in range(30)} == {"e1", "e2"}
    with pytest.raises(NoEngineAvailableError, match="every one of the 3 candidate engines"):
        router.pick([1], 1, exclude=["e0", "e1", "e2"])
    with pytest.raises(TypeError, match="not a string"):
        router.pick([1], 1, exclude="e0")


def test_explain_names_each_filter() -> None:
    fleet = Fleet()
    fleet.add("ready", 0, labels={"model": "a"}, policy=LB)
    fleet.add("other", 1, labels={"model": "b"}, policy=LB)
    fleet.add("short", 2, labels={"model": "a"}, policy=LB, context_length=64)
    fleet.add("fenced", 3, labels={"model": "a"}, policy=LB)
    fleet.add("full", 4, labels={"model": "a"}, policy=LB, max_num_seqs=1)
    fleet.add("drain", 5, labels={"model": "a"}, policy=LB)
    set_status(fleet, "drain", EngineStatus.DRAINING)
    old = dataclasses.replace(fleet.records["ready"], engine_id="old", weight_version=1)
    new = dataclasses.replace(fleet.records["ready"], engine_id="new", weight_version=2)
    fleet._deliver((EventType.ADDED, old), (EventType.ADDED, new))
    router = Router(fleet.table, selector={"model": "a"}, fence_after=1, wait=0)
    router.pick([1], 1, exclude={"ready", "short", "full", "old", "new"}).release(failed=True)
    router.pick([1], 1, exclude={"ready", "short", "fenced", "old", "new"})  # full now
    reasons = {e: router.explain(e).reason for e in fleet.table.snapshot()}
    assert reasons == {
        "ready": "candidate",
        "other": "labels",
        "short": "candidate",
        "fenced": "fenced",
        "full": "capacity",
        "drain": "draining",
        "old": "candidate",
        "new": "candidate",
    }
    assert router.explain("nowhere").reason == "absent"
    assert router.explain("short", [1] * 60, 10).reason == "fit"
    assert router.explain("ready", selector={"zone": "x"}).reason == "selector"
    assert router.explain("ready", exclude=["ready"]).reason == "excluded"
    assert router.explain("old", weight_version="latest").reason == "version"
    text = str(router.explain("full"))
    assert "capacity: load 1 of capacity 1" in text and "NO" in text
    checks = [name for name, _, _ in router.explain("ready").checks]
    assert checks == [
        "table",
        "labels",
        "status",
        "fit",
        "selector",
        "exclude",
        "version",
        "fencing",
        "capacity",
        "state",
    ]
    assert router.reasons() == {"candidate": 4, "fenced": 1, "capacity": 1, "draining": 1}
