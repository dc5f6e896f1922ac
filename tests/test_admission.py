"""Admission under overload: engines at capacity are no candidates, picks wait (issue 32).

Unit tests on tables fed by hand (``Fleet``) and engine states fed by hand (``feed``):
capacity, the queue's order and bounds, priorities, many routers sharing an engine, and
the asyncio form; then the same rules on real etcd with stand-in engines. The end-to-end
figures (stand-in engines, 4 routers, 2x the capacity) are bench/bench_overload.py's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from discovery import (
    EngineStates,
    EventType,
    NoEngineAvailableError,
    OverloadedError,
    PickHandle,
    PrefixCachingCoordinatorPolicy,
    Router,
    Settings,
)
from discovery._records.record import EngineRecord
from discovery._state.kvstate import pack_hashes

from .helpers import make_endpoint, wait_for
from .test_fleet import fleet_of as fleet_of_engines
from .test_router import Fleet

LB = PrefixCachingCoordinatorPolicy.LOAD_BALANCED


def fleet_of(count: int, slots: int) -> Fleet:
    fleet = Fleet()
    for i in range(count):
        fleet.add(f"e{i}", i, policy=LB, max_num_seqs=slots)
    return fleet


def test_an_engine_at_capacity_is_no_candidate_and_the_bound_is_named() -> None:
    fleet = fleet_of(2, slots=2)
    router = Router(fleet.table, wait=0)
    handles = [router.pick([1, 2], 4) for _ in range(4)]
    assert sorted(h.engine_id for h in handles) == ["e0", "e0", "e1", "e1"]
    with pytest.raises(OverloadedError) as refused:
        router.pick([1, 2], 4)
    error = refused.value
    assert (error.capacity, error.load, error.waited, error.queued) == (4, 4, 0.0, 0)
    assert "run 4 requests of their capacity 4" in str(error)
    assert isinstance(error, NoEngineAvailableError)  # a 503 handler catches both
    handles[0].release()
    assert router.pick([1, 2], 4).engine_id == handles[0].engine_id


def test_without_admission_options_picks_go_past_capacity_as_before() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table)
    assert [router.pick([1], 1).engine_id for _ in range(3)] == ["e0"] * 3
    # A pick that asks to wait turns admission on for itself.
    with pytest.raises(OverloadedError):
        router.pick([1], 1, wait=0)


def test_capacity_is_overridable_per_router() -> None:
    fleet = fleet_of(2, slots=8)
    router = Router(fleet.table, capacity=1)
    first, second = router.pick([1], 1), router.pick([1], 1)
    assert {first.engine_id, second.engine_id} == {"e0", "e1"}
    with pytest.raises(OverloadedError, match="capacity 2"):
        router.pick([1], 1)
    by_record = Router(fleet.table, capacity=lambda record: 3 if record.engine_id == "e0" else 1)
    assert sorted(by_record.pick([1], 1).engine_id for _ in range(4)) == ["e0"] * 3 + ["e1"]
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        Router(fleet.table, capacity=0)
    bad = Router(fleet.table, capacity=lambda record: 0)
    with pytest.raises(ValueError, match=r"capacity\(e0\) returned 0"):
        bad.pick([1], 1)


class Waiting:
    """Picks waiting in threads, started one at a time so their order is known."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.served: list[tuple[str, PickHandle | BaseException]] = []
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, name: str, **kwargs) -> None:
        queued = self.router.health().waiting

        def pick() -> None:
            try:
                outcome: PickHandle | BaseException = self.router.pick([1], 1, **kwargs)
            except BaseException as exc:
                outcome = exc
            with self._lock:
                self.served.append((name, outcome))

        thread = threading.Thread(target=pick, daemon=True)
        thread.start()
        self.threads.append(thread)
        wait_for(lambda: self.router.health().waiting == queued + 1, message=f"{name} queued")

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.served]

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)


def test_waiting_picks_are_served_first_come_first_served_as_room_appears() -> None:
    fleet = fleet_of(1, slots=2)
    router = Router(fleet.table, wait=30)
    held = [router.pick([1], 1), router.pick([1], 1)]
    waiting = Waiting(router)
    for name in "abc":
        waiting.start(name)
    assert waiting.names() == []
    held[0].release()
    wait_for(lambda: waiting.names() == ["a"], message="a served by the release")
    # A new pick does not jump the queue: the room goes to those waiting first.
    held[1].release()
    wait_for(lambda: waiting.names() == ["a", "b"], message="b served")
    a = waiting.served[0][1]
    assert isinstance(a, PickHandle) and a.waited > 0
    a.release()
    wait_for(lambda: waiting.names() == ["a", "b", "c"], message="c served")
    waiting.join()
    assert router.health().waiting == 0


def test_room_from_a_new_engine_serves_a_waiting_pick() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table, wait=30)
    router.pick([1], 1)
    waiting = Waiting(router)
    waiting.start("a")
    fleet.add("e1", 1, policy=LB, max_num_seqs=1)
    wait_for(lambda: waiting.names() == ["a"], message="served by the new engine")
    handle = waiting.served[0][1]
    assert isinstance(handle, PickHandle) and handle.engine_id == "e1"


def test_a_pick_raises_past_its_wait_and_past_the_queue_bound() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table, wait=30, max_waiting=1)
    router.pick([1], 1)
    started = time.monotonic()
    with pytest.raises(OverloadedError) as timed_out:
        router.pick([1], 1, wait=0.2)
    assert time.monotonic() - started >= 0.2
    assert timed_out.value.waited >= 0.2 and "its wait ran out" in str(timed_out.value)
    waiting = Waiting(router)
    waiting.start("a")
    with pytest.raises(OverloadedError, match="1 picks wait already") as full:
        router.pick([1], 1)
    assert full.value.waited == 0.0 and full.value.queued == 1
    with pytest.raises(ValueError, match="wait must be"):
        router.pick([1], 1, wait=-1)
    with pytest.raises(TypeError, match="priority must be an integer"):
        router.pick([1], 1, priority=1.5)  # type: ignore[arg-type]


def test_filters_still_raise_no_engine_at_once_under_admission() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table, wait=30)
    started = time.monotonic()
    with pytest.raises(NoEngineAvailableError, match="matches the selector 'model=other'") as error:
        router.pick([1], 1, selector={"model": "other"})
    assert not isinstance(error.value, OverloadedError)
    assert time.monotonic() - started < 5


def test_high_priority_keeps_the_reserved_headroom_and_is_served_first() -> None:
    fleet = fleet_of(1, slots=4)
    router = Router(fleet.table, wait=30, reserve=0.5)
    low = [router.pick([1], 1), router.pick([1], 1)]
    with pytest.raises(OverloadedError, match="reserve 50%"):
        router.pick([1], 1, wait=0)  # half the engine is kept for higher priorities
    high = [router.pick([1], 1, priority=1), router.pick([1], 1, priority=1)]
    waiting = Waiting(router)
    waiting.start("low", priority=0)
    waiting.start("high", priority=1)
    high[0].release()  # room for priority 1 only (the engine runs 3 of 4)
    wait_for(lambda: waiting.names() == ["high"], message="the high-priority pick served")
    low[0].release()
    low[1].release()
    assert waiting.names() == ["high"]  # 2 of 4 run: priority 0 may fill only half
    high[1].release()  # 1 of 4: room for priority 0 again
    wait_for(lambda: waiting.names() == ["high", "low"], message="then the low one")
    with pytest.raises(ValueError, match="reserve must be within"):
        Router(fleet.table, reserve=1.0)


def kv_states(fleet: Fleet) -> EngineStates:
    states = EngineStates(fleet.table).start(connect=False)
    return states


def relay_load(states: EngineStates, engine_id: str, *, in_flight: int, yours: int, routers: int):
    load = {"in_flight": in_flight, "routers": routers, "yours": yours, "engine": None}
    states.feed(engine_id, ["hello", 1, 0, pack_hashes([]), load])


def relayed_fleet(slots: int) -> tuple[Fleet, EngineStates]:
    fleet = Fleet()
    record = EngineRecord(
        "e0", make_endpoint(0, LB, max_num_seqs=slots), state_address="tcp://127.0.0.1:1"
    )
    fleet.records["e0"] = record
    fleet._deliver((EventType.ADDED, record))
    return fleet, kv_states(fleet)


def test_other_routers_load_counts_and_each_router_keeps_to_its_share() -> None:
    fleet, states = relayed_fleet(slots=8)
    router = Router(fleet.table, states=states, wait=0)
    # Three other routers report 2 each; we are the fourth: our share is 8 / 4 = 2.
    relay_load(states, "e0", in_flight=6, yours=0, routers=4)
    router.pick([1], 1)
    router.pick([1], 1)
    with pytest.raises(OverloadedError):
        router.pick([1], 1)
    explanation = router.explain("e0")
    assert "this router's share 1/4" in str(explanation)
    states.stop()


def test_a_lower_relayed_load_serves_a_waiting_pick() -> None:
    fleet, states = relayed_fleet(slots=4)
    router = Router(fleet.table, states=states, wait=30)
    relay_load(states, "e0", in_flight=4, yours=0, routers=1)  # the engine's count: full
    waiting = Waiting(router)
    waiting.start("a")
    states.feed("e0", ["load", 1, {"in_flight": 2, "routers": 1, "yours": 0, "engine": None}])
    wait_for(lambda: waiting.names() == ["a"], message="served by the relayed load")
    states.stop()


def test_apick_waits_without_blocking_the_event_loop() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table, wait=30)
    held = router.pick([1], 1)

    async def main() -> tuple[PickHandle, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick = asyncio.create_task(ticker())
        pick = asyncio.create_task(router.apick([1], 1))
        # While the pick waits, the loop keeps running other coroutines.
        while ticks < 50:
            await asyncio.sleep(0.001)
        assert not pick.done() and router.health().waiting == 1
        threading.Thread(target=held.release).start()  # room, from another thread
        handle = await asyncio.wait_for(pick, 10)
        stop.set()
        await tick
        return handle, ticks

    handle, ticks = asyncio.run(main())
    assert handle.engine_id == "e0" and ticks >= 50


def test_a_cancelled_apick_gives_its_place_up() -> None:
    fleet = fleet_of(1, slots=1)
    router = Router(fleet.table, wait=30)
    held = router.pick([1], 1)

    async def main() -> None:
        pick = asyncio.create_task(router.apick([1], 1))
        while router.health().waiting != 1:
            await asyncio.sleep(0.001)
        pick.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pick
        assert router.health().waiting == 0
        with pytest.raises(OverloadedError):
            await router.apick([1], 1, wait=0.05)

    asyncio.run(main())
    held.release()
    assert router.in_flight() == {"e0": 0}


def test_on_real_etcd_picks_wait_in_priority_order_and_overload_is_raised_at_the_bound(
    settings: Settings,
) -> None:
    """Stand-in engines registered in etcd, the router on a watched table: the same rules."""
    with fleet_of_engines(settings, 2, capacity=1, wait=30, max_waiting=2) as (_, router):
        held = [router.pick([1], 1), router.pick([1], 1)]
        assert {h.engine_id for h in held} == {"e0", "e1"}
        with pytest.raises(OverloadedError, match="no wait allowed"):
            router.pick([1], 1, wait=0)
        waiting = Waiting(router)
        waiting.start("low")
        waiting.start("high", priority=1)
        with pytest.raises(OverloadedError, match="2 picks wait already"):
            router.pick([1], 1)
        held[0].release()
        wait_for(lambda: waiting.names() == ["high"], message="the high priority served first")
        held[1].release()
        wait_for(lambda: waiting.names() == ["high", "low"], message="then the low one")
        waiting.join()
        for _, handle in waiting.served:
            assert isinstance(handle, PickHandle) and handle.waited > 0
            handle.release()
        assert router.health().waiting == 0
