"""The connection layer: error mapping, failover, paging, and the client defects it guards."""

from __future__ import annotations

import inspect
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import etcd3
import etcd3.exceptions
import grpc
import pytest

from discovery import (
    ClosedError,
    Connection,
    DiscoveryError,
    EtcdUnavailableError,
    PermissionDeniedError,
    Settings,
)
from discovery._etcd.connection import is_transient, translate

from .helpers import connected_member, wait_for


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _etcd3_exceptions() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(etcd3.exceptions, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == etcd3.exceptions.__name__
    ]


@pytest.mark.parametrize("cls", _etcd3_exceptions(), ids=lambda c: c.__name__)
def test_every_etcd3_exception_has_a_mapping(cls: type[BaseException]) -> None:
    exc = cls(5) if cls is etcd3.exceptions.RevisionCompactedError else cls()
    assert isinstance(translate(exc), DiscoveryError)


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_every_grpc_status_has_a_mapping(code: grpc.StatusCode) -> None:
    mapped = translate(FakeRpcError(code, "details here"))
    assert isinstance(mapped, DiscoveryError)
    assert "details here" in str(mapped)
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        assert isinstance(mapped, PermissionDeniedError)
    if code is grpc.StatusCode.UNAVAILABLE:
        assert isinstance(mapped, EtcdUnavailableError) and is_transient(FakeRpcError(code))


def test_etcd3_errors_keep_the_grpc_details() -> None:
    """python3-etcd3 re-raises its own detail-free type inside ``except``: keep the cause."""
    with (
        Connection(Settings(endpoints=["http://127.0.0.1:9"])) as conn,
        pytest.raises(EtcdUnavailableError, match=r"127\.0\.0\.1:9.*(refused|connect)") as caught,
    ):
        conn.call(lambda: conn.get("/k"), timeout=0)
    assert isinstance(caught.value.__cause__, etcd3.exceptions.ConnectionFailedError)


def test_wrong_password_is_permission_denied() -> None:
    exc = FakeRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "etcdserver: authentication failed, invalid user ID or password",
    )
    assert isinstance(translate(exc), PermissionDeniedError)


def test_a_restarted_single_member_is_usable_at_once(etcd) -> None:
    """Upstream benches a failed member for 300 s, even the only one; we must not."""
    settings = Settings(endpoints=etcd.endpoints, dial_timeout=10)
    with Connection(settings) as conn:
        conn.call(lambda: conn.replace("/k", b"v", 0))
        etcd.members[0].stop(kill=True)
        with pytest.raises(EtcdUnavailableError):
            conn.call(lambda: conn.get("/k"), timeout=0.3)
        etcd.members[0].start()
        etcd.wait_healthy()
        back = time.monotonic()
        assert conn.call(lambda: conn.get("/k"), timeout=5).value == b"v"
        assert time.monotonic() - back < 2


def test_raw_client_is_locked_out_after_one_failure(etcd) -> None:
    """The defect itself, so the guard above stays justified: Endpoint.fail() benches for 300 s."""
    host, port = etcd.endpoints[0].rsplit("//", 1)[1].split(":")
    raw = etcd3.client(host=host, port=int(port), timeout=2)
    etcd.members[0].stop(kill=True)
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        raw.get("/k")
    etcd.members[0].start()
    etcd.wait_healthy()
    with pytest.raises(ValueError, match="failed node"):
        raw.get("/k")
    raw.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_raw_watch_goes_silent_when_etcd_dies(etcd) -> None:
    """python3-etcd3's watch thread dies on NameError('six'): callbacks never hear of it."""
    host, port = etcd.endpoints[0].rsplit("//", 1)[1].split(":")
    raw = etcd3.client(host=host, port=int(port))
    told = threading.Event()
    raw.add_watch_prefix_callback("/p/", lambda response: told.set())
    thread = raw.watcher._callback_thread
    etcd.members[0].stop(kill=True)
    wait_for(lambda: not thread.is_alive(), message="the client's watch thread to die")
    assert not told.is_set()  # nobody was told: a silently dead watch
    raw.close()


def test_list_pages_at_one_revision_past_the_grpc_limit(settings: Settings) -> None:
    """~12,000 records of ~400 bytes exceed gRPC's 4 MiB default in one unpaged read."""
    prefix = settings.keyspace.prefix
    value = "x" * 400
    with Connection(settings) as conn:
        client = conn._current()
        for batch in range(120):
            ops = [
                client.transactions.put(f"{prefix}e{batch:03d}-{i:03d}", value) for i in range(100)
            ]
            assert client.transaction(compare=[], success=ops, failure=[])[0]
        host, port = settings.endpoints[0].rsplit("//", 1)[1].split(":")
        raw = etcd3.client(host=host, port=int(port))
        with pytest.raises(grpc.RpcError) as caught:
            raw.get_prefix_response(prefix)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        raw.close()

        stop = threading.Event()

        def churn() -> None:  # writes during the paged read must not leak into it
            i = 0
            while not stop.is_set():
                client.put(f"{prefix}late-{i}", value)
                i += 1

        writer = threading.Thread(target=churn)
        writer.start()
        try:
            revision, kvs = conn.list_prefix(prefix, page_size=500)
        finally:
            stop.set()
            writer.join()
        keys = [kv.key.decode() for kv in kvs]
        assert keys == sorted(set(keys))
        assert sum("/engines/e" in key for key in keys) == 12_000
        assert all(kv.mod_revision <= revision for kv in kvs)
        # Exactly the late writes that happened before the read's revision are in it.
        late = sorted(int(key.rsplit("-", 1)[1]) for key in keys if "/late-" in key)
        assert late == list(range(len(late)))
        newer = client.get(f"{prefix}late-{len(late)}")[1]
        assert newer is None or newer.mod_revision > revision


def test_closed_connection_refuses_calls(settings: Settings) -> None:
    conn = Connection(settings)
    conn.close()
    conn.close()
    with pytest.raises(ClosedError):
        conn.call(lambda: conn.get("/k"))


def test_members_fail_over(etcd3) -> None:
    settings = Settings(endpoints=etcd3.endpoints, dial_timeout=10)
    with Connection(settings) as conn:
        conn.call(lambda: conn.replace("/k", b"v", 0))
        victim = connected_member(etcd3, conn)
        victim.stop(kill=True)
        started = time.monotonic()
        assert conn.call(lambda: conn.get("/k")).value == b"v"
        assert time.monotonic() - started < 3
        assert connected_member(etcd3, conn) is not victim


class HungMember:
    """A gRPC server on loopback that accepts every call and never answers it: a member
    whose name does not resolve, or that is stuck, as a client sees it."""

    def __init__(self) -> None:
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
            ended = threading.Event()
            context.add_callback(ended.set)  # the client's deadline ends the call
            ended.wait(60)
            return b""

        return grpc.unary_unary_rpc_method_handler(hang)

    def stop(self) -> None:
        self.server.stop(grace=None)


def test_authentication_fails_over_from_a_member_that_does_not_answer(etcd, monkeypatch) -> None:
    assert etcd.etcdctl("user", "add", "root:root-pw").returncode == 0
    assert etcd.etcdctl("auth", "enable").returncode == 0
    hung = HungMember()
    try:
        label = f"127.0.0.1:{hung.port}"
        # python3-etcd3 picks the member to authenticate with at random: make it the hung one.
        monkeypatch.setattr(random, "choice", lambda seq: label if label in seq else seq[0])
        settings = Settings(
            endpoints=[f"http://{label}", *etcd.endpoints],
            username="root",
            password="root-pw",
            dial_timeout=10,
            request_timeout=2,
            allow_insecure_auth=True,  # a test of failover, on plaintext
        )
        started = time.monotonic()
        with Connection(settings) as conn:
            conn.call(lambda: conn.replace("/k", b"v", 0))
        # One request timeout on the hung member, then the next member (was: the hung
        # member again on every retry until the dial timeout ran out).
        assert time.monotonic() - started < 2 + 1.5
    finally:
        hung.stop()
