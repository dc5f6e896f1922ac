"""etcd in a container, for the tests: the offline image of deploy/images/, via testcontainers.

``docker_problem()`` says why Docker tests cannot run here (None when they can): no
Docker engine answers, or the images of ``deploy/images/build.sh`` are missing. Tests
that need Docker are marked ``docker``; conftest skips them with that reason, and in CI
(``CI=true``) a skipped Docker test fails the run (tests/test_fixtures.py).

``ContainerEtcd`` is an ``EtcdCluster`` of one member that runs in a container, so the
tests that kill and restart etcd run unchanged against it (``both_etcds``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from discovery.testing.embedded import EtcdCluster, EtcdMember, _free_ports

REPO = Path(__file__).resolve().parent.parent
IMAGES_ENV = REPO / "deploy" / "images" / "images.env"

# node id -> outcome of each Docker test run so far (conftest records them).
DOCKER_OUTCOMES: dict[str, str] = {}

# No Ryuk reaper: its image cannot be pulled here. Every container is removed by the
# fixture that made it (and .ci/run removes its whole private engine).
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")


def image_names() -> dict[str, str]:
    """The NAME=value lines of deploy/images/images.env."""
    names = {}
    for line in IMAGES_ENV.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            names[name] = value
    return names


@functools.cache
def docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None when they can."""
    import docker  # noqa: PLC0415 - only when asked

    where = os.environ.get("DOCKER_HOST", "the default socket")
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:
        return f"no Docker engine answers at {where} ({type(exc).__name__})"
    images = image_names()
    missing = []
    for name in (images["IMAGE_ETCD"], images["IMAGE_DISCOVERY"]):
        try:
            client.images.get(name)
        except docker.errors.ImageNotFound:
            missing.append(name)
    client.close()
    if missing:
        return f"images {', '.join(missing)} missing: run deploy/images/build.sh"
    return None


class ContainerMember(EtcdMember):
    """The member of a ContainerEtcd: an etcd container with its client port on loopback.

    ``stop`` keeps the container (and so its data); ``start`` starts it again on the
    same port. ``remove`` deletes it.
    """

    def __init__(self, cluster: ContainerEtcd, image: str) -> None:
        port = _free_ports(1)[0]
        super().__init__(cluster, "container", port, 0)
        from testcontainers.core.container import DockerContainer  # noqa: PLC0415

        self.container = DockerContainer(image).with_command(
            [
                "etcd",
                "--name=container",
                "--data-dir=/var/lib/etcd",
                "--listen-client-urls=http://0.0.0.0:2379",
                f"--advertise-client-urls={self.client_url}",
            ]
        )
        # Published on loopback only (with_bind_ports would publish on every address).
        self.container.ports["2379/tcp"] = ("127.0.0.1", port)  # type: ignore[assignment]
        self.container_id: str | None = None

    @property
    def running(self) -> bool:
        if self.container_id is None:
            return False
        self.container.reload()
        return self.container.status == "running"

    def start(self) -> None:
        """Create and start the container, or start the stopped one again."""
        if self.container_id is None:
            self.container_id = self.container.start().get_container_id()
        elif not self.running:
            self.container.get_wrapped_container().start()

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """``docker kill`` (SIGKILL) or ``docker stop``; the container and its data stay."""
        if self.running:
            wrapped = self.container.get_wrapped_container()
            if kill:
                wrapped.kill()
            else:
                wrapped.stop(timeout=int(timeout))
            wrapped.wait(timeout=timeout + 10)

    def remove(self) -> None:
        """Delete the container and its anonymous volumes."""
        if self.container_id is not None:
            self.container.stop(force=True, delete_volume=True)
            self.container_id = None

    def log_tail(self, lines: int = 20) -> str:
        if self.container_id is None:
            return ""
        out = self.container.get_wrapped_container().logs(tail=lines)
        return out.decode(errors="replace")


class ContainerEtcd(EtcdCluster):
    """One etcd member in a container of the offline image (``IMAGE_ETCD``)."""

    def __init__(self, image: str | None = None) -> None:
        super().__init__(1)
        self.image = image or image_names()["IMAGE_ETCD"]
        self.ids: list[str] = []  # every container made, for containers_left()

    def _start_once(self, timeout: float) -> None:
        self.stop()
        member = ContainerMember(self, self.image)
        self.members = [member]
        member.start()
        assert member.container_id is not None
        self.ids.append(member.container_id)
        self.wait_healthy(timeout)

    def stop(self) -> None:
        """Remove the container. Idempotent."""
        for member in self.members:
            assert isinstance(member, ContainerMember)
            member.remove()

    def containers_left(self) -> list[str]:
        """Ids of the containers this cluster made that still exist."""
        import docker  # noqa: PLC0415

        client = docker.from_env()
        try:
            existing = {c.id for c in client.containers.list(all=True)}
        finally:
            client.close()
        return [i for i in self.ids if i in existing]


# Runs a test (one that uses the ``etcd`` fixture) against a local etcd process and,
# marked ``docker``, against an etcd container.
both_etcds = pytest.mark.parametrize(
    "etcd", ["process", pytest.param("container", marks=pytest.mark.docker)], indirect=True
)
