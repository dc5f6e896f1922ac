"""Lease-backed registration (issue 3): its logic on the memory port and on real etcd
(``store``), what only etcd shows (etcdctl, restarts, failover, stalls) on real etcd."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from discovery import (
    Connection,
    EngineConflictError,
    EtcdUnavailableError,
    InvalidRecordError,
    RegistrationState,
    Settings,
    aregister_engine,
    default_engine_id,
    register_dynamic_engine,
    register_engine,
)
from discovery._records.codec import KeySpace

from .conftest import Store
from .containers import both_etcds
from .helpers import (
    Registrar,
    cli_env,
    connected_member,
    etcdctl,
    fake_engine,
    get_kv,
    losses_after_a_mass_loss,
    make_endpoint,
    raw_call,
    stall,
    wait_for,
)


def _states(registration) -> list[RegistrationState]:
    seen: list[RegistrationState] = []
    registration.subscribe(seen.append)
    return seen


def test_record_is_documented_json_on_a_lease(settings: Settings) -> None:
    endpoint = make_endpoint(3)
    with register_engine(
        endpoint,
        engine_id="engine-a",
        ttl=5,
        labels={"model": "llama", "role": "decode"},
        settings=settings,
    ) as reg:
        assert reg.state is RegistrationState.REGISTERED
        assert reg.key == f"/inference/v1/{settings.namespace}/engines/engine-a"
        result = etcdctl(
            settings.endpoints, "get", "--prefix", KeySpace(namespace=settings.namespace).prefix
        )
        assert result.returncode == 0
        key, value = result.stdout.splitlines()
        assert key == reg.key
        stored = json.loads(value)
        assert {k: stored[k] for k in ("coordinator_address", "capabilities")} == endpoint.to_dict()
        assert stored["capabilities"]["prefix_caching_coordinator_policy"] == "first_prefix_block"
        assert stored["engine_id"] == "engine-a"
        assert stored["labels"] == {"model": "llama", "role": "decode"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stored["registered_at"])
        assert " " not in value  # compact JSON

        ttl = etcdctl(settings.endpoints, "lease", "timetolive", f"{reg.lease_id:016x}", "--keys")
        assert ttl.returncode == 0
        assert f"lease {reg.lease_id:016x} granted with TTL(5s)" in ttl.stdout
        assert f"attached keys([{reg.key}])" in ttl.stdout
        assert get_kv(settings.endpoints, reg.key)["lease"] == reg.lease_id


def test_close_revokes_the_lease_and_is_idempotent(store: Store) -> None:
    reg = register_engine(make_endpoint(), engine_id="closing", ttl=30, **store.using())
    lease = reg.lease_id
    reg.close()
    assert store.get(reg.key) is None  # gone when close() returns
    assert reg.state is RegistrationState.CLOSED
    reg.close()
    assert store.port.lease_info(lease).ttl <= 0  # revoked


def test_invalid_input_is_refused_before_any_write(store: Store) -> None:
    bad_calls = [
        dict(engine_id="has/slash"),
        dict(engine_id=""),
        dict(labels={"bad key": "x"}),
        dict(labels={"k": 1}),
        dict(labels={"k": "x" * 10_000}),
        dict(ttl=0),
        dict(ttl=-3),
    ]
    for kwargs in bad_calls:
        with pytest.raises(InvalidRecordError):
            register_engine(make_endpoint(), **store.using(), **kwargs)
    with pytest.raises(InvalidRecordError, match="InferenceEngineEndpoint"):
        register_engine({"coordinator_address": "x"}, **store.using())  # type: ignore[arg-type]
    big_labels = {f"k{i}": "v" * 250 for i in range(64)}
    with pytest.raises(InvalidRecordError, match="over the"):
        register_engine(make_endpoint(), labels=big_labels, **store.using())
    assert store.port.list_prefix(store.settings.keyspace.prefix)[1] == []


def test_duplicate_engine_id_is_refused_and_replace_takes_over(store: Store) -> None:
    first = register_engine(make_endpoint(1), engine_id="dup", ttl=20, **store.using())
    states = _states(first)
    before = store.get(first.key)
    with pytest.raises(EngineConflictError) as caught:
        register_engine(make_endpoint(2), engine_id="dup", ttl=20, **store.using())
    error = caught.value
    assert error.lease_id == first.lease_id
    assert 0 < error.remaining_ttl <= 20
    assert f"lease {first.lease_id:016x}" in str(error) and "remaining TTL" in str(error)
    assert store.get(first.key) == before  # untouched

    second = register_engine(
        make_endpoint(2), engine_id="dup", ttl=20, replace=True, **store.using()
    )
    try:
        kv = store.get(second.key)
        assert kv.lease == second.lease_id
        assert json.loads(kv.value)["coordinator_address"] == make_endpoint(2).coordinator_address
        # The previous holder learns it lost the id and does not steal it back.
        assert first.wait_for_state(RegistrationState.LOST, timeout=10)
        wait_for(
            lambda: first.health().last_error and "already registered" in first.health().last_error,
            message="the old holder to report the conflict",
        )
        assert store.get(second.key).lease == second.lease_id
        # Listeners hear of it on the dispatcher's thread, a moment after the state changed.
        wait_for(lambda: RegistrationState.LOST in states, message="the listener told")
    finally:
        second.close()
        first.close()


def test_update_publishes_atomically_under_the_same_lease(store: Store) -> None:
    with register_engine(
        make_endpoint(1), engine_id="upd", labels={"a": "1"}, **store.using()
    ) as reg:
        lease = reg.lease_id
        reg.update(labels={"a": "2", "zone": "z1"}, endpoint=make_endpoint(7))
        kv = store.get(reg.key)
        value = json.loads(kv.value)
        assert value["labels"] == {"a": "2", "zone": "z1"}
        assert value["coordinator_address"] == make_endpoint(7).coordinator_address
        assert kv.lease == lease == reg.lease_id
        with pytest.raises(InvalidRecordError):
            reg.update(labels={"no spaces": "x"})
        assert json.loads(store.get(reg.key).value)["labels"]["a"] == "2"


def test_operator_revoke_brings_the_record_back(store: Store) -> None:
    with register_engine(make_endpoint(), engine_id="revoked", ttl=3, **store.using()) as reg:
        states = _states(reg)
        old_lease = reg.lease_id
        store.port.revoke(old_lease)
        # The registration takes its new lease once the record is written on it: the hook.
        wait_for(
            lambda: states[-2:] == [RegistrationState.LOST, RegistrationState.REGISTERED],
            timeout=5,
            message="lost then registered hooks",
        )
        kv = store.get(reg.key)
        assert kv is not None and kv.lease != old_lease and kv.lease == reg.lease_id
        assert reg.health().registrations == 2 and reg.health().losses == 1


def test_sigkill_removes_the_key_within_ttl_plus_2s(settings: Settings) -> None:
    registrar = Registrar(settings, "killed", ttl=3)
    key = settings.keyspace.key("killed")
    try:
        wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        registrar.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: get_kv(settings.endpoints, key) is None, timeout=3 + 2, message="expiry")
        assert time.monotonic() - killed <= 5
    finally:
        registrar.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_removes_the_key_within_half_a_second(
    settings: Settings, sig: signal.Signals
) -> None:
    registrar = Registrar(settings, "signalled", ttl=30)
    key = settings.keyspace.key("signalled")
    try:
        wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        registrar.signal(sig)
        sent = time.monotonic()
        wait_for(
            lambda: get_kv(settings.endpoints, key) is None,
            timeout=0.5,
            interval=0.005,
            message="revocation",
        )
        assert time.monotonic() - sent <= 0.5
        assert registrar.wait() == 0, registrar.output()
        assert "deregistered signalled" in registrar.output()
    finally:
        registrar.stop()


_LIBRARY_PROGRAM = """
import sys, signal, time
from discovery import register_engine, deregister_on_signals, Settings
from tests.helpers import make_endpoint
reg = register_engine(make_endpoint(), engine_id=sys.argv[1], ttl=30, settings=Settings.from_env())
if sys.argv[2] == "signals":
    deregister_on_signals(reg)
print("ready", flush=True)
if sys.argv[2] == "signals":
    while True:  # an application's main loop: bytecode runs, so handlers run
        time.sleep(0.05)
"""


def test_normal_interpreter_exit_revokes_the_lease(settings: Settings) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _LIBRARY_PROGRAM, "exiting", "exit"],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "ready" in result.stdout
    assert get_kv(settings.endpoints, settings.keyspace.key("exiting")) is None


def test_signal_helper_revokes_then_exits_like_the_default_handler(settings: Settings) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _LIBRARY_PROGRAM, "helper", "signals"],
        env=cli_env(settings),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        assert get_kv(settings.endpoints, settings.keyspace.key("helper")) is not None
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 128 + signal.SIGTERM
        assert get_kv(settings.endpoints, settings.keyspace.key("helper")) is None
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


@both_etcds
def test_etcd_restart_within_ttl_never_removes_the_record(etcd, private_settings: Settings) -> None:
    with register_engine(
        make_endpoint(), engine_id="steady", ttl=6, settings=private_settings
    ) as reg:
        before = get_kv(etcd.endpoints, reg.key)
        seen_keepalive = reg.health().last_keepalive
        etcd.restart(etcd.members[0], kill=True)
        # Keepalives flow again on the same lease...
        wait_for(
            lambda: reg.health().last_keepalive != seen_keepalive,
            timeout=6,
            message="a keepalive after the restart",
        )
        after = get_kv(etcd.endpoints, reg.key)
        # ...and the key was never deleted: a delete + put would change create_revision.
        assert after["create_revision"] == before["create_revision"]
        assert after["lease"] == before["lease"] == reg.lease_id
        assert reg.health().losses == 0


@both_etcds
def test_outage_longer_than_ttl_reregisters_within_2s(etcd, private_settings: Settings) -> None:
    registrar = Registrar(private_settings, "survivor", ttl=2)
    key = private_settings.keyspace.key("survivor")
    try:
        with register_engine(
            make_endpoint(), engine_id="inproc", ttl=2, settings=private_settings
        ) as reg:
            states = _states(reg)
            wait_for(lambda: get_kv(etcd.endpoints, key), message="subprocess registration")
            etcd.members[0].stop(kill=True)
            assert reg.wait_for_state(RegistrationState.LOST, timeout=5)
            # The subprocess keeps its own clock: a restart before its TTL runs out lets it keep
            # the lease (etcd extends leases on restart), and there is no loss to come back from.
            wait_for(
                lambda: "survivor: registered -> lost" in registrar.output(),
                timeout=5,
                message="the subprocess's own loss",
            )
            etcd.members[0].start()
            etcd.wait_healthy()
            back = time.monotonic()
            wait_for(
                lambda: get_kv(etcd.endpoints, key) and get_kv(etcd.endpoints, reg.key),
                timeout=2,
                message="both records back",
            )
            assert reg.wait_for_state(
                RegistrationState.REGISTERED, timeout=2 - (time.monotonic() - back)
            )
            wait_for(
                lambda: states == [RegistrationState.LOST, RegistrationState.REGISTERED],
                message="hooks: lost, then registered",
            )
            assert registrar.process.poll() is None, "the engine process must keep running"
            wait_for(lambda: "registered again" in registrar.output(), message="subprocess log")
    finally:
        registrar.stop()


def test_lease_expired_while_partitioned_is_replaced_by_a_new_one(etcd3) -> None:
    """The registrar talks to one member; that member dies, the cluster lets the lease expire."""
    lonely = Settings(
        endpoints=[etcd3.members[0].client_url], namespace="partition", dial_timeout=5
    )
    others = [m.client_url for m in etcd3.members[1:]]
    with register_engine(make_endpoint(), engine_id="cut-off", ttl=2, settings=lonely) as reg:
        old_lease = reg.lease_id
        etcd3.members[0].stop(kill=True)
        wait_for(lambda: get_kv(others, reg.key) is None, timeout=8, message="lease expiry")
        assert reg.wait_for_state(RegistrationState.LOST, timeout=5)
        etcd3.members[0].start()
        etcd3.wait_healthy(members=[etcd3.members[0]])
        kv = wait_for(lambda: get_kv(others, reg.key), timeout=2, message="re-registration")
        assert kv["lease"] != old_lease
        assert reg.state is RegistrationState.REGISTERED


def test_a_delete_at_the_compaction_revision_still_brings_the_record_back(etcd3) -> None:
    """An operator deletes the record while the registrar's member is down, and etcd is
    compacted at exactly that delete (etcd before 3.5.16 then drops its tombstone,
    etcd-io/etcd#18089). The record watch resumes from the last revision it delivered,
    so the compaction makes it read the key again instead of missing the delete."""
    member = etcd3.members[0]
    lonely = Settings(endpoints=[member.client_url], namespace="tombstone", dial_timeout=10)
    others = Settings(
        endpoints=[m.client_url for m in etcd3.members[1:]], namespace="tombstone", dial_timeout=15
    )
    conn = Connection(others)
    try:
        with register_engine(make_endpoint(), engine_id="e0", ttl=30, settings=lonely) as reg:
            written = get_kv(others.endpoints, reg.key)["mod_revision"]
            member.stop(kill=True)
            deleted = raw_call(conn, lambda c: c.delete(reg.key, return_response=True))
            revision = deleted.header.revision
            assert revision == written + 1, "the delete is not the record watch's next revision"
            raw_call(conn, lambda c: c.compact(revision, physical=True))
            member.start()
            etcd3.wait_healthy(members=[member])
            # Within the record watch's bound: a reconnect to a stream that never answers
            # is dropped after two 10 s heartbeats, then the backoff (<= 3 s) and the list.
            kv = wait_for(
                lambda: get_kv(others.endpoints, reg.key), timeout=30, message="the record back"
            )
            assert kv["lease"] == reg.lease_id
            assert reg.health().losses == 1
    finally:
        conn.close()


def test_killing_the_connected_member_keeps_the_record(etcd3) -> None:
    """The hardest case: the member the registrar uses is the leader, killed at once.

    Keepalives fail over to another member, which answers once a new leader is elected
    (one to two election timeouts, 1 s each here; measured up to 2.4 s). The TTL covers
    that, so the registration never even reports ``lost``.
    """
    settings = Settings(endpoints=etcd3.endpoints, namespace="failover", dial_timeout=10)
    with register_engine(make_endpoint(), engine_id="ha", ttl=4, settings=settings) as reg:
        victim = connected_member(etcd3, reg._conn)
        etcd3.move_leader(victim)
        others = [m.client_url for m in etcd3.members if m is not victim]
        created = get_kv(others, reg.key)["create_revision"]
        killed = datetime.now(UTC)
        victim.stop(kill=True)
        # Watch the key for three TTLs: it must never disappear.
        deadline = time.monotonic() + 3 * reg.ttl
        while time.monotonic() < deadline:
            kv = get_kv(others, reg.key)
            assert kv is not None and kv["create_revision"] == created
        health = reg.health()
        assert health.state is RegistrationState.REGISTERED
        assert (health.losses, health.registrations) == (0, 1)
        assert health.last_keepalive is not None and health.last_keepalive > killed


def test_a_keepalive_lost_with_its_member_goes_again_at_once(etcd3) -> None:
    """The first keepalive goes to the member that took the write, dead since: its stream
    fails at once and the keepalive goes to another member then, not TTL/3 later."""
    settings = Settings(endpoints=etcd3.endpoints, namespace="resend", dial_timeout=10)
    with register_engine(make_endpoint(), engine_id="resend", ttl=9, settings=settings) as reg:
        victim = connected_member(etcd3, reg._conn)
        etcd3.move_leader(next(m for m in etcd3.members if m is not victim))  # no election
        victim.stop(kill=True)
        # The first keepalive leaves TTL/3 after the write; the next regular turn would
        # answer only after 2 x TTL/3.
        wait_for(
            lambda: reg.health().last_keepalive is not None,
            timeout=1.5 * reg.ttl / 3,
            message="the keepalive answered through another member",
        )
        assert reg.health().losses == 0


def test_unreachable_etcd_fails_clearly_at_start() -> None:
    settings = Settings(endpoints=["http://127.0.0.1:9"], dial_timeout=1)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=r"127\.0\.0\.1:9"):
        register_engine(make_endpoint(), settings=settings)
    assert time.monotonic() - started < 5


def test_register_dynamic_engine_reads_the_engine_once(store: Store) -> None:
    with register_dynamic_engine(
        fake_engine(
            max_sequence_length=4096,
            block_size_tokens=64,
            pool_size=513,
            max_requests=32,
            max_tokens=2048,
            tokenizer=SimpleNamespace(bos=7),
        ),
        "tcp://engine:7000",
        logical_data_parallel_size=2,
        engine_id="megatron",
        **store.using(),
    ) as reg:
        caps = json.loads(store.get(reg.key).value)["capabilities"]
        assert caps["total_kv_blocks"] == 512
        assert caps["bos_token_id"] == 7
        assert caps["logical_data_parallel_size"] == 2


def test_async_registration_does_not_block_the_loop(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = store.client()
    looped = threading.Event()
    grant = conn.grant

    def grant_once_the_loop_ran_on(ttl: int) -> int:
        assert looped.wait(10), "the event loop stood still while the registration ran"
        return grant(ttl)

    monkeypatch.setattr(conn, "grant", grant_once_the_loop_ran_on)

    async def main() -> bool:
        stop = asyncio.Event()

        async def ticker() -> None:
            for _ in range(10):
                await asyncio.sleep(0)
            looped.set()
            await stop.wait()

        task = asyncio.create_task(ticker())
        async with await aregister_engine(
            make_endpoint(), engine_id="aio", settings=store.settings, connection=conn
        ) as reg:
            present = store.get(reg.key) is not None
        stop.set()
        await task
        return present and store.get(reg.key) is None

    assert asyncio.run(main())


def test_default_engine_id_is_unique_stable_and_key_safe() -> None:
    first, second = default_engine_id(), default_engine_id()
    assert first != second
    stem = re.fullmatch(rf"([A-Za-z0-9._-]+-{os.getpid()}-[0-9a-f]{{6}})(-\d+)?", first)
    assert stem, first
    assert second.startswith(stem.group(1))  # same process: same host-pid-nonce stem
    KeySpace().key(first)


def test_many_registrations_share_one_keeper_thread(store: Store) -> None:
    before = {t.name for t in threading.enumerate()}
    with store.client() as conn:
        regs = [
            register_engine(
                make_endpoint(i),
                engine_id=f"many-{i}",
                ttl=3,
                settings=store.settings,
                connection=conn,
            )
            for i in range(50)
        ]
        keepers = [t for t in threading.enumerate() if t.name == "discovery-keeper"]
        assert len(keepers) - sum(name == "discovery-keeper" for name in before) == 1
        # All survive several TTLs on the shared stream.
        first_keepalive = {r.engine_id: r.health().last_keepalive for r in regs}
        wait_for(
            lambda: all(r.health().last_keepalive != first_keepalive[r.engine_id] for r in regs),
            timeout=5,
            message="keepalives for all",
        )
        for reg in regs:
            reg.close()
        assert store.port.list_prefix(store.settings.keyspace.prefix)[1] == []


def _many(settings: Settings, count: int, ttl: int) -> tuple[Connection, list]:
    conn = Connection(settings)
    with ThreadPoolExecutor(8) as pool:
        regs = list(
            pool.map(
                lambda i: register_engine(
                    make_endpoint(i), engine_id=f"m{i}", ttl=ttl, connection=conn
                ),
                range(count),
            )
        )
    return conn, regs


def test_a_short_stall_loses_no_registration_of_many(etcd, private_settings: Settings) -> None:
    """A stall shorter than the TTL but longer than TTL/3 must not cascade into losses."""
    conn, regs = _many(private_settings, 500, ttl=3)
    try:
        wait_for(lambda: all(r.health().last_keepalive for r in regs), message="keepalives")
        stall(etcd, 1.6)
        answered = {r.engine_id: r.health().last_keepalive for r in regs}
        wait_for(
            lambda: all(r.health().last_keepalive != answered[r.engine_id] for r in regs),
            timeout=6,
            message="keepalives after the stall",
        )
        assert sum(r.health().losses for r in regs) == 0
    finally:
        for reg in regs:
            reg.close()
        conn.close()


def test_mass_loss_settles_with_one_rewrite_each(etcd, private_settings: Settings) -> None:
    """After a stall longer than the TTL every lease is gone: each engine registers once
    more, and keepalives of the others never starve behind the re-registrations (no
    cascade of second losses).

    500 leases of their own (500 keepalives/s at TTL 3 s, about a fifth of a core here)
    hold under two CPU burners; 2,000 need more than a loaded 2-core machine gives a
    process (bench/bench_sessions.py: they cascade there): that is what a Session is for
    (tests/test_sessions.py does 2,000 on one). How fast it settles: bench_sessions.py.
    """
    conn, regs = _many(private_settings, 500, ttl=3)
    try:
        losses = losses_after_a_mass_loss(etcd, regs, ttl=3)
        assert losses == {1: len(regs)}, losses
        keys = etcdctl(
            etcd.endpoints, "get", "--prefix", "--keys-only", private_settings.keyspace.prefix
        )
        assert len(keys.stdout.split()) == len(regs)
    finally:
        for reg in regs:
            reg.close()
        conn.close()


def test_a_failing_keeper_turn_does_not_stop_keepalives(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with register_engine(make_endpoint(), engine_id="bug", ttl=3, **store.using()) as reg:
        original = type(reg.session)._keepalive
        failures = []

        def broken_once(self, keeper, now):
            if not failures:
                failures.append(now)
                raise RuntimeError("injected bug")
            return original(self, keeper, now)

        monkeypatch.setattr(type(reg.session), "_keepalive", broken_once)
        wait_for(lambda: failures, message="the injected failure")
        seen = reg.health().last_keepalive
        wait_for(lambda: reg.health().last_keepalive != seen, timeout=5, message="keepalives again")
        assert reg.health().losses == 0
        assert "keeper turn failed" in caplog.text


def test_a_write_whose_answer_was_lost_is_not_a_conflict(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd applied the create, but its answer never came (say its member was cut off from
    the cluster just after the entry was replicated), and a revoke would fail too: the retry
    finds the record on the registration's own session lease, which is ours, not a rival's
    (the session keeps its lease across attempts, so there is no attempt lease to lose)."""
    conn = store.client()
    create, revoke = conn.create, conn.revoke
    lost: list[int] = []

    def create_and_lose_the_answer(key: str, value: bytes, lease_id: int):
        result = create(key, value, lease_id)
        if not lost:
            lost.append(lease_id)
            raise EtcdUnavailableError("answer lost", "answer lost")
        return result

    def revoke_fails_once(lease_id: int) -> None:
        if lease_id in lost and lost.count(lease_id) == 1:
            lost.append(lease_id)
            raise EtcdUnavailableError("answer lost", "answer lost")
        revoke(lease_id)

    monkeypatch.setattr(conn, "create", create_and_lose_the_answer)
    monkeypatch.setattr(conn, "revoke", revoke_fails_once)
    with register_engine(
        make_endpoint(), engine_id="unsure", ttl=5, settings=store.settings, connection=conn
    ) as reg:
        assert reg.state is RegistrationState.REGISTERED and lost
        kv = store.get(reg.key)
        assert kv is not None and kv.lease == reg.lease_id == lost[0]
        assert reg.health().registrations == 1 and reg.health().losses == 0
