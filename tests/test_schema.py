"""One record schema: a field is declared once; keys we do not know survive every rewrite."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from discovery import (
    EngineStatus,
    InferenceEngineEndpoint,
    InvalidRecordError,
    PrefixCachingCoordinatorPolicy,
    RegistrationState,
    Settings,
    drain,
    register_dynamic_engine,
    register_engine,
    undrain,
)
from discovery._records.codec import KeySpace, encode
from discovery._records.record import EngineRecord

from .conftest import Store
from .helpers import MEGATRON_FIELDS, caps_kwargs, make_endpoint, wait_for

PACKAGE = Path(__file__).resolve().parent.parent / "discovery"

NEW_FIELD = """
    priority: int | None = _stored(
        form=Form(int | None, _priority, int, _priority, {"type": "integer", "maximum": 9}),
        json="integer",
        doc="how much the scheduler favours the engine (0-9)",
        column=Column("PRIO", lambda r: "-" if r.priority is None else f"p{r.priority}", lead=True),
    )
"""
NEW_CHECK = """

def _priority(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
        raise InvalidRecordError(f"priority must be an integer from 0 to 9, not {value!r}")
    return value
"""
PROBE = """
import json, sys
from discovery import EndpointEvent, EventType, InferenceEngineCapabilities as C
from discovery import InferenceEngineEndpoint as E, InvalidRecordError
from discovery._records.codec import KeySpace, encode
from discovery._records.record import EngineRecord, field_table, record_schema
from discovery.cli._commands import format_event

endpoint = E("tcp://a:1", C(8192, 256, 100, 8, 4096, 1, True))
record = EngineRecord("e1", endpoint, priority=7)
value = encode(record)
back = KeySpace().decode(KeySpace().key("e1"), value)
try:
    EngineRecord("e1", endpoint, priority=12)
    refused = None
except InvalidRecordError as exc:
    refused = str(exc)
try:
    KeySpace().decode(KeySpace().key("e1"), value.replace(b'"priority":7', b'"priority":"7"'))
    bad_value = None
except ValueError as exc:
    bad_value = str(exc)
event = EndpointEvent(EventType.ADDED, KeySpace().key("e1"), 5, back)
print(json.dumps({
    "stored": json.loads(value),
    "round_trip": back == record and back.priority == 7,
    "refused": refused,
    "bad_value": bad_value,
    "table": field_table(),
    "jsonl": event.to_dict(),
    "text": format_event(event, "text"),
    "headers": EngineRecord.column_headers(lead=True),
    "schema": record_schema()["properties"]["priority"],
}))
"""


@pytest.mark.external  # a fresh interpreter
def test_a_field_declared_in_one_place_is_stored_checked_shown_and_documented(
    tmp_path: Path,
) -> None:
    """Add one field to EngineRecord (one declaration) in a copy of the package: encode,
    both decode paths, validation, the CLI's columns, the jsonl form, the docs' table and
    the JSON Schema all carry it, with no other edit."""
    copy = tmp_path / "discovery"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "_records" / "record.py").read_text()
    anchor = "    extra: Mapping[str, Any] = field("
    assert source.count(anchor) == 1
    source = source.replace(anchor, NEW_FIELD.lstrip("\n") + anchor)
    source = source.replace("\n\n# -- the record --", NEW_CHECK + "\n\n# -- the record --")
    (copy / "_records" / "record.py").write_text(source)
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["stored"]["priority"] == 7
    assert out["round_trip"] is True
    assert "priority must be an integer from 0 to 9, not 12" in out["refused"]
    assert "priority must be an integer from 0 to 9, not '7'" in out["bad_value"]
    assert (
        "| `priority` | integer | how much the scheduler favours the engine (0-9) |"
        in (out["table"])
    )
    assert out["jsonl"]["priority"] == 7
    assert out["headers"] == ["STATUS", "VERSION", "ROLE", "PRIO"]
    assert " ready p7 rev=5" in out["text"]
    assert out["schema"] == {  # discovery schema (docs/record.schema.json) has it too
        "description": "how much the scheduler favours the engine (0-9)",
        "type": ["integer", "null"],
        "maximum": 9,
    }


def test_the_declared_fields_are_the_stored_metadata() -> None:
    record = EngineRecord(
        "e1",
        make_endpoint(),
        labels={"a": "b"},
        registered_at=None,
        status=EngineStatus.DRAINING,
        drain_deadline=None,
    )
    value = json.loads(encode(record))
    assert list(value) == ["coordinator_address", "capabilities", "engine_id", "labels", "status"]
    assert list(value["capabilities"]) == list(MEGATRON_FIELDS)


# -- keys this version does not know --------------------------------------------------------

FUTURE_TOP = {"weights": {"step": 42, "digest": "ab12"}, "zone_hint": ["a", None, 1.5]}
FUTURE_CAPS = {"speculative_tokens": 4, "kv_dtype": "fp8"}


def _with_future_keys(value: bytes) -> bytes:
    """The stored value as a newer writer would leave it: unknown keys at both levels."""
    obj = json.loads(value)
    obj["capabilities"].update(FUTURE_CAPS)
    obj.update(FUTURE_TOP)
    return json.dumps(obj).encode()


def _assert_future_keys(stored: dict[str, Any]) -> None:
    for key, value in FUTURE_TOP.items():
        assert stored[key] == value, key
    for key, value in FUTURE_CAPS.items():
        assert stored["capabilities"][key] == value, key


def test_unknown_keys_decode_into_extra_and_encode_back_unchanged() -> None:
    record = EngineRecord("e1", make_endpoint(), labels={"m": "x"})
    value = _with_future_keys(encode(record))
    decoded = KeySpace().decode(KeySpace().key("e1"), value)
    assert dict(decoded.extra) == FUTURE_TOP
    assert dict(decoded.extra_capabilities) == FUTURE_CAPS
    assert dataclasses.replace(decoded, extra={}, extra_capabilities={}) == record
    again = json.loads(encode(decoded))
    assert again == json.loads(value)
    # Megatron's reader still loads it (it ignores keys it does not know).
    assert InferenceEngineEndpoint.from_dict(again) == record.endpoint


def test_a_record_refuses_known_names_as_unknown_keys() -> None:
    with pytest.raises(InvalidRecordError, match=r"\['status'\] are fields of the record"):
        EngineRecord("e1", make_endpoint(), extra={"status": "ready"})
    with pytest.raises(InvalidRecordError, match="context_length"):
        EngineRecord("e1", make_endpoint(), extra_capabilities={"context_length": 1})
    with pytest.raises(InvalidRecordError, match="not JSON"):
        encode(EngineRecord("e1", make_endpoint(), extra={"when": object()}))


def _stored(store: Store, key: str) -> dict[str, Any]:
    """The stored value at ``key``."""
    kv = wait_for(lambda: store.get(key), message=f"{key} in etcd")
    return json.loads(kv.value)


def _outside_write(store: Store, key: str, change: Any) -> None:
    """Rewrite the stored value on its lease, as another writer would (compare-and-swap)."""
    found = store.get(key)
    assert found is not None
    result = store.port.update(
        key, change(found.value), found.lease, mod_revision=found.mod_revision
    )
    assert result.succeeded


def test_unknown_keys_survive_update_drain_undrain_and_reregistration(store: Store) -> None:
    key = store.settings.keyspace.key("future")
    with register_engine(make_endpoint(), engine_id="future", ttl=30, **store.using()) as reg:
        _outside_write(store, key, _with_future_keys)
        wait_for(lambda: reg.record.extra, message="the registrar adopts the unknown keys")
        assert dict(reg.record.extra_capabilities) == FUTURE_CAPS

        reg.update(labels={"model": "m2"})
        stored = _stored(store, key)
        assert stored["labels"] == {"model": "m2"}
        _assert_future_keys(stored)

        assert drain("future", **store.using()).status is EngineStatus.DRAINING
        _assert_future_keys(_stored(store, key))
        assert undrain("future", **store.using()).status is EngineStatus.READY
        _assert_future_keys(_stored(store, key))

        # The lease goes (an operator's revoke): the registrar writes its record again.
        lease = reg.lease_id
        store.port.revoke(lease)
        wait_for(
            lambda: reg.lease_id != lease and reg.state is RegistrationState.REGISTERED,
            message="registered again on a new lease",
        )
        stored = _stored(store, key)
        _assert_future_keys(stored)
        assert stored["labels"] == {"model": "m2"}


# -- Megatron's own objects -------------------------------------------------------------------


class MegatronStylePolicy(str):
    """Megatron's str-valued enum member, as ``dataclasses.asdict`` leaves it."""


class MegatronStyleEndpoint:
    """A class of this test's own with Megatron's fields and ``to_dict()`` (not ours)."""

    def __init__(self, address: str, **capabilities: Any) -> None:
        self.coordinator_address = address
        self.capabilities = SimpleNamespace(**capabilities)

    def to_dict(self) -> dict[str, Any]:
        return {
            "coordinator_address": self.coordinator_address,
            "capabilities": dict(vars(self.capabilities)),
        }


def test_megatron_shaped_endpoint_objects_register(store: Store) -> None:
    theirs = MegatronStyleEndpoint(
        "tcp://10.1.1.1:7000",
        **caps_kwargs(),
        logical_data_parallel_size=1,
        prefix_caching_coordinator_policy=MegatronStylePolicy("longest_prefix"),
        kv_dtype="fp8",  # a field of a newer Megatron
    )
    key = store.settings.keyspace.key("theirs")
    with register_engine(theirs, engine_id="theirs", **store.using()) as reg:
        stored = _stored(store, key)
        assert stored["coordinator_address"] == "tcp://10.1.1.1:7000"
        assert stored["capabilities"]["prefix_caching_coordinator_policy"] == "longest_prefix"
        assert stored["capabilities"]["kv_dtype"] == "fp8"
        policy = reg.endpoint.capabilities.prefix_caching_coordinator_policy
        assert policy is PrefixCachingCoordinatorPolicy.LONGEST_PREFIX
        # update() takes one too; the new object's own unknown capability replaces the old.
        newer = MegatronStyleEndpoint("tcp://10.1.1.1:7001", **caps_kwargs(), kv_dtype="fp4")
        reg.update(endpoint=newer)
        stored = _stored(store, key)
        assert stored["coordinator_address"] == "tcp://10.1.1.1:7001"
        assert stored["capabilities"]["kv_dtype"] == "fp4"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (object(), "InferenceEngineEndpoint or have Megatron's to_dict"),
        (SimpleNamespace(to_dict=lambda: ["x"]), "is a list, not a mapping"),
        (
            SimpleNamespace(to_dict=lambda: {"coordinator_address": "tcp://a:1"}),
            "missing field 'capabilities'",
        ),
        (
            SimpleNamespace(
                to_dict=lambda: {"coordinator_address": "tcp://a:1", "capabilities": {}}
            ),
            "missing field 'context_length'",
        ),
        (
            SimpleNamespace(
                to_dict=lambda: {
                    "coordinator_address": "tcp://a:1",
                    "capabilities": caps_kwargs(),
                    "status": "ready",
                }
            ),
            r"\['status'\] are fields of the record",
        ),
    ],
)
def test_bad_endpoint_objects_are_refused_before_any_write(bad: Any, message: str) -> None:
    settings = Settings(endpoints=["http://127.0.0.1:9"], dial_timeout=0.1)  # never reached
    started = time.monotonic()
    with pytest.raises(InvalidRecordError, match=message):
        register_engine(bad, engine_id="bad", settings=settings)
    assert time.monotonic() - started < 1.0  # refused before any connection attempt


def _engine(config: object) -> SimpleNamespace:
    """A stand-in DynamicInferenceEngine: only the attributes ``from_engine`` reads."""
    return SimpleNamespace(
        context=SimpleNamespace(
            max_sequence_length=4096,
            block_size_tokens=64,
            kv_block_allocator=SimpleNamespace(pool_size=101),
            max_requests=16,
            max_tokens=2048,
            enable_prefix_caching=True,
            config=config,
        ),
        controller=SimpleNamespace(tokenizer=SimpleNamespace(bos=2)),
    )


def test_from_engine_works_on_a_config_without_the_policy_field(store: Store) -> None:
    """Megatron before March 2026: the inference config has no routing policy."""
    old = _engine(SimpleNamespace(other_setting=1))
    endpoint = InferenceEngineEndpoint.from_engine("tcp://old:1", old)
    assert endpoint.capabilities.prefix_caching_coordinator_policy is None
    assert endpoint.capabilities.total_kv_blocks == 100
    with register_dynamic_engine(old, "tcp://old:1", engine_id="old", **store.using()):
        stored = _stored(store, store.settings.keyspace.key("old"))
        assert stored["capabilities"]["prefix_caching_coordinator_policy"] is None
    new = _engine(SimpleNamespace(prefix_caching_coordinator_policy="load_balanced"))
    policy = InferenceEngineEndpoint.from_engine("tcp://new:1", new).capabilities
    assert policy.prefix_caching_coordinator_policy is PrefixCachingCoordinatorPolicy.LOAD_BALANCED
