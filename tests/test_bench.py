"""The benchmarks (issue 44 item 7): each imports, and bench/run_all.py runs every one."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("bench_*.py"))


@pytest.fixture(scope="module")
def bench_path() -> Iterator[None]:
    """bench/ on the import path, as when a benchmark runs as a script."""
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def _bench_extra() -> set[str]:
    """The import names of pyproject's ``bench`` extra (the peers and the plotting)."""
    extras = tomllib.loads((BENCH.parent / "pyproject.toml").read_text(encoding="utf-8"))
    names = extras["project"]["optional-dependencies"]["bench"]
    return {re.split(r"[<>=\[]", name)[0].replace("-", "_") for name in names}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_imports(bench_path: None, script: str) -> None:
    """A benchmark whose imports moved (issue 44: bench_latency.py) fails here, not at run.

    Only a package of the ``bench`` extra missing (not installed with ``test``) skips.
    """
    try:
        module = importlib.import_module(script)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in _bench_extra():
            raise
        pytest.skip(f"{script} needs {error.name} (pip install -e '.[bench]')")
    assert callable(module.main)


def test_run_all_lists_every_benchmark(bench_path: None) -> None:
    run_all = importlib.import_module("run_all")
    assert sorted(f"bench_{name}" for name in run_all.BENCHMARKS) == SCRIPTS


def test_run_all_quick_runs_record_nothing(bench_path: None) -> None:
    """--quick must never replace a recorded section: each quick command says so."""
    run_all = importlib.import_module("run_all")
    for name, (_, small) in run_all.BENCHMARKS.items():
        assert "--no-results" in small or name in ("router", "routing_quality"), name


@pytest.mark.parametrize(
    ("value", "limit", "unit", "shown"),
    [
        (1.004, 1.0, "x", "1.004 x <= 1.00: MISSED"),
        (1.48, 1.2, "x", "1.48 x <= 1.20: MISSED"),
        (1.0, 1.0, "x", "1.00 x <= 1.00: met"),
        (3.2, 5.0, "µs", "3.2 µs <= 5: met"),
    ],
)
def test_target_ratio_shows_its_verdict(
    bench_path: None, value: float, limit: float, unit: str, shown: str
) -> None:
    """Enough digits that the verdict reads from the figures (not "1 x <= 1 x: MISSED")."""
    target = importlib.import_module("_common").Target("t", value, limit, unit)
    assert target.line() == f"target t: {shown}"
