"""Passive failure fencing in the router (issue 15): grow, reset, cap, visibility.

Time comes from an injected clock, so nothing sleeps. Unit tests feed the table by hand
(``Fleet``); the last test watches engines registered on the memory port and on real etcd.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    Metrics,
    Router,
    RouterHealth,
    register_engine,
    watch_table,
)

from .conftest import Store
from .helpers import make_endpoint
from .test_router import Fleet


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fail(router: Router, engine_id: str, times: int = 1) -> None:
    """Route round robin until ``engine_id`` comes up ``times`` times; fail those requests."""
    failed = 0
    for _ in range(100 * times):
        handle = router.pick([1], 1)
        if handle.engine_id == engine_id:
            handle.release(failed=True)
            failed += 1
            if failed == times:
                return
        else:
            handle.release()
    raise AssertionError(f"{engine_id} was never picked")


def picked(router: Router, count: int = 40, **kwargs) -> Counter:
    chosen: Counter = Counter()
    for _ in range(count):
        with router.pick([1], 1, **kwargs) as handle:
            chosen[handle.engine_id] += 1
    return chosen


@pytest.fixture
def fleet() -> Fleet:
    fleet = Fleet()
    fleet.add_many(4)  # e000 .. e003
    return fleet


def test_consecutive_failures_fence_with_a_growing_backoff(fleet: Fleet, caplog) -> None:
    clock = Clock()
    router = Router(fleet.table, policy="round_robin", clock=clock, fence_max_seconds=30)
    with caplog.at_level(logging.WARNING, logger="discovery._routing.fencing"):
        fail(router, "e001", 2)
        assert router.health().fenced == {}, "two failures in a row do not fence"
        assert router.health().failing == {"e001": 2}
        fail(router, "e001")
    health = router.health()
    assert isinstance(health, RouterHealth)
    assert health.fenced == {"e001": 5.0}
    assert "e001 fenced for 5.0 s after 3 failed requests" in caplog.text
    assert "e001" not in picked(router)
    clock.now += 4.9
    assert "e001" not in picked(router)
    clock.now += 0.1  # the fence has run out: e001 is picked again (fail() needs it) ...
    for seconds in (10.0, 20.0, 30.0, 30.0):  # doubling, capped by fence_max_seconds
        # ... and with no success since, its first failure fences it at once, for longer.
        fail(router, "e001")
        assert router.health().fenced == {"e001": seconds}
        assert "e001" not in picked(router, 8)
        clock.now += seconds


def test_a_success_resets_the_counts(fleet: Fleet) -> None:
    clock = Clock()
    router = Router(fleet.table, policy="round_robin", clock=clock)
    fail(router, "e002", 2)
    picked(router, 4)  # every engine succeeds once, e002 too
    assert router.health().failing == {}
    fail(router, "e002", 2)
    assert router.health().fenced == {}, "the streak started again"
    fail(router, "e002")
    assert router.health().fenced == {"e002": 5.0}
    # A request sent before the fence succeeds: the counts reset, the fence runs out.
    clock.now += 5
    picked(router, 4)
    fail(router, "e002", 2)
    assert router.health().fenced == {}, "after a success it takes three failures again"
    fail(router, "e002")
    assert router.health().fenced == {"e002": 5.0}, "and the backoff starts from the base"


def test_failures_while_fenced_and_unknown_outcomes_fence_nothing(fleet: Fleet) -> None:
    clock = Clock()
    router = Router(fleet.table, policy="round_robin", clock=clock)
    held = [router.pick([1], 1) for _ in range(8)]  # two on each engine
    on_e000 = [h for h in held if h.engine_id == "e000"]
    fail(router, "e000", 3)
    assert router.health().fenced == {"e000": 5.0}
    clock.now += 1
    for handle in on_e000:  # sent before the fence, failing after it: no longer fence
        handle.release(failed=True)
    assert router.health().fenced == {"e000": 4.0}
    for other in held:
        other.release()
    assert router.health().in_flight == 0


def test_an_exception_in_the_with_block_is_no_outcome() -> None:
    fleet = Fleet()
    fleet.add("x", 0, labels={"name": "x"})
    fleet.add("y", 1, labels={"name": "y"})
    router = Router(fleet.table, clock=Clock())
    router.pick([1], 1, selector={"name": "x"}).release(failed=True)
    # The caller's own bug: neither a failure (2) nor a success (0) of the engine.
    with pytest.raises(RuntimeError), router.pick([1], 1, selector={"name": "x"}) as handle:
        raise RuntimeError("the caller's own bug")
    assert handle.released
    assert router.health().failing == {"x": 1}
    handle.release(failed=True)  # already released: only the first call counts
    assert router.health().failing == {"x": 1}


def test_fencing_never_takes_more_than_the_share(fleet: Fleet, caplog) -> None:
    clock = Clock()
    registry = CollectorRegistry()
    router = Router(
        fleet.table,
        policy="round_robin",
        clock=clock,
        max_fenced_share=0.5,
        metrics=Metrics(registry),
    )
    assert router.health().fence_limit == 2
    fail(router, "e000", 3)
    fail(router, "e001", 3)
    with caplog.at_level(logging.WARNING, logger="discovery._routing.fencing"):
        fail(router, "e002", 5)  # past the limit: stays in rotation
    health = router.health()
    assert set(health.fenced) == {"e000", "e001"}
    assert health.failing["e002"] == 5
    assert set(picked(router)) == {"e002", "e003"}
    assert caplog.text.count("e002 failed 3 requests in a row but stays in rotation") == 1
    assert registry.get_sample_value("discovery_router_failed_requests_total") == 11
    assert registry.get_sample_value("discovery_router_fences_total") == 2
    assert registry.get_sample_value("discovery_router_fence_limited_total") == 3
    assert registry.get_sample_value("discovery_router_fenced_seconds", {"engine_id": "e000"}) == 5
    # When the fences end, an engine failing again takes a free place.
    clock.now += 5
    fail(router, "e002", 3)
    assert router.health().fenced == {"e002": 5.0}


def test_a_single_engine_is_never_fenced() -> None:
    fleet = Fleet()
    fleet.add("only")
    router = Router(fleet.table, clock=Clock())
    for _ in range(10):
        router.pick([1], 1).release(failed=True)
    assert router.health().fenced == {}
    assert router.health().fence_limit == 0
    assert router.pick([1], 1).engine_id == "only"


def test_a_pick_whose_candidates_are_mostly_fenced_ignores_fencing(caplog) -> None:
    fleet = Fleet()
    fleet.add("a1", 0, labels={"zone": "a"})
    fleet.add("a2", 1, labels={"zone": "a"})
    fleet.add("b1", 2, labels={"zone": "b"})
    fleet.add("b2", 3, labels={"zone": "b"})
    router = Router(fleet.table, policy="round_robin", clock=Clock(), max_fenced_share=0.5)
    fail(router, "a1", 3)
    fail(router, "a2", 3)
    assert set(router.health().fenced) == {"a1", "a2"}
    assert set(picked(router)) == {"b1", "b2"}
    # Zone a has only fenced engines: rather than fail, that pick uses them (panic mode).
    with caplog.at_level(logging.WARNING, logger="discovery._routing.router"):
        assert set(picked(router, selector={"zone": "a"})) == {"a1", "a2"}
    assert "2 of 2 candidate engines are fenced" in caplog.text


def test_with_every_engine_fenced_picks_still_succeed(fleet: Fleet) -> None:
    router = Router(fleet.table, policy="round_robin", clock=Clock(), max_fenced_share=1.0)
    for engine_id in ("e000", "e001", "e002", "e003"):
        fail(router, engine_id, 3)
    assert len(router.health().fenced) == 4
    assert set(picked(router)) == {"e000", "e001", "e002", "e003"}


def test_fencing_options_are_checked_and_can_be_off(fleet: Fleet) -> None:
    for kwargs, message in (
        ({"fence_after": 0}, "fence_after must be >= 1"),
        ({"fence_seconds": 0}, "fence_seconds must be positive"),
        ({"fence_max_seconds": 1}, "fence_max_seconds must be finite and >= fence_seconds"),
        ({"max_fenced_share": 1.5}, r"max_fenced_share must be within \[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            Router(fleet.table, **kwargs)
    with pytest.raises(TypeError, match="clock"):
        Router(fleet.table, clock=5)
    router = Router(fleet.table, policy="round_robin", fence_after=None)
    fail(router, "e000", 10)
    assert router.health().fenced == {}
    assert router.health().failing == {"e000": 10}


def test_a_fenced_engine_that_leaves_etcd_is_forgotten(store: Store) -> None:
    clock = Clock()
    regs = [register_engine(make_endpoint(i), engine_id=f"f{i}", **store.using()) for i in range(4)]
    try:
        with watch_table(**store.using()) as table:
            table.wait_until(lambda snap: len(snap) == 4, timeout=15)
            router = Router(table, policy="round_robin", clock=clock)
            fail(router, "f1", 3)
            assert set(router.health().fenced) == {"f1"}
            regs[1].close()
            table.wait_until(lambda snap: "f1" not in snap, timeout=15)
            assert router.health().fenced == {}
            assert router.health().engines == 3
            # Registered again, it starts with a clean slate.
            regs[1] = register_engine(make_endpoint(1), engine_id="f1", **store.using())
            table.wait_until(lambda snap: "f1" in snap, timeout=15)
            assert set(picked(router)) == {"f0", "f1", "f2", "f3"}
            fail(router, "f1", 2)
            assert router.health().fenced == {}
    finally:
        for reg in regs:
            reg.close()
