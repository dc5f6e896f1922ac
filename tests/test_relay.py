"""The engine-state relay and the routers' view of it, over real ZeroMQ sockets.

The relay (``discovery._state.relay``) serves one engine's block set; ``EngineStates`` follows a
routing table's engines. No etcd here: the table is fed by hand (the store's own API), so
what is tested is the relay protocol, the resynchronisation and the views.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from discovery import EngineStates, RoutingTable
from discovery._reads.store import EngineStore, Entry
from discovery._records.record import EngineRecord
from discovery._state.kvstate import BlockSet, kv_change, pack_hashes, unpack_hashes
from discovery._state.relay import StateRelay

from .helpers import make_endpoint, wait_for

FAST = {"heartbeat": 0.05}  # ticks and heartbeats: gaps at the tail show within 0.1 s


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class Fleet:
    """A routing table fed by hand with engines that advertise relays."""

    def __init__(self) -> None:
        self.store = EngineStore()
        self.table = RoutingTable(self.store).start()
        self.revision = 0
        self.entries: dict[str, Entry] = {}

    def put(self, engine_id: str, state_address: str | None) -> None:
        self.revision += 1
        record = EngineRecord(engine_id, make_endpoint(), state_address=state_address)
        self.entries[engine_id] = Entry(f"/k/{engine_id}", record, self.revision)
        self.store.replace(dict(self.entries), self.revision)

    def remove(self, engine_id: str) -> None:
        self.revision += 1
        del self.entries[engine_id]
        self.store.replace(dict(self.entries), self.revision)

    def close(self) -> None:
        self.table.stop()
        self.store.close()


@pytest.fixture
def fleet():
    fleet = Fleet()
    yield fleet
    fleet.close()


def _view(states: EngineStates, engine_id: str) -> frozenset[int] | None:
    state = states.state(engine_id)
    return state.blocks if state is not None and state.synced else None


def test_a_router_sees_the_snapshot_then_every_increment(fleet: Fleet) -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", **FAST)
    relay.publish("stored", [1, 2, 3])  # before anyone subscribed: in the snapshot
    address = relay.start()
    fleet.put("e1", address)
    with EngineStates(fleet.table, **FAST) as states:
        states.wait_synced(["e1"], timeout=5)
        assert _view(states, "e1") == {1, 2, 3}
        relay.publish("stored", [4, 5])
        relay.publish("removed", [2, 99])  # 99 was never announced: ignored
        wait_for(lambda: _view(states, "e1") == {1, 3, 4, 5}, timeout=5, message="increments")
        assert states.cached_prefix("e1", [1, 3, 4, 6, 5]) == 3
        relay.publish("cleared", [])
        wait_for(lambda: _view(states, "e1") == frozenset(), timeout=5, message="cleared")
        assert states.cached_prefix("e1", [1]) == 0
        assert states.health().resyncs["gap"] == 0  # nothing was lost on the way
        fleet.remove("e1")
        assert states.state("e1") is None and "e1" not in states  # at the removal event
    relay.close()


def test_a_lost_increment_is_a_gap_and_the_view_resynchronises(fleet: Fleet) -> None:
    relay = _Lossy("tcp://127.0.0.1:*", name="e1", **FAST)
    fleet.put("e1", relay.start())
    with EngineStates(fleet.table, **FAST) as states:
        states.wait_synced(["e1"], timeout=5)
        relay.drop = {"kv"}
        relay.publish("stored", [7, 8])  # lost on the way
        wait_for(lambda: relay.lost == 1, timeout=5, message="the frame lost")
        relay.drop = set()
        relay.publish("stored", [9])  # seq + 2: a gap
        wait_for(lambda: _view(states, "e1") == {7, 8, 9}, timeout=5, message="resync")
        assert states.health().resyncs["gap"] >= 1
        relay.drop = {"kv"}
        relay.publish("removed", [9])  # the last increment lost: the next tick says so
        wait_for(lambda: _view(states, "e1") == {7, 8}, timeout=5, message="tick-led resync")
    relay.close()


def test_a_relay_restart_is_a_new_epoch(fleet: Fleet) -> None:
    address = _free_address()
    first = StateRelay(address, name="e1", **FAST)
    first.publish("stored", [1, 2])
    first.start()
    fleet.put("e1", address)
    with EngineStates(fleet.table, **FAST) as states:
        states.wait_synced(["e1"], timeout=5)
        epoch = states.state("e1").epoch
        first.close()
        second = StateRelay(address, name="e1", **FAST)  # the launcher restarted
        second.publish("stored", [5])
        second.start()
        wait_for(lambda: _view(states, "e1") == {5}, timeout=5, message="the new engine's state")
        assert states.state("e1").epoch == second.epoch != epoch  # replaced, not merged
        second.close()


def test_a_silent_relay_makes_the_state_stale(fleet: Fleet) -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", **FAST)
    fleet.put("e1", relay.start())
    with EngineStates(fleet.table, stale_after=0.3, **FAST) as states:
        states.wait_synced(["e1"], timeout=5)
        relay.publish("stored", [1])
        wait_for(lambda: states.cached_prefix("e1", [1]) == 1, timeout=5, message="fresh")
        relay.close()  # the launcher died: nothing more comes
        wait_for(lambda: states.cached_prefix("e1", [1]) is None, timeout=5, message="stale")
        assert states.state("e1").age > 0.3
        assert states.health().synced == 0


def test_fresh_view_is_one_mapping_until_a_state_changes(fleet: Fleet) -> None:
    fleet.put("e1", "tcp://127.0.0.1:1")
    fleet.put("e2", "tcp://127.0.0.1:2")
    states = EngineStates(fleet.table, stale_after=0.2).start(connect=False)  # fed by hand
    load = {"in_flight": 0, "routers": 1, "yours": 0, "engine": None}
    try:
        assert states.fresh_view() == {}  # nothing synced yet
        states.feed("e1", ["hello", 5, 0, pack_hashes([1, 2]), load])
        view = states.fresh_view()
        assert view == {"e1": {1, 2}}
        assert states.fresh_view() is view  # nothing changed: the same mapping
        states.feed("e1", ["kv", 5, 1, "stored", pack_hashes([3])])
        assert states.fresh_view() is view  # an increment changes the live set, not the view
        assert view["e1"] == {1, 2, 3}
        states.feed("e2", ["hello", 7, 0, pack_hashes([9]), load])
        assert states.fresh_view() == {"e1": {1, 2, 3}, "e2": {9}}
        states.feed("e1", ["kv", 5, 3, "stored", pack_hashes([4])])  # a gap: unsynced
        assert states.fresh_view() == {"e2": {9}}
        time.sleep(0.3)  # silent past stale_after
        assert states.fresh_view() == {}
        states.feed("e2", ["tick", 7, 0])  # heard from again
        assert states.fresh_view() == {"e2": {9}}
        fleet.remove("e2")
        assert states.fresh_view() == {}
    finally:
        states.stop()


def test_load_reports_are_summed_across_routers_and_age_out(fleet: Fleet) -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", subscriber_timeout=0.5, **FAST)
    fleet.put("e1", relay.start())
    one = EngineStates(fleet.table, load=lambda: {"e1": 3}, **FAST).start()
    two = EngineStates(fleet.table, load=lambda: {"e1": 4}, **FAST).start()
    try:
        wait_for(
            lambda: (
                (one.fresh("e1") or {}).get("in_flight") == 7
                and (two.fresh("e1") or {}).get("in_flight") == 7
            ),
            timeout=5,
            message="both routers see the sum",
        )
        assert one.fresh("e1")["routers"] == 2 and one.fresh("e1")["engine"] is None
        two.stop()  # its report ages out after the subscriber timeout
        wait_for(lambda: one.fresh("e1")["in_flight"] == 3, timeout=5, message="aged out")
        assert relay.health().subscribers == 1
    finally:
        one.stop()
        two.stop()
        relay.close()


def test_the_load_an_engine_reports_replaces_the_routers_sum(fleet: Fleet) -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", **FAST)
    fleet.put("e1", relay.start())
    states = EngineStates(fleet.table, load=lambda: {"e1": 3}, **FAST).start()
    try:
        wait_for(lambda: states.others("e1") == 0, timeout=5, message="our own 3 only")
        relay.set_engine_load({"active_request_count": 5, "waiting_request_count": 2})
        # The engine's 7 include our 3: the other routers hold 4.
        wait_for(lambda: states.others("e1") == 4, timeout=5, message="the engine's count")
        assert states.fresh("e1")["engine"] == {
            "active_request_count": 5,
            "waiting_request_count": 2,
        }
        relay.set_engine_load(None)  # back to the routers' reports
        wait_for(lambda: states.others("e1") == 0, timeout=5, message="the routers' sum")
    finally:
        states.stop()
        relay.close()


def test_garbage_from_subscribers_is_ignored_and_counted(fleet: Fleet) -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", **FAST)
    address = relay.start()
    relay.publish("stored", [11])
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(address)
    try:
        for frame in (b"\xc1", msgpack.packb({"x": 1}), msgpack.packb(["nonsense"]), b"x" * 4096):
            rogue.send(frame)
        fleet.put("e1", address)
        with EngineStates(fleet.table, **FAST) as states:
            states.wait_synced(["e1"], timeout=5)  # the relay still serves
            assert _view(states, "e1") == {11}
        wait_for(lambda: relay.health().garbage >= 3, timeout=5, message="garbage counted")
    finally:
        rogue.close()
        context.term()
        relay.close()


def test_an_event_flood_stays_within_the_engine_capacity() -> None:
    relay = StateRelay("tcp://127.0.0.1:*", name="e1", backlog=16, **FAST)
    relay.resize(1000)  # the engine's total_kv_blocks
    for start in range(0, 50_000, 500):
        relay.publish("stored", range(start, start + 500))
    health = relay.health()
    assert health.blocks == 1000 and health.dropped_blocks == 49_000
    assert relay.hashes()[0] == 49_000  # the newest stay, as the engine's LRU keeps them
    assert health.overflows == 100 - 16  # the backlog is bounded: subscribers resync


def test_block_sets_follow_megatrons_events() -> None:
    blocks = BlockSet(capacity=3)
    blocks.apply("stored", kv_change("stored", {"block_hashes": [1, 2]}))
    blocks.apply("stored", kv_change("stored", {"block_hashes": [1, 3, 4]}))  # 1 again: newest
    assert blocks.hashes() == [1, 3, 4] and blocks.dropped == 1
    blocks.apply("removed", kv_change("removed", {"block_hashes": [3, 42]}))
    assert blocks.hashes() == [1, 4]
    blocks.apply("cleared", kv_change("cleared", {}))
    assert len(blocks) == 0
    for bad in ({"block_hashes": [-1]}, {"block_hashes": [2**64]}, {"block_hashes": [True]}, []):
        with pytest.raises(ValueError):
            kv_change("stored", bad)
    assert list(unpack_hashes(pack_hashes([1, 2**63 - 1, 2**64 - 1]))) == [1, 2**63 - 1, 2**64 - 1]


class _Lossy(StateRelay):
    """A relay whose frames of the kinds in ``drop`` are lost on the way (as a full queue
    or a network would lose them)."""

    drop: set[str] = set()
    lost = 0

    def _send_all(self, sock: Any, frame: bytes) -> None:
        if msgpack.unpackb(frame, raw=False)[0] in self.drop:
            self.lost += 1
            return
        super()._send_all(sock, frame)


# -- property: whatever is lost on the way, every view converges to the engine's truth --

HASHES = st.integers(min_value=1, max_value=40)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.lists(HASHES, min_size=1, max_size=6)),
        st.tuples(st.just("removed"), st.lists(HASHES, min_size=1, max_size=6)),
        st.tuples(st.just("cleared"), st.just([])),
        st.tuples(st.just("lossy"), st.booleans()),
        st.tuples(st.just("reconnect"), st.integers(0, 1)),
        st.tuples(st.just("restart"), st.just([])),
    ),
    max_size=30,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(  # increments lost, then the stream ends: only the tick tells
    ops=[("stored", [1, 2]), ("lossy", True), ("stored", [3]), ("removed", [1])], seed=0
)
@example(  # a loss in the middle: the next increment shows the gap
    ops=[("stored", [1]), ("lossy", True), ("cleared", []), ("lossy", False), ("stored", [2])],
    seed=1,
)
@example(  # a restart while frames are lost, a reconnect after
    ops=[("stored", [4]), ("lossy", True), ("restart", []), ("stored", [5]), ("reconnect", 0)],
    seed=2,
)
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_views_converge_to_the_engines_true_block_set(ops: list[Any], seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet()
    address = _free_address()
    relay = _Lossy(address, name="e1", **FAST)
    relay.start()
    fleet.put("e1", address)
    routers = [EngineStates(fleet.table, **FAST).start() for _ in range(2)]
    truth = BlockSet()
    try:
        for op, arg in ops:
            if op == "lossy":
                relay.drop = {"kv", "tick"} if arg else set()
            elif op == "reconnect":  # one router's subscription starts over
                routers[arg].stop()
                routers[arg] = EngineStates(fleet.table, **FAST).start()
            elif op == "restart":  # the launcher (and its engine) start again: empty cache
                relay.close()
                relay = _Lossy(address, name="e1", **FAST)
                relay.start()
                truth = BlockSet()
            else:
                relay.publish(op, arg)
                truth.apply(op, arg)
            if rng.random() < 0.3:
                threading.Event().wait(0.005)  # let frames interleave with the next ops
        relay.drop = set()  # the stream quiesces: nothing more is lost
        expected = frozenset(truth.hashes())
        for router in routers:
            wait_for(lambda r=router: _view(r, "e1") == expected, timeout=10, message="converged")
        fleet.remove("e1")
        for router in routers:
            assert router.state("e1") is None and len(router) == 0
            assert router.health().blocks == 0
    finally:
        for router in routers:
            router.stop()
        relay.close()
        fleet.close()
