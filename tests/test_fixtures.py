"""The test fixtures themselves: an external etcd when configured, else a container when
Docker answers; Docker tests run in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .containers import DOCKER_OUTCOMES, docker_problem

ROOT = Path(__file__).resolve().parent.parent


def _revision(cluster) -> int:
    result = cluster.etcdctl("endpoint", "status", "-w", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]["Status"]["header"]["revision"]


def test_configured_endpoints_are_used_instead_of_a_new_etcd(etcd) -> None:
    before = _revision(etcd)
    env = {**os.environ, "DISCOVERY_TEST_ETCD_ENDPOINTS": ",".join(etcd.endpoints)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_registration.py::test_close_revokes_the_lease_and_is_idempotent",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _revision(etcd) > before  # the registration was written to *this* etcd


def test_leadership_moves_to_the_member_asked_for(etcd3) -> None:
    for member in [m for m in etcd3.members if m is not etcd3.leader()]:
        etcd3.move_leader(member)
        assert etcd3.leader() is member
    etcd3.move_leader(etcd3.leader())  # already the leader: nothing to do


@pytest.mark.docker
def test_the_shared_etcd_is_the_container_when_docker_answers(etcd_endpoints) -> None:
    if os.environ.get("DISCOVERY_TEST_ETCD_ENDPOINTS"):
        pytest.skip("DISCOVERY_TEST_ETCD_ENDPOINTS names the shared etcd")
    import docker  # noqa: PLC0415

    port = etcd_endpoints[0].rsplit(":", 1)[1]
    client = docker.from_env()
    try:
        published = [
            binding
            for container in client.containers.list()
            for binding in (container.ports.get("2379/tcp") or [])
        ]
    finally:
        client.close()
    assert {"HostIp": "127.0.0.1", "HostPort": port} in published


@pytest.mark.counts_docker_tests
def test_every_docker_test_ran_in_ci(request: pytest.FixtureRequest) -> None:
    """Runs last (conftest). Under CI=true, a skipped or missing Docker test fails CI."""
    collected = [i.nodeid for i in request.session.items if i.get_closest_marker("docker")]
    skipped = sorted(n for n in collected if DOCKER_OUTCOMES.get(n) == "skipped")
    ran = [n for n in collected if DOCKER_OUTCOMES.get(n) in ("passed", "failed")]
    print(f"Docker tests: {len(collected)} collected, {len(ran)} ran, {len(skipped)} skipped")
    if os.environ.get("CI") == "true":
        assert collected, "CI collected no Docker test"
        assert not skipped, f"CI skipped {len(skipped)} Docker tests: {docker_problem()}"
        assert len(ran) == len(collected), sorted(set(collected) - set(ran))
    elif skipped:
        pytest.skip(f"{len(skipped)} Docker tests skipped: {docker_problem()}")
