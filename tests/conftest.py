"""The etcd of the tests: real members, or the in-memory one; and the two test tiers.

* ``etcd_endpoints`` (session): ``$DISCOVERY_TEST_ETCD_ENDPOINTS`` if set; else an etcd
  container of the offline image (deploy/images/) through testcontainers when a Docker
  engine answers (the path CI takes: .ci/run prepares one); else a local etcd binary.
  Tests that share it use their own namespace.
* ``etcd`` / ``etcd3`` (per test): private local members the test may kill and restart;
  ``etcd`` parametrized with ``"container"`` (``tests.containers.both_etcds``) is a
  private etcd container instead.
* ``netns_etcd3`` (per test): 3 members in network namespaces that the test may partition
  (``discovery.testing.embedded_netns``); skipped, with the reason, where namespaces cannot be
  built (not root, no iproute2). ``chaos_etcd3``: the same where it can be built, else 3
  loopback members and a warning.
* ``memory_etcd``: an etcd in memory (``discovery.testing.memory``), no process. ``store`` runs
  a test twice, on the memory port and on the shared etcd (``private_store``: on a
  private member the test may stop); see ``Store``.

Tests marked ``megatron`` need Megatron-LM's real files, ``megatron_release`` the released
megatron-core (``tests/megatron_files.py``): without them they are skipped with the reason,
and under CI=true a skipped one fails the run. Tests marked ``docker`` need a Docker
engine and the images: without them they are skipped with the reason. Tests marked
``prometheus`` need Debian's ``prometheus`` package
(``prometheus`` and ``promtool``; .ci/prometheus.sh installs it in CI): without it they
are skipped with the reason. Under CI=true a skipped test of either kind fails the run
(the counting tests of tests/test_fixtures.py run last). Every local member is checked to
be gone, with its data directory (and its namespaces and links), after the test; every
container, to be removed.

A test that uses one of the real-etcd fixtures above (directly or through another, like
``settings``) or is marked ``docker`` or ``prometheus`` is marked ``external`` here; a test
that starts a process itself carries the mark in its module. The quick tier (``./dev test
--quick``) is ``-m "not external"``; a test without the mark that starts a process fails,
saying so.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from discovery import Connection, EtcdPort, Settings
from discovery._etcd.port import KeyValue
from discovery.testing.embedded import EtcdCluster
from discovery.testing.embedded_netns import PartitionableCluster, leftovers, unavailable_reason
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .containers import DOCKER_OUTCOMES, ContainerEtcd, docker_problem
from .megatron_files import MEGATRON_OUTCOMES, main_problem, release_problem
from .prometheus import PROMETHEUS_OUTCOMES, prometheus_problem

# The fixtures of this module that start etcd: a test using one is marked external.
PROCESS_FIXTURES = frozenset({"etcd_endpoints", "etcd", "etcd3", "netns_etcd3", "chaos_etcd3"})


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """Mark tests external (before ``-m`` selects); then, among the selected tests, skip
    Docker and Prometheus tests, with the reason, where they cannot run; count them last."""
    for item in items:
        uses = getattr(item, "fixturenames", ())
        marked = item.get_closest_marker("docker") or item.get_closest_marker("prometheus")
        if marked or PROCESS_FIXTURES.intersection(uses):
            item.add_marker(pytest.mark.external)
    yield
    for marker, problem_of in (
        ("docker", docker_problem),
        ("prometheus", prometheus_problem),
        ("megatron", main_problem),
        ("megatron_release", release_problem),
    ):
        marked = [item for item in items if item.get_closest_marker(marker)]
        problem = problem_of() if marked else None
        if problem:
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=f"{marker} test: {problem}"))
    # The tests that count the Docker and the Prometheus tests run after all of them.
    counters = [
        item
        for item in items
        if item.get_closest_marker("counts_docker_tests")
        or item.get_closest_marker("counts_prometheus_tests")
        or item.get_closest_marker("counts_megatron_tests")
    ]
    for item in counters:
        items.remove(item)
        items.append(item)


@pytest.fixture(autouse=True)
def _no_process_unless_external(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test not marked external fails if it starts a process (from any thread)."""
    if request.node.get_closest_marker("external"):
        yield
        return
    elsewhere: list[object] = []

    def refuse(self: subprocess.Popen[bytes], args: object, *_: object, **__: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            elsewhere.append(args)  # an exception there would not fail the test
        pytest.fail(f"this test starts a process ({args!r}): mark it external", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
    if elsewhere:
        pytest.fail(f"this test starts a process ({elsewhere[0]!r}): mark it external")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each Docker and Prometheus test's outcome for the tests that count them."""
    if report.when == "call" or report.outcome != "passed":
        if "docker" in report.keywords:
            DOCKER_OUTCOMES[report.nodeid] = report.outcome
        if "prometheus" in report.keywords:
            PROMETHEUS_OUTCOMES[report.nodeid] = report.outcome
        if "megatron" in report.keywords or "megatron_release" in report.keywords:
            MEGATRON_OUTCOMES[report.nodeid] = report.outcome


@contextlib.contextmanager
def _checked_cluster(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    cluster.start()
    base_dir = cluster.base_dir
    processes = [m.process for m in cluster.members]
    prefix = cluster.prefix if isinstance(cluster, PartitionableCluster) else None
    try:
        yield cluster
    finally:
        # Members the test added (add_member) and removed must be gone too.
        processes += [m.process for m in (*cluster.members, *cluster.removed)]
        cluster.stop()
    assert all(p is None or p.poll() is not None for p in processes), "etcd left running"
    assert not base_dir or not Path(base_dir).exists(), f"etcd data {base_dir} left behind"
    if isinstance(cluster, ContainerEtcd):
        assert not cluster.containers_left(), "etcd container left behind"
    if prefix is not None:
        assert not leftovers(prefix), f"namespaces or links left behind: {leftovers(prefix)}"


@pytest.fixture(scope="session")
def etcd_endpoints() -> Iterator[list[str]]:
    configured = os.environ.get("DISCOVERY_TEST_ETCD_ENDPOINTS")
    if configured:
        yield configured.split(",")
        return
    cluster = ContainerEtcd() if docker_problem() is None else EtcdCluster(1)
    with _checked_cluster(cluster):
        yield cluster.endpoints


def _namespace(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]
    return f"t-{name}-{os.getpid()}"


@pytest.fixture
def settings(etcd_endpoints: list[str], request: pytest.FixtureRequest) -> Settings:
    """Settings for the shared etcd, in a namespace of this test's own."""
    return Settings(endpoints=etcd_endpoints, namespace=_namespace(request), dial_timeout=10)


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    """A private single etcd member the test may kill and restart (a process, or a
    container when parametrized with ``"container"``)."""
    kind = getattr(request, "param", "process")
    with _checked_cluster(ContainerEtcd() if kind == "container" else EtcdCluster(1)) as cluster:
        yield cluster


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    """A private 3-member etcd cluster."""
    with _checked_cluster(EtcdCluster(3)) as cluster:
        yield cluster


@pytest.fixture
def netns_available() -> None:
    """Skip, saying why, where network namespaces cannot be built (never a silent pass)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"partition test skipped: {reason}")


@pytest.fixture
def netns_etcd3(netns_available: None) -> Iterator[PartitionableCluster]:
    """A private 3-member cluster, one network namespace per member: cut() / heal() them."""
    with _checked_cluster(PartitionableCluster(3)) as cluster:
        assert isinstance(cluster, PartitionableCluster)
        yield cluster


@pytest.fixture
def chaos_etcd3() -> Iterator[EtcdCluster]:
    """3 members in network namespaces where they can be built (so they can be cut), else on
    loopback, with a warning naming the reason (the soak then runs without partitions)."""
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"chaos soak without partitions: {reason}", pytest.PytestWarning, 2)
    with _checked_cluster(EtcdCluster(3) if reason else PartitionableCluster(3)) as cluster:
        yield cluster


@pytest.fixture
def private_settings(etcd: EtcdCluster, request: pytest.FixtureRequest) -> Settings:
    return Settings(endpoints=etcd.endpoints, namespace=_namespace(request), dial_timeout=10)


@pytest.fixture
def memory_etcd() -> Iterator[MemoryEtcd]:
    """An etcd in memory, closed after the test."""
    with MemoryEtcd() as etcd:
        yield etcd


# Parameters of a fixture that runs a test in memory (the quick tier) and on real etcd.
STORES = ["memory", pytest.param("etcd", marks=pytest.mark.external)]


class Store:
    """The etcd a test runs on (``name``: ``"memory"`` or ``"etcd"``), as the package and
    the test reach it.

    ``settings`` name the test's own namespace. ``connection()`` is what to pass as
    ``connection=`` where the package would otherwise build its own client: None on real
    etcd (the package then builds one from ``settings``, as in production), a new client of
    the shared ``MemoryEtcd`` in memory. ``port`` is the test's own client, for what it
    does behind the package's back (writes, deletes, revokes, reads). A ``private_store``
    also has ``down()`` and ``up()``: etcd unreachable (a killed member, an outage) and back.
    """

    down: Callable[[], object]
    up: Callable[[], object]

    def __init__(self, name: str, settings: Settings, client: Callable[[], EtcdPort]) -> None:
        self.name = name
        self.settings = settings
        self._client = client
        self._clients: list[EtcdPort] = []
        self.port = self.client()

    def client(self) -> EtcdPort:
        """Another client of this etcd, closed after the test."""
        port = self._client()
        self._clients.append(port)
        return port

    def connection(self) -> EtcdPort | None:
        """``connection=`` for the package: None on real etcd, a new client in memory."""
        return self.client() if self.name == "memory" else None

    def using(self) -> dict[str, Any]:
        """``settings=`` and ``connection=`` for a call of the package."""
        return {"settings": self.settings, "connection": self.connection()}

    def get(self, key: str) -> KeyValue | None:
        """``key`` as stored now (retried while etcd does not answer)."""
        return self.port.call(lambda: self.port.get(key))

    def close(self) -> None:
        for port in self._clients:
            port.close()


def _memory_store(request: pytest.FixtureRequest, etcd: MemoryEtcd) -> Store:
    return Store("memory", Settings(namespace=_namespace(request)), lambda: MemoryPort(etcd))


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The test in memory, then on the shared etcd (in the test's namespace)."""
    if request.param == "memory":
        store = _memory_store(request, request.getfixturevalue("memory_etcd"))
    else:
        settings: Settings = request.getfixturevalue("settings")
        store = Store("etcd", settings, lambda: Connection(settings))
    yield store
    store.close()


@pytest.fixture(params=STORES)
def private_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The test in memory, then on a private etcd member; ``down()`` kills it, ``up()``
    starts it again."""
    if request.param == "memory":
        etcd: MemoryEtcd = request.getfixturevalue("memory_etcd")
        store = _memory_store(request, etcd)
        store.down, store.up = etcd.outage, etcd.restore
    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd")
        settings: Settings = request.getfixturevalue("private_settings")
        store = Store("etcd", settings, lambda: Connection(settings))
        member = cluster.members[0]
        store.down = lambda: member.stop(kill=True)
        store.up = lambda: (member.start(), cluster.wait_healthy())
    yield store
    store.close()
