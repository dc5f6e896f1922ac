"""The test fixtures themselves: an external etcd when configured, else a container when
Docker answers; Docker tests run in CI; partitionable clusters cut, heal and leave nothing;
a test not marked external starts no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from discovery.testing.embedded import find_binary
from discovery.testing.embedded_netns import leftovers, sweep_stale

from .containers import DOCKER_OUTCOMES, docker_problem
from .helpers import wait_for
from .megatron_files import MEGATRON_OUTCOMES, main_problem, release_problem
from .prometheus import PROMETHEUS_OUTCOMES, prometheus_problem

ROOT = Path(__file__).resolve().parent.parent


def _revision(cluster) -> int:
    result = cluster.etcdctl("endpoint", "status", "-w", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]["Status"]["header"]["revision"]


def test_a_test_not_marked_external_cannot_start_a_process() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"starts a process \(\['true'\]\): mark it"):
        subprocess.run(["true"], check=False)


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


def test_a_cut_member_loses_its_leader_and_heals(netns_etcd3) -> None:
    cluster = netns_etcd3
    cut, *majority = cluster.members
    with cluster.partitioned(cut):
        assert cluster.is_cut(cut)
        wait_for(lambda: not cluster.has_leader(cut), timeout=15, message="the cut member's leader")
        assert wait_for(lambda: cluster.has_leader(majority[0]), timeout=15, message="a leader")
        put = wait_for(
            lambda: (
                (r := cluster.etcdctl("put", "/k", "v", endpoints=majority)).returncode == 0 and r
            ),
            timeout=15,
            message="a write on the majority",
        )
        assert put.stdout.strip() == "OK"
        # Clients still reach the cut member; it serves its own, older state.
        stale = cluster.etcdctl("get", "/k", "--consistency=s", endpoints=[cut])
        assert stale.returncode == 0 and stale.stdout == ""
    assert not cluster.is_cut(cut)
    cluster.wait_healthy(members=[cut])
    wait_for(
        lambda: (
            cluster.etcdctl("get", "/k", "--consistency=s", endpoints=[cut]).stdout == "/k\nv\n"
        ),
        timeout=15,
        message="the healed member to catch up",
    )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def test_an_engine_host_reaches_etcd_until_cut(netns_etcd3, tmp_path: Path) -> None:
    """An engine host's processes reach the members at their usual URLs and are reached
    from the root namespace; cut() takes etcd away (clients=True: the root too)."""
    cluster = netns_etcd3
    host = cluster.add_host()
    ctl = [*host.wrapper, find_binary("etcdctl"), "--endpoints", ",".join(cluster.endpoints),
           "--dial-timeout", "1s", "--command-timeout", "1s"]  # fmt: skip

    def etcd_answers() -> bool:
        put = subprocess.run([*ctl, "put", "/k", "v"], capture_output=True, timeout=30, check=False)
        return put.returncode == 0

    server = subprocess.Popen(
        [*host.wrapper, sys.executable, "-m", "http.server", "--bind", host.address, "8000"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://{host.address}:8000/"
    try:
        assert wait_for(etcd_answers, timeout=15, message="etcd from the host")
        wait_for(lambda: _answers(url), timeout=15, message="the host's server from the root")
        host.cut()
        assert not etcd_answers()
        assert _answers(url)  # only etcd is cut off
        host.cut(clients=True)
        assert not _answers(url)
        host.heal()
        assert _answers(url)
        assert wait_for(etcd_answers, timeout=15, message="etcd from the healed host")
    finally:
        server.kill()
        server.wait(10)


_OWNER = """
import sys, time
from discovery.testing.embedded_netns import PartitionableCluster
cluster = PartitionableCluster(3).start()
pids = [m.pid for m in cluster.members] + [cluster.network._reaper.pid]
print(cluster.prefix, *pids, flush=True)
time.sleep(600)
"""


def _kill_owner(*, reaper_too: bool) -> tuple[str, list[int]]:
    """Start a cluster in a child process, SIGKILL the child: (its prefix, member + reaper pids)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        prefix, *pids = owner.stdout.readline().split()
        assert leftovers(prefix), "the child built no namespaces"
        if reaper_too:
            os.kill(int(pids[-1]), signal.SIGKILL)
    finally:
        owner.kill()
        owner.wait(10)
        owner.stdout.close()
    return prefix, [int(pid) for pid in pids]


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie is gone too
    except FileNotFoundError:
        return True


@pytest.mark.external  # network namespaces, an owner process
def test_a_killed_owner_leaves_no_namespace_behind(netns_available) -> None:
    """The owner is SIGKILLed, so no finally block runs: its reaper removes everything."""
    prefix, pids = _kill_owner(reaper_too=False)
    wait_for(lambda: not leftovers(prefix), timeout=20, message=f"{prefix} namespaces removed")
    wait_for(lambda: all(_gone(pid) for pid in pids), message="etcd members and reaper gone")


@pytest.mark.external  # network namespaces, etcd
def test_leftovers_of_a_dead_owner_are_swept_at_the_next_start(netns_available) -> None:
    """Owner and reaper both SIGKILLed: the next start sweeps what they left."""
    prefix, pids = _kill_owner(reaper_too=True)
    wait_for(lambda: all(_gone(pid) for pid in pids), message="members die with their owner")
    assert leftovers(prefix), "nothing was left to sweep"
    assert prefix in sweep_stale()
    assert not leftovers(prefix)


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


@pytest.mark.counts_prometheus_tests
def test_every_prometheus_test_ran_in_ci(request: pytest.FixtureRequest) -> None:
    """Runs last (conftest). Under CI=true, a skipped Prometheus test fails CI, whatever
    skipped it (no promtool, or no network namespaces for the partition)."""
    collected = [i.nodeid for i in request.session.items if i.get_closest_marker("prometheus")]
    skipped = sorted(n for n in collected if PROMETHEUS_OUTCOMES.get(n) == "skipped")
    ran = [n for n in collected if PROMETHEUS_OUTCOMES.get(n) in ("passed", "failed")]
    print(f"Prometheus tests: {len(collected)} collected, {len(ran)} ran, {len(skipped)} skipped")
    if os.environ.get("CI") == "true":
        assert not skipped, f"CI skipped {skipped}: {prometheus_problem()}"
        assert len(ran) == len(collected), sorted(set(collected) - set(ran))
    elif skipped:
        pytest.skip(f"{len(skipped)} Prometheus tests skipped: {prometheus_problem()}")


@pytest.mark.counts_megatron_tests
def test_every_megatron_test_ran_in_ci(request: pytest.FixtureRequest) -> None:
    """Runs last (conftest). Under CI=true, a skipped Megatron test (main's files or the
    released wheel absent) fails CI."""
    marks = ("megatron", "megatron_release")
    items = request.session.items
    collected = [i.nodeid for i in items if any(i.get_closest_marker(m) for m in marks)]
    skipped = sorted(n for n in collected if MEGATRON_OUTCOMES.get(n) == "skipped")
    ran = [n for n in collected if MEGATRON_OUTCOMES.get(n) in ("passed", "failed")]
    print(f"Megatron tests: {len(collected)} collected, {len(ran)} ran, {len(skipped)} skipped")
    problems = "; ".join(p for p in (main_problem(), release_problem()) if p)
    if os.environ.get("CI") == "true":
        assert collected, "CI collected no Megatron test"
        assert not skipped, f"CI skipped {len(skipped)} Megatron tests: {problems}"
        assert len(ran) == len(collected), sorted(set(collected) - set(ran))
    elif skipped:
        pytest.skip(f"{len(skipped)} Megatron tests skipped: {problems}")
