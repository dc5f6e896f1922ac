"""Megatron's real files in the tests: where they are, and importing them with the shims.

Two sources, each a directory holding ``megatron/core/inference/inference_client.py``:

* **main**: Megatron-LM's files at main d98e8a64 (the client, the headers, the sampling
  parameters, its OpenAI-compatible server). ``$DISCOVERY_TEST_MEGATRON`` names the
  directory; else ``shared/megatron/d98e8a64`` beside the repository or one of its parents
  (``../shared``, where CI has it).
* **release**: the newest ``megatron-core`` wheel on the package index (``RELEASE``),
  installed without its dependencies (it needs torch) by ``./dev`` into
  ``.venv/megatron-core-<version>``; ``$DISCOVERY_TEST_MEGATRON_RELEASE`` names another.

Tests marked ``megatron`` need main's files, ``megatron_release`` the wheel: conftest skips
them with the reason where they are absent, and under CI=true a skipped one fails the run
(tests/test_fixtures.py). Neither is edited: ``tests/megatron_shims/`` (its README lists
each shim) goes first on the path, for what cannot import without torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIMS = Path(__file__).resolve().parent / "megatron_shims"
MAIN_COMMIT = "d98e8a64"
RELEASE = "0.16.1"
"""The newest megatron-core on the package index (./dev installs this one)."""

# node id -> outcome of each Megatron test run so far (conftest records them).
MEGATRON_OUTCOMES: dict[str, str] = {}
_CLIENT = Path("megatron", "core", "inference", "inference_client.py")


def main_root() -> Path:
    """Where main's files should be (they may be absent: ``main_problem`` says).

    ``shared/megatron/<commit>`` beside the repository, or beside one of its parents (a clone
    made in a folder of its own, as CI makes it); the one beside the repository if none is.
    """
    configured = os.environ.get("DISCOVERY_TEST_MEGATRON")
    if configured:
        return Path(configured)
    beside = [parent / "shared" / "megatron" / MAIN_COMMIT for parent in ROOT.parents]
    return next((root for root in beside if (root / _CLIENT).is_file()), beside[0])


def release_root() -> Path:
    """Where the released wheel should be unpacked (``release_problem`` says if it is not)."""
    configured = os.environ.get("DISCOVERY_TEST_MEGATRON_RELEASE")
    return Path(configured) if configured else ROOT / ".venv" / f"megatron-core-{RELEASE}"


def _problem(root: Path, what: str, how: str) -> str | None:
    if (root / _CLIENT).is_file():
        return None
    return f"no {what} at {root} (no {_CLIENT}): {how}"


def main_problem() -> str | None:
    """Why main's files cannot be used here, or None."""
    return _problem(
        main_root(),
        f"Megatron-LM files of main {MAIN_COMMIT}",
        "set DISCOVERY_TEST_MEGATRON to a directory holding them",
    )


def release_problem() -> str | None:
    """Why the released wheel cannot be used here, or None."""
    return _problem(
        release_root(),
        f"megatron-core {RELEASE}",
        f"./dev installs it (pip install --no-deps --target {release_root()} "
        f"megatron-core=={RELEASE}), or set DISCOVERY_TEST_MEGATRON_RELEASE",
    )


def python_path(root: Path) -> str:
    """``PYTHONPATH`` for a process that imports Megatron's files from ``root``."""
    return os.pathsep.join([str(SHIMS), str(root)])


def _forget() -> None:
    for name in list(sys.modules):
        if name in ("megatron", "torch") or name.startswith(("megatron.", "torch.")):
            del sys.modules[name]


@contextlib.contextmanager
def importable(root: Path) -> Iterator[None]:
    """Megatron's files from ``root`` (and the shims) importable in this process, then not.

    The modules are forgotten on the way in and out, so main's and the release's never mix.
    """
    _forget()
    entries = [str(SHIMS), str(root)]
    sys.path[:0] = entries
    try:
        yield
    finally:
        for entry in entries:
            sys.path.remove(entry)
        _forget()
