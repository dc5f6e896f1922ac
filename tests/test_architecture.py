"""The package's import rules: one adapter knows the etcd client, imports flow one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "discovery"
ADAPTER = "discovery._connection"
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
