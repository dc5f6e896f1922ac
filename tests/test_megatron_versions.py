"""Engines of every Megatron version register (issue 30), on real etcd.

Megatron's ``PrefixCachingCoordinatorPolicy`` differs by version (config.py): main
(d98e8a64) has ``load_balanced`` (its default since bcf4c8fb), core_r0.17.0 (432585d5),
core_r0.18.0 (dc0ee41a) and dev (d48bd6be) have ``round_robin`` instead (default
``first_prefix_block``), and the next version may add a value. A record of any of them registers
through the library, ``discovery register --endpoint-file`` and ``discovery launch``, is
stored unchanged (the same version's ``from_dict`` reads it back) and is routed: ``auto``
sends ``round_robin`` engines in turn and any value it does not know by load.
"""

from __future__ import annotations

import enum
import json
import signal
import subprocess
import sys
from typing import Any

import pytest

from discovery import (
    PrefixCachingCoordinatorPolicy,
    Router,
    RoutingPolicy,
    Settings,
    UnknownValue,
    register_dynamic_engine,
    register_engine,
    watch_table,
)
from discovery.testing.stand_in_engine import default_endpoint

from .helpers import (
    STAND_IN,
    ChildLog,
    Launcher,
    WatchLog,
    cli_env,
    fake_engine,
    get_kv,
    run_cli,
    wait_for,
)
from .test_endpoint import MAIN_POLICIES, RELEASED_POLICIES, megatron_from_dict

INVENTED = "weighted_prefix"  # invented: no Megatron has it (yet)
FUTURE_POLICIES = (*MAIN_POLICIES, INVENTED)  # the enum of a Megatron that writes it
VERSIONS = [
    # (policy as written, the policies of the Megatron version writing it, routed as)
    ("round_robin", RELEASED_POLICIES, RoutingPolicy.ROUND_ROBIN),
    ("first_prefix_block", RELEASED_POLICIES, RoutingPolicy.FIRST_PREFIX_BLOCK),
    ("load_balanced", MAIN_POLICIES, RoutingPolicy.LOAD_BALANCED),
    (INVENTED, FUTURE_POLICIES, RoutingPolicy.LOAD_BALANCED),
]
IDS = [policy for policy, _, _ in VERSIONS]


class ReleasedPolicy(str, enum.Enum):  # noqa: UP042 - as Megatron declares it
    """Megatron 0.17/0.18/dev's enum (core_r0.18.0 dc0ee41a, config.py)."""

    LONGEST_PREFIX = "longest_prefix"
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    ROUND_ROBIN = "round_robin"


def megatron_value(policy: str, address: str = "tcp://10.0.0.7:5555") -> dict[str, Any]:
    """``InferenceEngineEndpoint.to_dict()`` of that version, with keys of a newer one."""
    value = default_endpoint(address)
    value["capabilities"]["prefix_caching_coordinator_policy"] = policy
    value["capabilities"]["future_capability"] = {"kv_offload": True}
    value["future_top"] = [1, "two"]
    return json.loads(json.dumps(value))


class MegatronEndpoint:
    """Megatron-Core's own endpoint object, as far as ``register_engine`` reads it."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def to_dict(self) -> dict[str, Any]:
        return self.value


def check_stored(settings: Settings, engine_id: str, sent: dict[str, Any], policies) -> None:
    """The stored value holds what the engine sent, unchanged, and its Megatron reads it."""
    value = json.loads(get_kv(settings.endpoints, settings.keyspace.key(engine_id))["value"])
    assert value["capabilities"] == sent["capabilities"]
    assert value["future_top"] == sent["future_top"]
    assert megatron_from_dict(value, policies) == megatron_from_dict(sent, policies)


@pytest.mark.parametrize(("policy", "policies", "routed"), VERSIONS, ids=IDS)
def test_the_library_registers_watches_and_routes_a_record_of_each_version(
    settings: Settings, policy: str, policies, routed: RoutingPolicy
) -> None:
    sent = megatron_value(policy)
    watch = WatchLog(settings)
    try:
        with (
            register_engine(MegatronEndpoint(sent), engine_id="m-0", settings=settings),
            register_engine(
                MegatronEndpoint(megatron_value(policy, "tcp://10.0.0.8:5555")),
                engine_id="m-1",
                settings=settings,
            ),
        ):
            _, event = watch.wait("m-0", "added")
            read = event.endpoint.capabilities.prefix_caching_coordinator_policy
            assert read == policy
            assert (type(read) is UnknownValue) is (policy == INVENTED)
            assert dict(event.record.extra_capabilities) == {
                "future_capability": {"kv_offload": True}
            }
            check_stored(settings, "m-0", sent, policies)
            with watch_table(settings) as table:
                table.wait_until(lambda s: len(s) == 2, timeout=30)
                router = Router(table)
                prompt = list(range(600))
                chosen = [router.pick(prompt, 1) for _ in range(4)]
                assert {h.policy for h in chosen} <= {routed, RoutingPolicy.LOAD_BALANCED}
                if routed is RoutingPolicy.ROUND_ROBIN:
                    assert [h.engine_id for h in chosen] == ["m-0", "m-1"] * 2
                    assert {h.policy for h in chosen} == {RoutingPolicy.ROUND_ROBIN}
                if policy == INVENTED:
                    assert {h.policy for h in chosen} == {RoutingPolicy.LOAD_BALANCED}
            listed = run_cli(settings, "list")
            assert listed.returncode == 0, listed.stderr
            assert policy in listed.stdout
    finally:
        watch.stop()


def test_watch_and_top_show_an_engine_with_a_policy_this_version_does_not_know(
    settings: Settings,
) -> None:
    logs = {"watch": ChildLog(), "top": ChildLog()}
    commands = {"watch": ["watch", "--format", "jsonl"], "top": ["top"]}
    children = {
        name: subprocess.Popen(
            [sys.executable, "-m", "discovery", *commands[name]],
            env=cli_env(settings),
            stdout=logs[name].file,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        for name in logs
    }
    try:
        with register_engine(
            MegatronEndpoint(megatron_value(INVENTED)), engine_id="new", settings=settings
        ):
            line = wait_for(
                lambda: next((x for x in logs["watch"].read().splitlines() if '"new"' in x), None),
                30,
                "watch's line",
            )
            caps = json.loads(line)["endpoint"]["capabilities"]
            assert caps["prefix_caching_coordinator_policy"] == INVENTED
            wait_for(lambda: "added    new " in logs["top"].read(), 30, "top's line")
    finally:
        for child in children.values():
            child.terminate()
            child.wait(10)
        for log in logs.values():
            log.close()


@pytest.mark.parametrize(("policy", "policies", "routed"), VERSIONS[::3], ids=IDS[::3])
def test_register_endpoint_file_keeps_the_policy_and_unknown_keys(
    settings: Settings, tmp_path, policy: str, policies, routed: RoutingPolicy
) -> None:
    sent = megatron_value(policy)
    path = tmp_path / "endpoint.json"
    path.write_text(json.dumps({**sent, "engine_id": "from-file", "labels": {"zone": "z"}}))
    process = subprocess.Popen(
        [sys.executable, "-m", "discovery", "register", "--endpoint-file", str(path)],
        env=cli_env(settings),
        stderr=subprocess.PIPE,
        text=True,
    )
    key = settings.keyspace.key("from-file")
    try:
        wait_for(lambda: get_kv(settings.endpoints, key), message="registration")
        check_stored(settings, "from-file", sent, policies)
        stored = json.loads(get_kv(settings.endpoints, key)["value"])
        assert stored["labels"] == {"zone": "z"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()


@pytest.mark.parametrize(("policy", "policies", "routed"), VERSIONS[::3], ids=IDS[::3])
def test_launch_registers_a_stand_in_engine_sending_the_policy(
    settings: Settings, policy: str, policies, routed: RoutingPolicy
) -> None:
    watch = WatchLog(settings)
    launcher = Launcher(settings, "launched", [*STAND_IN, "--policy", policy])
    try:
        _, event = watch.wait("launched", "added", timeout=60)
        assert event.endpoint.capabilities.prefix_caching_coordinator_policy == policy
        value = json.loads(get_kv(settings.endpoints, launcher.key)["value"])
        assert value["capabilities"]["prefix_caching_coordinator_policy"] == policy
        assert (
            megatron_from_dict(value, policies)["capabilities"]["prefix_caching_coordinator_policy"]
            == policy
        )
        with watch_table(settings) as table:
            table.wait_until(lambda s: "launched" in s, timeout=30)
            with Router(table).pick(list(range(600)), 1) as handle:
                assert handle.policy is routed
    finally:
        launcher.stop()
        watch.stop()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (ReleasedPolicy.ROUND_ROBIN, PrefixCachingCoordinatorPolicy.ROUND_ROBIN),
        (enum.Enum("Next", {"COST": INVENTED}).COST, INVENTED),
    ],
    ids=["round_robin", INVENTED],
)
def test_register_dynamic_engine_on_an_engine_of_another_version(
    settings: Settings, policy: object, expected: str
) -> None:
    with register_dynamic_engine(
        fake_engine(policy=policy),
        "tcp://engine:7000",
        engine_id="dyn",
        settings=settings,
    ) as reg:
        value = json.loads(get_kv(settings.endpoints, reg.key)["value"])
        assert value["capabilities"]["prefix_caching_coordinator_policy"] == expected
        assert reg.record.endpoint.capabilities.prefix_caching_coordinator_policy == expected
