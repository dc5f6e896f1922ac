"""README and the documentation site: examples run as written, the site builds with no broken
link or missing reference, and the public surface is exactly as intended and documented."""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import discovery
from discovery import Settings, register_engine
from discovery._records.record import STORED
from discovery._settings import env_names
from discovery.cli import build_parser

from .helpers import cli_env, make_endpoint, run_python

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# Pages whose examples another test runs, checking what they print.
EXAMPLES_RUN_ELSEWHERE = {"routing.md": "tests/test_router.py"}

INTENDED = {
    # records (Megatron-compatible) and the stored form
    "PrefixCachingCoordinatorPolicy",
    "InferenceEngineCapabilities",
    "InferenceEngineEndpoint",
    "EngineRecord",
    "EngineStatus",
    "KeySpace",
    "DEFAULT_ROOT",
    "DEFAULT_NAMESPACE",
    "MAX_VALUE_BYTES",
    "record_schema",
    "UnknownValue",
    # prefill/decode hand-off: what the record says, and which pairs can hand off
    "EngineRole",
    "KvTransferBackend",
    "KvLayout",
    "HandoffKey",
    "handoff_key",
    "handoff_problem",
    # settings and connection
    "Settings",
    "Metrics",
    "MetricsHooks",
    "Connection",
    "EtcdPort",
    # registration
    "register_engine",
    "register_dynamic_engine",
    "aregister_engine",
    "default_engine_id",
    "deregister_on_signals",
    "drain_and_close",
    "StopSignals",
    "deregister",
    "drain",
    "undrain",
    "pause",
    "resume",
    "Session",
    "Registration",
    "RegistrationState",
    "RegistrationHealth",
    # automatic registration on engine start (Megatron's engine events)
    "EngineEventReceiver",
    "EngineStates",
    "EngineState",
    "EngineStatesHealth",
    "block_hashes",
    "launch",
    "ReceiverState",
    "ReceiverHealth",
    # watching and routing
    "EndpointWatcher",
    "EndpointEvent",
    "EventType",
    "WatcherHealth",
    "WatcherState",
    "RoutingTable",
    "watch_table",
    "list_engines",
    "EngineListing",
    "ListedEngine",
    "RoutingSnapshot",
    "Selector",
    "Router",
    "RouterHealth",
    "RoutingPolicy",
    "PickHandle",
    "PickPair",
    # the fleet client: Megatron requests through the router
    "FleetClient",
    "ControlResult",
    "RequestLostError",
    # Megatron's InferenceClient over the fleet, from one string naming it
    "FleetInferenceClient",
    "FleetAddress",
    "parse_fleet",
    # discovery serve: Megatron's OpenAI server over the fleet
    "ServeOptions",
    "serve_fleet",
    "Explanation",
    # routing policies: the protocol, what it sees, the built-in classes
    "Policy",
    "Candidate",
    "PickRequest",
    "Choice",
    "RoundRobinPolicy",
    "LoadBalancedPolicy",
    "FirstPrefixBlockPolicy",
    "LongestPrefixPolicy",
    "SessionPolicy",
    "Split",
    # errors
    "DiscoveryError",
    "ConfigurationError",
    "InvalidRecordError",
    "RecordDecodeError",
    "InvalidSelectorError",
    "EtcdError",
    "EtcdUnavailableError",
    "EtcdNoSpaceError",
    "RequestTooLargeError",
    "PermissionDeniedError",
    "EngineConflictError",
    "NoEngineAvailableError",
    "OverloadedError",
    "NotACandidateError",
    "ClosedError",
    "__version__",
}


def test_exported_names_are_exactly_the_intended_ones() -> None:
    assert set(discovery.__all__) == INTENDED
    assert len(discovery.__all__) == len(set(discovery.__all__))
    for name in discovery.__all__:
        assert hasattr(discovery, name), name


def test_every_public_name_is_documented_and_typed() -> None:
    for name in sorted(
        INTENDED - {"__version__", "DEFAULT_ROOT", "DEFAULT_NAMESPACE", "MAX_VALUE_BYTES"}
    ):
        obj = getattr(discovery, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if inspect.isfunction(obj):
            hints = inspect.signature(obj)
            assert hints.return_annotation is not inspect.Signature.empty, name
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member):
                    continue
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


@pytest.mark.external  # a fresh interpreter
@pytest.mark.parametrize(
    "module",
    [
        "discovery.testing.embedded",
        "discovery.testing.memory",
        "discovery.testing.stand_in_engine",
        "discovery.testing.stand_in_wire",
        "discovery.testing.stand_in_coordinator",
        "discovery.testing.stand_in_client",
    ],
)
def test_test_support_modules_are_not_imported_by_the_library(module: str) -> None:
    code = f"import discovery, sys; print({module!r} in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_memory_port_is_documented() -> None:
    import discovery.testing.memory  # noqa: PLC0415

    assert inspect.getdoc(discovery.testing.memory)
    for name in discovery.testing.memory.__all__:
        cls = getattr(discovery.testing.memory, name)
        assert inspect.getdoc(cls), f"{name} has no docstring"
        for attr, member in vars(cls).items():
            if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


def test_readme_opens_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["./dev demo", "./dev test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line.startswith("./")] == ["./dev test"]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks(README))))
def test_readme_examples_run(index: int, settings: Settings) -> None:
    # A live engine the watch example can see and pick.
    with register_engine(
        make_endpoint(), engine_id="sample", labels={"model": "llama-3-8b"}, settings=settings
    ):
        returncode, out, err = run_python(_python_blocks(README)[index], cli_env(settings))
    assert returncode == 0, err
    if "router.pick" in _python_blocks(README)[index]:
        assert "send to tcp://" in out


def test_readme_watch_example_on_an_empty_namespace_prints_a_real_revision(
    settings: Settings,
) -> None:
    """README says "N engines at revision R": with no engine, R is still the real revision."""
    (example,) = [b for b in _python_blocks(README) if "engines at revision" in b]
    returncode, out, err = run_python(example, cli_env(settings))
    assert returncode == 0, err
    count, revision = re.search(r"^(\d+) engines at revision (\d+)$", out, re.M).groups()
    assert count == "0" and int(revision) > 0, out


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


class _Loader(yaml.SafeLoader):
    """mkdocs.yml's YAML: its !!python/name tags are names, not values, here."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def test_every_page_is_reached_from_the_navigation() -> None:
    nav = _nav_pages(_config()["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(pages - set(nav)) == [], "pages not in mkdocs.yml's nav"
    assert sorted(set(nav) - pages) == [], "nav names pages that do not exist"


def test_readme_links_resolve() -> None:
    """README is not on the site (mkdocs checks the site's links): its own must resolve."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert targets, "README links nowhere"
    assert [t for t in targets if "://" not in t and not (ROOT / t).exists()] == []


def test_the_api_reference_covers_every_public_name() -> None:
    api = (DOCS / "reference" / "api.md").read_text()
    documented = re.findall(r"^::: discovery\.([\w.]+)$", api, re.M)
    assert sorted(set(discovery.__all__) - set(documented)) == [], "docs/reference/api.md"
    # and the test support's public module, discovery.testing.memory
    assert sorted(set(documented) - set(discovery.__all__)) == ["testing.memory"]


@pytest.mark.external  # mkdocs in a process of its own
def test_the_site_builds_strictly_with_every_generated_reference(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, anchor or reference fails; the generated
    reference pages hold every command, setting and stored field."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-6000:]

    def page(name: str) -> str:
        return html.unescape((site / name / "index.html").read_text())

    api = page("reference/api")
    assert [n for n in discovery.__all__ if f'id="discovery.{n}"' not in api] == []
    cli = page("reference/cli")
    (commands,) = (a for a in build_parser()._actions if a.dest == "command")
    assert [c for c in commands.choices if f"discovery {c}" not in cli] == []
    settings = page("reference/settings")
    assert [v for v in env_names().values() if v not in settings] == []
    fields = page("reference/fields")
    assert [name for name, _ in STORED if f"<code>{name}</code>" not in fields] == []
    assert (site / "performance" / "latency.png").exists()


def _python_blocks_of(page: Path) -> list[str]:
    return _python_blocks(page.read_text())


GUIDES = sorted(
    str(p.relative_to(DOCS))
    for p in DOCS.rglob("*.md")
    if _python_blocks_of(p) and str(p.relative_to(DOCS)) not in EXAMPLES_RUN_ELSEWHERE
)
# Runs a page's examples in order, in one namespace: a page's first example may set up
# what the later ones use.
RUN_PAGE = """
import re, sys
from pathlib import Path
namespace = {"__name__": "__main__"}
blocks = re.findall(r"```python\\n(.*?)```", Path(sys.argv[1]).read_text(), re.S)
for number, block in enumerate(blocks, 1):
    exec(compile(block, f"{sys.argv[1]}, example {number}", "exec"), namespace)
"""


@pytest.mark.parametrize("page", GUIDES)
def test_guide_examples_run(page: str, settings: Settings) -> None:
    """Every example of a guide runs as written, against etcd, in a fresh interpreter."""
    process = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", RUN_PAGE, str(DOCS / page)],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert process.returncode == 0, process.stderr[-6000:]
