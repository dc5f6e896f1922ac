"""Which prefill engine can hand a request's KV to which decode engine: Megatron's rules.

Each row of the table cites the rule in Megatron-LM (main d98e8a64 unless named; the
facts with their commits are in docs/prefill-decode.md). Pure, but for the
operators' rewrites (the ``store`` fixture: in memory, and real etcd).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from discovery import (
    EndpointEvent,
    EngineRecord,
    EngineRole,
    EngineStatus,
    EventType,
    InvalidRecordError,
    KeySpace,
    KvLayout,
    KvTransferBackend,
    drain,
    handoff_key,
    handoff_problem,
    undrain,
)
from discovery._records.codec import encode
from discovery.cli._commands import format_event

from .conftest import Store
from .helpers import make_endpoint, make_layout

DISAGG = "megatron/core/inference/disaggregation"


def engine(
    engine_id: str,
    role: str = "prefill",
    *,
    backend: str | None = "nixl",
    layout: KvLayout | None = None,
    stored: dict[str, Any] | None = None,
    **capabilities: Any,
) -> EngineRecord:
    """An engine's record; ``stored`` overrides keys of its stored value (a newer writer's)."""
    record = EngineRecord(
        engine_id,
        make_endpoint(**capabilities),
        role=role,
        kv_transfer_backend=backend,
        kv_layout=make_layout() if layout is None else layout,
    )
    if not stored:
        return record
    value = json.loads(encode(record))
    for key, override in stored.items():
        if isinstance(override, dict):
            value[key] = {**value[key], **override}
        else:
            value[key] = override
    keys = KeySpace()
    return keys.decode(keys.key(engine_id), json.dumps(value).encode())


# (prefill, decode, None or a piece of the reason, the Megatron rule it follows)
Row = tuple[EngineRecord, EngineRecord, str | None, str]
COMPATIBLE: dict[str, Row] = {
    "the same layout": (
        engine("p"),
        engine("d", "decode"),
        None,
        f"{DISAGG}/transfer_backends/nixl.py begin_pull_blocks: full-slice transfers",
    ),
    "TP 4 to TP 1: KV heads resharded": (
        engine("p", layout=make_layout(tp_size=4)),
        engine("d", "decode", layout=make_layout(tp_size=1)),
        None,
        f"{DISAGG}/kv_reshard.py plan_kv_reshard: head ranges intersected per rank pair",
    ),
    "TP 1 to TP 8 (8 KV heads)": (
        engine("p", layout=make_layout(tp_size=1)),
        engine("d", "decode", layout=make_layout(tp_size=8)),
        None,
        f"{DISAGG}/kv_reshard.py KVShardLayout: TP divides the KV heads on each side",
    ),
    "PP 2 to PP 1, TP 1 to TP 2": (
        engine("p", layout=make_layout(tp_size=1, pp_size=2)),
        engine("d", "decode", layout=make_layout(tp_size=2, pp_size=1)),
        None,
        f"{DISAGG}/inference_state_handoff.py setup_kv_transfer: explicit layer windows "
        "per PP stage; kv_reshard.py intersects layer ranges",
    ),
    "PP 3 over 32 layers (an uneven split)": (
        engine("p", layout=make_layout(pp_size=3)),
        engine("d", "decode"),
        None,
        f"{DISAGG}/kv_reshard.py KVShardLayout: an explicit (layer_start, num_local_layers) "
        "window may be uneven",
    ),
    "capacities differ (blocks, sequences, context)": (
        engine("p", total_kv_blocks=100, max_num_seqs=8, context_length=4096),
        engine("d", "decode", total_kv_blocks=9000, max_num_seqs=256),
        None,
        f"{DISAGG}/decode_admission.py: capacity is checked per request at admission",
    ),
    "a hybrid model on both (4 SSM layers)": (
        engine("p", layout=make_layout(num_ssm_layers_global=4)),
        engine("d", "decode", layout=make_layout(tp_size=1, num_ssm_layers_global=4)),
        None,
        f"{DISAGG}/ssm_reshard.py plan_ssm_reshard: SSM state resharded between TP layouts",
    ),
    "MTP on both (2 proposals)": (
        engine("p", layout=make_layout(num_speculative_tokens=2)),
        engine("d", "decode", layout=make_layout(num_speculative_tokens=2)),
        None,
        f"{DISAGG}/inference_state_handoff.py: resume tokens = num_speculative_tokens + 1",
    ),
    "the backend written as Megatron's registry reads it ('NIXL')": (
        engine("p", backend="NIXL"),
        engine("d", "decode"),
        None,
        f"{DISAGG}/transfer_backends/base.py construct_kv_transfer_backend_class: "
        "name.lower().replace('_', '-')",
    ),
    "a dtype and a layout key this version does not know, equal on both": (
        engine("p", stored={"kv_layout": {"dtype": "float8_e4m3fn", "kv_lora_rank": 512}}),
        engine(
            "d", "decode", stored={"kv_layout": {"dtype": "float8_e4m3fn", "kv_lora_rank": 512}}
        ),
        None,
        "equal values are equal whatever they mean",
    ),
}
INCOMPATIBLE: dict[str, Row] = {
    "two prefill engines": (
        engine("p"),
        engine("q"),
        "q has role 'prefill', not 'decode'",
        f"{DISAGG}/inference_state_handoff.py add_request_with_kv_handoff: decode side only",
    ),
    "an aggregated engine as the prefill side": (
        engine("a", "aggregated"),
        engine("d", "decode"),
        "a has role 'aggregated', not 'prefill'",
        "engines/dynamic_engine.py: without DisaggDynamicInferenceEngine a hand-off raises "
        "'requires KV handoff, but it is not enabled'",
    ),
    "an aggregated engine as the decode side": (
        engine("p"),
        engine("a", "aggregated"),
        "a has role 'aggregated', not 'decode'",
        "engines/dynamic_engine.py add_request_with_kv_handoff: the raising stub",
    ),
    "a decode engine as the prefill side": (
        engine("d", "decode"),
        engine("e", "decode"),
        "d has role 'decode', not 'prefill'",
        f"{DISAGG}/inference_state_handoff.py schedule_waiting_requests: a decode engine "
        "cannot schedule prompt prefill requests",
    ),
    "a role this version does not know": (
        engine("p", stored={"role": "encode"}),
        engine("d", "decode"),
        "p has role 'encode', not 'prefill'",
        "an unknown role is never offered (the tolerant-reader rule)",
    ),
    "no backend declared": (
        engine("p", backend=None),
        engine("d", "decode"),
        "p declares no kv_transfer_backend",
        "the record cannot show the pair shares a backend",
    ),
    "a backend this version does not know": (
        engine("p", stored={"kv_transfer_backend": "mooncake"}),
        engine("d", "decode", stored={"kv_transfer_backend": "mooncake"}),
        "kv_transfer_backend 'mooncake' is unknown",
        f"{DISAGG}/transfer_backends/base.py: 'nixl' or 'nccl' only",
    ),
    "nixl to nccl": (
        engine("p"),
        engine("d", "decode", backend="nccl"),
        "d nccl hands off only inside one torch.distributed process group",
        f"{DISAGG}/transfer_backends/nccl.py: a nixl peer's metadata has no nccl_rank",
    ),
    "nccl on both, two registered engines": (
        engine("p", backend="nccl"),
        engine("d", "decode", backend="nccl"),
        "p nccl hands off only inside one torch.distributed process group",
        f"{DISAGG}/transfer_backends/nccl.py: 'the prefill and decode workers must share a "
        "process group'; coordinator_setup.py (PR 6675): one coordinator per world",
    ),
    "prefix caching off on the decode engine": (
        engine("p"),
        engine("d", "decode", enable_prefix_caching=False),
        "d has prefix caching off",
        f"{DISAGG}/inference_state_handoff.py setup_kv_transfer: 'KV handoff requires prefix "
        "caching on both prefill and decode engines'",
    ),
    "no layout declared": (
        engine("p"),
        EngineRecord("d", make_endpoint(), role="decode", kv_transfer_backend="nixl"),
        "d declares no kv_layout",
        "the record cannot show the layouts match or reshard",
    ),
    "TP 16 over 8 KV heads (replicated heads)": (
        engine("p", layout=make_layout(tp_size=16)),
        engine("d", "decode"),
        "tp_size 16 does not divide its 8 KV heads",
        f"{DISAGG}/transfer_backends/base.py compute_buffer_geometry: no layout unless "
        "heads_per_partition * tp_size == num_kv_heads_global",
    ),
    "TP 3 over 8 KV heads": (
        engine("p"),
        engine("d", "decode", layout=make_layout(tp_size=3)),
        "tp_size 3 does not divide its 8 KV heads",
        f"{DISAGG}/kv_reshard.py KVShardLayout: 'num_heads not divisible by tp_size'",
    ),
    "block sizes 256 and 128": (
        engine("p"),
        engine("d", "decode", kv_cache_block_size=128),
        "kv_cache_block_size differs: 256 on p, 128 on d",
        f"{DISAGG}/inference_state_handoff.py add_request_with_kv_handoff: 'requires every "
        "prompt KV block' counted in the decode's block_size_tokens; nixl.py tokens_per_block",
    ),
    "32 and 40 layers": (
        engine("p"),
        engine("d", "decode", layout=make_layout(num_layers_global=40)),
        "num_layers_global differs: 32 on p, 40 on d",
        f"{DISAGG}/kv_reshard.py plan_kv_reshard: 'src and dst describe different global models'",
    ),
    "8 and 32 KV heads": (
        engine("p"),
        engine("d", "decode", layout=make_layout(num_kv_heads_global=32)),
        "num_kv_heads_global differs: 8 on p, 32 on d",
        f"{DISAGG}/kv_reshard.py plan_kv_reshard: 'src and dst describe different global models'",
    ),
    "head size 128 and 64": (
        engine("p"),
        engine("d", "decode", layout=make_layout(head_dim=64)),
        "head_dim differs: 128 on p, 64 on d",
        f"{DISAGG}/transfer_backends/nixl.py _validate_peer: 'transfer geometry mismatch: "
        "head_dim'",
    ),
    "bfloat16 and float16 (the same element size)": (
        engine("p"),
        engine("d", "decode", layout=make_layout(dtype="float16")),
        "dtype differs: bfloat16 on p, float16 on d",
        f"{DISAGG}/transfer_backends/nixl.py copies bytes as they are (it checks "
        "element_size only); nccl.py receives into the decode's dtype",
    ),
    "bfloat16 and float32": (
        engine("p", layout=make_layout(dtype="float32")),
        engine("d", "decode"),
        "dtype differs: float32 on p, bfloat16 on d",
        f"{DISAGG}/transfer_backends/nixl.py _validate_peer: element_size",
    ),
    "a hybrid prefill, a transformer decode": (
        engine("p", layout=make_layout(num_ssm_layers_global=4)),
        engine("d", "decode"),
        "num_ssm_layers_global differs: 4 on p, 0 on d",
        f"{DISAGG}/inference_state_handoff.py: 'Transformer decode received SSM metadata "
        "from a hybrid prefill'",
    ),
    "MTP 2 on prefill, none on decode": (
        engine("p", layout=make_layout(num_speculative_tokens=2)),
        engine("d", "decode"),
        "num_speculative_tokens differs: 2 on p, 0 on d",
        f"{DISAGG}/inference_state_handoff.py: 'Decode-only handoff requires one sampled "
        "token plus the configured MTP proposals'",
    ),
    "a layout key this version does not know, on one side only": (
        engine("p", stored={"kv_layout": {"kv_lora_rank": 512}}),
        engine("d", "decode"),
        "extra differs",
        "what this version cannot read must be equal to be safe",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPATIBLE))
def test_compatible_pairs(case: str) -> None:
    prefill, decode, _, _rule = COMPATIBLE[case]
    assert handoff_problem(prefill, decode) is None


@pytest.mark.parametrize("case", sorted(INCOMPATIBLE))
def test_incompatible_pairs_say_why(case: str) -> None:
    prefill, decode, reason, _rule = INCOMPATIBLE[case]
    problem = handoff_problem(prefill, decode)
    assert problem is not None and reason is not None
    assert reason in problem, problem


@pytest.mark.parametrize("case", sorted({**COMPATIBLE, **INCOMPATIBLE}))
def test_compatible_exactly_when_the_keys_are_equal(case: str) -> None:
    prefill, decode, _, _rule = {**COMPATIBLE, **INCOMPATIBLE}[case]
    roles = prefill.role is EngineRole.PREFILL and decode.role is EngineRole.DECODE
    key = handoff_key(prefill)
    same = roles and key is not None and key == handoff_key(decode)
    assert (handoff_problem(prefill, decode) is None) == same


def test_unknown_values_read_from_etcd_are_kept_and_written_back() -> None:
    record = engine(
        "p",
        stored={
            "role": "encode",
            "kv_transfer_backend": "mooncake",
            "kv_layout": {"dtype": "float8_e4m3fn", "kv_lora_rank": 512},
        },
    )
    assert record.role == "encode" and not isinstance(record.role, EngineRole)
    assert record.kv_transfer_backend == "mooncake"
    assert not isinstance(record.kv_transfer_backend, KvTransferBackend)
    assert record.kv_layout is not None and record.kv_layout.dtype == "float8_e4m3fn"
    assert dict(record.kv_layout.extra) == {"kv_lora_rank": 512}
    value = json.loads(encode(record))
    assert (value["role"], value["kv_transfer_backend"]) == ("encode", "mooncake")
    assert value["kv_layout"]["kv_lora_rank"] == 512
    assert value["kv_layout"]["dtype"] == "float8_e4m3fn"


def test_an_aggregated_record_stores_no_role_and_reads_as_aggregated() -> None:
    value = json.loads(encode(EngineRecord("a", make_endpoint())))
    assert "role" not in value and "kv_layout" not in value
    keys = KeySpace()
    assert keys.decode(keys.key("a"), json.dumps(value).encode()).role is EngineRole.AGGREGATED


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"role": "prefil"}, "role 'prefil' is not one of aggregated, prefill, decode"),
        ({"role": 1}, "role 1 is not one of"),
        ({"kv_transfer_backend": "ucx"}, "kv_transfer_backend 'ucx' is not one of nixl, nccl"),
        ({"kv_layout": {"tp_size": 2}}, "kv_layout must be a KvLayout, not dict"),
    ],
)
def test_values_given_in_python_are_checked_strictly(given: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        EngineRecord("e", make_endpoint(), **given)


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ({"role": 7}, "role must be a string, not 7"),
        ({"role": "x" * 300}, "is not a name"),
        ({"kv_layout": {"tp_size": 2.0}}, "kv_layout tp_size must be an integer >= 1, not 2.0"),
        ({"kv_layout": {"head_dim": True}}, "kv_layout head_dim must be an integer >= 1"),
        ({"kv_layout": {"pp_size": 0}}, "kv_layout pp_size must be an integer >= 1, not 0"),
        ({"kv_layout": ["tp_size"]}, "kv_layout must be an object, not list"),
    ],
)
def test_values_of_the_wrong_type_in_etcd_are_named(stored: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        engine("e", stored=stored)


def test_a_stored_layout_missing_a_key_is_named() -> None:
    value = json.loads(encode(engine("e")))
    del value["kv_layout"]["head_dim"]
    keys = KeySpace()
    with pytest.raises(InvalidRecordError, match="kv_layout is missing head_dim"):
        keys.decode(keys.key("e"), json.dumps(value).encode())


def test_a_layout_given_as_text() -> None:
    text = (
        "tp_size=2,pp_size=1,num_layers_global=32,num_kv_heads_global=8,head_dim=128,dtype=bfloat16"
    )
    assert KvLayout.parse(text) == make_layout()
    assert KvLayout.parse(text + ",num_speculative_tokens=1").num_speculative_tokens == 1
    for bad, message in [
        (text + ",tp=2", "'tp=2' must be KEY=VALUE with KEY one of tp_size, pp_size"),
        (text.replace("head_dim=128", "head_dim=x"), "head_dim must be an integer, not 'x'"),
        (text.replace(",head_dim=128", ""), "kv_layout is missing head_dim"),
        (text.replace("bfloat16", "bf16"), "dtype 'bf16' is not one of bfloat16, float16"),
    ]:
        with pytest.raises(InvalidRecordError, match=message):
            KvLayout.parse(bad)


def test_the_cli_shows_a_role_other_than_aggregated() -> None:
    keys = KeySpace()
    shown = {}
    for role in ("aggregated", "prefill", "decode"):
        record = EngineRecord(role, make_endpoint(), role=role, weight_version=3)
        event = EndpointEvent(EventType.ADDED, keys.key(role), 5, record)
        shown[role] = format_event(event, "text")
    assert " ready v3 rev=5" in shown["aggregated"]  # the absent role, as an absent version
    assert " ready v3 prefill rev=5" in shown["prefill"]
    assert " ready v3 decode rev=5" in shown["decode"]
    assert EngineRecord.column_headers(lead=True) == ["STATUS", "VERSION", "ROLE"]


def test_values_it_does_not_know_survive_an_operators_drain_and_undrain(store: Store) -> None:
    newer = engine(
        "newer",
        stored={
            "role": "encode",
            "kv_transfer_backend": "mooncake",
            "kv_layout": {"dtype": "float8_e4m3fn", "kv_lora_rank": 512},
        },
    )
    key = store.settings.keyspace.key("newer")
    lease = store.port.grant(30)
    try:
        assert store.port.create(key, encode(newer), lease).succeeded
        assert drain("newer", **store.using()).status is EngineStatus.DRAINING
        assert undrain("newer", **store.using()).role == "encode"
        value = json.loads(store.get(key).value)
        assert (value["role"], value["kv_transfer_backend"]) == ("encode", "mooncake")
        assert value["kv_layout"]["dtype"] == "float8_e4m3fn"
        assert value["kv_layout"]["kv_lora_rank"] == 512
    finally:
        store.port.revoke(lease)
