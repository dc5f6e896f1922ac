"""The python3-etcd3 adapter: the one implementation of the etcd port (``_etcd/port.py``).

It is the only module that imports etcd3, gRPC or protobuf, and it knows nothing about
engines. It owns:

- building a python3-etcd3 ``MultiEndpointEtcd3Client`` with failover over every
  configured member, TLS and authentication;
- retries (tenacity, waiting the package's ``CALL`` backoff, bounded by a deadline);
- translating every gRPC / etcd3 error into discovery's exceptions, at one boundary
  (``translate``), so that nothing above it sees a client type;
- guarding the client's known defects:
  * ``Endpoint.fail()`` benches a member for 300 s, even the only one, and then every
    call fails with NoServerAvailableError: ``_FailoverClient`` benches a failed member
    for ``_FAILED_MEMBER_COOLDOWN`` seconds only while another member is healthy;
  * gRPC's reconnect backoff grows to 120 s: capped at 1 s so a restarted member is
    used again at once;
  * its watch thread dies silently on a stream error (``NameError: six``), never resumes
    after an error and delivers events one by one: we do not use it. ``_WatchStream``
    is a bidirectional Watch stream of our own on the client's channel, with a
    watchdog that asks etcd for progress and cancels the stream when it stays silent;
  * a member cut off from the rest of the cluster keeps serving an open watch from its
    frozen state, silently: every stream is opened leader-required (gRPC metadata
    ``hasleader: true``, like etcd's ``WithRequireLeader``), so etcd refuses it on a
    member without a leader and ends it when its member loses the leader; that member
    is benched and the error is a ``NoLeaderError``;
  * ``Lease.refresh()`` opens one stream per refresh: ``_KeepAliveStream`` keeps one
    stream for every lease of the connection;
  * an expired auth token: the client is rebuilt (re-authenticating) and the call retried;
  * with a username on a plaintext channel every call fails ("insufficient security level
    to transfer call credential"): the token is sent as metadata only;
  * prefix reads over gRPC's 4 MiB limit: ``list_prefix`` pages at one fixed revision;
  * it only knows the endpoints it was given: once the last of them has left the
    cluster (members replaced at runtime) it is blind. With ``settings.member_sync`` the
    connection follows the membership, like etcd's Go client with ``AutoSyncInterval``:
    a ``discovery-member-sync`` thread replaces the endpoints with the client URLs of
    etcd's member list every ``member_sync_interval`` seconds and after every failover.
    Removed members' channels are closed (their streams end and move to a listed
    member). It never follows an etcd gRPC proxy (its member list names one member of
    id 0, itself) nor a member list that does not name the URL it was asked through (a
    load balancer, a NAT, members advertising other names): those keep their endpoints.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import etcd3
import etcd3.exceptions as etcd3_exc
import grpc
from etcd3 import etcdrpc
from etcd3.client import EtcdTokenCallCredentials
from etcd3.transactions import BaseCompare, Txn
from etcd3.utils import prefix_range_end
from google.protobuf.unknown_fields import UnknownFieldSet
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
)

from discovery._backoff import CALL
from discovery._errors import (
    ClosedError,
    ConfigurationError,
    DiscoveryError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    PermissionDeniedError,
    RequestTooLargeError,
)
from discovery._etcd.port import (
    MAX_BATCH,
    PAGE_SIZE,
    CloseHooks,
    Compacted,
    KeyValue,
    LeaseGone,
    LeaseInfo,
    NoLeaderError,
    Page,
    PutResult,
    StreamSilentError,
    WatchEvent,
    WatchResponse,
    explain,
)
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._settings import ETCD_MAX_REQUEST_BYTES, Settings, parse_endpoint

__all__ = ["Connection"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_Client = Any  # etcd3.MultiEndpointEtcd3Client: the library ships no type information

_FAILED_MEMBER_COOLDOWN = 5.0
# Failovers come in bursts (every stream and call of a connection fails over at once):
# one member-list refresh for them all, and none in a tight loop while etcd is down.
_MEMBER_SYNC_MIN_GAP = 0.5
_LEARNER_FIELD = 5  # etcdserverpb.Member.isLearner: newer than python3-etcd3's stubs
_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 32 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # etcd's default keepalive enforcement allows pings every 5 s on active streams.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
# Transient: a member is down, restarting, electing, or the network dropped a call.
_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
_TRANSIENT_ETCD3 = (
    etcd3_exc.ConnectionFailedError,
    etcd3_exc.ConnectionTimeoutError,
    etcd3_exc.InternalServerError,
    etcd3_exc.NoServerAvailableError,
    etcd3_exc.WatchTimedOut,
)
# Codes after which python3-etcd3 benches the member (its _FAILED_EP_CODES).
_MEMBER_FAILURE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
)
# etcd's ErrGRPCNoSpace: writes are refused until an operator frees space (not transient).
_NO_SPACE = "database space exceeded"
# etcd's ErrGRPCRequestTooLarge, and gRPC's own refusal of a message over etcd's
# --max-request-bytes plus its 512 KiB allowance: the same request fails again (not transient).
_TOO_LARGE = ("request is too large", "received message larger than max")
_SOCKET_CLOSED = "Socket closed"  # gRPC's reason when a member hangs up (a TLS one on plaintext)
_TLS_PROBE_TIMEOUT = 0.5
_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# etcd's clientv3.WithRequireLeader: no stream on (or kept by) a member without a leader.
_REQUIRE_LEADER = ("hasleader", "true")
_PUT = 0  # mvccpb.Event.EventType


class _TokenExpired(Exception):
    """etcd no longer accepts our auth token; the client was rebuilt."""


class _TokenRejected(EtcdUnavailableError):
    """Transient: the call is retried with a fresh token."""


# -- error translation: the one boundary -------------------------------------------------


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc`` (etcd3 raises its own types from inside ``except``)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe(exc: BaseException) -> str:
    """A one-line, secret-free description of a client error."""
    if isinstance(exc, DiscoveryError):
        return explain(exc)
    rpc = _rpc_error(exc)
    if rpc is not None:
        details = rpc.details() or ""
        return f"{rpc.code().name}: {details}".strip()
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same raw client call later may succeed."""
    if isinstance(exc, (_TokenExpired, *_TRANSIENT_ETCD3)):
        return True
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True  # python3-etcd3's Endpoint.use() on a benched member
    if _closed_channel(exc):
        return True  # a member's channel closed under the call (it left the cluster)
    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() in _TRANSIENT_CODES and not _refused(rpc)


def _refused(rpc: grpc.RpcError) -> bool:
    """Whether etcd refused the request itself and will again (RESOURCE_EXHAUSTED says not)."""
    details = rpc.details() or ""
    return _NO_SPACE in details or any(sign in details for sign in _TOO_LARGE)


def translate(
    exc: BaseException,
    endpoints: Sequence[str] = (),
    *,
    user: str | None = None,
    key: str | None = None,
    size: int | None = None,
    limit: int = ETCD_MAX_REQUEST_BYTES,
) -> DiscoveryError:
    """Map any etcd3 / gRPC error to a discovery exception (callers use ``raise ... from``).

    ``user``, ``key`` (or prefix) and ``size`` (the bytes a write carried) say what the
    call was, for the errors etcd itself does not explain; ``limit``: the members'
    ``--max-request-bytes`` as the settings know it.
    """
    if isinstance(exc, DiscoveryError):
        return exc
    what = describe(exc)
    rpc = _rpc_error(exc)
    code = rpc.code() if rpc is not None else None
    if code in _AUTH_CODES or "authentication failed" in what or "user name is empty" in what:
        who = f"etcd user {user!r}" if user else "no etcd user (no credentials given)"
        on = f" on {key!r}" if key else ""
        return PermissionDeniedError(f"etcd refused the request{on} for {who}: {what}")
    if _NO_SPACE in what:
        return EtcdNoSpaceError(what)
    if any(sign in what for sign in _TOO_LARGE):
        return RequestTooLargeError(
            size or 0,
            limit,
            "write fewer records at once, shorten their labels and extra fields, or raise "
            "the members' limit",
            what,
        )
    if isinstance(exc, _TokenExpired):
        return _TokenRejected("etcd rejected the auth token; authenticating again", what)
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in what:
        return LeaseGone(f"etcd refused the write: {what}", "lease not found")
    if is_transient(exc):
        where = ", ".join(endpoints) or "etcd"
        hint = ""
        if any(word in what.lower() for word in ("ssl", "handshake", "certificate", "tls")):
            hint = " (TLS failed: check ca_cert, and cert/key when etcd requires client certs)"
        return EtcdUnavailableError(f"etcd unavailable at {where}: {what}{hint}", what)
    return EtcdError(f"etcd request failed: {what}")


def _closed_channel(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and "closed channel" in str(exc)


def _token_expired(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    return rpc is not None and "invalid auth token" in (rpc.details() or "")


def _compacted(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() == grpc.StatusCode.OUT_OF_RANGE


class _Range(NamedTuple):
    """One page's Range request: keys from ``start`` (inclusive) to ``end``."""

    start: bytes
    end: bytes
    limit: int
    revision: int  # 0: the current revision (the first page)


class _Prefetch:
    """One thread that reads a listing's next page while the caller decodes the current one.

    Plain blocking reads (a gRPC future per page would start a channel thread per page);
    at most one request is out at a time. ``close()`` ends the thread.
    """

    def __init__(self, read: Callable[[_Range], Any], name: str) -> None:
        self._read = read
        self._requests: queue.SimpleQueue[_Range | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        for request in iter(self._requests.get, None):
            try:
                self._answers.put((True, self._read(request)))
            except BaseException as exc:  # re-raised on the caller's thread
                self._answers.put((False, exc))

    def send(self, request: _Range) -> None:
        """Start reading ``request``'s page."""
        self._requests.put(request)

    def result(self) -> Any:
        """The page last sent, or what its read raised."""
        ok, answer = self._answers.get()
        if not ok:
            raise answer
        return answer

    def close(self) -> None:
        """End the thread once its read in progress (if any) is done."""
        self._requests.put(None)


def _compacted_as_such(read: Callable[[], Any]) -> Any:
    """``read()``, with etcd's "revision compacted" raised as ``Compacted``."""
    try:
        return read()
    except grpc.RpcError as exc:
        if _compacted(exc):
            raise Compacted(0) from exc
        raise


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    if exc is not None:
        log.warning(
            "etcd call failed (attempt %d), retrying: %s", state.attempt_number, describe(exc)
        )


_kv_fields = operator.attrgetter("key", "value", "mod_revision", "create_revision", "lease")
_new_key_value = functools.partial(tuple.__new__, KeyValue)


def _key_value(kv: Any) -> KeyValue:
    return _new_key_value(_kv_fields(kv))


def _key_values(kvs: Iterable[Any]) -> list[KeyValue]:
    """A page's keys, converted without a Python call per key (a listing has 50,000)."""
    return list(map(_new_key_value, map(_kv_fields, kvs)))


class _LeaseCompare(BaseCompare):  # type: ignore[misc]
    """``lease(key) == id``: the lease a key is bound to (python3-etcd3 has no helper)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


class _FailoverClient(etcd3.MultiEndpointEtcd3Client):  # type: ignore[misc]
    """python3-etcd3's client with a member choice that never locks us out.

    Upstream keeps using the current member until it fails, then benches it for
    ``time_retry`` seconds and raises NoServerAvailableError when every member is
    benched, so a single-member client is unusable after any blip. Here a failed
    member is avoided while others are healthy; when all are benched, the one benched
    longest ago is tried at once.

    Upstream also authenticates with one member chosen at random and no failover: a
    member that does not answer (a name that does not resolve) failed the whole client.
    Here a member that fails to answer is benched and the next one tried.

    The members can change while the client is in use (``replace_members``):
    ``endpoints`` is then replaced whole, never changed in place, so a thread reading it
    meanwhile sees the old members or the new ones. ``on_failover`` is called whenever
    the client moves away from a failed member.
    """

    call_credentials: grpc.CallCredentials | None  # None on a plaintext channel
    endpoints: dict[str, etcd3.Endpoint]  # by label (host:port)

    def __init__(
        self,
        *,
        endpoints: list[etcd3.Endpoint],
        new_member: Callable[[str], etcd3.Endpoint],
        on_failover: Callable[[], None],
        timeout: float,
        user: str | None,
        password: str | None,
    ) -> None:
        self._new_member = new_member
        self._on_failover = on_failover
        super().__init__(endpoints=endpoints, timeout=timeout, failover=True)
        if user is not None and password is not None:
            self._authenticate(etcdrpc.AuthenticateRequest(name=user, password=password))

    def _authenticate(self, request: Any) -> None:
        last = len(self.endpoints) - 1
        for attempt in range(last + 1):
            try:
                response = self.authstub.Authenticate(request, self.timeout)
            except grpc.RpcError as exc:
                if exc.code() not in _MEMBER_FAILURE_CODES or attempt == last:
                    raise
                self.endpoint_in_use.fail()  # benched: the next try goes to another member
                self._clear_old_stubs()
                continue
            self.metadata = (("token", response.token),)
            self.call_credentials = grpc.metadata_call_credentials(
                EtcdTokenCallCredentials(response.token)
            )
            return

    @property
    def endpoint_in_use(self) -> etcd3.Endpoint:
        members = self.endpoints  # read once: replace_members swaps it whole
        # The label may name a member replace_members has just dropped: any other will do.
        return members.get(self._current_endpoint_label) or next(iter(members.values()))

    @property
    def channel(self) -> grpc.Channel:
        current = self.endpoint_in_use
        if not current.is_failed():
            channel: grpc.Channel = current.use()
            return channel
        self._on_failover()
        members = self.endpoints
        healthy = [label for label, ep in members.items() if not ep.is_failed()]
        if healthy:
            label = random.choice(healthy)
        else:
            label = min(members, key=lambda name: members[name].last_failed)
            members[label].last_failed = 0  # try it now; a new failure benches it
        self._current_endpoint_label = label
        channel = members[label].use()
        return channel

    def replace_members(self, urls: Sequence[str]) -> None:
        """Use the members at ``urls`` from now on, and close the others' channels.

        A member kept keeps its channel and the streams on it. A stream on a closed
        channel ends with an error and its owner opens it again on a listed member.
        """
        old = self.endpoints
        members = {_netloc(url): old.get(_netloc(url)) or self._new_member(url) for url in urls}
        if self._current_endpoint_label not in members:
            healthy = [label for label, ep in members.items() if not ep.is_failed()]
            # Also drops the stubs bound to the old member's channel.
            self._current_endpoint_label = random.choice(healthy or list(members))
        self.endpoints = members
        for label, member in old.items():
            if label not in members:
                member.close()


class Connection(CloseHooks):
    """A failover etcd client with retries, error translation and defect guards.

    The python3-etcd3 implementation of the etcd port. Thread-safe: registrations,
    watchers and user threads share one Connection. Every method below makes one
    attempt and raises discovery's exceptions; ``call`` retries transient failures.
    With ``settings.member_sync`` it follows the cluster's membership (``endpoints``);
    ``metrics`` hears which endpoints it knows.
    """

    def __init__(
        self, settings: Settings | None = None, *, metrics: MetricsHooks | None = None
    ) -> None:
        super().__init__()
        self.settings = settings if settings is not None else Settings.from_env()
        self._metrics = metrics or NO_METRICS
        self._lock = threading.Lock()
        self._client: _Client | None = None
        self._endpoints = tuple(self.settings.endpoints)
        # Member sync: the thread waits on _sync_due for its period or a failover.
        self._sync_due = threading.Condition()
        self._sync_asked = False
        self._sync_thread: threading.Thread | None = None
        self._not_followed = ""  # why the last member list was not followed (logged once)

    # -- client lifecycle -------------------------------------------------------------

    def _current(self) -> _Client:
        """The python3-etcd3 client, built (and authenticated) on first use."""
        with self._lock:
            if self._closed:
                raise ClosedError("connection is closed")
            if self._client is None:
                self._client = self._build_client()
                self._metrics.etcd_endpoints(len(self._endpoints))
            return self._client

    def _follow_membership(self) -> None:
        """Start the member-sync thread (``settings.member_sync``), once."""
        if self._sync_thread is not None or not self.settings.member_sync:
            return
        with self._lock:
            if self._sync_thread is None and not self._closed:
                self._sync_thread = threading.Thread(
                    target=self._sync_members, name="discovery-member-sync", daemon=True
                )
                self._sync_thread.start()

    def _build_client(self) -> _Client:
        s = self.settings
        creds = None
        if s.secure:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(s.ca_cert),
                private_key=_read(s.key),
                certificate_chain=_read(s.cert),
            )
        new_member = functools.partial(_member, secure=s.secure, creds=creds)
        members = [new_member(url) for url in self._endpoints]
        try:
            # Authenticates at once when credentials are set; members are tried in turn.
            client = _FailoverClient(
                endpoints=members,
                new_member=new_member,
                on_failover=self._failed_over,
                timeout=s.request_timeout,
                user=s.username,
                password=s.read_password(),  # a rotated password file is read again
            )
        except BaseException:
            for member in members:
                member.close()
            raise
        if not s.secure:
            # gRPC refuses call credentials on a plaintext channel ("insufficient security
            # level"); the token also travels as plain metadata, which is all etcd reads.
            client.call_credentials = None
        return client

    def _reset_client(self, broken: _Client) -> None:
        with self._lock:
            if self._client is broken:
                self._client = None
        broken.close()

    # -- following the cluster's membership (settings.member_sync) -------------------------

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The etcd URLs in use.

        The configured ones, then (``settings.member_sync``) the client URLs of the
        cluster's members.
        """
        return self._endpoints

    def _failed_over(self) -> None:
        """The client moved away from a failed member: the members may have changed."""
        with self._sync_due:
            self._sync_asked = True
            self._sync_due.notify()

    def _sync_members(self) -> None:
        """The ``discovery-member-sync`` thread: refresh when due, until the connection closes."""
        interval = self.settings.member_sync_interval or math.inf  # 0: after failovers only
        periodic = time.monotonic() + interval
        earliest = 0.0  # of a refresh asked for by a failover
        while True:
            with self._sync_due:
                while not self._closed:
                    now = time.monotonic()
                    due = min(periodic, max(earliest, now) if self._sync_asked else math.inf)
                    if due <= now:
                        break
                    self._sync_due.wait(None if due == math.inf else due - now)
                if self._closed:
                    return
                self._sync_asked = False
            self._refresh_members()
            earliest = time.monotonic() + _MEMBER_SYNC_MIN_GAP
            periodic = time.monotonic() + interval

    def _refresh_members(self) -> None:
        """Read the member list and follow it; a failed read keeps the endpoints.

        A member that does not answer is benched and the next one asked at once, each
        known member at most once per refresh. Not only at the next refresh: the bench
        lasts ``_FAILED_MEMBER_COOLDOWN``, no longer than a refresh period, so an idle
        connection (nothing of its own fails over) would ask its removed member again at
        every refresh, never learn the new members, and be blind once the last member it
        knows is gone (tests/test_failure_catalogue.py, member-rotation).
        """
        try:
            client = self._current()
        except DiscoveryError:
            return  # closed, or etcd refuses the credentials: the callers hear of it
        for _ in range(len(client.endpoints)):
            channel = client.channel  # moves off a benched member (a failover)
            member = client.endpoint_in_use
            try:
                members = (
                    etcdrpc.ClusterStub(channel)
                    .MemberList(
                        etcdrpc.MemberListRequest(),
                        client.timeout,
                        credentials=client.call_credentials,
                        metadata=client.metadata,
                    )
                    .members
                )
            except Exception as exc:  # etcd unreachable: its callers say so
                log.debug("etcd member list not read from %s: %s", member.netloc, describe(exc))
                rpc = _rpc_error(exc)
                if rpc is None or rpc.code() not in _MEMBER_FAILURE_CODES:
                    return  # not this member's fault: another would answer the same
                member.fail()  # benched: the next attempt asks another member
                continue
            self._follow(client, member.netloc, members)
            return
        log.debug("etcd member list not read from any member, endpoints kept")

    def _follow(self, client: _FailoverClient, asked: str, members: Sequence[Any]) -> None:
        """Use the client URLs of ``members``, read through ``asked``, if they can be trusted.

        Else keep the endpoints, and say why (once).
        """
        urls = _client_urls(members, "https" if self.settings.secure else "http")
        why_not = ""
        if any(member.ID == 0 for member in members):
            why_not = f"{asked} is an etcd gRPC proxy (its member list names itself, id 0)"
        elif urls and asked not in {_netloc(url) for url in urls}:
            why_not = (
                f"the member list read through {asked} does not name it ({', '.join(urls)}): "
                "a load balancer, a NAT, or members advertising other client URLs"
            )
        if why_not and why_not != self._not_followed:
            log.warning(
                "not following etcd membership changes: %s; endpoints kept: %s (turn member "
                "sync off there: DISCOVERY_MEMBER_SYNC=0)",
                why_not,
                ", ".join(self._endpoints),
            )
        self._not_followed = why_not
        if why_not or not urls:
            return
        with self._lock:
            if self._client is not client or set(urls) == set(self._endpoints):
                return
            before, self._endpoints = self._endpoints, urls
            client.replace_members(urls)
        added = [url for url in urls if url not in before]
        removed = [url for url in before if url not in urls]
        log.info(
            "etcd membership changed: endpoints now %s (added: %s; removed: %s)",
            ", ".join(urls),
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
        )
        self._metrics.etcd_endpoints(len(urls), added=len(added), removed=len(removed))

    @property
    def dial_timeout(self) -> float:
        """``settings.dial_timeout``: how long ``call`` retries by default."""
        return self.settings.dial_timeout

    @property
    def election_timeout(self) -> float:
        """``settings.election_timeout``: etcd's election timeout."""
        return self.settings.election_timeout

    @property
    def max_request_bytes(self) -> int:
        """``settings.max_request_bytes``: the members' request limit."""
        return self.settings.max_request_bytes

    @property
    def member_in_use(self) -> str:
        """``host:port`` of the member calls go to now."""
        return str(self._current().endpoint_in_use.netloc)

    def close(self) -> None:
        """Close every channel. Streams opened on this connection end with an error."""
        if not self._close_hooks_run():
            return
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()  # also ends a member-list read in flight
        with self._sync_due:
            self._sync_due.notify()
        if self._sync_thread is not None:
            self._sync_thread.join()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    # -- calls --------------------------------------------------------------------------

    def _attempt(
        self,
        op: Callable[[_Client], T],
        *,
        sync: bool = True,
        key: str | None = None,
        size: int | None = None,
    ) -> T:
        """Run ``op`` once on the client; every failure leaves as a DiscoveryError.

        ``sync``: start following the membership after it, if not yet (member_sync).
        ``key`` (or prefix) and ``size`` (the bytes it writes) name the call in errors.
        """
        client = None
        try:
            client = self._current()  # building it authenticates: that may fail too
            return op(client)
        except DiscoveryError:
            raise
        except Exception as exc:
            if client is not None and _token_expired(exc):
                self._reset_client(client)
                raise translate(_TokenExpired(), self._endpoints) from exc
            if client is not None and _closed_channel(exc):
                # A stub cached on a removed member's channel (built while replace_members
                # ran): the retry builds it again on the member in use.
                client._clear_old_stubs()
            raise translate(
                exc,
                self._endpoints,
                user=self.settings.username,
                key=key,
                size=size,
                limit=self.settings.max_request_bytes,
            ) from exc
        finally:
            if sync and client is not None:
                self._follow_membership()

    def call(self, op: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``op`` with retries of transient failures for up to ``timeout`` seconds.

        The default timeout is ``settings.dial_timeout``. Raises a DiscoveryError.
        """
        try:
            try:
                return op()  # the common case builds no retry machinery (~40 us a call)
            except EtcdUnavailableError as exc:
                failed: list[BaseException] = [exc]

            def attempt() -> T:
                if failed:  # the first attempt, made above: replayed for the policy
                    raise failed.pop()
                return op()

            retrying = Retrying(
                retry=retry_if_exception(
                    lambda e: isinstance(e, EtcdUnavailableError) and not self._closed
                ),
                wait=CALL,
                stop=stop_after_delay(self.settings.dial_timeout if timeout is None else timeout),
                before_sleep=_log_retry,
                reraise=True,
            )
            return retrying(attempt)
        except _TokenRejected as exc:
            raise PermissionDeniedError("etcd keeps rejecting the auth token") from exc
        except EtcdUnavailableError as exc:
            tls = _answering_tls(self._endpoints) if _SOCKET_CLOSED in (exc.reason or "") else []
            if not tls:
                raise
            raise EtcdUnavailableError(
                f"etcd unavailable: {', '.join(tls)} answers with TLS, not plaintext: use "
                f"https:// (and ca_cert, DISCOVERY_ETCD_CA_CERT, for its CA) ({exc.reason})",
                exc.reason,
            ) from exc

    def list_prefix(
        self, prefix: str, *, page_size: int = PAGE_SIZE, timeout: float | None = None
    ) -> tuple[int, list[KeyValue]]:
        """Read every key under ``prefix`` at one revision, in pages; return (revision, kvs).

        Each page is retried for up to ``timeout`` seconds (see ``call``). If the revision
        is compacted between pages the whole read starts again.
        """
        retrying = Retrying(
            retry=retry_if_exception_type(Compacted),
            stop=stop_after_attempt(5),
            reraise=True,
        )
        return retrying(self._list_once, prefix, page_size, timeout)

    def _list_once(
        self, prefix: str, page_size: int, timeout: float | None
    ) -> tuple[int, list[KeyValue]]:
        revision, found = 0, []
        for page_revision, kvs in self.list_pages(prefix, page_size=page_size, timeout=timeout):
            revision = page_revision
            found.extend(kvs)
        return revision, found

    def list_pages(
        self,
        prefix: str,
        *,
        page_size: int = PAGE_SIZE,
        first_page: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[Page]:
        """(revision, keys) per page of ``prefix``, every page read at the first's revision.

        ``first_page`` keys in the first page (default ``page_size``): a small one gives the
        caller work sooner. While the caller works on one page, a thread of the listing's
        reads the next (blocking reads, one at a time), so decoding overlaps the network.
        Each page is retried for up to ``timeout`` seconds; raises ``Compacted`` if the
        revision goes meanwhile.
        """
        key = prefix.encode()
        request = _Range(key, prefix_range_end(key), first_page or page_size, 0)
        read = functools.partial(self._range_page, timeout=timeout, prefix=prefix)
        page = read(request)
        request = request._replace(revision=page.header.revision, limit=page_size)
        ahead = None  # started by a full first page: a listing of one page starts no thread
        try:
            while True:
                kvs = page.kvs
                more = page.more and kvs
                if more:
                    request = request._replace(start=kvs[-1].key + b"\0")
                    if ahead is None:
                        ahead = _Prefetch(read, f"list {prefix}")
                    ahead.send(request)
                yield Page(request.revision, _key_values(kvs), page.header.cluster_id)
                if not more:
                    return
                assert ahead is not None
                page = ahead.result()
        finally:
            if ahead is not None:
                ahead.close()

    def _range_page(self, request: _Range, *, timeout: float | None, prefix: str) -> Any:
        """One page of ``prefix``, retried for up to ``timeout`` seconds.

        A listing's pages do not start the member sync (a watcher's watch does, on its own
        thread): no thread start holds up a new watcher's first listing.
        """
        start, end, limit, revision = request
        return self.call(
            lambda: self._attempt(
                lambda c: _compacted_as_such(
                    lambda: c.get_range_response(start, end, limit=limit, revision=revision or None)
                ),
                sync=False,
                key=prefix,
            ),
            timeout=timeout,
        )

    def get(self, key: str) -> KeyValue | None:
        """The key, or None."""
        kvs = self._attempt(lambda c: c.get_response(key).kvs, key=key)
        return _key_value(kvs[0]) if kvs else None

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self._attempt(lambda c: c.lease(ttl).id))

    def lease_info(self, lease_id: int) -> LeaseInfo:
        """The lease's remaining TTL (<= 0 when gone) and the keys bound to it."""
        info = self._attempt(lambda c: c.get_lease_info(lease_id))
        return LeaseInfo(int(info.TTL), tuple(info.keys))

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease; one that no longer exists (it expired) is revoked already."""

        def revoke(client: _Client) -> None:
            try:
                client.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._attempt(revoke)

    def create(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` only if ``key`` does not exist."""
        return self._put(key, value, lease_id, lambda txn: [txn.version(key) == 0])

    def replace(self, key: str, value: bytes, lease_id: int) -> PutResult:
        """Put ``value`` on ``lease_id`` whatever the key holds."""
        return self._put(key, value, lease_id, lambda txn: [])

    def update(self, key: str, value: bytes, lease_id: int, *, mod_revision: int) -> PutResult:
        """Put ``value`` only if the key was last written at ``mod_revision``."""
        return self._put(key, value, lease_id, lambda txn: [txn.mod(key) == mod_revision])

    def _put(
        self, key: str, value: bytes, lease_id: int, compare: Callable[[Any], list[Any]]
    ) -> PutResult:
        def transact(client: _Client) -> PutResult:
            txn = client.transactions
            ok, responses = client.transaction(
                compare=compare(txn),
                success=[txn.put(key, value, lease_id, prev_kv=True)],
                failure=[txn.get(key)],
            )
            if not ok:
                found = responses[0]
                current = found[0][1] if found else None
                return PutResult(
                    False,
                    current.response_header.revision if current else 0,
                    KeyValue(
                        current.key,
                        found[0][0],
                        current.mod_revision,
                        current.create_revision,
                        current.lease_id,
                    )
                    if current
                    else None,
                )
            put = responses[0].response_put
            previous = _key_value(put.prev_kv) if put.prev_kv.key else None
            return PutResult(True, put.header.revision, previous)

        return self._attempt(transact, key=key, size=len(key.encode()) + len(value))

    def create_many(self, items: Sequence[tuple[str, bytes]], lease_id: int) -> list[PutResult]:
        """Create each absent key on ``lease_id`` in one transaction of nested ones."""
        # etcd compares a missing key's mod revision as 0: "absent" is "at revision 0".
        return self.update_many([(key, value, 0) for key, value in items], lease_id)

    def update_many(
        self, items: Sequence[tuple[str, bytes, int]], lease_id: int
    ) -> list[PutResult]:
        """Put each (key, value) still at its mod revision, in one transaction of nested ones."""
        if len(items) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} keys per batch, got {len(items)}")

        def transact(client: _Client) -> list[PutResult]:
            txn = client.transactions
            ops = [
                Txn(
                    compare=[txn.mod(key) == mod_revision],
                    success=[txn.put(key, value, lease_id)],
                    failure=[txn.get(key)],
                )
                for key, value, mod_revision in items
            ]
            _, responses = client.transaction(compare=[], success=ops, failure=[])
            results = []
            for response in responses:
                nested = response.response_txn
                op = nested.responses[0]
                if nested.succeeded:
                    results.append(PutResult(True, op.response_put.header.revision, None))
                else:
                    found = op.response_range
                    current = _key_value(found.kvs[0]) if found.kvs else None
                    results.append(PutResult(False, found.header.revision, current))
            return results

        size = sum(len(key.encode()) + len(value) for key, value, _ in items)
        return self._attempt(transact, key=_common_prefix(items), size=size)

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return bool(self._attempt(lambda c: c.delete(key), key=key))

    def delete_owned(self, key: str, lease_id: int) -> bool:
        """Delete ``key`` only if it is bound to ``lease_id``."""

        def transact(client: _Client) -> bool:
            ok, _ = client.transaction(
                compare=[_LeaseCompare(key) == lease_id],
                success=[client.transactions.delete(key)],
                failure=[],
            )
            return bool(ok)

        return self._attempt(transact, key=key)

    # -- streams --------------------------------------------------------------------------

    def open_watch(
        self, prefix: str, start_revision: int, *, heartbeat: float, progress_interval: float
    ) -> _WatchStream:
        """Open a leader-required watch of ``prefix`` from ``start_revision`` (inclusive)."""
        return self._attempt(
            lambda c: _WatchStream(
                c,
                self._reset_client,
                prefix,
                start_revision,
                heartbeat=heartbeat,
                progress_interval=progress_interval,
            )
        )

    def open_keepalive(self) -> _KeepAliveStream:
        """Open one leader-required LeaseKeepAlive stream to refresh any number of leases."""
        return self._attempt(lambda c: _KeepAliveStream(c, self._reset_client))


def _common_prefix(items: Sequence[tuple[str, bytes, int]]) -> str | None:
    """The one key of a batch, or the prefix its keys share (for errors)."""
    keys = [key for key, _, _ in items]
    return os.path.commonprefix(keys) or None  # noqa: RUF071 (keys, not paths: a prefix)


def _answering_tls(endpoints: Sequence[str]) -> list[str]:
    """The ``http://`` endpoints whose member completes a TLS handshake (a scheme mistake).

    Asked only once a call has given up on "Socket closed", gRPC's word for a TLS member
    hanging up on plaintext: nothing else tells that mistake from a member going away.
    """
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # whether it speaks TLS, not whether we trust it
    found = []
    for url in endpoints:
        if not url.startswith("http://"):
            continue
        try:
            with (
                socket.create_connection(_host_port(url), timeout=_TLS_PROBE_TIMEOUT) as raw,
                context.wrap_socket(raw),
            ):
                found.append(url)
        except ssl.SSLError as exc:
            if "ALERT" in (exc.reason or ""):  # a TLS alert (say, a client cert required)
                found.append(url)
        except OSError:  # refused, timed out, reset
            pass
    return found


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


def _netloc(url: str) -> str:
    """The label python3-etcd3 gives the member at ``url`` (``scheme://host:port``)."""
    return "{}:{}".format(*_host_port(url))


def _member(url: str, *, secure: bool, creds: grpc.ChannelCredentials | None) -> etcd3.Endpoint:
    """A python3-etcd3 endpoint for ``url``, benched for a few seconds when it fails."""
    host, port = _host_port(url)
    return etcd3.Endpoint(
        host,
        port,
        secure=secure,
        creds=creds,
        time_retry=_FAILED_MEMBER_COOLDOWN,
        opts=_GRPC_OPTIONS,
    )


def _client_urls(members: Iterable[Any], scheme: str) -> tuple[str, ...]:
    """The client URLs of the listed voting members, as ``scheme://host:port``.

    A member added but not started yet has none; a learner is left out (it refuses most
    requests); so are URLs of another scheme, which the connection's TLS settings do not
    fit. A URL without a scheme (what an etcd gRPC proxy advertises) gets ``scheme``.
    """
    urls: dict[str, None] = {}  # ordered, without repeats
    for member in members:
        if any(f.field_number == _LEARNER_FIELD and f.data for f in UnknownFieldSet(member)):
            continue
        for raw in member.clientURLs:
            try:
                url = parse_endpoint(raw if "://" in raw else f"{scheme}://{raw}")
            except ConfigurationError:
                continue  # unix:// and the like
            if url.startswith(f"{scheme}://"):
                urls[url] = None
    return tuple(urls)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as handle:
        return handle.read()


class _Stream:
    """A leader-required bidirectional gRPC stream fed from a queue; cancel() ends it.

    python3-etcd3 only benches a member after a failed unary call; a stream that fails
    on a member (or that the member refuses or ends for want of a leader) benches it
    here, so the next stream fails over to another member.
    """

    def __init__(self, client: _Client, on_token_expired: Callable[[_Client], None]) -> None:
        self._client = client
        self._on_token_expired = on_token_expired
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call: Any = None
        self._channel = client.channel  # picks a member that is not benched
        self._member = client.endpoint_in_use
        self._credentials = client.call_credentials
        self._metadata = (*(client.metadata or ()), _REQUIRE_LEADER)

    def _request_iter(self) -> Iterator[Any]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _open(self, method: Callable[..., Any]) -> None:
        self._call = method(
            self._request_iter(), credentials=self._credentials, metadata=self._metadata
        )

    def _responses(self) -> Iterator[Any]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            if exc.code() in _MEMBER_FAILURE_CODES:
                self._member.fail()
            elif _token_expired(exc):
                # A stream opened with a stale token (etcd restarted, or the token idled
                # out): authenticate again before the next stream.
                self._on_token_expired(self._client)
            raise self._translated(exc) from exc

    def _translated(self, exc: grpc.RpcError) -> DiscoveryError:
        if exc.code() is grpc.StatusCode.UNAVAILABLE and "no leader" in (exc.details() or ""):
            return NoLeaderError(
                f"etcd member {self._member.netloc} has no leader (cut off from the rest of "
                f"the cluster, or electing one): {describe(exc)}",
                f"member {self._member.netloc} has no leader",
            )
        return translate(exc)

    def send(self, request: Any) -> None:
        self._requests.put(request)

    def cancel(self) -> None:
        """End the stream; a reader blocked on it gets an error."""
        self._requests.put(None)
        if self._call is not None:
            self._call.cancel()

    def abandon(self) -> None:
        """End a stream that stopped answering and bench its member for a moment."""
        self._member.fail()
        self.cancel()


class _WatchStream(_Stream):
    """One etcd Watch of a key prefix, guarded against silent death.

    Iterate it for ``WatchResponse`` values (all events of one revision arrive in one
    response). A watchdog thread sends a progress request whenever the stream has been
    quiet for ``progress_interval`` seconds (at most one per interval: each answer proves
    the member still has a leader) and cancels the stream when nothing has arrived for
    two ``heartbeat`` s, so a dead stream always ends in an error instead of hanging.
    """

    def __init__(
        self,
        client: _Client,
        on_token_expired: Callable[[_Client], None],
        prefix: str,
        start_revision: int,
        *,
        heartbeat: float,
        progress_interval: float,
    ) -> None:
        super().__init__(client, on_token_expired)
        self._prefix = prefix
        key = prefix.encode()
        # progress_notify: etcd's periodic progress responses (member flag
        # --experimental-watch-progress-notify-interval) also cross an etcd gRPC proxy,
        # which drops the watchdog's progress requests (docs/operations/many-routers.md).
        create = etcdrpc.WatchCreateRequest(
            key=key,
            range_end=prefix_range_end(key),
            start_revision=start_revision,
            progress_notify=True,
        )
        self.send(etcdrpc.WatchRequest(create_request=create))
        self._open(etcdrpc.WatchStub(self._channel).Watch)
        self._heartbeat = heartbeat
        self._progress_interval = progress_interval
        self._last_seen = self._last_asked = time.monotonic()
        self._stopped = threading.Event()
        self.silent = False
        self._watchdog = threading.Thread(
            target=self._guard, name="discovery-watch-watchdog", daemon=True
        )
        self._watchdog.start()

    def _guard(self) -> None:
        every = min(self._progress_interval, self._heartbeat)  # ask before giving up
        while not self._stopped.wait(every / 2):
            now = time.monotonic()
            quiet = now - self._last_seen
            if quiet >= 2 * self._heartbeat:
                log.warning("watch stream silent for %.1f s; reconnecting", quiet)
                self.silent = True
                self.abandon()
                return
            if quiet >= every and now - self._last_asked >= every:
                self._last_asked = now
                self.send(etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest()))

    def _translated(self, exc: grpc.RpcError) -> DiscoveryError:
        if self.silent:
            return StreamSilentError(
                f"watch stream silent for {2 * self._heartbeat:g} s (no answer to progress "
                "requests); reconnecting",
                "silent stream",
            )
        return super()._translated(exc)

    def __iter__(self) -> Iterator[WatchResponse]:
        """Yield responses; raise Compacted, or the stream's error when it ends."""
        try:
            for response in self._responses():
                self._last_seen = time.monotonic()
                if response.compact_revision:
                    raise Compacted(response.compact_revision)
                if response.canceled:
                    raise self._cancelled(response.cancel_reason)
                yield WatchResponse(
                    response.header.revision,
                    tuple(
                        WatchEvent(_key_value(event.kv), event.type == _PUT)
                        for event in response.events
                    ),
                    response.header.cluster_id,
                )
                # Time spent by the consumer is not the stream's silence.
                self._last_seen = time.monotonic()
            raise EtcdUnavailableError("watch stream closed by etcd", "stream closed")
        finally:
            self.close()

    def _cancelled(self, reason: str) -> EtcdError:
        if "permission denied" not in reason:
            return EtcdError(f"etcd cancelled the watch: {reason}")
        if self._client.metadata:
            # etcd answers an expired token on a new watch with "permission denied", not
            # "invalid auth token" (upstream #1227: a watch that never resumes).
            # Authenticate again; a real lack of permission stays denied.
            self._on_token_expired(self._client)
        return PermissionDeniedError(f"etcd refused the watch of {self._prefix!r}: {reason}")

    def close(self) -> None:
        """Cancel the stream and stop its watchdog."""
        self._stopped.set()
        self.cancel()


class _KeepAliveStream(_Stream):
    """One LeaseKeepAlive stream: ``send_keepalive(id)``, iterate for (lease id, ttl)."""

    def __init__(self, client: _Client, on_token_expired: Callable[[_Client], None]) -> None:
        super().__init__(client, on_token_expired)
        self._open(etcdrpc.LeaseStub(self._channel).LeaseKeepAlive)

    def send_keepalive(self, lease_id: int) -> None:
        """Ask etcd to renew ``lease_id``; the answer arrives through iteration."""
        self.send(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """Yield (lease id, remaining TTL); TTL <= 0 means the lease no longer exists."""
        try:
            for response in self._responses():
                yield response.ID, response.TTL
        finally:
            self.cancel()
