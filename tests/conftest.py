"""Real etcd for the tests.

* ``etcd_endpoints`` (session): ``$DISCOVERY_TEST_ETCD_ENDPOINTS`` if set; else an etcd
  container of the offline image (deploy/images/) through testcontainers when a Docker
  engine answers (the path CI takes: .ci/run prepares one); else a local etcd binary.
  Tests that share it use their own namespace.
* ``etcd`` / ``etcd3`` (per test): private local members the test may kill and restart;
  ``etcd`` parametrized with ``"container"`` (``tests.containers.both_etcds``) is a
  private etcd container instead.
* ``netns_etcd3`` (per test): 3 members in network namespaces that the test may partition
  (``discovery.embedded_netns``); skipped, with the reason, where namespaces cannot be
  built (not root, no iproute2). ``chaos_etcd3``: the same where it can be built, else 3
  loopback members and a warning.

Tests marked ``docker`` need a Docker engine and the images: without them they are
skipped with the reason. Tests marked ``prometheus`` need Debian's ``prometheus`` package
(``prometheus`` and ``promtool``; .ci/prometheus.sh installs it in CI): without it they
are skipped with the reason. Under CI=true a skipped test of either kind fails the run
(the counting tests of tests/test_fixtures.py run last). Every local member is checked to
be gone, with its data directory (and its namespaces and links), after the test; every
container, to be removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery import Settings
from discovery.embedded import EtcdCluster
from discovery.embedded_netns import PartitionableCluster, leftovers, unavailable_reason

from .containers import DOCKER_OUTCOMES, ContainerEtcd, docker_problem
from .prometheus import PROMETHEUS_OUTCOMES, prometheus_problem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip Docker and Prometheus tests, with the reason, where they cannot run; count them
    last."""
    for marker, problem_of in (("docker", docker_problem), ("prometheus", prometheus_problem)):
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
    ]
    for item in counters:
        items.remove(item)
        items.append(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each Docker and Prometheus test's outcome for the tests that count them."""
    if report.when == "call" or report.outcome != "passed":
        if "docker" in report.keywords:
            DOCKER_OUTCOMES[report.nodeid] = report.outcome
        if "prometheus" in report.keywords:
            PROMETHEUS_OUTCOMES[report.nodeid] = report.outcome


@contextlib.contextmanager
def _checked_cluster(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    cluster.start()
    base_dir = cluster.base_dir
    processes = [m.process for m in cluster.members]
    prefix = cluster.prefix if isinstance(cluster, PartitionableCluster) else None
    try:
        yield cluster
    finally:
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
