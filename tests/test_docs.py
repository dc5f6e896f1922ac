"""README and docs examples run as written, and the public surface is exactly as intended."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import discovery
from discovery import Settings, register_engine
from discovery._record import STORED, field_table

from .helpers import cli_env, make_endpoint, run_python

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

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
        "discovery.embedded",
        "discovery.memory",
        "discovery.stand_in_engine",
        "discovery.stand_in_wire",
        "discovery.stand_in_coordinator",
        "discovery.stand_in_client",
    ],
)
def test_test_support_modules_are_not_imported_by_the_library(module: str) -> None:
    code = f"import discovery, sys; print({module!r} in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_memory_port_is_documented() -> None:
    import discovery.memory  # noqa: PLC0415

    assert inspect.getdoc(discovery.memory)
    for name in discovery.memory.__all__:
        cls = getattr(discovery.memory, name)
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


def test_readme_field_table_is_the_declared_one() -> None:
    """README's stored-field table is rendered from EngineRecord's declaration."""
    table = README.split("<!-- fields:begin -->\n")[1].split("<!-- fields:end -->")[0]
    assert table == field_table() + "\n", "README's field table is out of date: ./dev docs"
    for name, _ in STORED:
        assert f"| `{name}` |" in table
