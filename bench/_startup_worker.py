"""One sample of bench_startup.py: a new process, a new user, one client (see bench_startup.py).

``python _startup_worker.py sync <kind> <url> <prefix> <records>``: import the client,
build it, read every record; print one JSON line of times (seconds, ``perf_counter``).

``profile`` instead of ``sync``: the same, waiting for a line on stdin after the import and
after the table is complete (a profiler attaches between the two).

``python _startup_worker.py events <kind> <url> <prefix> <records>``: import, build, list,
watch; print ``ready``; then stamp ``perf_counter_ns()`` for each put seen (by its
sequence number, the record's ``weight_version``) until a line arrives on stdin; print
them as one JSON line.

Imports nothing heavy at module level: the import of the client is the first thing timed.
Times are ``perf_counter``: CLOCK_MONOTONIC, system-wide on Linux, so the writer's
(bench_startup.py's) and the worker's compare.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable

STARTED = time.perf_counter()
# Standard library only (no client): the peers' page reads of bench_sync.py; it also puts
# the copy of discovery to measure on the path, as _common.py does.
from _sync_worker import (  # noqa: E402
    _raw_read,
    _read_pages,
    _read_sub_prefixes,
    aetcd_pages,
    etcd3aio_pages,
    host_port,
    prefix_range_end,
)

NAMESPACE = "startup"


class Times:
    """The phases of one sample: import done, first call, first page in hand, table complete.

    ``gated`` (bench_startup.py's profile): wait for a line on stdin once the import is done
    (a profiler attaches meanwhile) and once the table is complete (it detaches).
    """

    def __init__(self, gated: bool = False) -> None:
        self.imported = self.called = self.first_page = self.complete = 0.0
        self.cpu_called = self.cpu_complete = 0.0
        self._gated = gated

    def _gate(self, what: str) -> None:
        if self._gated:
            print(what, os.getpid(), flush=True)
            sys.stdin.readline()

    def import_done(self) -> None:
        self.imported = time.perf_counter()
        self._gate("imported")

    def call(self) -> None:
        self.cpu_called = time.process_time()
        self.called = time.perf_counter()

    def table_complete(self) -> None:
        self.complete = time.perf_counter()
        self.cpu_complete = time.process_time()
        self._gate("complete")

    def page(self) -> None:
        if not self.first_page:
            self.first_page = time.perf_counter()

    def answer(self, count: int) -> dict:
        return {
            "import": self.imported - STARTED,
            "first_page": self.first_page - self.called,
            "call": self.complete - self.called,
            "cpu": self.cpu_complete - self.cpu_called,  # every thread of the process
            "count": count,
        }


# -- ours -------------------------------------------------------------------------------------


def ours(url: str, prefix: bytes, times: Times, events: Stamps | None):
    from discovery import Router, Settings, watch_table  # noqa: PLC0415
    from discovery._etcd.connection import Connection  # noqa: PLC0415 - the first-page hook only

    times.import_done()
    # The hook that notes when the first page is in hand (one generator layer, < 1 us a page).
    list_pages = Connection.list_pages

    def noted(self, *args, **kwargs):
        pages = list_pages(self, *args, **kwargs)  # called now: its first request may leave

        def each():
            for page in pages:
                times.page()
                yield page

        return each()

    Connection.list_pages = noted  # type: ignore[method-assign]
    times.call()
    namespace = prefix.decode().split("/")[-3]  # /inference/v1/<namespace>/engines/
    table = watch_table(Settings(endpoints=[url], namespace=namespace))
    if events is not None:
        router = Router(table)

        def listener(batch, _snapshot) -> None:
            now = time.perf_counter_ns()
            for event in batch:
                events.callback(event.record.weight_version, now)

        table.subscribe(listener)

        # pick()-visible: the store publishes a batch's snapshot (what pick() reads), then
        # calls its sinks in order; this one is the first (added before the table's own).
        class Visible:
            def deliver(self, batch) -> None:
                now = time.perf_counter_ns()
                for event in batch:
                    events.visible(event.record.weight_version, now)

            def close(self) -> None:
                pass

        table.store.add_sink(Visible(), replay=False)
    table.start()
    times.table_complete()
    count = len(table)
    if events is not None:
        assert router.pick([1, 2, 3], 1).release() is None  # a pick works: the router is live
        events.wait_stop()
    table.stop()
    return count


# -- the peers of bench_sync.py ---------------------------------------------------------------


def raw(url: str, prefix: bytes, times: Times, events: Stamps | None):
    import etcd3  # noqa: PLC0415

    times.import_done()
    times.call()
    client = etcd3.client(*host_port(url))
    table, revision = _raw_read(client, prefix, times.page)
    times.table_complete()
    if events is not None:
        import etcd3.watch  # noqa: PLC0415

        # Its watch thread dies on ``NameError: six`` when the stream ends (bench_latency.py).
        etcd3.watch.six = type("six", (), {"itervalues": staticmethod(lambda d: iter(d.values()))})

        def callback(response) -> None:
            if isinstance(response, Exception):
                return
            for event in response.events:
                decoded = table[event.key] = json.loads(event.value)
                events.both(decoded["weight_version"], time.perf_counter_ns())

        watch_id = client.add_watch_prefix_callback(prefix, callback, start_revision=revision + 1)
        events.wait_stop()
        client.cancel_watch(watch_id)
    client.close()
    return len(table)


async def aetcd_(url: str, prefix: bytes, times: Times, events: Stamps | None):
    import aetcd  # noqa: PLC0415

    times.import_done()
    times.call()
    async with aetcd.Client(*host_port(url)) as client:
        table, revision = await _read_pages(aetcd_pages(aetcd, client), prefix, times.page)
        times.table_complete()
        if events is not None:
            watch = await client.watch_prefix(prefix, start_revision=revision + 1)

            async def consume() -> None:
                async for event in watch:
                    decoded = table[event.kv.key] = json.loads(event.kv.value)
                    events.both(decoded["weight_version"], time.perf_counter_ns())

            await events.until_stop(consume())
            await watch.cancel()
        return len(table)


async def etcd3aio_(url: str, prefix: bytes, times: Times, events: Stamps | None):
    import etcd3aio  # noqa: PLC0415

    times.import_done()
    times.call()
    async with etcd3aio.Etcd3Client([url.split("://", 1)[1]]) as client:
        table, revision = await _read_pages(etcd3aio_pages(client), prefix, times.page)
        times.table_complete()
        if events is not None:
            end = prefix_range_end(prefix)

            async def consume() -> None:
                async for response in client.watch.watch(
                    prefix, range_end=end, start_revision=revision + 1
                ):
                    now = time.perf_counter_ns()
                    for event in response.events:
                        decoded = table[event.kv.key] = json.loads(event.kv.value)
                        events.both(decoded["weight_version"], now)

            await events.until_stop(consume())
        return len(table)


async def etcd_client_(url: str, prefix: bytes, times: Times, events: Stamps | None):
    import etcd_client  # noqa: PLC0415

    times.import_done()
    times.call()
    async with etcd_client.Client([url]).connect() as communicator:
        table = await _read_sub_prefixes(communicator, prefix, times.page)
        times.table_complete()
        if events is not None:
            # No start revision in its API: it watches from now (the writer waits for
            # "ready", and the first puts are warm-up).

            async def consume() -> None:
                async for event in communicator.watch_prefix(prefix):
                    now = time.perf_counter_ns()
                    decoded = table[bytes(event.key)] = json.loads(bytes(event.value))
                    events.both(decoded["weight_version"], now)

            await events.until_stop(consume())
    return len(table)


CLIENTS: dict[str, Callable] = {
    "ours": ours,
    "raw": raw,
    "aetcd": aetcd_,
    "etcd3aio": etcd3aio_,
    "etcd_client": etcd_client_,
}


class Stamps:
    """When each put (by its sequence number: the record's weight_version) reached the
    callback, and became visible to a lookup (ours: ``pick()``; a peer: its dict)."""

    def __init__(self) -> None:
        self.callbacks: dict[int, int] = {}
        self.visibles: dict[int, int] = {}

    # seq None: a record of the initial listing (no weight_version), not a put of ours.

    def callback(self, seq: int | None, now: int) -> None:
        if seq is not None:
            self.callbacks.setdefault(seq, now)

    def visible(self, seq: int | None, now: int) -> None:
        if seq is not None:
            self.visibles.setdefault(seq, now)

    def both(self, seq: int | None, now: int) -> None:
        """A peer's table is its callback's dict: visible when the callback stored it."""
        self.callback(seq, now)
        self.visible(seq, now)

    def wait_stop(self) -> None:
        """Say the watch is on, then block until a line arrives on stdin."""
        print("ready", flush=True)
        sys.stdin.readline()

    async def until_stop(self, consume) -> None:
        """Run the ``consume`` coroutine (a watch loop) until a line arrives on stdin."""
        task = asyncio.ensure_future(consume)
        await asyncio.to_thread(self.wait_stop)
        task.cancel()


def main(mode: str, kind: str, url: str, prefix: bytes, records: int) -> None:
    times = Times(gated=mode == "profile")
    events = Stamps() if mode == "events" else None
    result = CLIENTS[kind](url, prefix, times, events)
    count = asyncio.run(result) if asyncio.iscoroutine(result) else result
    if count != records:
        raise SystemExit(f"{kind} read {count} of {records} records")
    answer = times.answer(count)
    if events is not None:
        answer = {"callbacks": events.callbacks, "visibles": events.visibles}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode(), int(sys.argv[5]))
