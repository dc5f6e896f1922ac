"""Sessions: many registrations of one process on one lease (issue 16), on the memory port
and on real etcd (``store``); a mass loss on real etcd."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from discovery import (
    ConfigurationError,
    Connection,
    EngineConflictError,
    EngineStatus,
    EtcdPort,
    RegistrationState,
    Session,
    Settings,
    deregister,
    register_engine,
)
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .conftest import Store
from .helpers import losses_after_a_mass_loss, make_endpoint, wait_for


def _lease_keys(port: EtcdPort, lease_id: int) -> list[str]:
    return sorted(key.decode() for key in port.lease_info(lease_id).keys)


def test_registrations_share_the_session_lease_and_one_keepalive(store: Store) -> None:
    before = sum(t.name == "discovery-keeper" for t in threading.enumerate())
    with Session(ttl=3, **store.using()) as session:
        regs = [
            register_engine(make_endpoint(i), engine_id=f"s{i}", session=session) for i in range(20)
        ]
        assert {r.lease_id for r in regs} == {session.lease_id}
        assert {r.ttl for r in regs} == {3}
        assert _lease_keys(store.port, session.lease_id) == sorted(r.key for r in regs)
        assert sum(t.name == "discovery-keeper" for t in threading.enumerate()) - before == 1
        first = session.last_keepalive
        wait_for(lambda: session.last_keepalive != first, timeout=5, message="a keepalive")
        wait_for(lambda: regs[0].health().last_keepalive == session.last_keepalive)
        assert all(r.state is RegistrationState.REGISTERED for r in regs)

        regs[0].close()  # a member leaves: its key only
        assert store.get(regs[0].key) is None
        assert len(_lease_keys(store.port, session.lease_id)) == 19
        lease = session.lease_id
    # Closing the session revokes the lease: every member's key goes, every member closes.
    assert all(r.state is RegistrationState.CLOSED for r in regs)
    assert _lease_keys(store.port, lease) == []
    assert store.port.list_prefix(store.settings.keyspace.prefix)[1] == []


def test_session_members_are_protected_like_any_engine_id(store: Store) -> None:
    with Session(ttl=3, **store.using()) as session:
        member = register_engine(make_endpoint(1), engine_id="dup", session=session)
        with pytest.raises(EngineConflictError):
            register_engine(make_endpoint(2), engine_id="dup", session=session)
        with pytest.raises(EngineConflictError):
            register_engine(make_endpoint(3), engine_id="dup", **store.using())
        with pytest.raises(ConfigurationError, match="belong to the session"):
            register_engine(make_endpoint(4), engine_id="x", ttl=5, session=session)
        other = register_engine(make_endpoint(5), engine_id="other", session=session)

        # A takeover does not touch the session's lease: only that member loses its id.
        taker = register_engine(make_endpoint(6), engine_id="dup", replace=True, **store.using())
        try:
            assert member.wait_for_state(RegistrationState.LOST, timeout=10)
            wait_for(
                lambda: "already registered" in (member.health().last_error or ""),
                message="the member to report the conflict",
            )
            assert store.get(member.key).lease == taker.lease_id
            assert session.alive and other.state is RegistrationState.REGISTERED
            assert store.get(other.key).lease == session.lease_id
        finally:
            taker.close()
        # The id is free again: the member takes it back on the session's lease.
        assert member.wait_for_state(RegistrationState.REGISTERED, timeout=10)
        assert store.get(member.key).lease == session.lease_id


def test_deregister_of_one_member_leaves_the_session_and_it_comes_back(store: Store) -> None:
    with Session(ttl=10, **store.using()) as session:
        a = register_engine(make_endpoint(1), engine_id="a", session=session)
        b = register_engine(make_endpoint(2), engine_id="b", session=session)
        created = store.get(b.key).create_revision
        assert deregister("a", **store.using()) == 0  # no lease revoked: it is shared
        assert store.get(b.key).create_revision == created  # untouched
        # Self-healing, as for a private registrar: the record is written again.
        kv = wait_for(lambda: store.get(a.key), message="a written again")
        assert kv.lease == session.lease_id
        assert a.wait_for_state(RegistrationState.REGISTERED, timeout=5)
        assert a.health().losses == 1 and b.health().losses == 0


def test_a_member_drains_alone(store: Store) -> None:
    with Session(ttl=10, **store.using()) as session:
        a = register_engine(make_endpoint(1), engine_id="a", session=session)
        b = register_engine(make_endpoint(2), engine_id="b", session=session)
        a.drain(0.5)
        assert json.loads(store.get(a.key).value)["status"] == "draining"
        assert a.wait_for_state(RegistrationState.CLOSED, timeout=10)
        assert store.get(a.key) is None
        assert b.status is EngineStatus.READY and session.alive
        assert store.get(b.key).lease == session.lease_id


class _SlowDelete(MemoryPort):
    """A client whose deletes wait for ``release`` (a close that takes its time)."""

    def __init__(self, etcd: MemoryEtcd) -> None:
        super().__init__(etcd)
        self.deleting = threading.Event()
        self.release = threading.Event()

    def delete_owned(self, key: str, lease_id: int) -> bool:
        self.deleting.set()
        assert self.release.wait(10)
        return super().delete_owned(key, lease_id)


def test_closed_means_the_key_is_gone(memory_etcd: MemoryEtcd) -> None:
    # The port closed with the test: its record watch retried on a closed etcd after it.
    with _SlowDelete(memory_etcd) as port, Session(ttl=10, connection=port) as session:
        a = register_engine(make_endpoint(1), engine_id="a", session=session)
        closing = threading.Thread(target=a.close)
        closing.start()
        assert port.deleting.wait(5)
        # The close has begun but the key is still there: not CLOSED yet.
        assert not a.wait_for_state(RegistrationState.CLOSED, timeout=0.2)
        port.release.set()
        assert a.wait_for_state(RegistrationState.CLOSED, timeout=10)
        assert port.get(a.key) is None
        closing.join()


def test_operator_revoke_of_the_session_lease_brings_every_record_back(store: Store) -> None:
    with Session(ttl=3, **store.using()) as session:
        regs = [
            register_engine(make_endpoint(i), engine_id=f"r{i}", session=session) for i in range(5)
        ]
        old = session.lease_id
        store.port.revoke(old)
        wait_for(
            lambda: all(
                (kv := store.get(r.key)) and kv.lease == session.lease_id != old for r in regs
            ),
            message="every record on the new lease",
        )
        wait_for(lambda: all(r.state is RegistrationState.REGISTERED for r in regs))
        assert [(r.health().losses, r.health().registrations) for r in regs] == [(1, 2)] * 5


def test_mass_loss_with_a_session_is_one_grant_and_one_loss_each(
    etcd, private_settings: Settings
) -> None:
    """2,000 registrations on one session, etcd stalled past the TTL: each registration is
    lost exactly once and written again on one new lease. How fast: bench_sessions.py."""
    with Connection(private_settings) as conn:
        session = Session(ttl=3, connection=conn)
        with ThreadPoolExecutor(8) as pool:
            regs = list(
                pool.map(
                    lambda i: register_engine(make_endpoint(i), engine_id=f"m{i}", session=session),
                    range(2000),
                )
            )
        old = session.lease_id
        losses = losses_after_a_mass_loss(etcd, regs, ttl=3)
        assert losses == {1: len(regs)}, losses
        assert session.lease_id != old and {r.lease_id for r in regs} == {session.lease_id}
        assert len(_lease_keys(conn, session.lease_id)) == 2000
        session.close()
