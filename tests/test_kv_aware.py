"""``kv_aware`` routing on what the engines report, over real etcd and real relays.

Each engine is an ``EngineEventReceiver`` (the code ``discovery launch`` runs) fed by a
rank-zero socket sending Megatron's frames; routers follow the engines' relays with
``EngineStates`` and pick with ``Router(policy="kv_aware" / "auto", states=...)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest

from discovery import (
    EngineEventReceiver,
    EngineStates,
    EngineStatus,
    Router,
    RoutingTable,
    Settings,
    block_hashes,
    drain,
    watch_table,
)
from discovery.testing.stand_in_engine import default_endpoint

from .helpers import RankZero, wait_for

BLOCK = 16
SEQS = 8


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK)]


class Engine:
    """One engine: its receiver (launcher side) and its rank zero (engine side)."""

    def __init__(self, settings: Settings, engine_id: str, **receiver: object) -> None:
        self.engine_id = engine_id
        self.receiver = EngineEventReceiver(engine_id=engine_id, settings=settings, **receiver)
        self.rank = RankZero(self.receiver.start())
        self.rank.send(
            "ready",
            default_endpoint(
                f"tcp://10.0.0.{len(engine_id)}:5555",
                kv_cache_block_size=BLOCK,
                max_num_seqs=SEQS,  # and first_prefix_block, as default_endpoint advertises
            ),
        )
        self.receiver.wait_registered(timeout=10)

    def stores(self, tokens: list[int], first: int = 0) -> list[int]:
        """Megatron's stored event for ``tokens``' blocks from ``first`` on; their hashes."""
        hashes = block_hashes(tokens, BLOCK)
        self.rank.send(
            "stored",
            {
                "block_hashes": hashes[first:],
                "token_ids": tokens[first * BLOCK : len(hashes) * BLOCK],
                "num_block_tokens": [BLOCK] * (len(hashes) - first),
                "parent_hash": hashes[first - 1] if first else None,
            },
        )
        return hashes

    def removes(self, hashes: list[int]) -> None:
        self.rank.send("removed", {"block_hashes": hashes})

    def close(self) -> None:
        self.rank.close()
        self.receiver.close()


@pytest.fixture
def fleet(settings: Settings) -> Iterator[dict[str, Engine]]:
    engines = {name: Engine(settings, name) for name in ("a", "b", "c")}
    yield engines
    for engine in engines.values():
        engine.close()


@contextlib.contextmanager
def following(settings: Settings, **options: object) -> Iterator[tuple[RoutingTable, EngineStates]]:
    with watch_table(settings) as table, EngineStates(table, **options) as states:
        yield table, states


def _holds(states: EngineStates, engine_id: str, hashes: list[int]) -> bool:
    return states.cached_prefix(engine_id, hashes) == len(hashes)


def test_picks_follow_the_blocks_engines_report(settings: Settings, fleet) -> None:
    p, q = prompt(1), prompt(2)
    with following(settings) as (table, states):
        wait_for(lambda: len(table) == 3, message="three engines")
        states.wait_synced(timeout=10)
        hashes_p = fleet["b"].stores(p)
        hashes_q = fleet["c"].stores(q)
        wait_for(lambda: _holds(states, "b", hashes_p) and _holds(states, "c", hashes_q))
        for policy in ("kv_aware", "auto"):  # auto: they advertise a prefix policy and relay
            router = Router(table, policy=policy, states=states)
            for _ in range(3):
                with router.pick(p, 16) as handle:
                    assert (handle.engine_id, handle.policy) == ("b", "kv_aware")
                    assert handle.matched_tokens == len(p)
                with router.pick(q + [7] * 5, 16) as handle:  # a longer prompt, same prefix
                    assert handle.engine_id == "c" and handle.matched_tokens == len(q)
        assert router.health().kv_fallbacks == 0


def test_an_evicted_block_is_not_counted(settings: Settings, fleet) -> None:
    p = prompt(3)
    with following(settings) as (table, states):
        wait_for(lambda: len(table) == 3, message="three engines")
        hashes = fleet["b"].stores(p)  # all six blocks
        fleet["c"].stores(p[: 2 * BLOCK])  # the first two only
        wait_for(lambda: _holds(states, "b", hashes) and _holds(states, "c", hashes[:2]))
        router = Router(table, policy="kv_aware", states=states)
        with router.pick(p, 16) as handle:
            assert handle.engine_id == "b"
        fleet["b"].removes([hashes[0]])  # evicted: b's chain breaks at block 0
        wait_for(lambda: states.cached_prefix("b", hashes) == 0, message="the removal relayed")
        with router.pick(p, 16) as handle:
            assert (handle.engine_id, handle.matched_tokens) == ("c", 2 * BLOCK)


def test_stale_state_falls_back_to_the_estimate_and_is_counted(settings: Settings, fleet) -> None:
    p = prompt(4)
    with following(settings, stale_after=1.5) as (table, states):  # relays tick every 1 s
        wait_for(lambda: len(table) == 3, message="three engines")
        states.wait_synced(timeout=10)
        router = Router(table, policy="kv_aware", states=states)
        fleet["a"].receiver._relay.close()  # a's launcher stops relaying: its state ages
        wait_for(lambda: states.fresh_blocks("a") is None, message="a's state stale")
        assert states.state("a").age > 1.5
        before = router.health().kv_fallbacks
        picked = {router.pick(prompt(10 + i), 1).engine_id for i in range(12)}
        assert "a" in picked  # still routed: by this router's own estimate
        assert router.health().kv_fallbacks - before == 12  # one per pick: a was estimated
        # What this router sent a is its estimate: the same prompt goes back to a.
        first = router.pick(p, 16)
        if first.engine_id == "a":
            assert router.pick(p, 16).engine_id == "a"


def test_removed_draining_or_stalled_engines_are_never_picked(settings: Settings) -> None:
    p = prompt(5)
    engines = {
        name: Engine(settings, name, stall_timeout=0.5) for name in ("best", "drained", "ok")
    }
    try:
        with following(settings) as (table, states):
            wait_for(lambda: len(table) == 3, message="three engines")
            for engine in engines.values():
                hashes = engine.stores(p)  # every engine caches the whole prompt
            router = Router(table, policy="kv_aware", states=states)
            wait_for(lambda: all(_holds(states, n, hashes) for n in engines), message="held")
            drain("drained", settings=settings)
            wait_for(lambda: table.get("drained").status is EngineStatus.DRAINING)
            engines["best"].rank.send("progress", {})
            wait_for(lambda: table.get("best").status is EngineStatus.STALLED, timeout=10)
            for _ in range(6):  # both report the whole prompt cached: neither is picked
                assert router.pick(p, 16).engine_id == "ok"
            engines["ok"].close()
            wait_for(lambda: "ok" not in table, message="ok removed")
            assert states.state("ok") is None  # its state went with it
            with pytest.raises(Exception, match="none of the 2 engines"):
                router.pick(p, 16)
    finally:
        for engine in engines.values():
            engine.close()


def test_the_load_bound_holds_across_two_routers_sharing_load(settings: Settings, fleet) -> None:
    hot = prompt(6)
    routers: list[Router] = []
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(watch_table(settings))
        wait_for(lambda: len(table) == 3, message="three engines")
        for _ in range(2):
            states = stack.enter_context(EngineStates(table))
            routers.append(Router(table, policy="kv_aware", states=states, load_factor=1.25))
        for r in routers:
            r._states.wait_synced(timeout=10)
        hashes = fleet["b"].stores(hot)
        for r in routers:
            wait_for(lambda r=r: _holds(r._states, "b", hashes), message="b holds the hot prompt")
        held = []
        for turn in range(2 * SEQS):
            router, other = routers[turn % 2], routers[(turn + 1) % 2]
            held.append(router.pick(hot, 16))
            mine = router.in_flight()
            # The other router sees what this one holds (reported, summed, relayed).
            wait_for(
                lambda mine=mine, other=other: all(
                    other._states.others(e) == mine.get(e, 0) for e in ("a", "b", "c")
                ),
                timeout=5,
                message="the shared load view",
            )
        on_b = sum(h.engine_id == "b" for h in held)
        total = len(held)
        bound = math.ceil(1.25 * total * SEQS / (3 * SEQS))  # b's share of the last pick's bound
        assert on_b <= bound, (on_b, bound)
        assert on_b >= 2  # affinity still worked: the hot prompt went to b while it could
        # Without the shared view each router would have bounded only its own half.
        for handle in held:
            handle.release()
