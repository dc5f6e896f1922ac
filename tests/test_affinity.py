"""Affinity every router agrees on: session keys and pins (issue 33).

Session keys are placed by rendezvous hashing over the candidates: the same table gives
the same engine at every router, an engine that leaves moves only its own keys, and the
load bound walks a hot key on in its own order. Unit tests feed tables by hand
(``Fleet``); the agreement of 8 routers runs on real tables (the ``store`` fixture: the
memory port and real etcd). The figures on an agent workload are
bench/bench_routing_quality.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from discovery import (
    EngineStatus,
    EventType,
    InvalidSelectorError,
    NoEngineAvailableError,
    NotACandidateError,
    PrefixCachingCoordinatorPolicy,
    Router,
    RoutingPolicy,
    Split,
    register_engine,
    watch_table,
)
from discovery._metrics import NoMetrics
from discovery._routing.policies import session_hash

from .conftest import Store
from .helpers import make_endpoint, run_cli
from .test_router import Fleet

LB = PrefixCachingCoordinatorPolicy.LOAD_BALANCED
LP = PrefixCachingCoordinatorPolicy.LONGEST_PREFIX


def placed(router: Router, keys: range | list[str]) -> dict[str, str]:
    """Where each key goes now (each handle released at once: no load builds up)."""
    out = {}
    for key in keys:
        handle = router.pick([1, 2, 3], 8, session_key=str(key))
        out[str(key)] = handle.engine_id
        handle.release()
    return out


def test_a_session_key_decides_whatever_the_policy_and_is_deterministic() -> None:
    fleet = Fleet()
    fleet.add_many(8, policy=LP)
    by_policy = {
        policy: placed(Router(fleet.table, policy=policy), range(300))
        for policy in ("auto", "longest_prefix", "load_balanced", "round_robin", "session")
    }
    first = by_policy["auto"]
    assert all(places == first for places in by_policy.values())
    assert len(set(first.values())) == 8  # spread over every engine
    handle = Router(fleet.table).pick([1], 1, session_key="k")
    assert handle.policy == RoutingPolicy.SESSION
    # The hash is fixed: the same in every process and on every machine.
    assert session_hash("conversation-1") == session_hash(b"conversation-1")
    assert session_hash(42) == session_hash("42")
    assert session_hash("conversation-1") == 0xA0571DAD4ADCFD00  # pinned: never changes
    with pytest.raises(TypeError, match="session_key must be"):
        Router(fleet.table).pick([1], 1, session_key=1.5)  # type: ignore[arg-type]
    # Without a key, the session policy load-balances.
    assert Router(fleet.table, policy="session").pick([1], 1).policy == "load_balanced"


def test_keys_move_only_off_a_departing_engine_and_about_one_in_n_to_a_new_one() -> None:
    fleet = Fleet()
    ids = fleet.add_many(10, policy=LB)
    router = Router(fleet.table)
    keys = range(5000)
    before = placed(router, keys)
    fleet.remove(ids[3])
    after = placed(router, keys)
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == ids[3] for k in moved)  # only the departed's keys
    fleet.add("new", 99, policy=LB)
    joined = placed(router, keys)
    moved = [k for k in after if after[k] != joined[k]]
    assert all(joined[k] == "new" for k in moved)  # only to the newcomer
    assert len(moved) / len(keys) <= 1.2 / 10  # N = 10 engines after it joined


def test_a_hot_key_walks_its_own_order_under_the_load_bound() -> None:
    fleet = Fleet()
    fleet.add_many(4, policy=LB, max_num_seqs=8)
    router = Router(fleet.table, session_load_factor=1.25)
    handles = [router.pick([1], 1, session_key="hot") for _ in range(40)]
    loads = Counter(h.engine_id for h in handles)
    mean = sum(loads.values()) / 4
    assert max(loads.values()) <= math.ceil(1.25 * mean)  # the bound holds
    first = handles[0].engine_id
    assert loads[first] == max(loads.values())  # its first choice takes the most
    # Pure affinity (no bound) keeps it on one engine.
    pure = Router(fleet.table, session_load_factor=None)
    assert {pure.pick([1], 1, session_key="hot").engine_id for _ in range(40)} == {first}


def test_a_session_key_respects_every_filter() -> None:
    fleet = Fleet()
    ids = fleet.add_many(6, policy=LB, max_num_seqs=1)
    router = Router(fleet.table, fence_after=1, wait=0)
    home = placed(router, ["k"])["k"]
    record = dataclasses.replace(fleet.records[home], status=EngineStatus.DRAINING)
    fleet.records[home] = record
    fleet._deliver((EventType.UPDATED, record))
    elsewhere = router.pick([1], 1, session_key="k")
    assert elsewhere.engine_id != home  # status: the next engine in the key's order
    second = elsewhere.engine_id
    # Capacity: the next one is full (max_num_seqs 1): the one after it.
    third = router.pick([1], 1, session_key="k").engine_id
    assert third not in (home, second)
    elsewhere.release(failed=True)  # fenced now
    fourth = router.pick([1], 1, session_key="k").engine_id
    assert fourth not in (home, second, third)
    assert set(ids) >= {home, second, third, fourth}


def test_a_pin_routes_to_its_engine_or_says_why_not() -> None:
    fleet = Fleet()
    fleet.add("a", 0, labels={"zone": "x"}, policy=LB)
    fleet.add("b", 1, labels={"zone": "y"}, policy=LB)
    fleet.add("c", 2, labels={"zone": "y"}, policy=LB)
    router = Router(fleet.table)
    handle = router.pick([1], 1, engine_id="b")
    assert (handle.engine_id, handle.policy) == ("b", "pinned")
    record = dataclasses.replace(fleet.records["b"], status=EngineStatus.DRAINING)
    fleet.records["b"] = record
    fleet._deliver((EventType.UPDATED, record))
    with pytest.raises(NotACandidateError, match=r"engine b is no candidate \(draining\)") as no:
        router.pick([1], 1, engine_id="b")
    assert no.value.explanation.reason == "draining"
    assert isinstance(no.value, NoEngineAvailableError)
    # Asked to, it falls back to an ordinary pick.
    assert router.pick([1], 1, engine_id="b", fallback=True).engine_id in {"a", "c"}
    with pytest.raises(NotACandidateError, match="selector"):
        router.pick([1], 1, engine_id="a", selector={"zone": "y"})
    with pytest.raises(NotACandidateError, match="absent"):
        router.pick([1], 1, engine_id="nowhere")
    with pytest.raises(NotACandidateError, match="excluded"):
        router.pick([1], 1, engine_id="c", exclude=["c"])


def test_eight_routers_on_real_tables_agree_on_every_key(store: Store) -> None:
    registrations = [
        register_engine(make_endpoint(i), engine_id=f"e{i}", **store.using()) for i in range(6)
    ]
    tables = [watch_table(**store.using()) for _ in range(8)]
    try:
        for table in tables:
            table.start()
            table.wait_until(lambda s: len(s) == 6, timeout=30)
        routers = [Router(table) for table in tables]
        keys = range(500)
        places = [placed(router, keys) for router in routers]
        assert all(p == places[0] for p in places)
        assert len(set(places[0].values())) == 6
    finally:
        for table in tables:
            table.stop()
        for registration in registrations:
            registration.close()


def split_fleet() -> Fleet:
    fleet = Fleet()
    for i in range(4):
        fleet.add(f"stable-{i}", i, labels={"track": "stable"}, policy=LB)
    fleet.add("canary-0", 9, labels={"track": "canary"}, policy=LB)
    return fleet


def test_a_weighted_split_holds_its_shares_and_a_session_keeps_its_group() -> None:
    fleet = split_fleet()
    router = Router(fleet.table, split={"track=stable": 95, "track in (canary)": 5})
    groups = Counter()
    for _ in range(10_000):
        handle = router.pick([1], 1)
        groups[handle.group] += 1
        assert handle.labels["track"] in handle.group
        handle.release()
    assert abs(groups["track in (canary)"] / 10_000 - 0.05) <= 0.01
    # A session draws its group by its key: always the same one, whatever else happens.
    for key in range(200):
        seen = {router.pick([1], 1, session_key=key).group for _ in range(3)}
        assert len(seen) == 1
    keyed = Counter(router.pick([1], 1, session_key=k).group for k in range(10_000))
    assert abs(keyed["track in (canary)"] / 10_000 - 0.05) <= 0.01
    # Per pick, a split replaces the router's.
    only = router.pick([1], 1, split={"track=canary": 1})
    assert only.engine_id == "canary-0"


def test_an_empty_group_gives_its_share_to_the_others_and_is_counted() -> None:
    class Counted(NoMetrics):
        def __init__(self) -> None:
            self.empty: Counter[str] = Counter()

        def split_empty(self, group: str) -> None:
            self.empty[group] += 1

    fleet = split_fleet()
    metrics = Counted()
    router = Router(
        fleet.table,
        split={"track=stable": 95, "track=canary": 5},
        metrics=metrics,
        protect_threshold=None,  # these removals are no mass lease loss to ride out
    )
    fleet.remove("canary-0")
    assert {router.pick([1], 1).group for _ in range(100)} == {"track=stable"}
    assert metrics.empty["track=canary"] == 100
    for i in range(4):
        fleet.remove(f"stable-{i}")
    with pytest.raises(NoEngineAvailableError, match="no group of the split has a candidate"):
        router.pick([1], 1)


def test_bad_splits_are_refused_naming_the_group() -> None:
    fleet = split_fleet()
    with pytest.raises(ValueError, match="weight of 'track=stable' must be positive"):
        Router(fleet.table, split={"track=stable": 0})
    with pytest.raises(ValueError, match="given twice"):
        Router(fleet.table, split={"track=stable": 1, "track == stable": 2})
    with pytest.raises(ValueError, match="needs a selector"):
        Router(fleet.table, split={"": 1})
    with pytest.raises(InvalidSelectorError, match="invalid selector 'track in \\('"):
        Router(fleet.table, split={"track in (": 1})
    assert Split({"a=b": 1}) == Split([("a == b", 1)])


def test_list_wide_shows_a_split_and_refuses_a_bad_one(settings) -> None:
    registrations = [
        register_engine(
            make_endpoint(i), engine_id=f"t{i}", labels={"track": track}, settings=settings
        )
        for i, track in enumerate(["stable", "stable", "canary"])
    ]
    try:
        wide = run_cli(
            settings,
            "list",
            "-o",
            "wide",
            "--split",
            "track=stable:95",
            "--split",
            "track=canary:5",
        )
        assert wide.returncode == 0, wide.stderr
        assert (
            "split: track=stable 95% (2 candidates), track=canary 5% (1 candidates)" in wide.stdout
        )
        for bad, says in (("track=canary", "no ':WEIGHT'"), ("track in (:5", "invalid selector")):
            refused = run_cli(settings, "list", "-o", "wide", "--split", bad)
            assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    finally:
        for registration in registrations:
            registration.close()
