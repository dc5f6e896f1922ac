"""Watch fan-out: 10, 100 and 500 watchers of one prefix, direct and through one gRPC proxy.

Run: ``.venv/bin/python bench/bench_fanout.py [--watchers 10,100,500] [--events 200]``.

One etcd member; for the proxied rows one ``etcd grpc-proxy start`` in front of it (same
binary), which coalesces the identical watches into one watch on the member. The watchers
are raw gRPC Watch streams of the prefix, each on a channel (an HTTP/2 connection) of its
own like separate routers, spread over ``--procs`` asyncio processes. A writer puts
``--events`` records at ``--rate`` per second, each stamped with ``time.monotonic_ns()``;
every watcher notes when each arrives. Reported per configuration: the etcd member's CPU
(100% = one core) during the writes and its RSS with all watchers connected, the proxy's,
and the event latency at the slowest watcher (per event, the latest arrival), p50/p99/max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from _common import (
    BENCH,
    CpuMeter,
    Target,
    etcd_cluster,
    percentile,
    proc_rss_bytes,
    record_results,
    table_text,
    write_json,
)

from discovery.testing.embedded import EtcdGrpcProxy

PREFIX = b"/inference/v1/fanout/engines/"


# -- a watcher process ---------------------------------------------------------------------------


async def watch_one(target: str, arrivals: dict[int, list[int]], ready: asyncio.Event) -> None:
    import grpc  # noqa: PLC0415
    from etcd3 import etcdrpc  # noqa: PLC0415

    end = PREFIX[:-1] + bytes([PREFIX[-1] + 1])
    create = etcdrpc.WatchCreateRequest(key=PREFIX, range_end=end)

    async def requests():
        yield etcdrpc.WatchRequest(create_request=create)
        await asyncio.Event().wait()  # keep the stream open

    async with grpc.aio.insecure_channel(target) as channel:
        async for response in etcdrpc.WatchStub(channel).Watch(requests()):
            now = time.monotonic_ns()
            if response.created:
                ready.set()
            for event in response.events:
                arrivals.setdefault(int(event.kv.key.rsplit(b"/", 1)[1]), []).append(now)


async def watcher_process(target: str, count: int) -> None:
    arrivals: dict[int, list[int]] = {}
    readies = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(watch_one(target, arrivals, r)) for r in readies]
    await asyncio.gather(*(r.wait() for r in readies))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    # Per event, this process's latest arrival and how many of its watchers got it.
    print(json.dumps({k: [max(v), len(v)] for k, v in arrivals.items()}), flush=True)
    for task in tasks:
        task.cancel()


# -- the parent ------------------------------------------------------------------------------------


def run_config(url: str, watchers: int, procs: int, events: int, rate: float, pids: dict) -> dict:
    import etcd3  # noqa: PLC0415

    target = url.split("://", 1)[1]
    per = [watchers // procs + (i < watchers % procs) for i in range(procs)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", target, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=BENCH,
        )
        for n in per
        if n
    ]
    try:
        for child in children:
            assert child.stdout and child.stdout.readline().strip() == "ready"
        rss = {name: proc_rss_bytes(pid) for name, pid in pids.items()}
        meters = {name: CpuMeter([pid]) for name, pid in pids.items()}
        client = etcd3.client(*target.split(":"))
        sent = {}
        t0 = time.monotonic()
        for i in range(events):
            pause = t0 + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            sent[i] = time.monotonic_ns()
            client.put(PREFIX + b"%d" % i, json.dumps({"i": i}).encode())
        cpu = {name: meter.share() for name, meter in meters.items()}
        client.close()
        time.sleep(1.0)  # stragglers: the slowest watcher's last events
        latest: dict[int, int] = {}
        got: dict[int, int] = {}
        for child in children:
            assert child.stdin and child.stdout
            child.stdin.write("dump\n")
            child.stdin.flush()
            for key, (arrival, n) in json.loads(child.stdout.readline()).items():
                latest[int(key)] = max(latest.get(int(key), 0), arrival)
                got[int(key)] = got.get(int(key), 0) + n
    finally:
        for child in children:
            child.kill()
            child.wait()
    slowest = [(latest[i] - sent[i]) / 1e6 for i in sent if got.get(i) == watchers]
    return {
        "watchers": watchers,
        "cpu": cpu,
        "rss": rss,
        "slowest_ms": slowest,
        "complete": len(slowest),
        "events": events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", default="10,100,500")
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0, help="puts per second")
    parser.add_argument("--procs", type=int, default=4, help="watcher processes")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(watcher_process(args.child[0], int(args.child[1])))
        return
    rows, results = [], []
    with etcd_cluster(1) as cluster:
        member = cluster.members[0]
        proxy = EtcdGrpcProxy(cluster.endpoints).start()
        try:
            for n in (int(w) for w in args.watchers.split(",")):
                for via in ("direct", "proxy"):
                    url = member.client_url if via == "direct" else proxy.client_url
                    pids = {"etcd": member.pid, "proxy": proxy.pid}
                    r = run_config(url, n, min(args.procs, n), args.events, args.rate, pids)
                    r["via"] = via
                    results.append(r)
                    s = r["slowest_ms"]
                    rows.append(
                        (
                            f"{n}",
                            via,
                            f"{r['cpu']['etcd'] * 100:.1f}%",
                            f"{r['rss']['etcd'] / 2**20:.0f}",
                            f"{r['cpu']['proxy'] * 100:.1f}%",
                            f"{r['rss']['proxy'] / 2**20:.0f}",
                            f"{percentile(s, 50):.2f}",
                            f"{percentile(s, 99):.2f}",
                            f"{max(s):.2f}",
                            f"{r['complete']}/{r['events']}",
                        )
                    )
                    print(rows[-1], flush=True)
        finally:
            proxy.close()
    ratios = []  # the issue sets no target here: the figures are the finding
    for n in sorted({r["watchers"] for r in results}):
        direct, proxied = (
            next(r for r in results if r["watchers"] == n and r["via"] == via)
            for via in ("direct", "proxy")
        )
        ratios.append(
            f"{n} watchers, through the proxy / direct: etcd CPU "
            f"{proxied['cpu']['etcd'] / max(direct['cpu']['etcd'], 1e-9):.2f}x, slowest p99 "
            f"{percentile(proxied['slowest_ms'], 99) / percentile(direct['slowest_ms'], 99):.2f}x"
        )
    header = (
        "watchers",
        "via",
        "etcd CPU",
        "etcd RSS MiB",
        "proxy CPU",
        "proxy RSS MiB",
        "slowest p50 ms",
        "p99 ms",
        "max ms",
        "events seen by all",
    )
    text = table_text(header, rows) + "\n\n" + "\n".join(ratios)
    print(text)
    if not args.no_results:
        record_results(
            "fanout",
            text,
            about=(
                f"`bench_fanout.py`: N raw gRPC watch streams of one prefix (a channel each, "
                f"over {args.procs} asyncio processes) on one etcd member, directly or through "
                f"one `etcd grpc-proxy start`; {args.events} puts at {args.rate:g}/s. CPU over "
                "the write phase (100% = one core), RSS with all watchers connected (the proxy "
                "runs in both rows; it idles in the direct ones). Latency: per event, put -> "
                "its arrival at the slowest watcher. The watcher processes share the 2 cores."
            ),
        )
    write_json("fanout", {"results": results, "targets": list[Target]()})


if __name__ == "__main__":
    main()
