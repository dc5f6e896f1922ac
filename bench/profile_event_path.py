"""Where the event path's time goes: one raw put, stage by stage, up to our table listener.

Run: ``.venv/bin/python bench/profile_event_path.py [--count 1000]``. One private etcd
member; a writer process puts a valid record (no lease), alternately into our prefix and
into a raw prefix. The watching process stamps ``perf_counter_ns()`` (system-wide
monotonic, so it compares with the writer's) at each stage of our path:

* *response in*: the watcher's feed (``_Feed.apply``) called (the gRPC response read,
  converted to the port's ``WatchResponse``): where python3-etcd3 would call a raw callback;
* *decoded*: the record decoded and validated (end of ``_Feed._decode``);
* *store in* / *applied*: ``EngineStore.apply`` entered / the table's ``deliver`` called
  from the store's commit (the new snapshot published: a pick() sees it);
* *handed over*: ``deliver`` returned (the listener queued on the dispatcher);
* *listener*: the table listener runs, on the dispatcher thread.

The raw baseline is python3-etcd3's ``add_watch_prefix_callback`` on another client in the
same process. Prints p50 of each stage from the put's start and the p50 of each step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import etcd3
from _common import LABELS, etcd_cluster, host_port, make_endpoint, percentile, table_text
from bench_latency import _patch_etcd3_six

from discovery import EndpointWatcher, RoutingTable, Settings
from discovery._reads import store as _store
from discovery._reads import watcher as _watcher
from discovery._records.codec import encode
from discovery._records.record import EngineRecord

STAGES = ["response in", "decoded", "store in", "applied", "handed over", "listener"]
WARMUP = 50


def writer(url: str, pipe) -> None:
    """Put the value named by each command; send back the time just before the put."""
    client = etcd3.client(*host_port(url))
    while (command := pipe.recv()) is not None:
        key, value = command
        t0 = time.perf_counter_ns()
        client.put(key, value)
        pipe.send(t0)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="samples per side")
    count = parser.parse_args().count
    _patch_etcd3_six()
    stamps: dict[str, int] = {}
    arrived = threading.Event()

    def stamp(stage: str) -> None:
        stamps.setdefault(stage, time.perf_counter_ns())

    apply, decode, store_apply = (
        _watcher._Feed.apply,
        _watcher._Feed._decode,
        _store.EngineStore.apply,
    )

    def timed_apply(self, response):
        stamp("response in")
        apply(self, response)

    def timed_decode(self, key, value):
        record = decode(self, key, value)
        stamp("decoded")
        return record

    def timed_store_apply(self, changes):
        stamp("store in")
        return store_apply(self, changes)

    class Table(RoutingTable):
        def deliver(self, batch):  # type: ignore[override]
            stamp("applied")
            super().deliver(batch)
            stamp("handed over")

    _watcher._Feed.apply = timed_apply  # type: ignore[method-assign]
    _watcher._Feed._decode = timed_decode  # type: ignore[method-assign]
    _store.EngineStore.apply = timed_store_apply  # type: ignore[method-assign]

    def listener(_events, _snapshot) -> None:
        stamp("listener")
        arrived.set()

    def raw_callback(_response) -> None:
        stamp("raw callback")
        arrived.set()

    with etcd_cluster(1) as cluster:
        url = cluster.members[0].client_url
        settings = Settings(endpoints=[url], namespace="profile", dial_timeout=10)
        table = Table(EndpointWatcher(settings, heartbeat=5.0), own_watcher=True)
        table.subscribe(listener)
        table.start()
        raw = etcd3.client(*host_port(url))
        raw.add_watch_prefix_callback("/raw/profile/", raw_callback)
        ours_pipe, theirs = multiprocessing.Pipe()
        process = multiprocessing.Process(target=writer, args=(url, theirs))
        process.start()
        ours: list[dict[str, int]] = []
        baseline: list[int] = []
        try:
            for n in range(2 * (count + WARMUP)):
                side = n % 2
                engine_id = f"e{n // 2}"
                prefix = settings.keyspace.prefix if side == 0 else "/raw/profile/"
                value = encode(EngineRecord(engine_id, make_endpoint(n // 2), LABELS))
                stamps.clear()
                arrived.clear()
                ours_pipe.send((prefix + engine_id, value))
                t0 = ours_pipe.recv()
                if not arrived.wait(10):
                    raise RuntimeError(f"no event for sample {n}")
                if n < 2 * WARMUP:
                    continue
                if side == 0:
                    ours.append({stage: stamps[stage] - t0 for stage in STAGES})
                else:
                    baseline.append(stamps["raw callback"] - t0)
        finally:
            ours_pipe.send(None)
            process.join(10)
            raw.close()
            table.stop()

    def p50(values: list[int]) -> float:
        return percentile(values, 50) / 1e3

    rows = [["raw etcd3: put -> watch callback", f"{p50(baseline):.0f}", ""]]
    for i, stage in enumerate(STAGES):
        steps = [sample[stage] - (sample[STAGES[i - 1]] if i else 0) for sample in ours]
        at = p50([sample[stage] for sample in ours])
        rows.append([f"ours: put -> {stage}", f"{at:.0f}", f"{p50(steps):.0f}"])
    print(f"event path, us (n={count} each, p50)")
    print(table_text(["stage", "from the put", "this step"], rows))
    listener = p50([sample["listener"] for sample in ours])
    print(f"ours / raw at the listener: {listener / p50(baseline):.2f}x")


if __name__ == "__main__":
    main()
