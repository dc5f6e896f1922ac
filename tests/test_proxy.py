"""Watching through etcd's gRPC proxy (``etcd grpc-proxy start``), real processes (issue 16).

The proxy coalesces identical watches of many routers into one watch on a member. These
tests prove our watcher works through one (snapshot, events, the proxy restarted under it,
an idle watch that stays connected) and pin down what the proxy changes for the liveness
checks (docs/operations/many-routers.md):

* it does not answer a watch progress request (etcd 3.5: "not supported request type");
* it forwards the member's periodic progress notifications to watches created with
  ``progress_notify``, which is what keeps our watchdog quiet behind it;
* it ignores the ``hasleader`` metadata of its clients: a require-leader watch through it
  stays open and silent on a member that lost its leader, where a direct one is cancelled.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd3 import etcdrpc

from discovery import EndpointWatcher, EventType, RoutingTable, Settings, register_engine
from discovery.testing.embedded import EtcdCluster, EtcdGrpcProxy, find_binary

from .helpers import etcdctl, make_endpoint, wait_for
from .test_watcher import Recorder

# Every test runs etcd and its gRPC proxy, or etcd's own --help.
pytestmark = pytest.mark.external

NOTIFY = ["--experimental-watch-progress-notify-interval", "500ms"]
HEARTBEAT = 2.0  # the watcher's watchdog: progress request after 2 s quiet, drop after 4 s


@contextlib.contextmanager
def checked_proxy(endpoints: list[str]) -> Iterator[EtcdGrpcProxy]:
    proxy = EtcdGrpcProxy(endpoints).start()
    process, base_dir = proxy.process, proxy.base_dir
    try:
        yield proxy
    finally:
        proxy.close()
    assert process is not None and process.poll() is not None, "grpc-proxy left running"
    assert not os.path.exists(base_dir), f"proxy directory {base_dir} left behind"


@pytest.fixture
def member() -> Iterator[EtcdCluster]:
    """One member that sends watch progress notifications every 500 ms."""
    with EtcdCluster(1, extra_args=NOTIFY) as cluster:
        yield cluster


@pytest.fixture
def proxy(member: EtcdCluster) -> Iterator[EtcdGrpcProxy]:
    with checked_proxy(member.endpoints) as started:
        yield started


def test_watcher_through_the_proxy_gets_snapshot_events_and_survives_a_proxy_restart(
    member: EtcdCluster, proxy: EtcdGrpcProxy
) -> None:
    direct = Settings(endpoints=member.endpoints, namespace="proxied", dial_timeout=10)
    through = Settings(endpoints=[proxy.client_url], namespace="proxied", dial_timeout=10)
    regs = {
        i: register_engine(make_endpoint(i), engine_id=f"e{i}", settings=direct) for i in (0, 1)
    }
    try:
        with EndpointWatcher(through, heartbeat=HEARTBEAT) as watcher:
            table = RoutingTable(watcher).start()
            recorder = Recorder()
            watcher.subscribe(recorder)
            assert set(table.snapshot()) == {"e0", "e1"}  # the snapshot, read through the proxy

            regs[2] = register_engine(make_endpoint(2), engine_id="e2", settings=direct)
            wait_for(lambda: "e2" in table, message="e2 added through the proxy")

            proxy.stop()  # SIGKILL: the watch stream dies with it
            wait_for(lambda: watcher.health().reconnects >= 1, message="watcher noticed")
            regs.pop(0).close()
            regs[3] = register_engine(make_endpoint(3), engine_id="e3", settings=direct)
            proxy.start()  # same port

            wait_for(
                lambda: set(table.snapshot()) == {"e1", "e2", "e3"}, timeout=20, message="resync"
            )
            # Its close was announced (stopping), then the record went.
            assert recorder.of("e0") == [EventType.ADDED, EventType.UPDATED, EventType.REMOVED]
            assert recorder.of("e3") == [EventType.ADDED]
            assert recorder.of("e2") == [EventType.ADDED]
            recorder.check_order()
            listed = etcdctl(member.endpoints, "get", "--prefix", "--keys-only", watcher.prefix)
            assert sorted(k.rsplit("/", 1)[1] for k in listed.stdout.split()) == sorted(
                table.snapshot()
            )
            table.stop()
    finally:
        for reg in regs.values():
            reg.close()


def test_idle_watch_through_the_proxy_stays_connected(proxy: EtcdGrpcProxy) -> None:
    # The proxy drops progress requests; the member's progress notifications, forwarded
    # by the proxy, are what the watchdog sees on a prefix where nothing changes.
    settings = Settings(endpoints=[proxy.client_url], namespace="idle", dial_timeout=10)
    with EndpointWatcher(settings, heartbeat=HEARTBEAT) as watcher:
        started = time.time()
        wait_for(
            lambda: (
                (seen := watcher.health().last_success)
                and seen.timestamp() > started + 3 * HEARTBEAT
            ),
            timeout=30,
            message="three heartbeats of progress notifications",
        )
        health = watcher.health()
        assert health.reconnects == 0, health
        assert health.state.value == "connected"


# -- what the proxy changes, on raw gRPC streams ---------------------------------------------


class RawWatch:
    """One Watch stream of /a.../b with the given metadata; responses and the end in a queue."""

    def __init__(self, url: str, metadata: tuple = (), *, progress_notify: bool = False) -> None:
        self.channel = grpc.insecure_channel(url.split("://", 1)[1])
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        create = etcdrpc.WatchCreateRequest(
            key=b"/a", range_end=b"/b", progress_notify=progress_notify
        )
        self.requests.put(etcdrpc.WatchRequest(create_request=create))
        self.call = etcdrpc.WatchStub(self.channel).Watch(self._requests(), metadata=metadata)
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next(10)[0] == "created"

    def _requests(self):
        while (request := self.requests.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for response in self.call:
                self.out.put(("created" if response.created else "response", response))
        except grpc.RpcError as exc:
            self.out.put(("error", exc))

    def next(self, timeout: float) -> tuple:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            return ("nothing", None)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


def test_proxy_drops_progress_requests_and_forwards_progress_notifications(
    member: EtcdCluster, proxy: EtcdGrpcProxy
) -> None:
    progress = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())
    direct, proxied = RawWatch(member.endpoints[0]), RawWatch(proxy.client_url)
    notified = RawWatch(proxy.client_url, progress_notify=True)
    try:
        direct.requests.put(progress)
        assert direct.next(5)[0] == "response"  # a member answers at once
        proxied.requests.put(progress)
        # Every notification (500 ms apart) reaches the watch that asked for them...
        assert [notified.next(5)[0] for _ in range(3)] == ["response"] * 3
        # ...while the progress request, seconds later, still has no answer.
        assert proxied.next(0)[0] == "nothing"
        assert "not supported request type" in proxy.log_path.read_text()
    finally:
        for watch in (direct, proxied, notified):
            watch.close()


def test_proxy_ignores_hasleader_of_its_clients() -> None:
    with EtcdCluster(3) as cluster, checked_proxy([cluster.leader().client_url]) as proxy:
        alone = next(m for m in cluster.members if m.client_url == proxy.endpoints[0])
        others = [m for m in cluster.members if m is not alone]
        hasleader = (("hasleader", "true"),)
        direct = RawWatch(alone.client_url, hasleader)
        proxied = RawWatch(proxy.client_url, hasleader)
        try:
            for other in others:  # the proxy's member loses its quorum, hence its leader
                os.kill(other.pid, signal.SIGSTOP)
            kind, error = direct.next(20)
            assert kind == "error" and "no leader" in error.details()
            # The proxied require-leader watch outlived the direct one: still open, silent.
            assert proxied.next(0)[0] == "nothing"
            assert proxied.call.running() or not proxied.call.done()
            later = RawWatch(proxy.client_url, hasleader)  # even a new one is created
            later.close()
        finally:
            for other in others:
                os.kill(other.pid, signal.SIGCONT)
            direct.close()
            proxied.close()


# -- deploy/k8s/proxy, offline --------------------------------------------------------------

PROXY_MANIFEST = (
    Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "proxy" / "etcd-proxy.yaml"
)


def test_proxy_manifest_validates_and_uses_only_flags_grpc_proxy_knows() -> None:
    import kubernetes_validate  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    docs = list(yaml.safe_load_all(PROXY_MANIFEST.read_text()))
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("Deployment", "etcd-proxy"),
        ("Service", "etcd-proxy"),
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["grpc-proxy", "start"]
    used = {a.removeprefix("--").split("=", 1)[0] for a in container["args"][2:]}
    help_text = subprocess.run(
        [find_binary("etcd"), "grpc-proxy", "start", "--help"], capture_output=True, text=True
    )
    known = set(re.findall(r"--([a-z0-9-]+)", help_text.stdout + help_text.stderr))
    assert "trusted-ca-file" in known  # the help text was read
    assert used <= known, f"grpc-proxy does not know: {sorted(used - known)}"
    # TLS both ways: to the routers, and to the members that require client certificates.
    assert {"cert-file", "key-file", "trusted-ca-file", "cacert", "cert", "key"} <= used
    assert all(e.startswith("https://") for e in container["args"][2].split("=", 1)[1].split(","))
