"""Codec: encode + decode + validate per record, next to bare ``json.loads`` of the same bytes.

Run: ``.venv/bin/python bench/bench_codec.py [--records 10000]``. No etcd. The records are
what ``register_engine`` writes: a full endpoint, three labels and ``registered_at``.
Each figure is the best of 7 passes over all records (per-record mean within a pass), so
it is the cost without interference from other processes; the decode row is split into
its stages to show where the time goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from datetime import UTC, datetime

from _common import LABELS, Target, append_results, make_endpoint, table_text, write_json

from discovery import EngineRecord, InferenceEngineEndpoint, KeySpace
from discovery._codec import _parse_time, encode

PASSES = 7


def best_per_item(fn, items) -> float:
    """Microseconds per item: the best of PASSES passes of ``fn`` over ``items``."""
    best = float("inf")
    for _ in range(PASSES):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for item in items:
                fn(item)
            elapsed = time.perf_counter_ns() - t0
        finally:
            gc.enable()
        best = min(best, elapsed / len(items) / 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--no-results", action="store_true", help="do not touch RESULTS.md")
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
    objs = [json.loads(v) for v in values]
    endpoints = [InferenceEngineEndpoint.from_dict(o) for o in objs]
    size = sum(map(len, values)) / len(values)

    def roundtrip(i: int) -> None:
        keyspace.decode(keys[i], encode(records[i]))

    def construct(i: int) -> None:
        o = objs[i]
        EngineRecord(
            records[i].engine_id, endpoints[i], o["labels"], _parse_time(o["registered_at"])
        )

    indexes = range(len(records))
    rows = {
        "json.loads (bare, same bytes)": best_per_item(json.loads, values),
        "encode (to_value + json.dumps + size check)": best_per_item(encode, records),
        "decode + validate (KeySpace.decode)": best_per_item(
            lambda kv: keyspace.decode(*kv), pairs
        ),
        "  of which: key -> engine id (regex)": best_per_item(
            lambda k: keyspace.engine_id(k.decode()), keys
        ),
        "  of which: json.loads": best_per_item(lambda v: json.loads(v.decode()), values),
        "  of which: InferenceEngineEndpoint.from_dict": best_per_item(
            InferenceEngineEndpoint.from_dict, objs
        ),
        "  of which: EngineRecord(...) + registered_at": best_per_item(construct, indexes),
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
        append_results(
            "bench_codec.py",
            text,
            notes="`bench_codec.py`: per-record cost of the codec (best of 7 passes), "
            "next to bare `json.loads` of the same bytes. No target in the issue; "
            "the figures explain the watch path's costs in the other benchmarks.",
        )
    write_json("codec", {"rows": rows, "value_bytes": size, "targets": list[Target]()})


if __name__ == "__main__":
    main()
