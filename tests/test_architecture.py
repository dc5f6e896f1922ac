"""The package's import rules: one adapter knows the etcd client, imports flow one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "discovery"
ADAPTER = "discovery._etcd.connection"
CLIENT_MODULES = ("etcd3", "grpc", "google.protobuf")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, package: str) -> set[str]:
    """Absolute names of the modules ``source`` imports (relative to ``package`` resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            target = f"{base}.{module}".strip(".") if node.level else module
            found.add(target)
            # ``from . import x`` names a module, not an attribute
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


MODULES = {
    _module_name(p): _imports(p.read_text(), _package(p)) for p in sorted(PACKAGE.rglob("*.py"))
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_adapter_imports_the_etcd_client(module: str) -> None:
    client = {
        imported
        for imported in MODULES[module]
        if any(imported == c or imported.startswith(c + ".") for c in CLIENT_MODULES)
    }
    if module == ADAPTER:
        assert client, "the adapter is expected to be the one module using python3-etcd3"
    else:
        assert not client, f"{module} imports {sorted(client)}: only {ADAPTER} may"


def test_the_rule_sees_client_imports() -> None:
    found = _imports("import grpc\nfrom etcd3 import etcdrpc\nfrom .._port import X\n", "a.b")
    assert {"grpc", "etcd3", "a._port"} <= found


def test_package_imports_have_no_cycle() -> None:
    graph = {
        module: {i for i in imports if i in MODULES and i != module}
        for module, imports in MODULES.items()
    }
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, f"import cycle: {' -> '.join([*visiting, module])}"
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_library_never_imports_the_cli() -> None:
    for module, imports in MODULES.items():
        if module.startswith("discovery.cli") or module == "discovery.__main__":
            continue
        assert not any(i.startswith("discovery.cli") for i in imports), module


def _imported_names(source: str, package: str) -> list[tuple[str, str]]:
    """(module, name) for every ``from module import name`` of ``source``, resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module or ''}".strip(".") if node.level else node.module
            found.extend((module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names)
    return found


def _library_use_of_the_cli() -> dict[str, list[str]]:
    """What each CLI module takes from the library that is not public."""
    import discovery  # noqa: PLC0415

    private: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "cli").rglob("*.py")):
        for module, name in _imported_names(path.read_text(), _package(path)):
            if not module.startswith("discovery") or module.startswith("discovery.cli"):
                continue
            if module == "discovery" and name in discovery.__all__:
                continue  # the package's public names
            parts = module.split(".")[1:]
            if module != "discovery" and not any(p.startswith("_") for p in parts):
                continue  # a public module (discovery.testing.embedded, discovery.embedded)
            private.setdefault(_module_name(path), []).append(f"{module}:{name}")
    return private


def test_the_cli_uses_only_public_names() -> None:
    assert _library_use_of_the_cli() == {}


def test_the_public_name_rule_sees_private_imports() -> None:
    found = _imported_names("from .._launch import launch\nfrom .. import Settings\n", "a.cli")
    assert found == [("a._launch", "launch"), ("a", "Settings")]


def test_only_the_factory_and_the_package_import_the_adapter() -> None:
    importers = {module for module, imports in MODULES.items() if ADAPTER in imports}
    assert importers == {"discovery._etcd.transport", "discovery"}


def _calls(module: str, attribute: str) -> bool:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    return any(
        isinstance(node, ast.Attribute) and node.attr == attribute
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_one_watch_loop() -> None:
    """Only the list-watch loop opens watches (the port and its adapters define them)."""
    openers = {m for m in MODULES if _calls(m, "open_watch")}
    assert openers == {"discovery._etcd.reflector"}


def test_one_backoff_policy() -> None:
    """Delays come from _backoff: no other module draws jitter or builds a tenacity wait."""
    for module, imports in MODULES.items():
        if module == "discovery._backoff":
            continue
        assert not _calls(module, "uniform"), f"{module} draws its own jittered delay"
        waits = {i for i in imports if i.startswith("tenacity.wait")}
        assert not waits, f"{module} builds its own tenacity wait: {sorted(waits)}"


# The rooms (docs/architecture.md): each may import the rooms listed for it, the foundations
# and itself. The package's __init__ may import any room; the test support anything.
FOUNDATIONS = {
    "discovery._errors": {"discovery._errors"},
    "discovery._backoff": set(),
    "discovery._dispatch": set(),
    "discovery._settings": {"discovery._errors", "discovery._records"},
    "discovery._metrics": {"discovery._records"},
}
ROOMS = {
    "discovery._records": {"discovery._errors"},
    "discovery._etcd": {*FOUNDATIONS, "discovery._records"},
    "discovery._writes": {*FOUNDATIONS, "discovery._records", "discovery._etcd"},
    "discovery._reads": {*FOUNDATIONS, "discovery._records", "discovery._etcd"},
    "discovery._state": {*FOUNDATIONS, "discovery._records", "discovery._etcd", "discovery._reads"},
    "discovery._routing": {
        *FOUNDATIONS,
        *("discovery._records", "discovery._etcd", "discovery._writes", "discovery._reads"),
        "discovery._state",
    },
    "discovery._serving": {
        *FOUNDATIONS,
        *("discovery._records", "discovery._etcd", "discovery._reads", "discovery._routing"),
    },
    "discovery._engine": {
        *FOUNDATIONS,
        *("discovery._records", "discovery._etcd", "discovery._writes", "discovery._state"),
    },
}
TEST_SUPPORT = "discovery.testing"
# Old paths of the test support's public modules: shims re-exporting discovery.testing.*
SHIMS = {
    "discovery.memory",
    "discovery.embedded",
    "discovery.embedded_netns",
    "discovery.stand_in_engine",
    "discovery.stand_in_wire",
    "discovery.stand_in_coordinator",
    "discovery.stand_in_client",
}


def _room(module: str) -> str | None:
    """The room or foundation ``module`` belongs to (None: the package, the CLI, shims)."""
    for room in (*ROOMS, *FOUNDATIONS, TEST_SUPPORT):
        if module == room or module.startswith(room + "."):
            return room
    return None


def test_every_module_is_in_a_room() -> None:
    loose = {
        m
        for m in MODULES
        if _room(m) is None
        and m not in SHIMS
        and m not in {"discovery", "discovery.__main__"}
        and not m.startswith("discovery.cli")
    }
    assert not loose, f"modules outside every room: {sorted(loose)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _room(m) in {*ROOMS, *FOUNDATIONS}))
def test_rooms_import_only_the_rooms_below(module: str) -> None:
    room = _room(module)
    assert room is not None
    allowed = {room} | (ROOMS.get(room) or FOUNDATIONS[room])
    ours = {i for i in MODULES[module] if i.startswith("discovery.") and i in MODULES}
    wrong = {i for i in ours if _room(i) not in allowed}
    assert not wrong, f"{module} ({room}) imports {sorted(wrong)}; it may import {sorted(allowed)}"


def test_nothing_but_tests_the_cli_and_the_demo_imports_the_test_support() -> None:
    for module, imports in MODULES.items():
        if _room(module) == TEST_SUPPORT or module.startswith("discovery.cli") or module in SHIMS:
            continue
        support = {i for i in imports if _room(i) == TEST_SUPPORT or i in SHIMS}
        assert not support, f"{module} imports the test support: {sorted(support)}"


def test_the_room_rule_sees_a_wrong_import() -> None:
    router = "discovery._routing.router"
    assert _room(router) == "discovery._routing"
    assert "discovery._engine" not in ROOMS["discovery._routing"]
    assert _room("discovery._engine.launch") == "discovery._engine"


def test_the_architecture_doc_names_every_module() -> None:
    # docs/architecture.md's rooms name each module (in backticks) so a reader finds it.
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(PACKAGE.parent))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and f"`{path.stem}`" not in doc
    ]
    assert not unnamed, f"docs/architecture.md names no {unnamed}"
