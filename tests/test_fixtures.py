"""The test fixtures themselves: an external etcd is used when configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
