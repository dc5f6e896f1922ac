"""Every public import path of before the layout still works (issue 36): the package's
names, the test support's public modules at their old paths and their new ones, and the
modules run with ``python -m``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import discovery

# Public modules as they were imported before the rooms, and where they live now.
MOVED = {
    "discovery.memory": "discovery.testing.memory",
    "discovery.embedded": "discovery.testing.embedded",
    "discovery.embedded_netns": "discovery.testing.embedded_netns",
    "discovery.stand_in_engine": "discovery.testing.stand_in_engine",
    "discovery.stand_in_wire": "discovery.testing.stand_in_wire",
    "discovery.stand_in_coordinator": "discovery.testing.stand_in_coordinator",
    "discovery.stand_in_client": "discovery.testing.stand_in_client",
}
# A few names each old path was imported for, named here so that a change shows in review.
NAMES = {
    "discovery.memory": ["MemoryEtcd", "MemoryPort"],
    "discovery.embedded": ["EtcdCluster", "EtcdGrpcProxy", "EtcdMember", "find_binary"],
    "discovery.embedded_netns": ["EngineHost", "PartitionableCluster", "sweep_stale"],
    "discovery.stand_in_engine": ["StandInCache", "default_endpoint", "main", "nested_ready"],
    "discovery.stand_in_wire": ["Headers", "pack", "unpack", "SamplingParams"],
    "discovery.stand_in_coordinator": ["StandInCoordinator", "generated_tokens"],
    "discovery.stand_in_client": ["AsyncStream", "InferenceClient", "serialize_multimodal_data"],
}


def test_every_name_of_the_package_imports() -> None:
    for name in discovery.__all__:
        assert getattr(discovery, name) is not None, name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_public_module_keeps_its_old_path(old: str) -> None:
    before, now = importlib.import_module(old), importlib.import_module(MOVED[old])
    assert set(NAMES[old]) <= set(now.__all__)
    assert list(before.__all__) == list(now.__all__)
    for name in now.__all__:
        assert getattr(before, name) is getattr(now, name), f"{old}.{name}"


@pytest.mark.external
def test_the_cli_entry_points_keep_their_paths() -> None:
    from discovery.cli import main  # noqa: PLC0415 - the console script's target

    assert callable(main)
    for module in ("discovery", "discovery.stand_in_engine", "discovery.testing.stand_in_engine"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, (module, done.stderr[-2000:])
        assert "usage" in done.stdout.lower(), module
