"""Real etcd for the tests.

* ``etcd_endpoints`` (session): ``$DISCOVERY_TEST_ETCD_ENDPOINTS`` if set; else an etcd
  container through testcontainers when a Docker engine answers; else a local etcd
  binary (the path CI takes here). Tests that share it use their own namespace.
* ``etcd`` / ``etcd3`` (per test): private local members the test may kill and restart.
* ``netns_etcd3`` (per test): 3 members in network namespaces that the test may partition
  (``discovery.embedded_netns``); skipped, with the reason, where namespaces cannot be
  built (not root, no iproute2).

Every local member is checked to be gone, with its data directory (and its namespaces
and links), after the test.
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

_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"


def _docker_answers() -> bool:
    try:
        import docker  # noqa: PLC0415

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _container_etcd() -> Iterator[list[str]]:
    from testcontainers.core.container import DockerContainer  # noqa: PLC0415
    from testcontainers.core.waiting_utils import wait_for_logs  # noqa: PLC0415

    container = (
        DockerContainer(_ETCD_IMAGE)
        .with_command(
            "etcd --listen-client-urls http://0.0.0.0:2379 "
            "--advertise-client-urls http://0.0.0.0:2379"
        )
        .with_exposed_ports(2379)
    )
    with container:
        wait_for_logs(container, "ready to serve client requests", timeout=30)
        host = container.get_container_host_ip()
        yield [f"http://{host}:{container.get_exposed_port(2379)}"]


@contextlib.contextmanager
def _checked_cluster(size: int, cls=EtcdCluster, **kwargs) -> Iterator[EtcdCluster]:
    cluster = cls(size, **kwargs).start()
    base_dir = Path(cluster.base_dir)
    processes = [m.process for m in cluster.members]
    prefix = getattr(cluster, "prefix", None)
    try:
        yield cluster
    finally:
        cluster.stop()
    assert all(p is None or p.poll() is not None for p in processes), "etcd left running"
    assert not base_dir.exists(), f"etcd data directory {base_dir} left behind"
    if prefix is not None:
        assert not leftovers(prefix), f"namespaces or links left behind: {leftovers(prefix)}"


@pytest.fixture(scope="session")
def etcd_endpoints() -> Iterator[list[str]]:
    configured = os.environ.get("DISCOVERY_TEST_ETCD_ENDPOINTS")
    if configured:
        yield configured.split(",")
    elif _docker_answers():
        with _container_etcd() as endpoints:
            yield endpoints
    else:
        with _checked_cluster(1) as cluster:
            yield cluster.endpoints


def _namespace(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]
    return f"t-{name}-{os.getpid()}"


@pytest.fixture
def settings(etcd_endpoints: list[str], request: pytest.FixtureRequest) -> Settings:
    """Settings for the shared etcd, in a namespace of this test's own."""
    return Settings(endpoints=etcd_endpoints, namespace=_namespace(request), dial_timeout=10)


@pytest.fixture
def etcd() -> Iterator[EtcdCluster]:
    """A private single etcd member the test may kill and restart."""
    with _checked_cluster(1) as cluster:
        yield cluster


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    """A private 3-member etcd cluster."""
    with _checked_cluster(3) as cluster:
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
    with _checked_cluster(3, PartitionableCluster) as cluster:
        yield cluster


@pytest.fixture
def chaos_etcd3() -> Iterator[EtcdCluster]:
    """3 members in network namespaces where they can be built (so they can be cut), else on
    loopback, with a warning naming the reason (the soak then runs without partitions)."""
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"chaos soak without partitions: {reason}", pytest.PytestWarning, 2)
    with _checked_cluster(3, EtcdCluster if reason else PartitionableCluster) as cluster:
        yield cluster


@pytest.fixture
def private_settings(etcd: EtcdCluster, request: pytest.FixtureRequest) -> Settings:
    return Settings(endpoints=etcd.endpoints, namespace=_namespace(request), dial_timeout=10)
