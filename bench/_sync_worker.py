"""The contenders of bench_sync.py, one per worker process (see bench_sync.py).

Imports no client and nothing of discovery at module level: aetcd's and etcd3aio's
generated protobuf modules cannot share a process with python3-etcd3's (the one
discovery uses), so each worker imports only its own client.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The copy of discovery to measure, as in _common.py.
sys.path.insert(0, os.environ.get("DISCOVERY_BENCH_PACKAGE") or str(Path(__file__).parents[1]))

NAMESPACE = "sync"
PAGE = 1000


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def prefix_range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _take(page, table: dict) -> bytes | None:
    """Decode a Range page into ``table``; the next page's first key, None after the last."""
    for kv in page.kvs:
        table[kv.key] = json.loads(kv.value)
    return page.kvs[-1].key + b"\0" if page.more else None


def _raw_read(client, prefix: bytes, on_page: Callable = lambda: None) -> tuple[dict, int]:
    """Every value under ``prefix``, python3-etcd3 paged at one revision, JSON-decoded."""
    end = prefix_range_end(prefix)
    start, revision, table = prefix, None, {}
    while start is not None:
        page = client.get_range_response(start, end, limit=PAGE, revision=revision)
        on_page()
        revision = revision or page.header.revision
        start = _take(page, table)
    return table, revision


async def _read_pages(range_page, prefix: bytes, on_page: Callable) -> tuple[dict, int]:
    """The same read through an asyncio client's ``range_page(start, end, revision)``."""
    end = prefix_range_end(prefix)
    start, revision, table = prefix, 0, {}
    while start is not None:
        page = await range_page(start, end, revision)
        on_page()
        revision = revision or page.header.revision
        start = _take(page, table)
    return table, revision


async def _read_sub_prefixes(communicator, prefix: bytes, on_page: Callable) -> dict:
    """etcd-client-py: the 1,000-key sub-prefixes of the benchmark's ids (see sync_etcd_client)."""
    table = {}
    for page in itertools.count():
        kvs = await communicator.get_prefix(prefix + b"e%03d" % page)
        on_page()
        if not kvs:
            return table
        for key, value in kvs:
            table[bytes(key)] = json.loads(bytes(value))
    raise AssertionError("unreachable")


# -- the contenders (each in its own worker process) ---------------------------------------


def sync_ours(url: str, prefix: bytes) -> tuple[int, float]:
    from discovery import Settings, watch_table  # noqa: PLC0415

    table = watch_table(Settings(endpoints=[url], namespace=NAMESPACE))
    try:
        table.start()
        return len(table), time.perf_counter()
    finally:
        table.stop()


def sync_raw(url: str, prefix: bytes) -> tuple[int, float]:
    import etcd3  # noqa: PLC0415

    client = etcd3.client(*host_port(url))
    try:
        table, _ = _raw_read(client, prefix)
        return len(table), time.perf_counter()
    finally:
        client.close()


def aetcd_pages(aetcd, client):
    """aetcd's Range with limit and revision (its ``get_range``/``get_prefix`` take neither)."""

    def range_page(start: bytes, end: bytes, revision: int):
        request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=PAGE, revision=revision)
        return client.kvstub.Range(request, metadata=client.metadata)

    return range_page


def etcd3aio_pages(client):
    """etcd3aio's ``kv.get`` with range end, revision and limit."""

    def range_page(start: bytes, end: bytes, revision: int):
        return client.kv.get(start, range_end=end, revision=revision, limit=PAGE)

    return range_page


async def sync_aetcd(url: str, prefix: bytes) -> tuple[int, float]:
    import aetcd  # noqa: PLC0415

    async with aetcd.Client(*host_port(url)) as client:
        table, _ = await _read_pages(aetcd_pages(aetcd, client), prefix, lambda: None)
        return len(table), time.perf_counter()


async def sync_etcd3aio(url: str, prefix: bytes) -> tuple[int, float]:
    import etcd3aio  # noqa: PLC0415

    async with etcd3aio.Etcd3Client([url.split("://", 1)[1]]) as client:
        table, _ = await _read_pages(etcd3aio_pages(client), prefix, lambda: None)
        return len(table), time.perf_counter()


async def sync_etcd_client(url: str, prefix: bytes) -> tuple[int, float]:
    import etcd_client  # noqa: PLC0415

    # Its API has neither limit nor revision, and one read of the whole prefix overflows
    # its 4 MiB message limit from 10,000 records on: read the 1,000-key sub-prefixes of
    # the benchmark's ids (e000..., e001...) until one is empty; not at one revision.
    async with etcd_client.Client([url]).connect() as communicator:
        table = await _read_sub_prefixes(communicator, prefix, lambda: None)
        return len(table), time.perf_counter()


SYNCS: dict[str, Callable] = {
    "ours": sync_ours,
    "raw": sync_raw,
    "aetcd": sync_aetcd,
    "etcd3aio": sync_etcd3aio,
    "etcd_client": sync_etcd_client,
}


def retained_bytes(kind: str, url: str, prefix: bytes) -> dict:
    """tracemalloc: what one finished sync keeps, per endpoint (ours and raw)."""
    import tracemalloc  # noqa: PLC0415

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    if kind == "ours":
        from discovery import Settings, watch_table  # noqa: PLC0415

        # tracemalloc slows every allocation: give the first snapshot all the time it needs.
        settings = Settings(endpoints=[url], namespace=NAMESPACE, dial_timeout=600)
        table = watch_table(settings)
        table.start()
        snapshot = table.snapshot()
        keep: object = (table, snapshot)
        count = len(snapshot)
    else:
        import etcd3  # noqa: PLC0415

        client = etcd3.client(*host_port(url))
        decoded, _ = _raw_read(client, prefix)
        keep, count = decoded, len(decoded)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    if kind == "ours":
        table.stop()
    else:
        client.close()
    del keep
    return {"per_endpoint": traced / count, "count": count}


def main(kind: str, url: str, prefix: bytes) -> None:
    """Answer commands on stdin with one JSON line each: run, mem, pid, quit."""
    sync = SYNCS[kind]
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        command = line.split()
        if command[0] == "run":
            gc.collect()
            cpu0, t0 = time.process_time(), time.perf_counter()
            result = sync(url, prefix)
            if asyncio.iscoroutine(result):
                result = loop.run_until_complete(result)
            count, ready = result
            # Wall: until the contender holds every decoded record (its clean-up excluded).
            answer: dict = {"wall": ready - t0, "cpu": time.process_time() - cpu0, "count": count}
        elif command[0] == "mem":
            answer = retained_bytes(kind, url, prefix)
        elif command[0] == "pid":  # for a sampling profiler outside the process
            answer = {"pid": os.getpid()}
        else:
            break
        print(json.dumps(answer), flush=True)
    loop.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].encode())
