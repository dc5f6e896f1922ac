"""Codec: encode + decode + validate per record, next to bare JSON parsers of the same bytes.

Run: ``.venv/bin/python bench/bench_codec.py [--records 10000]``. No etcd. The records are
what ``register_engine`` writes: a full endpoint, three labels and ``registered_at``.
Each figure is the best of 7 passes over all records (per-record mean of the thread's CPU
time within a pass), so it is the cost without interference from other processes. The JSON
libraries the codec could use are measured on the same bytes: orjson and msgspec bare, orjson
followed by Megatron's ``from_dict`` and our checks (the orjson design), msgspec decoding
into typed Structs (the design the codec uses): the numbers that chose msgspec.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from datetime import UTC, datetime

import msgspec
import orjson
from _common import LABELS, Target, make_endpoint, record_results, table_text, write_json

from discovery import EngineRecord, InferenceEngineEndpoint, KeySpace
from discovery._records.codec import _exact_record, _WireCapabilities, encode

PASSES = 7


class _WireValue(msgspec.Struct):
    """What msgspec would check by itself: types, not ranges, label rules or times."""

    coordinator_address: str
    capabilities: _WireCapabilities
    engine_id: str | None = None
    labels: dict[str, str] | None = None
    registered_at: str | None = None


def best_per_item(fn, items) -> float:
    """Microseconds per item: the best of PASSES passes of ``fn`` over ``items``."""
    best = float("inf")
    for _ in range(PASSES):
        gc.collect()
        gc.disable()
        try:
            t0 = time.thread_time_ns()
            for item in items:
                fn(item)
            elapsed = time.thread_time_ns() - t0
        finally:
            gc.enable()
        best = min(best, elapsed / len(items) / 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()

    keyspace = KeySpace()
    now = datetime.now(UTC)
    records = [
        EngineRecord(f"engine-{i:06d}", make_endpoint(i), LABELS, registered_at=now)
        for i in range(args.records)
    ]
    values = [encode(r) for r in records]
    keys = [keyspace.key(r.engine_id).encode() for r in records]
    pairs = list(zip(keys, values, strict=True))
    texts = [(keyspace.key(r.engine_id), v) for r, v in zip(records, values, strict=True)]
    objs = [json.loads(v) for v in values]
    dicts = [r.to_value() for r in records]
    size = sum(map(len, values)) / len(values)
    typed = msgspec.json.Decoder(_WireValue)
    untyped = msgspec.json.Decoder()
    json_encoder = msgspec.json.Encoder()

    def roundtrip(i: int) -> None:
        keyspace.decode(keys[i], encode(records[i]))

    def dumps(value: dict) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    indexes = range(len(records))
    rows = {
        "json.loads (bare, same bytes)": best_per_item(json.loads, values),
        "orjson.loads (bare)": best_per_item(orjson.loads, values),
        "msgspec.json.decode (bare, untyped)": best_per_item(untyped.decode, values),
        "msgspec.json.decode into Structs (types only)": best_per_item(typed.decode, values),
        "orjson.loads + from_dict + checks (not chosen)": best_per_item(
            lambda kv: _exact_record(kv[0], orjson.loads(kv[1]), keyspace.engine_id(kv[0])), texts
        ),
        "decode + validate (KeySpace.decode)": best_per_item(
            lambda kv: keyspace.decode(*kv), pairs
        ),
        "  of which: key -> engine id (regex)": best_per_item(
            lambda k: keyspace.engine_id(k.decode()), keys
        ),
        "  InferenceEngineEndpoint.from_dict (exact path)": best_per_item(
            InferenceEngineEndpoint.from_dict, objs
        ),
        "encode (to_value + msgspec + size check)": best_per_item(encode, records),
        "  of which: EngineRecord.to_value": best_per_item(EngineRecord.to_value, records),
        "  json.dumps of the same dict": best_per_item(dumps, dicts),
        "  orjson.dumps of the same dict": best_per_item(orjson.dumps, dicts),
        "  msgspec.json.encode of the same dict": best_per_item(json_encoder.encode, dicts),
        "encode + decode + validate": best_per_item(roundtrip, indexes),
    }
    loads = rows["json.loads (bare, same bytes)"]
    text = table_text(
        (f"codec, {len(records)} records of {size:.0f} B", "us/record", "x json.loads"),
        [(name, f"{us:.2f}", f"{us / loads:.1f}") for name, us in rows.items()],
    )
    decode_rate = 1e6 / rows["decode + validate (KeySpace.decode)"]
    text += f"\n\ndecode + validate throughput on one core: {decode_rate:,.0f} records/s"
    print(text)
    if not args.no_results:
        record_results(
            "codec",
            text,
            about="`bench_codec.py`: per-record cost of the codec (best of 7 passes), "
            "next to bare `json.loads`, orjson and msgspec on the same bytes. No target of "
            "its own; the figures explain the watch path's costs in the other benchmarks. "
            "Decoded records share equal capabilities and label sets (a cache hit here).",
        )
    write_json("codec", {"rows": rows, "value_bytes": size, "targets": list[Target]()})


if __name__ == "__main__":
    main()
