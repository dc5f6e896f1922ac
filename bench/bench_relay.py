"""Engine state relay: engine sockets -> launchers' relays -> one router's view, at 100 engines.

Run: ``.venv/bin/python bench/bench_relay.py [--engines 100] [--events 100] [--hashes 32]``.
No etcd: the router's table is fed by hand with the engines' records (their
``state_address``), so only the state path is measured, over real ZeroMQ sockets:

* **engines** (one process): a PUSH socket per engine, sending Megatron's ``"stored"``
  frames (``block_hashes`` of random 63-bit values, as Megatron's hash gives);
* **launchers** (``--launcher-processes`` processes): an ``EngineEventReceiver`` per engine
  (the code ``discovery launch`` runs), each with its ``StateRelay``;
* **router** (this process): ``EngineStates`` following the 100 engines.

Figures: throughput (every engine sends ``--events`` frames of ``--hashes`` block hashes as
fast as it can; the time from the first send to the router's view holding every hash, and
the router process's CPU time per block event: its capacity on a core of its own); latency
(each engine sends a frame every 50 ms whose hash is the send time, ``time.monotonic_ns``:
the router computes engine event -> its view per frame); memory per cached block in the
router (``tracemalloc``, the views rebuilt from snapshots).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc

from _common import Target, percentile, record_results, table_text, write_json

from discovery import EngineRecord, EngineStates, RoutingTable
from discovery._reads.store import EngineStore, Entry
from discovery._state.engine_states import _Follow
from discovery._state.kvstate import unpack_hashes
from discovery.testing.stand_in_engine import default_endpoint

LATENCY_PERIOD = 0.05  # each engine's frame interval in the latency phase
LATENCY_SECONDS = 5.0


def launchers(first: int, count: int) -> None:
    """A launcher process: receivers for engines ``first``..; their addresses on stdout."""
    from discovery import EngineEventReceiver  # noqa: PLC0415

    receivers = []
    for index in range(first, first + count):
        receiver = EngineEventReceiver(engine_id=f"e{index}", stall_timeout=None)
        receiver.start()
        receivers.append(receiver)
        print(json.dumps([index, receiver.address, receiver.state_address]), flush=True)
    sys.stdin.read()  # until the router closes our stdin
    for receiver in receivers:
        receiver.close()


def engines(addresses: list[str], events: int, hashes: int) -> None:
    """The engines' process: a phase per line on stdin (throughput, latency), then exit."""
    import msgpack  # noqa: PLC0415
    import zmq  # noqa: PLC0415

    context = zmq.Context()
    socks = []
    for address in addresses:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        socks.append(sock)
    pack = msgpack.Packer(use_bin_type=True).pack
    rng = random.Random(7)
    for line in sys.stdin:
        if line.strip() == "throughput":
            frames = [
                pack(["stored", {"block_hashes": [rng.getrandbits(63) for _ in range(hashes)]}])
                for _ in range(events)
            ]
            for frame in frames:  # round robin: every engine keeps sending
                for sock in socks:
                    sock.send(frame)
        elif line.strip() == "latency":
            ends = time.monotonic() + LATENCY_SECONDS
            tick = LATENCY_PERIOD / len(socks)
            while time.monotonic() < ends:
                for sock in socks:
                    stamp = time.monotonic_ns()
                    sock.send(pack(["stored", {"block_hashes": [stamp]}]))
                    time.sleep(tick)
        print("done", flush=True)
    for sock in socks:
        sock.close()
    context.term()


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _view_blocks(states: EngineStates) -> int:
    return states.health().blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=100)
    parser.add_argument("--events", type=int, default=100, help="frames per engine")
    parser.add_argument("--hashes", type=int, default=32, help="block hashes per frame")
    parser.add_argument("--launcher-processes", type=int, default=4)
    parser.add_argument("--no-results", action="store_true")
    parser.add_argument("--role", choices=("launchers", "engines"))
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--addresses", default="")
    args = parser.parse_args()
    if args.role == "launchers":
        return launchers(args.first, args.engines)
    if args.role == "engines":
        return engines(args.addresses.split(","), args.events, args.hashes)

    per = -(-args.engines // args.launcher_processes)
    procs = [
        _spawn("--role", "launchers", "--first", str(first), "--engines", str(n))
        for first in range(0, args.engines, per)
        if (n := min(per, args.engines - first)) > 0
    ]
    found: dict[int, tuple[str, str]] = {}
    for proc in procs:
        assert proc.stdout is not None
        for _ in range(min(per, args.engines - len(found))):
            index, event_address, state_address = json.loads(proc.stdout.readline())
            found[index] = (event_address, state_address)
    store = EngineStore()
    table = RoutingTable(store).start()
    entries = {
        f"e{i}": Entry(
            f"/k/e{i}",
            EngineRecord(
                f"e{i}",
                _endpoint(i),
                state_address=found[i][1],
            ),
            1,
        )
        for i in range(args.engines)
    }
    store.replace(entries, 1)
    latencies: list[float] = []
    states = _instrumented(table, latencies)
    states.start()
    states.wait_synced(timeout=60)
    feeder = _spawn(
        "--role", "engines", "--events", str(args.events), "--hashes", str(args.hashes),
        "--addresses", ",".join(found[i][0] for i in range(args.engines)),
    )  # fmt: skip
    assert feeder.stdin is not None and feeder.stdout is not None

    # -- throughput ---------------------------------------------------------------------
    total = args.engines * args.events * args.hashes
    cpu0, t0 = time.process_time(), time.monotonic()
    feeder.stdin.write("throughput\n")
    feeder.stdin.flush()
    while _view_blocks(states) < total:
        time.sleep(0.005)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    feeder.stdout.readline()
    rate = total / wall
    cpu_per_event_us = cpu / total * 1e6

    # -- latency --------------------------------------------------------------------------
    latencies.clear()
    feeder.stdin.write("latency\n")
    feeder.stdin.flush()
    feeder.stdout.readline()
    wait_until = time.monotonic() + 2
    while time.monotonic() < wait_until and len(latencies) < 0.99 * _sent_latency(args):
        time.sleep(0.01)
    samples = sorted(latencies)

    # -- memory per block ----------------------------------------------------------------
    held = _view_blocks(states)
    states.stop()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    states = EngineStates(table).start()
    states.wait_synced(timeout=60)
    while _view_blocks(states) < held:
        time.sleep(0.01)
    per_block = (tracemalloc.get_traced_memory()[0] - before) / held
    tracemalloc.stop()
    states.stop()

    feeder.stdin.close()
    feeder.wait(30)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in procs:
        proc.wait(60)
    table.stop()
    store.close()

    rows = [
        ("engines / launcher processes", f"{args.engines} / {len(procs)}"),
        ("block events (frames x hashes)", f"{total:,} ({args.engines * args.events:,} frames)"),
        ("throughput, engine sockets -> router view", f"{rate:,.0f} block events/s"),
        ("router process CPU per block event", f"{cpu_per_event_us:.2f} us"),
        ("router capacity on a core of its own", f"{1e6 / cpu_per_event_us:,.0f} block events/s"),
        ("latency samples", f"{len(samples):,}"),
        ("latency engine event -> router view p50", f"{percentile(samples, 50):.2f} ms"),
        ("latency p90", f"{percentile(samples, 90):.2f} ms"),
        ("latency p99", f"{percentile(samples, 99):.2f} ms"),
        ("latency max", f"{samples[-1]:.2f} ms" if samples else "-"),
        ("router memory per cached block", f"{per_block:.1f} B ({held:,} blocks)"),
    ]
    targets = [
        Target(
            f"router capacity @ {args.engines} engines, as time per block event (>= 50,000/s)",
            cpu_per_event_us,
            20.0,
            "us",
        ),
        Target("engine event -> router view p99 (loopback)", percentile(samples, 99), 10.0, "ms"),
        Target("router memory per cached block", per_block, 100.0, "B"),
    ]
    text = table_text(("relay", "figure"), rows)
    text += "\n\n" + "\n".join(t.line() for t in targets)
    text += (
        f"\nwall-clock throughput on this shared 2-core machine (engines, launchers and the "
        f"router on the same 2 cores): {rate:,.0f} block events/s"
    )
    print(text)
    if not args.no_results:
        record_results(
            "relay",
            text,
            about="`bench_relay.py`: engines (one process, Megatron's `stored` frames) -> "
            "`EngineEventReceiver`s and their state relays (launcher processes) -> one "
            "router's `EngineStates` (this process) over real ZeroMQ sockets on loopback. "
            "Throughput: every engine sends its frames as fast as it can; the router's CPU "
            "per block event gives its capacity on a core of its own (the issue's figure: "
            "per router process), since here all processes share 2 cores. Latency: a frame "
            "every 50 ms per engine whose hash is its send time. Memory: tracemalloc while "
            "the views are rebuilt from snapshots.",
            targets=targets,
        )
    write_json(
        "relay",
        {
            "rate": rate,
            "cpu_per_event_us": cpu_per_event_us,
            "latency_ms": samples,
            "bytes_per_block": per_block,
        },
    )


def _endpoint(index: int):  # type: ignore[no-untyped-def]
    from discovery import InferenceEngineEndpoint  # noqa: PLC0415

    return InferenceEngineEndpoint.from_dict(
        default_endpoint(f"tcp://10.0.{index // 256}.{index % 256}:5555")
    )


def _sent_latency(args: argparse.Namespace) -> float:
    return args.engines * LATENCY_SECONDS / LATENCY_PERIOD


def _instrumented(table: RoutingTable, latencies: list[float]) -> EngineStates:
    """EngineStates whose kv frames carrying a send time record engine -> view latency."""
    lock = threading.Lock()

    class Timed(EngineStates):
        def _apply(self, follow: _Follow, message: object, pack: object) -> None:  # type: ignore[override]
            super()._apply(follow, message, pack)  # type: ignore[arg-type]
            if isinstance(message, list) and message[0] == "kv":
                now = time.monotonic_ns()
                for stamp in unpack_hashes(message[4]):
                    age = (now - stamp) / 1e6
                    if 0 <= age < 60_000:  # a send time, not a random throughput hash
                        with lock:
                            latencies.append(age)

    return Timed(table)


if __name__ == "__main__":
    main()
