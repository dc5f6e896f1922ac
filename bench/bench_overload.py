"""Overload: stand-in engines offered twice their capacity by 4 routers, admission on.

Run: ``.venv/bin/python bench/bench_overload.py`` (``--quick``: 15 s, nothing recorded).

* A private etcd member; ``ENGINES`` stand-in engines under ``discovery launch`` (each with
  its state relay), each declaring ``max_num_seqs`` = ``CAPACITY`` and serving requests on
  its HTTP request port: ``GET /?hold=S`` answers after ``HOLD`` s; ``GET /stats`` says how
  many ran at once at most (the check at the engines).
* ``ROUTERS`` router processes, each a ``watch_table`` + ``EngineStates`` + ``Router``
  (``load_balanced``, admission: ``wait`` ``WAIT`` s, ``reserve`` ``RESERVE``), started and
  warmed up until every engine's relay counts every router. Then, for ``--seconds``, each
  offers Poisson arrivals at its share of twice the fleet's capacity (``2 x ENGINES x
  CAPACITY / HOLD`` requests a second over all routers), one in ``HIGH`` at priority 1:
  each arrival is an ``apick`` on the router's event loop, then the request (asyncio
  streams), then ``release`` (``failed=True`` without an answer).
* Figures: per class, the picks served and shed and the p50 / p99 wait of served picks
  (``PickHandle.waited``); sheds before the bound (an ``OverloadedError`` that waited less
  than ``WAIT`` with the queue not full: never); the most requests an engine ran at once
  (never above its capacity); throughput against the fleet's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from _common import ROOT, Target, etcd_cluster, percentile, record_results, table_text

sys.path.insert(0, str(ROOT))  # the stand-in launcher helpers live with the tests

from discovery import (
    EngineStates,
    OverloadedError,
    Router,
    Settings,
    watch_table,
)
from tests.helpers import STAND_IN, Launcher, cli_env, wait_for

ENGINES = 4
CAPACITY = 8  # max_num_seqs each engine declares
ROUTERS = 4
HOLD = 0.5  # seconds a request runs
WAIT = 2.0  # a pick's wait for room
RESERVE = 0.25  # of each engine, for priority 1
HIGH = 5  # one arrival in HIGH is priority 1
MAX_WAITING = 1024
HEADER = ("class", "served", "shed", "shed share", "wait p50 ms", "wait p99 ms")


# -- a router process -------------------------------------------------------------------------


async def _request(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /?hold={HOLD:g} HTTP/1.0\r\nHost: e\r\n\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), HOLD + 5)
        writer.close()
        return answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False


async def _offer(router: Router, rate: float, seconds: float, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    waits: dict[int, list[float]] = {0: [], 1: []}
    shed: dict[int, int] = {0: 0, 1: 0}
    early = failed = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(priority: int) -> None:
        nonlocal early, failed
        prompt = [rng.randrange(32000) for _ in range(8)]
        try:
            handle = await router.apick(prompt, 8, priority=priority)
        except OverloadedError as exc:
            shed[priority] += 1
            if exc.waited < WAIT - 0.05 and exc.queued < MAX_WAITING:
                early += 1  # shed before its bound
            return
        waits[priority].append(handle.waited)
        answered = await _request(handle.endpoint.coordinator_address)
        failed += not answered
        handle.release(failed=not answered)

    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while next_at < end:
        next_at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        task = asyncio.create_task(one(1 if rng.randrange(HIGH) == 0 else 0))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    return {"waits": waits, "shed": shed, "early": early, "failed": failed}


def router_main(args: argparse.Namespace) -> int:
    """One router: warm up, say ``ready``, wait for ``go`` on stdin, offer, print figures."""
    with watch_table(Settings.from_env()) as table:
        states = EngineStates(table).start()
        router = Router(
            table,
            policy="load_balanced",
            states=states,
            wait=WAIT,
            reserve=RESERVE,
            max_waiting=MAX_WAITING,
        )

        def counted() -> bool:
            snapshot = table.snapshot()
            shares = [states.share(e) for e in snapshot]
            return len(snapshot) == ENGINES and all(
                s is not None and s[1] == ROUTERS for s in shares
            )

        wait_for(counted, timeout=60, message="every relay counting every router")
        print("ready", flush=True)
        sys.stdin.readline()
        figures = asyncio.run(_offer(router, args.rate, args.seconds, args.seed))
        states.stop()
    print(json.dumps(figures), flush=True)
    return 0


# -- the run ---------------------------------------------------------------------------------


def engine_stats(address: str) -> dict[str, int]:
    url = f"http://{address.removeprefix('tcp://')}/stats"
    with urllib.request.urlopen(url, timeout=5) as response:
        stats: dict[str, int] = json.loads(response.read())
        return stats


def run(seconds: float) -> tuple[str, list[Target]]:
    capacity = ENGINES * CAPACITY
    offered = 2 * capacity / HOLD  # requests a second
    with etcd_cluster(1) as cluster:
        settings = Settings(endpoints=cluster.endpoints, namespace="overload")
        command = [*STAND_IN, "--serve-port", "0", "--max-num-seqs", str(CAPACITY)]
        launchers = [
            Launcher(settings, f"engine-{i}", command, "--ttl", "10") for i in range(ENGINES)
        ]
        routers: list[subprocess.Popen[str]] = []
        try:
            with watch_table(settings) as table:
                table.wait_until(lambda s: len(s) == ENGINES, timeout=60)
                addresses = [r.endpoint.coordinator_address for r in table.snapshot().values()]
            for i in range(ROUTERS):
                routers.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--router", "--rate", f"{offered / ROUTERS}",
                         "--seconds", f"{seconds}", "--seed", str(i)],
                        env=cli_env(settings),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=ROOT,
                    )
                )  # fmt: skip
            for process in routers:
                assert process.stdout is not None and process.stdout.readline().strip() == "ready"
            started = time.monotonic()
            for process in routers:
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
            results = []
            for process in routers:
                out, _ = process.communicate(timeout=seconds + 120)
                results.append(json.loads(out.strip().splitlines()[-1]))
            elapsed = time.monotonic() - started
            stats = [engine_stats(a) for a in addresses]
        finally:
            for process in routers:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
            for launcher in launchers:
                launcher.stop()
    return figures(results, stats, elapsed, offered, capacity)


def figures(
    results: Sequence[dict],
    stats: Sequence[dict[str, int]],
    elapsed: float,
    offered: float,
    capacity: int,
) -> tuple[str, list[Target]]:
    rows = []
    waits: dict[str, list[float]] = {}
    for priority, name in ((1, "high (priority 1)"), (0, "low (priority 0)")):
        served = [w for r in results for w in r["waits"][str(priority)]]
        shed = sum(r["shed"][str(priority)] for r in results)
        waits[name] = served
        rows.append(
            (
                name,
                len(served),
                shed,
                f"{shed / max(1, shed + len(served)):.1%}",
                f"{percentile(served, 50) * 1000:.0f}",
                f"{percentile(served, 99) * 1000:.0f}",
            )
        )
    early = sum(r["early"] for r in results)
    failed = sum(r["failed"] for r in results)
    served = sum(s["served"] for s in stats)
    peaks = [s["peak"] for s in stats]
    high_p99 = percentile(waits["high (priority 1)"], 99)
    low_p99 = percentile(waits["low (priority 0)"], 99)
    body = "\n".join(
        [
            f"{ENGINES} engines x {CAPACITY} slots, requests of {HOLD:g} s: capacity "
            f"{capacity / HOLD:.0f} requests/s; offered {offered:.0f}/s by {ROUTERS} routers "
            f"for {elapsed:.0f} s; wait {WAIT:g} s, reserve {RESERVE:.0%} for priority 1",
            "",
            table_text(HEADER, rows),
            "",
            f"served by the engines: {served} ({served / elapsed:.1f}/s, "
            f"{served / elapsed / (capacity / HOLD):.0%} of capacity); unanswered: {failed}",
            f"most requests an engine ran at once: {max(peaks)} (capacity {CAPACITY}; "
            f"each engine: {', '.join(map(str, peaks))})",
            f"picks shed before their bound (waited < {WAIT:g} s, queue not full): {early}",
        ]
    )
    targets = [
        Target("engine peak over its capacity", max(peaks) - CAPACITY, 0, "requests"),
        Target("sheds before the bound", early, 0, "picks"),
        Target("high p99 wait / low p99 wait", high_p99 / max(low_p99, 1e-9), 0.2, "x"),
    ]
    return body, targets


ABOUT = __doc__.split("\n\n", 2)[2] if __doc__ else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="15 s, nothing recorded")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--router", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.router:
        return router_main(args)
    body, targets = run(15.0 if args.quick else args.seconds)
    print(body)
    for target in targets:
        print(target.line())
    if not args.quick:
        record_results("overload", body, about=ABOUT, targets=targets)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
