"""Megatron-Core compatibility of the engine records (pure, no etcd).

Every fact in /work/shared/reference/wire_contract.md has a test here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from datetime import UTC, datetime
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from discovery import (
    EngineRecord,
    EngineStatus,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    KeySpace,
    PrefixCachingCoordinatorPolicy,
    UnknownValue,
)
from discovery._records.codec import encode

from .helpers import INTEGER_FIELDS, MEGATRON_FIELDS, POSITIVE_FIELDS, caps_kwargs, fake_engine

Policy = PrefixCachingCoordinatorPolicy

FIELD_ORDER = MEGATRON_FIELDS
REQUIRED_KEYS = FIELD_ORDER[:7]
INT_FIELDS = INTEGER_FIELDS
POLICY_VALUES = {
    "LONGEST_PREFIX": "longest_prefix",
    "FIRST_PREFIX_BLOCK": "first_prefix_block",
    "LOAD_BALANCED": "load_balanced",
    "ROUND_ROBIN": "round_robin",
}
ALL_POLICIES = [*Policy, None]
ADDRESS = "tcp://10.0.0.1:5555"


def make_caps(**overrides: Any) -> InferenceEngineCapabilities:
    return InferenceEngineCapabilities(**caps_kwargs(**overrides))


def caps_dict(**overrides: Any) -> dict[str, Any]:
    """A capabilities mapping with only the seven required keys, plus overrides."""
    return caps_kwargs(**overrides)


def endpoint_dict(**cap_overrides: Any) -> dict[str, Any]:
    return {"coordinator_address": ADDRESS, "capabilities": caps_dict(**cap_overrides)}


# --- PrefixCachingCoordinatorPolicy ------------------------------------------------------


def test_policy_has_the_members_of_every_megatron_version() -> None:
    # main (d98e8a64): the first three; core_r0.17.0, core_r0.18.0, dev: round_robin for
    # load_balanced (bcf4c8fb replaced it).
    assert {m.name: m.value for m in Policy} == POLICY_VALUES


def test_policy_is_a_str_enum() -> None:
    assert issubclass(Policy, str)
    assert issubclass(Policy, enum.Enum)
    assert Policy.FIRST_PREFIX_BLOCK == "first_prefix_block"


@pytest.mark.parametrize("value", POLICY_VALUES.values())
def test_policy_is_looked_up_by_value(value: str) -> None:
    assert Policy(value).value == value


# --- InferenceEngineCapabilities: shape ---------------------------------------------------


def test_capabilities_field_names_and_order() -> None:
    names = tuple(f.name for f in dataclasses.fields(InferenceEngineCapabilities))
    assert names == FIELD_ORDER


def test_capabilities_defaults() -> None:
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(InferenceEngineCapabilities)
        if f.default is not dataclasses.MISSING
    }
    assert defaults == {"logical_data_parallel_size": 1, "prefix_caching_coordinator_policy": None}
    caps = make_caps()
    assert caps.logical_data_parallel_size == 1
    assert caps.prefix_caching_coordinator_policy is None


def test_capabilities_required_fields_have_no_default() -> None:
    required = [
        f.name
        for f in dataclasses.fields(InferenceEngineCapabilities)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    assert tuple(required) == REQUIRED_KEYS


@pytest.mark.parametrize("name", FIELD_ORDER)
def test_capabilities_are_frozen(name: str) -> None:
    caps = make_caps()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(caps, name, getattr(caps, name))


# --- InferenceEngineCapabilities: validation ----------------------------------------------


@pytest.mark.parametrize("bad", [True, False, "8192", 8192.0, None], ids=repr)
@pytest.mark.parametrize("name", INT_FIELDS)
def test_int_field_must_be_a_real_int(name: str, bad: object) -> None:
    with pytest.raises(TypeError, match=f"^{name} must be an integer$"):
        make_caps(**{name: bad})


@pytest.mark.parametrize("bad", [1, 0, "true", None, 1.0], ids=repr)
def test_enable_prefix_caching_must_be_a_real_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        make_caps(enable_prefix_caching=bad)


@pytest.mark.parametrize("bad", [*POLICY_VALUES.values(), "LONGEST_PREFIX", 1])
def test_policy_must_be_a_member_not_a_plain_value(bad: object) -> None:
    with pytest.raises(TypeError, match="prefix_caching_coordinator_policy"):
        make_caps(prefix_caching_coordinator_policy=bad)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_policy_accepts_every_member_and_none(policy: Policy | None) -> None:
    caps = make_caps(prefix_caching_coordinator_policy=policy)
    assert caps.prefix_caching_coordinator_policy is policy


@pytest.mark.parametrize("bad", [0, -1])
@pytest.mark.parametrize("name", POSITIVE_FIELDS)
def test_positive_field_rejects_zero_and_negative(name: str, bad: int) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be positive$"):
        make_caps(**{name: bad})


def test_total_kv_blocks_rejects_negative() -> None:
    with pytest.raises(ValueError, match="total_kv_blocks"):
        make_caps(total_kv_blocks=-1)


def test_total_kv_blocks_allows_zero() -> None:
    assert make_caps(total_kv_blocks=0).total_kv_blocks == 0


@pytest.mark.parametrize("bos", [-1, -(2**40), 0, 2**40])
def test_bos_token_id_has_no_range_check(bos: int) -> None:
    assert make_caps(bos_token_id=bos).bos_token_id == bos


def test_type_errors_win_over_range_errors() -> None:
    # A bool in a positive field is a type problem, even though False <= 0.
    with pytest.raises(TypeError, match="context_length must be an integer"):
        make_caps(context_length=False, max_num_seqs=0)


# --- InferenceEngineEndpoint: shape and validation ----------------------------------------


def test_endpoint_field_names_and_order() -> None:
    names = tuple(f.name for f in dataclasses.fields(InferenceEngineEndpoint))
    assert names == ("coordinator_address", "capabilities")


@pytest.mark.parametrize("name", ["coordinator_address", "capabilities"])
def test_endpoint_is_frozen(name: str) -> None:
    endpoint = InferenceEngineEndpoint(ADDRESS, make_caps())
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(endpoint, name, getattr(endpoint, name))


@pytest.mark.parametrize("bad", [None, 5, b"tcp://a:1"], ids=repr)
def test_coordinator_address_must_be_a_str(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^coordinator_address must be a string$"):
        InferenceEngineEndpoint(bad, make_caps())  # type: ignore[arg-type]


def test_coordinator_address_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="coordinator_address"):
        InferenceEngineEndpoint("", make_caps())


@pytest.mark.parametrize("bad", [None, caps_kwargs(), "caps"], ids=["none", "dict", "str"])
def test_endpoint_capabilities_must_be_capabilities(bad: object) -> None:
    with pytest.raises(TypeError, match="capabilities"):
        InferenceEngineEndpoint(ADDRESS, bad)  # type: ignore[arg-type]


# --- from_dict ----------------------------------------------------------------------------


@pytest.mark.parametrize("missing", REQUIRED_KEYS)
def test_capabilities_from_dict_requires_each_required_key(missing: str) -> None:
    value = caps_dict()
    del value[missing]
    with pytest.raises(KeyError, match=missing):
        InferenceEngineCapabilities.from_dict(value)


@pytest.mark.parametrize("missing", REQUIRED_KEYS)
def test_endpoint_from_dict_requires_each_required_capability_key(missing: str) -> None:
    value = endpoint_dict()
    del value["capabilities"][missing]
    with pytest.raises(KeyError, match=missing):
        InferenceEngineEndpoint.from_dict(value)


@pytest.mark.parametrize("missing", ["coordinator_address", "capabilities"])
def test_endpoint_from_dict_requires_its_two_keys(missing: str) -> None:
    value = endpoint_dict()
    del value[missing]
    with pytest.raises(KeyError, match=missing):
        InferenceEngineEndpoint.from_dict(value)


def test_from_dict_logical_data_parallel_size_defaults_to_one() -> None:
    assert InferenceEngineCapabilities.from_dict(caps_dict()).logical_data_parallel_size == 1


def test_from_dict_reads_logical_data_parallel_size() -> None:
    caps = InferenceEngineCapabilities.from_dict(caps_dict(logical_data_parallel_size=4))
    assert caps.logical_data_parallel_size == 4


def test_from_dict_policy_absent_is_none() -> None:
    caps = InferenceEngineCapabilities.from_dict(caps_dict())
    assert caps.prefix_caching_coordinator_policy is None


def test_from_dict_policy_null_is_none() -> None:
    caps = InferenceEngineCapabilities.from_dict(caps_dict(prefix_caching_coordinator_policy=None))
    assert caps.prefix_caching_coordinator_policy is None


@pytest.mark.parametrize("policy", list(Policy))
def test_from_dict_converts_every_policy_value_string(policy: Policy) -> None:
    value = caps_dict(prefix_caching_coordinator_policy=policy.value)
    assert type(value["prefix_caching_coordinator_policy"]) is str
    caps = InferenceEngineCapabilities.from_dict(value)
    assert caps.prefix_caching_coordinator_policy is policy


@pytest.mark.parametrize(
    "unknown", ["weighted_prefix", "LONGEST_PREFIX", "Load_Balanced", "x" * 64]
)
def test_from_dict_keeps_a_policy_string_it_does_not_know(unknown: str) -> None:
    # A value of Megatron's next version must not refuse the engine: kept verbatim.
    caps = InferenceEngineCapabilities.from_dict(
        caps_dict(prefix_caching_coordinator_policy=unknown)
    )
    policy = caps.prefix_caching_coordinator_policy
    assert type(policy) is UnknownValue and policy == unknown
    assert caps.to_dict()["prefix_caching_coordinator_policy"] == unknown
    assert InferenceEngineCapabilities(**caps.to_dict()) == caps
    assert json.loads(json.dumps(caps.to_dict()))["prefix_caching_coordinator_policy"] == unknown


@pytest.mark.parametrize("bad", ["", "x" * 65, "a\nb", 1, 1.5, True, ["round_robin"]], ids=repr)
def test_from_dict_refuses_a_policy_that_is_no_name(bad: object) -> None:
    # Strict where Megatron is: a non-string raises ValueError there too.
    with pytest.raises(ValueError, match="prefix_caching_coordinator_policy"):
        InferenceEngineCapabilities.from_dict(caps_dict(prefix_caching_coordinator_policy=bad))


def test_from_dict_ignores_unknown_keys() -> None:
    value = caps_dict(future_field=[1, 2], another={"x": 1})
    assert InferenceEngineCapabilities.from_dict(value) == make_caps()
    wrapped = {**endpoint_dict(), "engine_id": "e1", "labels": {"a": "b"}, "extra": None}
    assert InferenceEngineEndpoint.from_dict(wrapped) == InferenceEngineEndpoint(
        ADDRESS, make_caps()
    )


def test_from_dict_validates_values() -> None:
    with pytest.raises(TypeError, match="context_length must be an integer"):
        InferenceEngineCapabilities.from_dict(caps_dict(context_length="8192"))
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        InferenceEngineEndpoint.from_dict(endpoint_dict(max_num_seqs=0))


def test_from_dict_accepts_any_mapping() -> None:
    value = MappingProxyType(
        {"coordinator_address": ADDRESS, "capabilities": MappingProxyType(caps_dict())}
    )
    assert InferenceEngineEndpoint.from_dict(value).capabilities == make_caps()


@pytest.mark.parametrize("bad", [None, [], "caps", 1, list(caps_dict().items())], ids=repr)
def test_endpoint_from_dict_capabilities_must_be_a_mapping(bad: object) -> None:
    with pytest.raises(TypeError, match="capabilities"):
        InferenceEngineEndpoint.from_dict({"coordinator_address": ADDRESS, "capabilities": bad})


@pytest.mark.parametrize("bad", [None, [], "x", 1])
def test_from_dict_of_a_non_mapping_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        InferenceEngineCapabilities.from_dict(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        InferenceEngineEndpoint.from_dict(bad)  # type: ignore[arg-type]


# --- to_dict and JSON round trips ---------------------------------------------------------


def test_capabilities_to_dict_is_a_plain_dict_of_all_nine_fields_in_order() -> None:
    caps = make_caps(logical_data_parallel_size=2, prefix_caching_coordinator_policy=None)
    value = caps.to_dict()
    assert type(value) is dict
    assert tuple(value) == FIELD_ORDER
    assert value == {**caps_kwargs(), "logical_data_parallel_size": 2, **{FIELD_ORDER[-1]: None}}


def test_endpoint_to_dict_nests_the_capabilities() -> None:
    caps = make_caps(prefix_caching_coordinator_policy=Policy.LOAD_BALANCED)
    value = InferenceEngineEndpoint(ADDRESS, caps).to_dict()
    assert type(value) is dict
    assert type(value["capabilities"]) is dict
    assert list(value) == ["coordinator_address", "capabilities"]
    assert value == {"coordinator_address": ADDRESS, "capabilities": caps.to_dict()}


@pytest.mark.parametrize("policy", list(Policy))
def test_json_dumps_writes_the_policy_value_string(policy: Policy) -> None:
    text = json.dumps(make_caps(prefix_caching_coordinator_policy=policy).to_dict())
    assert f'"prefix_caching_coordinator_policy": "{policy.value}"' in text


def test_json_dumps_writes_first_prefix_block() -> None:
    caps = make_caps(prefix_caching_coordinator_policy=Policy.FIRST_PREFIX_BLOCK)
    assert json.loads(json.dumps(caps.to_dict()))[FIELD_ORDER[-1]] == "first_prefix_block"


def test_json_dumps_writes_null_for_no_policy() -> None:
    text = json.dumps(make_caps().to_dict())
    assert '"prefix_caching_coordinator_policy": null' in text


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_capabilities_round_trip_through_json(policy: Policy | None) -> None:
    caps = make_caps(logical_data_parallel_size=8, prefix_caching_coordinator_policy=policy)
    assert InferenceEngineCapabilities.from_dict(json.loads(json.dumps(caps.to_dict()))) == caps


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_endpoint_round_trips_through_json(policy: Policy | None) -> None:
    endpoint = InferenceEngineEndpoint(ADDRESS, make_caps(prefix_caching_coordinator_policy=policy))
    loaded = InferenceEngineEndpoint.from_dict(json.loads(json.dumps(endpoint.to_dict())))
    assert loaded == endpoint
    assert loaded.capabilities.prefix_caching_coordinator_policy is policy


def test_old_record_without_policy_key_loads_with_policy_none() -> None:
    old = {
        "coordinator_address": ADDRESS,
        "capabilities": caps_dict(logical_data_parallel_size=2),
    }
    assert FIELD_ORDER[-1] not in old["capabilities"]
    endpoint = InferenceEngineEndpoint.from_dict(json.loads(json.dumps(old)))
    assert endpoint.capabilities.prefix_caching_coordinator_policy is None
    assert endpoint.capabilities.logical_data_parallel_size == 2


# --- from_engine with duck-typed engines --------------------------------------------------


class IntLike:
    """A numpy-scalar stand-in: not an int, but converts with int()."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class ForeignPolicy(str, enum.Enum):  # noqa: UP042 - as Megatron declares it
    """Megatron's own enum: same values, a different class."""

    LONGEST_PREFIX = "longest_prefix"
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    LOAD_BALANCED = "load_balanced"


def test_from_engine_maps_every_context_attribute() -> None:
    caps = InferenceEngineCapabilities.from_engine(
        fake_engine(
            max_sequence_length=16384,
            block_size_tokens=128,
            pool_size=501,
            max_requests=32,
            max_tokens=2048,
            tokenizer=SimpleNamespace(bos=7),
        )
    )
    assert caps.to_dict() == {
        "context_length": 16384,
        "kv_cache_block_size": 128,
        "total_kv_blocks": 500,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "bos_token_id": 7,
        "enable_prefix_caching": True,
        "logical_data_parallel_size": 1,
        "prefix_caching_coordinator_policy": None,
    }


@pytest.mark.parametrize(("pool_size", "blocks"), [(1001, 1000), (2, 1), (1, 0), (0, 0)])
def test_from_engine_total_kv_blocks_excludes_the_root_block(pool_size: int, blocks: int) -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(pool_size=pool_size))
    assert caps.total_kv_blocks == blocks


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"bos": 5, "bos_token_id": 6, "eod": 7}, 5),
        ({"bos": None, "bos_token_id": 6, "eod": 7}, 6),
        ({"bos_token_id": 6, "eod": 7}, 6),
        ({"bos": None, "bos_token_id": None, "eod": 7}, 7),
        ({"eod": 7}, 7),
        ({"bos": 0, "bos_token_id": 6}, 0),
        ({"bos": None, "bos_token_id": None, "eod": None}, 0),
        ({}, 0),
    ],
    ids=["bos", "bos-none", "bos_token_id", "eod", "eod-only", "bos-zero", "all-none", "empty"],
)
def test_from_engine_bos_token_is_the_first_set_tokenizer_attribute(
    attrs: dict[str, Any], expected: int
) -> None:
    engine = fake_engine(tokenizer=SimpleNamespace(**attrs))
    assert InferenceEngineCapabilities.from_engine(engine).bos_token_id == expected


def test_from_engine_passes_numbers_through_int() -> None:
    engine = fake_engine(
        max_sequence_length=IntLike(4096),
        block_size_tokens=IntLike(64),
        pool_size=IntLike(11),
        max_requests=IntLike(8),
        max_tokens=IntLike(1024),
        tokenizer=SimpleNamespace(bos=IntLike(3)),
    )
    caps = InferenceEngineCapabilities.from_engine(engine, logical_data_parallel_size=IntLike(2))
    values = caps.to_dict()
    del values["enable_prefix_caching"], values["prefix_caching_coordinator_policy"]
    assert values == {
        "context_length": 4096,
        "kv_cache_block_size": 64,
        "total_kv_blocks": 10,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "bos_token_id": 3,
        "logical_data_parallel_size": 2,
    }
    assert all(type(v) is int for v in values.values())


@pytest.mark.parametrize(("flag", "expected"), [(1, True), (0, False), (True, True), (None, False)])
def test_from_engine_enable_prefix_caching_passes_through_bool(
    flag: object, expected: bool
) -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(enable_prefix_caching=flag))
    assert caps.enable_prefix_caching is expected


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_from_engine_reads_our_policy_from_the_context_config(policy: Policy | None) -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(policy=policy))
    assert caps.prefix_caching_coordinator_policy is policy


@pytest.mark.parametrize("foreign", list(ForeignPolicy))
def test_from_engine_converts_a_foreign_policy_enum_to_ours(foreign: ForeignPolicy) -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(policy=foreign))
    assert type(caps.prefix_caching_coordinator_policy) is Policy
    assert caps.prefix_caching_coordinator_policy is Policy(foreign.value)
    assert caps.prefix_caching_coordinator_policy.name == foreign.name


class ReleasedPolicy(str, enum.Enum):  # noqa: UP042 - as Megatron declares it
    """Megatron 0.17/0.18/dev's enum (core_r0.18.0 dc0ee41a, config.py)."""

    LONGEST_PREFIX = "longest_prefix"
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    ROUND_ROBIN = "round_robin"


def test_from_engine_reads_a_released_megatron_engine_round_robin() -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(policy=ReleasedPolicy.ROUND_ROBIN))
    assert caps.prefix_caching_coordinator_policy is Policy.ROUND_ROBIN


def test_from_engine_keeps_an_engine_policy_it_does_not_know() -> None:
    foreign = enum.Enum("Foreign", {"FREE_CAPACITY": "prefix_tree_v2"})
    caps = InferenceEngineCapabilities.from_engine(fake_engine(policy=foreign.FREE_CAPACITY))
    assert type(caps.prefix_caching_coordinator_policy) is UnknownValue
    assert caps.prefix_caching_coordinator_policy == "prefix_tree_v2"


def test_from_engine_logical_data_parallel_size() -> None:
    caps = InferenceEngineCapabilities.from_engine(fake_engine(), logical_data_parallel_size=4)
    assert caps.logical_data_parallel_size == 4


def test_from_engine_validates_the_result() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        InferenceEngineCapabilities.from_engine(fake_engine(max_requests=0))


def test_endpoint_from_engine() -> None:
    engine = fake_engine(policy=ForeignPolicy.LONGEST_PREFIX)
    endpoint = InferenceEngineEndpoint.from_engine(ADDRESS, engine, logical_data_parallel_size=2)
    assert endpoint.coordinator_address == ADDRESS
    assert endpoint.capabilities == InferenceEngineCapabilities.from_engine(
        engine, logical_data_parallel_size=2
    )
    assert endpoint.capabilities.logical_data_parallel_size == 2
    assert endpoint.capabilities.prefix_caching_coordinator_policy is Policy.LONGEST_PREFIX


def test_endpoint_from_engine_defaults_logical_data_parallel_size_to_one() -> None:
    endpoint = InferenceEngineEndpoint.from_engine(ADDRESS, fake_engine())
    assert endpoint.capabilities.logical_data_parallel_size == 1


def test_endpoint_from_engine_validates_the_address() -> None:
    with pytest.raises(ValueError, match="coordinator_address"):
        InferenceEngineEndpoint.from_engine("", fake_engine())


def test_from_engine_does_not_keep_the_engine() -> None:
    engine = fake_engine()
    endpoint = InferenceEngineEndpoint.from_engine(ADDRESS, engine)
    stored = [*vars(endpoint).values(), *vars(endpoint.capabilities).values()]
    allowed = {str, int, bool, type(None), InferenceEngineCapabilities}
    assert {type(value) for value in stored} <= allowed


# --- An independent Megatron reader -------------------------------------------------------

MAIN_POLICIES = ("longest_prefix", "first_prefix_block", "load_balanced")  # d98e8a64
RELEASED_POLICIES = ("longest_prefix", "first_prefix_block", "round_robin")  # 0.17, 0.18, dev


def policies_knowing(policy: object) -> tuple[str, ...]:
    """The policy values of a Megatron version whose enum has ``policy`` (main's if none)."""
    return RELEASED_POLICIES if policy == "round_robin" else MAIN_POLICIES


def megatron_from_dict(
    value: dict[str, Any], policies: tuple[str, ...] = MAIN_POLICIES
) -> dict[str, Any]:
    """Megatron's ``InferenceEngineEndpoint.from_dict`` rules, by field name only.

    ``policies``: the values of that Megatron version's enum. Returns the endpoint as a
    plain dict with the policy as its value string, or raises KeyError / TypeError /
    ValueError exactly where Megatron would.
    """
    address = value["coordinator_address"]
    raw = value["capabilities"]
    if not isinstance(raw, dict):
        raise TypeError("capabilities must be a mapping")
    caps = {name: raw[name] for name in REQUIRED_KEYS}
    caps["logical_data_parallel_size"] = raw.get("logical_data_parallel_size", 1)
    policy = raw.get("prefix_caching_coordinator_policy")
    if policy is not None and policy not in policies:
        raise ValueError(f"{policy!r} is not a valid PrefixCachingCoordinatorPolicy")
    caps["prefix_caching_coordinator_policy"] = policy
    for name in INT_FIELDS:
        if type(caps[name]) is not int:
            raise TypeError(f"{name} must be an integer")
    if type(caps["enable_prefix_caching"]) is not bool:
        raise TypeError("enable_prefix_caching must be a bool")
    for name in POSITIVE_FIELDS:
        if caps[name] <= 0:
            raise ValueError(f"{name} must be positive")
    if caps["total_kv_blocks"] < 0:
        raise ValueError("total_kv_blocks must be non-negative")
    if not isinstance(address, str):
        raise TypeError("coordinator_address must be a string")
    if not address:
        raise ValueError("coordinator_address must be non-empty")
    return {"coordinator_address": address, "capabilities": caps}


def megatron_to_json(address: str, caps: dict[str, Any], *, with_policy: bool) -> bytes:
    """Bytes shaped exactly as Megatron writes them: ``json.dumps(endpoint.to_dict())``."""
    ordered = {name: caps[name] for name in FIELD_ORDER if with_policy or name != FIELD_ORDER[-1]}
    return json.dumps({"coordinator_address": address, "capabilities": ordered}).encode()


def test_megatron_reader_rejects_what_megatron_rejects() -> None:
    # The reader is itself checked, so the tests below prove something.
    with pytest.raises(KeyError):
        megatron_from_dict({"capabilities": caps_dict()})
    with pytest.raises(TypeError):
        megatron_from_dict(endpoint_dict(bos_token_id=True))
    with pytest.raises(ValueError):
        megatron_from_dict(endpoint_dict(prefix_caching_coordinator_policy="nope"))


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_megatron_reader_loads_the_values_our_codec_writes(policy: Policy | None) -> None:
    caps = make_caps(logical_data_parallel_size=2, prefix_caching_coordinator_policy=policy)
    record = EngineRecord(
        engine_id="engine-1",
        endpoint=InferenceEngineEndpoint(ADDRESS, caps),
        labels={"model": "llama-70b", "zone": "us-east-1a"},
        registered_at=datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC),
    )
    loaded = megatron_from_dict(json.loads(encode(record)), policies_knowing(policy))
    expected = {**caps_kwargs(), "logical_data_parallel_size": 2}
    expected["prefix_caching_coordinator_policy"] = None if policy is None else policy.value
    assert loaded == {"coordinator_address": ADDRESS, "capabilities": expected}


@pytest.mark.parametrize("status", list(EngineStatus))
def test_megatron_reader_loads_values_with_a_status(status: EngineStatus) -> None:
    # The lifecycle metadata (issue 13) is top-level, beside engine_id: from_dict ignores it.
    deadline = (
        datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC) if status is EngineStatus.DRAINING else None
    )
    caps = make_caps()
    record = EngineRecord(
        engine_id="engine-1",
        endpoint=InferenceEngineEndpoint(ADDRESS, caps),
        status=status,
        drain_deadline=deadline,
    )
    value = json.loads(encode(record))
    assert value["status"] == status.value
    bare = json.loads(json.dumps(InferenceEngineEndpoint(ADDRESS, caps).to_dict()))
    assert megatron_from_dict(value) == megatron_from_dict(bare)


@pytest.mark.parametrize(
    ("policy", "with_policy"),
    [*((p, True) for p in ALL_POLICIES), (None, False)],
    ids=[*(f"policy-key-{p}" for p in ALL_POLICIES), "no-policy-key"],
)
def test_our_codec_decodes_values_shaped_as_megatron_writes_them(
    policy: Policy | None, with_policy: bool
) -> None:
    caps = {
        **caps_kwargs(),
        "logical_data_parallel_size": 3,
        "prefix_caching_coordinator_policy": None if policy is None else policy.value,
    }
    value = megatron_to_json(ADDRESS, caps, with_policy=with_policy)
    assert megatron_from_dict(json.loads(value), policies_knowing(policy))["capabilities"] == caps
    record = KeySpace().decode(b"/inference/v1/default/engines/megatron-0", value)
    assert record.engine_id == "megatron-0"
    assert record.endpoint == InferenceEngineEndpoint(
        ADDRESS, make_caps(logical_data_parallel_size=3, prefix_caching_coordinator_policy=policy)
    )
    assert dict(record.labels) == {}
    assert record.registered_at is None


# --- Property: from_dict on arbitrary and nearly-valid input ------------------------------

ALLOWED = (TypeError, ValueError, KeyError)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=20,
)

weird_values = st.one_of(
    json_values,
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 1, 2**63, -(2**63), "8192", "1", "", 1.0, 0.5, None]),
    st.sampled_from([*POLICY_VALUES.values(), *POLICY_VALUES]),
    st.text(max_size=30),
)


@st.composite
def valid_capability_dicts(draw: st.DrawFn) -> dict[str, Any]:
    positive = st.integers(min_value=1, max_value=2**70)
    value = {
        "context_length": draw(positive),
        "kv_cache_block_size": draw(positive),
        "total_kv_blocks": draw(st.integers(min_value=0, max_value=2**70)),
        "max_num_seqs": draw(positive),
        "max_num_batched_tokens": draw(positive),
        "bos_token_id": draw(st.integers(min_value=-(2**70), max_value=2**70)),
        "enable_prefix_caching": draw(st.booleans()),
    }
    if draw(st.booleans()):
        value["logical_data_parallel_size"] = draw(positive)
    if draw(st.booleans()):
        policy = draw(st.sampled_from(ALL_POLICIES))
        value["prefix_caching_coordinator_policy"] = None if policy is None else policy.value
    return value


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid mapping with a few keys dropped, replaced by odd values, or added."""
    value = dict(draw(base))
    keys = st.sampled_from(sorted({*value, *FIELD_ORDER, "coordinator_address", "capabilities"}))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        key = draw(keys)
        action = draw(st.sampled_from(["drop", "replace", "bool", "str", "policy"]))
        if action == "drop":
            value.pop(key, None)
        elif action == "replace":
            value[key] = draw(weird_values)
        elif action == "bool":
            value[key] = draw(st.booleans())
        elif action == "str":
            value[key] = str(value.get(key))
        else:
            value["prefix_caching_coordinator_policy"] = draw(st.text(max_size=25) | weird_values)
    return value


nearly_valid_capabilities = mutated(valid_capability_dicts())


@st.composite
def valid_endpoint_dicts(draw: st.DrawFn) -> dict[str, Any]:
    capabilities = draw(valid_capability_dicts() | nearly_valid_capabilities)
    return {"coordinator_address": draw(st.text(min_size=1)), "capabilities": capabilities}


def check_capabilities(value: object) -> None:
    try:
        caps = InferenceEngineCapabilities.from_dict(value)  # type: ignore[arg-type]
    except ALLOWED:
        return
    assert InferenceEngineCapabilities(**caps.to_dict()) == caps
    assert InferenceEngineCapabilities.from_dict(json.loads(json.dumps(caps.to_dict()))) == caps
    assert isinstance(value, dict)
    for name in REQUIRED_KEYS:
        assert getattr(caps, name) == value[name]


def check_endpoint(value: object) -> None:
    try:
        endpoint = InferenceEngineEndpoint.from_dict(value)  # type: ignore[arg-type]
    except ALLOWED:
        return
    assert InferenceEngineEndpoint(**vars(endpoint)) == endpoint
    assert InferenceEngineEndpoint.from_dict(json.loads(json.dumps(endpoint.to_dict()))) == endpoint
    assert isinstance(value, dict)
    assert endpoint.coordinator_address == value["coordinator_address"]


@settings(max_examples=300, deadline=None)
@given(json_values | st.dictionaries(st.sampled_from(FIELD_ORDER), json_values))
def test_capabilities_from_dict_on_arbitrary_json_only_raises_megatron_errors(value: Any) -> None:
    check_capabilities(value)


@settings(max_examples=500, deadline=None)
@given(valid_capability_dicts() | nearly_valid_capabilities)
def test_capabilities_from_dict_on_nearly_valid_records_only_raises_megatron_errors(
    value: dict[str, Any],
) -> None:
    check_capabilities(value)


@settings(max_examples=300, deadline=None)
@given(
    json_values
    | st.fixed_dictionaries({"coordinator_address": json_values, "capabilities": json_values})
)
def test_endpoint_from_dict_on_arbitrary_json_only_raises_megatron_errors(value: Any) -> None:
    check_endpoint(value)


@settings(max_examples=500, deadline=None)
@given(valid_endpoint_dicts() | mutated(valid_endpoint_dicts()))
def test_endpoint_from_dict_on_nearly_valid_records_only_raises_megatron_errors(
    value: dict[str, Any],
) -> None:
    check_endpoint(value)


@settings(max_examples=200, deadline=None)
@given(valid_capability_dicts())
def test_valid_records_always_load_and_agree_with_the_megatron_reader(
    caps: dict[str, Any],
) -> None:
    value = {"coordinator_address": ADDRESS, "capabilities": caps}
    endpoint = InferenceEngineEndpoint.from_dict(value)
    policies = policies_knowing(caps.get("prefix_caching_coordinator_policy"))
    assert endpoint.to_dict() == megatron_from_dict(json.loads(json.dumps(value)), policies)
