"""etcd's own limits on real members (issue 43): a full space quota (NOSPACE), a request over
``--max-request-bytes``, a role without the permission. Each error says what happened, at
once, and a registration keeps its record alive through it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from discovery import (
    EndpointWatcher,
    EtcdNoSpaceError,
    PermissionDeniedError,
    RegistrationState,
    RequestTooLargeError,
    Session,
    Settings,
    register_engine,
)
from discovery._etcd.connection import Connection
from discovery._records.codec import MAX_VALUE_BYTES
from discovery.testing.embedded import EtcdCluster

from .catalogue import TTL, _free_space, _labels
from .conftest import _checked_cluster
from .helpers import get_kv, make_endpoint, wait_for
from .test_security import SECRET, _auth_settings, _ctl, _setup_auth

pytestmark = pytest.mark.external  # every test runs an etcd of its own

_QUOTA = 2 * 1024 * 1024  # a space quota a few dozen writes fill
_FILL = "/fill/"
_DIAL = 10.0  # what a retried failure would take: the refusals below must come far sooner


@pytest.fixture
def etcd_quota() -> Iterator[EtcdCluster]:
    with _checked_cluster(
        EtcdCluster(1, extra_args=["--quota-backend-bytes", str(_QUOTA)])
    ) as cluster:
        yield cluster


def _fill(conn: Connection) -> EtcdNoSpaceError:
    """Write 100 kB values until etcd raises its NOSPACE alarm; the refusal."""
    for i in range(10 * _QUOTA // 100_000):
        try:
            conn.replace(f"{_FILL}{i:04d}", b"x" * 100_000, 0)
        except EtcdNoSpaceError as exc:
            return exc
    raise AssertionError("the space quota never filled")


def _stored(cluster: EtcdCluster, key: str) -> dict:
    """The record etcd holds at ``key`` (decoded JSON)."""
    kv = get_kv(cluster.endpoints, key)
    assert kv is not None, f"{key} is not in etcd"
    return dict(json.loads(kv["value"]))


def test_nospace_is_refused_at_once_and_a_registration_rides_it_out(
    etcd_quota: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(endpoints=etcd_quota.endpoints, namespace="q", dial_timeout=_DIAL)
    caplog.set_level(logging.WARNING, logger="discovery")
    with (
        Connection(settings) as conn,
        register_engine(make_endpoint(), engine_id="e1", ttl=2, settings=settings) as reg,
    ):
        lease = reg.lease_id
        refused = _fill(conn)
        assert "NOSPACE" in str(refused) and "alarm disarm" in str(refused)
        started = time.monotonic()
        with pytest.raises(EtcdNoSpaceError, match=r"compact.*defrag.*alarm disarm"):
            conn.call(lambda: conn.replace(f"{_FILL}more", b"x", 0))
        assert time.monotonic() - started < _DIAL / 5  # not retried as unavailable

        filled = datetime.now(UTC)
        for n in range(3):  # each change is refused at once; logged once all the same
            started = time.monotonic()
            with pytest.raises(EtcdNoSpaceError):
                reg.update(labels={"v": str(n)})
            assert time.monotonic() - started < _DIAL / 5
        assert "NOSPACE" in (reg.health().last_error or "")
        # Keepalives still work: the lease outlives its TTL several times over.
        wait_for(
            lambda: (
                (reg.session.last_keepalive or filled) > filled + timedelta(seconds=3 * reg.ttl)
            ),
            timeout=20,
            message="keepalives answered past three TTLs under NOSPACE",
        )
        assert reg.state is RegistrationState.REGISTERED and reg.lease_id == lease
        assert "labels" not in _stored(etcd_quota, reg.key)  # the last accepted record
        refusals = [
            r for r in caplog.records if r.name.endswith("registration") and "NOSPACE" in r.message
        ]
        assert len(refusals) == 1, [r.message for r in refusals]

        _free_space(etcd_quota)
        wait_for(
            lambda: _stored(etcd_quota, reg.key).get("labels") == {"v": "2"},
            timeout=10,
            message="the change kept through NOSPACE published once etcd takes writes",
        )
        wait_for(lambda: reg.health().last_error is None, timeout=5, message="the error cleared")
        assert reg.lease_id == lease and reg.health().losses == 0


def test_request_too_large_names_its_size_and_the_limit() -> None:
    limit = 4096
    with _checked_cluster(
        EtcdCluster(1, extra_args=["--max-request-bytes", str(limit)])
    ) as cluster:
        settings = Settings(
            endpoints=cluster.endpoints, dial_timeout=_DIAL, max_request_bytes=limit
        )
        with Connection(settings) as conn:
            started = time.monotonic()
            with pytest.raises(RequestTooLargeError) as caught:
                conn.call(lambda: conn.replace("/big", b"y" * 6000, 0))
            assert time.monotonic() - started < _DIAL / 5
    message = str(caught.value)
    assert caught.value.size == 6004 and caught.value.limit == limit
    assert "6,004 bytes" in message and "4,096 bytes" in message, message
    assert "request is too large" in message


def test_permission_denied_names_the_user_and_the_key_never_the_password() -> None:
    with _checked_cluster(EtcdCluster(1)) as cluster:
        _setup_auth(cluster)
        with pytest.raises(PermissionDeniedError) as write:
            register_engine(
                make_endpoint(),
                engine_id="e1",
                settings=_auth_settings(cluster, "engine-a", namespace="b"),
            )
        with pytest.raises(PermissionDeniedError) as watch:
            EndpointWatcher(_auth_settings(cluster, "router-a", namespace="b")).start()
        assert "found 0 leases" in _ctl(cluster, "lease", "list")
    for caught, user, where in (
        (write, "engine-a", "/inference/v1/b/engines/e1"),
        (watch, "router-a", "/inference/v1/b/engines/"),
    ):
        message = str(caught.value)
        assert f"'{user}'" in message and where in message, message
        assert "permission denied" in message and SECRET not in message


def test_an_update_etcd_refuses_as_too_large_keeps_the_last_accepted_record_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="discovery")
    # The members take 8 KiB; the settings do not know it (etcd refuses, not us).
    with (
        _checked_cluster(EtcdCluster(1, extra_args=["--max-request-bytes", "8192"])) as cluster,
        Connection(Settings(endpoints=cluster.endpoints, namespace="s")) as conn,
        register_engine(
            make_endpoint(), engine_id="e1", ttl=2, labels={"a": "1"}, connection=conn
        ) as reg,
    ):
        lease = reg.lease_id
        started = time.monotonic()
        with pytest.raises(RequestTooLargeError, match="request is too large") as caught:
            reg.update(labels=_labels(12_000))
        assert time.monotonic() - started < _DIAL / 5
        assert caught.value.size > 12_000 and "shorten" in str(caught.value)
        assert reg.record.labels == {"a": "1"}  # the change is dropped, not kept to retry
        assert _stored(cluster, reg.key)["labels"] == {"a": "1"}
        assert "too large" in (reg.health().last_error or "")

        assert cluster.etcdctl("lease", "revoke", f"{lease:x}").returncode == 0
        wait_for(
            lambda: reg.lease_id != lease and reg.state is RegistrationState.REGISTERED,
            timeout=10,
            message="the registration back on a new lease",
        )
        back = get_kv(cluster.endpoints, reg.key)
        assert back is not None and back["lease"] == reg.lease_id
        assert json.loads(back["value"])["labels"] == {"a": "1"}  # the last accepted one

        reg.update(labels={"a": "2"})  # a change that fits goes through as ever
        assert _stored(cluster, reg.key)["labels"] == {"a": "2"}
    refusals = [r.message for r in caplog.records if "too large" in r.message]
    assert len(refusals) == 1, refusals


def test_a_session_of_100_records_of_16_kib_comes_back_after_its_lease_is_revoked(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="discovery")
    settings = Settings(endpoints=etcd.endpoints, namespace="big", dial_timeout=_DIAL)
    labels = _labels(15_800)
    with Connection(settings) as conn, Session(ttl=int(TTL), connection=conn) as session:
        regs = [
            register_engine(make_endpoint(i), engine_id=f"e{i:03d}", labels=labels, session=session)
            for i in range(100)
        ]
        sizes = {len(kv.value) for kv in conn.list_prefix(regs[0].key[: -len("e000")])[1]}
        assert min(sizes) > 15_500 and max(sizes) <= MAX_VALUE_BYTES  # 100 x ~16 KiB: 1.6 MB
        lease = session.lease_id
        assert lease is not None
        started = time.monotonic()
        conn.call(lambda: conn.revoke(lease))

        def all_back() -> bool:
            _, kvs = conn.list_prefix(regs[0].key[: -len("e000")])
            return len(kvs) == 100 and all(kv.lease not in (0, lease) for kv in kvs)

        wait_for(all_back, timeout=15, message="100 records back on a new lease", interval=0.05)
        took = time.monotonic() - started
        # The catalogue's lost-lease row: back within TTL/3 + 0.5 s.
        assert took <= TTL / 3 + 0.5, f"back after {took:.2f} s"
        assert all(r.state is RegistrationState.REGISTERED for r in regs)
    # Split by bytes before sending: etcd refused no batch (none was halved).
    assert not [r.message for r in caplog.records if "too large" in r.message]


def test_a_repair_etcd_refuses_as_too_large_is_halved_until_it_fits() -> None:
    # The members take 40 kB a request, the settings say etcd's default: a repair's first
    # batch (8 records of 16 KiB) is refused, then written in halves.
    with (
        _checked_cluster(EtcdCluster(1, extra_args=["--max-request-bytes", "40000"])) as cluster,
        Connection(Settings(endpoints=cluster.endpoints, namespace="h")) as conn,
        Session(ttl=int(TTL), connection=conn) as session,
    ):
        labels = _labels(15_800)
        regs = [
            register_engine(make_endpoint(i), engine_id=f"e{i}", labels=labels, session=session)
            for i in range(8)
        ]
        lease = session.lease_id
        assert lease is not None
        conn.call(lambda: conn.revoke(lease))
        wait_for(
            lambda: all(
                r.state is RegistrationState.REGISTERED and r.lease_id != lease for r in regs
            ),
            timeout=10,
            message="8 records back on a new lease",
        )
        _, kvs = conn.list_prefix(regs[0].key[: -len("e0")])
        assert len(kvs) == 8 and {kv.lease for kv in kvs} == {session.lease_id}
