"""Prefill/decode pairs picked together (issue 34): compatible by Megatron's rule, within a
label when asked, an aggregated engine alone when allowed, one side kept on a re-pick.

Tables fed by hand (``Fleet``), but for the losses of engines registered in etcd (the
``store`` fixture: in memory, then real etcd); docs/prefill-decode.md's examples run in
tests/test_docs.py (every guide's, on etcd). The
compatibility rule itself is tests/test_handoff.py's, the role from the ready shapes and
the flags tests/test_launch.py's and tests/test_cli.py's, and the figures (hit rate,
spread, racks, pick cost) bench/bench_pairs.py's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Sequence

import pytest

from discovery import (
    EngineRecord,
    EngineStates,
    EngineStatus,
    EventType,
    KvLayout,
    NoEngineAvailableError,
    OverloadedError,
    PickHandle,
    PickPair,
    PrefixCachingCoordinatorPolicy,
    Registration,
    Router,
    block_hashes,
    register_engine,
    watch_table,
)
from discovery._state import blockhash
from discovery._state.kvstate import pack_hashes

from .conftest import Store
from .helpers import make_endpoint, make_layout, wait_for
from .test_router import Fleet, no_hashing

LP = PrefixCachingCoordinatorPolicy.LONGEST_PREFIX


def add(
    fleet: Fleet,
    engine_id: str,
    role: str,
    *,
    rack: str = "r0",
    layout: KvLayout | None = None,
    relay: bool = False,
    **caps,
) -> EngineRecord:
    index = len(fleet.records)
    caps.setdefault("policy", LP)
    policy = caps.pop("policy")
    record = EngineRecord(
        engine_id,
        make_endpoint(index, policy, **caps),
        {"rack": rack},
        role=role,
        kv_transfer_backend=None if role == "aggregated" else "nixl",
        kv_layout=None if role == "aggregated" else (layout or make_layout()),
        state_address=f"tcp://127.0.0.1:{2000 + index}" if relay else None,
    )
    kind = EventType.UPDATED if engine_id in fleet.records else EventType.ADDED
    fleet.records[engine_id] = record
    fleet._deliver((kind, record))
    return record


def racks(fleet: Fleet) -> None:
    """4 prefill and 4 decode engines in 2 racks."""
    for i in range(4):
        add(fleet, f"p{i}", "prefill", rack=f"r{i % 2}")
        add(fleet, f"d{i}", "decode", rack=f"r{i % 2}")


def test_pairs_are_a_prefill_and_a_compatible_decode_engine() -> None:
    fleet = Fleet()
    add(fleet, "p-tp4", "prefill", layout=make_layout(tp_size=4))
    add(fleet, "d-tp1", "decode", layout=make_layout(tp_size=1))  # resharded: compatible
    add(fleet, "d-other", "decode", layout=make_layout(head_dim=64))  # another model
    add(fleet, "agg", "aggregated")
    router = Router(fleet.table)
    for _ in range(20):
        with router.pick_pair(list(range(600)), 16) as pair:
            assert pair.prefill is not None and not pair.alone
            assert (pair.prefill.engine_id, pair.decode.engine_id) == ("p-tp4", "d-tp1")
    # Ordinary picks never go to a decode engine (it cannot compute a prompt).
    assert {router.pick([1], 1).engine_id for _ in range(20)} == {"p-tp4", "agg"}
    # No pair at all: the reason, Megatron's.
    only_other = Fleet()
    add(only_other, "p", "prefill")
    add(only_other, "d", "decode", layout=make_layout(head_dim=64))
    with pytest.raises(NoEngineAvailableError, match=r"no pair can hand off.*head_dim"):
        Router(only_other.table).pick_pair([1], 1)


def test_decode_engines_are_picked_by_load() -> None:
    fleet = Fleet()
    add(fleet, "p", "prefill")
    for i in range(4):
        add(fleet, f"d{i}", "decode")
    router = Router(fleet.table)
    pairs = [router.pick_pair(list(range(600)), 16) for _ in range(40)]
    assert Counter(p.decode.engine_id for p in pairs) == {f"d{i}": 10 for i in range(4)}


def test_a_rack_constraint_required_always_holds_and_preferred_holds_while_there_is_room() -> None:
    fleet = Fleet()
    racks(fleet)
    router = Router(fleet.table)
    for _ in range(50):
        pair = router.pick_pair(list(range(600)), 16, pair_within="rack", require_within=True)
        assert pair.prefill is not None
        assert pair.prefill.labels["rack"] == pair.decode.labels["rack"]
    # Preferred: the same rack while it has room, another one after.
    small = Fleet()
    add(small, "p", "prefill", rack="r0")
    add(small, "d-near", "decode", rack="r0", max_num_seqs=1)
    add(small, "d-far", "decode", rack="r1")
    admitted = Router(small.table, wait=0)
    first = admitted.pick_pair([1], 1, pair_within="rack")
    second = admitted.pick_pair([1], 1, pair_within="rack")
    assert (first.decode.engine_id, second.decode.engine_id) == ("d-near", "d-far")
    with pytest.raises(OverloadedError):  # required: no room in the rack means none
        admitted.pick_pair([1], 1, pair_within="rack", require_within=True)
    lone = Fleet()
    add(lone, "p", "prefill", rack="r0")
    add(lone, "d", "decode", rack="r1")
    with pytest.raises(NoEngineAvailableError, match="same 'rack' label"):
        Router(lone.table).pick_pair([1], 1, pair_within="rack", require_within=True)


def test_preferred_moves_the_prefill_side_to_a_rack_with_decode_room() -> None:
    # The least loaded prefill engine's rack has no decode room: a pair inside another
    # rack beats it (the prefill side picked again), the first engine keeps no count.
    fleet = Fleet()
    for rack in ("r0", "r1"):
        add(fleet, f"p-{rack}", "prefill", rack=rack)
        add(fleet, f"d-{rack}", "decode", rack=rack, max_num_seqs=1)
    router = Router(fleet.table, policy="load_balanced", wait=0)
    busy = [router.pick([1], 1, engine_id="p-r1") for _ in range(2)]
    first = router.pick_pair([1], 1, pair_within="rack")
    assert (first.prefill.engine_id, first.decode.engine_id) == ("p-r0", "d-r0")
    second = router.pick_pair([1], 1, pair_within="rack")  # p-r0 is still less loaded
    assert (second.prefill.engine_id, second.decode.engine_id) == ("p-r1", "d-r1")
    assert router.in_flight() == {"p-r0": 1, "d-r0": 1, "p-r1": 3, "d-r1": 1}
    # No rack has room: no pair (wait=0), and nothing held by the attempt.
    with pytest.raises(OverloadedError):
        router.pick_pair([1], 1, pair_within="rack")
    assert router.in_flight() == {"p-r0": 1, "d-r0": 1, "p-r1": 3, "d-r1": 1}
    # A decode side that waits for room gets it when a handle is released.
    waited: list[PickPair] = []
    thread = threading.Thread(
        target=lambda: waited.append(router.pick_pair([1], 1, pair_within="rack", wait=15))
    )
    thread.start()
    wait_for(lambda: router.health().waiting == 1, message="the decode side waits")
    first.decode.release()
    thread.join(15)
    assert [pair.decode.engine_id for pair in waited] == ["d-r0"]
    for handle in (*busy, first.prefill, second, *waited):
        handle.release()
    assert set(router.in_flight().values()) == {0}


def test_an_aggregated_engine_serves_alone_exactly_at_the_thresholds() -> None:
    fleet = Fleet()
    add(fleet, "p", "prefill", kv_cache_block_size=16)
    add(fleet, "d", "decode", kv_cache_block_size=16)
    add(fleet, "agg", "aggregated", relay=True, kv_cache_block_size=16)
    states = EngineStates(fleet.table).start(connect=False)
    router = Router(fleet.table, states=states)
    # Not allowed: always a pair.
    assert not router.pick_pair(list(range(10)), 1).alone
    # Shorter than alone_below: alone; at it: a pair.
    short = router.pick_pair(list(range(63)), 1, allow_aggregated=True, alone_below=64)
    assert short.alone and short.decode.engine_id == "agg"
    assert not router.pick_pair(list(range(64)), 1, allow_aggregated=True, alone_below=64).alone
    # Caching at least alone_share of the prompt's blocks: alone; one block less: a pair.
    prompt = list(range(160))  # 10 blocks of 16
    cached = block_hashes(prompt, 16)[:9]
    states.feed("agg", ["hello", 1, 0, pack_hashes(cached), {}])
    kwargs = {"allow_aggregated": True, "alone_below": 0}
    assert router.pick_pair(prompt, 1, alone_share=0.9, **kwargs).alone
    assert not router.pick_pair(prompt, 1, alone_share=0.91, **kwargs).alone
    # The default share (0.9) counted in blocks: 9 of 10 cached is alone, 8 of 10 a pair.
    assert router.pick_pair(prompt, 1, **kwargs).alone
    states.feed("agg", ["kv", 1, 1, "removed", pack_hashes(cached[8:])])
    assert not router.pick_pair(prompt, 1, **kwargs).alone
    # Only complete blocks count: 15 tokens more make no 11th block to miss.
    assert router.pick_pair([*prompt, *range(15)], 1, alone_share=0.8, **kwargs).alone
    states.stop()


def test_without_a_pair_an_allowed_aggregated_engine_serves_alone() -> None:
    fleet = Fleet()
    add(fleet, "d", "decode")
    add(fleet, "agg", "aggregated")
    router = Router(fleet.table)
    with pytest.raises(NoEngineAvailableError, match=r"no pair|prefill"):
        router.pick_pair([1], 1)
    assert router.pick_pair([1], 1, allow_aggregated=True, alone_below=0).alone


def test_a_lost_prefill_engine_tells_its_handle_and_a_re_pick_keeps_the_decode_side() -> None:
    fleet = Fleet()
    racks(fleet)
    router = Router(fleet.table)
    pair = router.pick_pair(list(range(600)), 16)
    assert pair.prefill is not None
    lost = pair.prefill.engine_id
    fleet.remove(lost)
    wait_for(lambda: pair.prefill.lost is not None, message="the prefill handle told")
    assert pair.decode.lost is None
    again = router.pick_pair(list(range(600)), 16, keep_decode=pair.decode)
    assert again.decode is pair.decode and again.prefill is not None
    assert again.prefill.engine_id != lost
    # Excluding one side only.
    other = router.pick_pair(list(range(600)), 16, exclude_decode=[pair.decode.engine_id])
    assert other.decode.engine_id != pair.decode.engine_id
    pair.release()
    with pytest.raises(ValueError, match="no handle held"):
        router.pick_pair([1], 1, keep_decode=pair.decode)
    # A draining decode engine is no candidate for either side.
    drained = dataclasses.replace(fleet.records["d1"], status=EngineStatus.DRAINING)
    fleet.records["d1"] = drained
    fleet._deliver((EventType.UPDATED, drained))
    assert all(router.pick_pair([1] * 600, 16).decode.engine_id != "d1" for _ in range(20))


def test_a_decode_engine_whose_layout_changes_is_paired_by_its_new_record() -> None:
    fleet = Fleet()
    add(fleet, "p", "prefill")
    add(fleet, "d", "decode")
    router = Router(fleet.table)
    assert router.pick_pair([1], 1).decode.engine_id == "d"
    add(fleet, "d", "decode", layout=make_layout(head_dim=64))  # another model now
    with pytest.raises(NoEngineAvailableError, match="head_dim differs"):
        router.pick_pair([1], 1)
    add(fleet, "d", "decode")
    assert router.pick_pair([1], 1).decode.engine_id == "d"


def _register(store: Store, engine_id: str, role: str, index: int) -> Registration:
    return register_engine(
        make_endpoint(index),
        engine_id=engine_id,
        ttl=5,
        labels={"rack": "r0"},
        role=role,
        kv_transfer_backend="nixl",
        kv_layout=make_layout(),
        **store.using(),
    )


def _told(handle: PickHandle) -> threading.Event:
    told = threading.Event()
    handle.on_lost(lambda _: told.set())
    return told


def test_an_engine_leaving_etcd_tells_its_sides_handle_and_a_re_pick_keeps_the_other(
    store: Store,
) -> None:
    engines = {
        engine_id: _register(store, engine_id, role, index)
        for index, (engine_id, role) in enumerate(
            [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")]
        )
    }
    prompt = list(range(600))
    try:
        with watch_table(**store.using()) as table:
            table.wait_until(lambda snap: set(engines) <= set(snap), timeout=15)
            router = Router(table)
            pair = router.pick_pair(prompt, 16)
            assert pair.prefill is not None
            prefill_told, decode_told = _told(pair.prefill), _told(pair.decode)
            gone = pair.prefill.engine_id
            engines[gone].close()  # its lease revoked: the key deleted in etcd
            assert prefill_told.wait(15), "the prefill handle was not told"
            assert pair.prefill.lost is not None and pair.decode.lost is None
            again = router.pick_pair(prompt, 16, keep_decode=pair.decode)
            assert again.decode is pair.decode
            assert again.prefill is not None and again.prefill.engine_id != gone
            # Now the decode side goes: its handle is told, the prefill one is kept.
            kept_told = _told(again.prefill)
            engines[pair.decode.engine_id].close()
            assert decode_told.wait(15), "the decode handle was not told"
            assert again.prefill.lost is None and not kept_told.is_set()
            third = router.pick_pair(prompt, 16, keep_prefill=again.prefill)
            assert third.prefill is again.prefill
            assert third.decode.engine_id not in (gone, pair.decode.engine_id)
            third.release()
    finally:
        for registration in engines.values():
            registration.close()


def test_an_image_request_pairs_by_load_and_never_by_a_cache(monkeypatch) -> None:
    # Megatron (881f489f) caches no request with images: an aggregated engine's relayed
    # cache never makes it serve one alone, and prefill engines are taken by load.
    fleet = Fleet()
    for i in range(2):
        add(fleet, f"p{i}", "prefill", kv_cache_block_size=16)
    add(fleet, "d", "decode", kv_cache_block_size=16)
    add(fleet, "agg", "aggregated", relay=True, kv_cache_block_size=16)
    states = EngineStates(fleet.table).start(connect=False)
    router = Router(fleet.table, states=states)
    prompt = list(range(160))
    states.feed("agg", ["hello", 1, 0, pack_hashes(block_hashes(prompt, 16)), {}])
    kwargs = {"allow_aggregated": True, "alone_below": 0, "alone_share": 0.5}
    with router.pick_pair(prompt, 1, **kwargs) as text:
        assert text.alone, "text: the engine caching the prompt serves it alone"
    no_hashing(monkeypatch)
    pairs = [router.pick_pair(prompt, 1, images=True, **kwargs) for _ in range(4)]
    assert not any(pair.alone for pair in pairs)
    assert Counter(pair.prefill.engine_id for pair in pairs) == {"p0": 2, "p1": 2}
    states.stop()


def test_a_pair_pick_hashes_the_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two aggregated engines weighed for serving alone, then kv_aware's pick of one: the
    # prompt's tokens are packed (and so hashed) once, not per engine and again per pick.
    fleet = Fleet()
    add(fleet, "p", "prefill", kv_cache_block_size=16)
    add(fleet, "d", "decode", kv_cache_block_size=16)
    add(fleet, "agg-a", "aggregated", relay=True, kv_cache_block_size=16)
    add(fleet, "agg-b", "aggregated", relay=True, kv_cache_block_size=16)
    states = EngineStates(fleet.table).start(connect=False)
    router = Router(fleet.table, states=states, policy="kv_aware")
    prompt = list(range(170))  # 10 complete blocks of 16
    states.feed("agg-b", ["hello", 1, 0, pack_hashes(block_hashes(prompt, 16)), {}])
    packed: list[int] = []
    pack = blockhash.pack_tokens

    def counting(tokens: Sequence[int], start: int, stop: int) -> bytes:
        packed.append(stop - start)
        return pack(tokens, start, stop)

    monkeypatch.setattr(blockhash, "pack_tokens", counting)
    pair = router.pick_pair(prompt, 1, allow_aggregated=True, alone_below=0, alone_share=0.5)
    assert pair.alone and pair.decode.engine_id == "agg-b"
    assert sum(packed) == 160, packed
    pair.decode.release()
    states.stop()
