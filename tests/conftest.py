"""Real etcd for the tests.

* ``etcd_endpoints`` (session): ``$DISCOVERY_TEST_ETCD_ENDPOINTS`` if set; else an etcd
  container through testcontainers when a Docker engine answers; else a local etcd
  binary (the path CI takes here). Tests that share it use their own namespace.
* ``etcd`` / ``etcd3`` (per test): private local members the test may kill and restart.

Every local member is checked to be gone, with its data directory, after the test.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery import Settings
from discovery.embedded import EtcdCluster

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
def _checked_cluster(size: int, **kwargs) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(size, **kwargs).start()
    base_dir = Path(cluster.base_dir)
    processes = [m.process for m in cluster.members]
    try:
        yield cluster
    finally:
        cluster.stop()
    assert all(p is None or p.poll() is not None for p in processes), "etcd left running"
    assert not base_dir.exists(), f"etcd data directory {base_dir} left behind"


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
def private_settings(etcd: EtcdCluster, request: pytest.FixtureRequest) -> Settings:
    return Settings(endpoints=etcd.endpoints, namespace=_namespace(request), dial_timeout=10)
