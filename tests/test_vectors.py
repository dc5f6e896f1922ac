"""The record as a published contract (docs/record.md): its schema and its test vectors.

``docs/record.schema.json`` is what ``discovery schema`` prints, generated from the record's
declaration. Each ``tests/vectors/*.json`` is a stored value (``value``) and what a reader
must do with it: ``valid`` ones decode on both of our decode paths and keep every key and
value they carry (``megatron_policies``: the enum of the Megatron version that wrote it,
whose ``from_dict`` reads it back; ``routed_as``: what ``auto`` makes of its policy);
invalid ones raise the ``error`` named. The JSON Schema validator agrees on every vector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jsonschema import Draft202012Validator

from discovery import Candidate, KeySpace, RecordDecodeError, record_schema
from discovery._records.codec import _exact_record, _fast_record, _wire_decoder, encode
from discovery._records.record import STORED
from discovery.cli import main

from .test_endpoint import megatron_from_dict

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "docs" / "record.schema.json"
VECTORS = sorted((Path(__file__).resolve().parent / "vectors").glob("*.json"))
KEYS = KeySpace()
ENGINE_ID = "engine-0"
KEY = KEYS.key(ENGINE_ID)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_discovery_schema_prints_the_committed_schema(capsys: pytest.CaptureFixture) -> None:
    assert main(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == SCHEMA_FILE.read_text(), "out of date: run ./dev docs"
    assert json.loads(printed) == record_schema()


def test_the_schema_is_valid_draft_2020_12_and_follows_the_declaration() -> None:
    schema = record_schema()
    Draft202012Validator.check_schema(schema)
    names = [*schema["properties"]][3:]  # after coordinator_address, capabilities, engine_id
    assert names == [name for name, _ in STORED], "every declared field, in order"
    # Unknown keys are allowed everywhere: no object forbids them.
    assert Draft202012Validator(schema).is_valid(
        {
            "coordinator_address": "tcp://x:1",
            "capabilities": {
                **{k: 1 for k in schema["properties"]["capabilities"]["required"]},
                "enable_prefix_caching": True,
                "new": [],
            },
            "kv_layout": {
                **dict.fromkeys(schema["properties"]["kv_layout"]["required"], 1),
                "dtype": "bfloat16",
                "new": {},
            },
            "new": None,
        }
    )


def test_there_are_vectors_of_every_kind() -> None:
    vectors = [load(path) for path in VECTORS]
    policies = {
        v["value"]["capabilities"].get("prefix_caching_coordinator_policy")
        for v in vectors
        if v["valid"]
    }
    assert {"round_robin", "load_balanced", "first_prefix_block", None} <= policies
    assert any(v["valid"] and "future_top" in v["value"] for v in vectors)
    assert sum(not v["valid"] for v in vectors) >= 10


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_a_vector_is_judged_alike_by_the_schema_and_both_decode_paths(path: Path) -> None:
    vector = load(path)
    value = vector["value"]
    data = json.dumps(value).encode()
    errors = sorted(e.message for e in Draft202012Validator(record_schema()).iter_errors(value))
    if not vector["valid"]:
        assert errors, "the schema accepts an invalid vector"
        with pytest.raises(RecordDecodeError) as exact:
            _exact_record(KEY, json.loads(data), ENGINE_ID)
        assert vector["error"] in exact.value.reason
        with pytest.raises((msgspec.MsgspecError, ValueError, TypeError)):
            _fast_record(_wire_decoder.decode(data), ENGINE_ID)
        with pytest.raises(RecordDecodeError, match=vector["error"].replace("*", r"\*")):
            KEYS.decode(KEY, data)
        return
    assert errors == [], errors
    record = KEYS.decode(KEY, data)
    assert record == _exact_record(KEY, json.loads(data), ENGINE_ID)
    try:
        fast = _fast_record(_wire_decoder.decode(data), ENGINE_ID)
    except (msgspec.MsgspecError, ValueError, TypeError):
        # The fast path declines only what it cannot hold: keys this version does not know.
        assert record.extra or record.extra_capabilities
    else:
        assert fast == record
    # Written back: every key and value it carried, unchanged (defaults may be added).
    written = json.loads(encode(record))
    assert {k: written[k] for k in value if k != "capabilities"} == {
        k: v for k, v in value.items() if k != "capabilities"
    }
    capabilities = value["capabilities"]
    assert {k: written["capabilities"][k] for k in capabilities} == capabilities
    assert KEYS.decode(KEY, encode(record)) == record
    # The Megatron version that wrote it reads it back; auto routes it as said.
    policies = tuple(vector.get("megatron_policies", ()))
    if policies:
        read = megatron_from_dict(written, policies)["capabilities"]
        assert read == megatron_from_dict(value, policies)["capabilities"]
    assert Candidate(record).advertised == vector["routed_as"]
