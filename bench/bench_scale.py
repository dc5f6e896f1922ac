"""Scale: 1,000 / 10,000 / 50,000 registered engines; etcd CPU, keepalive rate, a new
watcher's time to a complete table, table memory per endpoint.

Run: ``.venv/bin/python bench/bench_scale.py [--sizes 1000,10000,50000] [--ttl 30]``.

* Engines: ``--workers`` processes, each with one ``discovery.Connection`` shared by all
  its ``register_engine(..., connection=conn)`` calls (8 threads each while growing);
  every engine has its own lease, kept alive by the worker's single keeper thread and
  LeaseKeepAlive stream (a keepalive every TTL/3 per lease). The fleet grows from one
  size to the next; each size is measured once keepalives are in steady state.
* etcd CPU: /proc/<pid>/stat of the etcd member over a ``--window`` second window (1.0 =
  one core busy); worker CPU likewise.
* Keepalive rate: LeaseKeepAlive requests sent and responses received per second,
  counted in the workers (by wrapping the keeper's send and the registration's answer
  handler), next to etcd's own ``etcd_debugging_lease_renewed_total`` rate.
* New watcher: a fresh ``watch_table(settings)`` (its own Connection and watcher)
  from ``start()`` until it holds all N engines; best and worst of ``--watchers`` runs,
  while the fleet's keepalives go on.
* Memory: in a separate process, tracemalloc's traced memory of a started table (its
  watcher's cache, the table and one snapshot) divided by N; and that process's RSS delta.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time

import etcd3
from _common import (
    LABELS,
    CpuMeter,
    Target,
    etcd_cluster,
    etcd_metrics,
    host_port,
    make_endpoint,
    proc_rss_bytes,
    record_results,
    table_text,
    write_json,
)

from discovery import Connection, RegistrationState, Settings, register_engine, watch_table

NAMESPACE = "scale"
WATCH_TARGETS = {1_000: 0.3, 10_000: 1.0, 50_000: 5.0}


# -- the worker processes ------------------------------------------------------------------


def worker_main(index: int, url: str, ttl: float, pipe) -> None:
    """Hold registrations; answer grow / stats / stop commands from the parent."""
    logging.basicConfig(level=logging.ERROR)
    from discovery import _lease, _session  # noqa: PLC0415

    sent = [0]
    answered = [0]
    send = _lease.LeaseKeeper.send_keepalive
    answer = _session.Session.keepalive_answered

    def counted_send(self, lease_id):
        stream = send(self, lease_id)  # the stream it went out on, or None
        sent[0] += stream is not None
        return stream

    def counted_answer(self, lease_id, ttl):
        answered[0] += 1
        return answer(self, lease_id, ttl)

    _lease.LeaseKeeper.send_keepalive = counted_send
    _session.Session.keepalive_answered = counted_answer

    settings = Settings(endpoints=[url], namespace=NAMESPACE, dial_timeout=30)
    conn = Connection(settings)
    regs = []
    lock = threading.Lock()

    def register(i: int) -> None:
        reg = register_engine(
            make_endpoint(i), engine_id=f"w{index}-{i}", ttl=ttl, labels=LABELS, connection=conn
        )
        with lock:
            regs.append(reg)

    pool = concurrent.futures.ThreadPoolExecutor(8)
    while True:
        command = pipe.recv()
        if command[0] == "grow":
            target = command[1]
            t0 = time.monotonic()
            list(pool.map(register, range(len(regs), target)))
            pipe.send(time.monotonic() - t0)
        elif command[0] == "stats":
            states = [r.state for r in regs]
            pipe.send(
                {
                    "sent": sent[0],
                    "answered": answered[0],
                    "registered": sum(s is RegistrationState.REGISTERED for s in states),
                    "losses": sum(r.health().losses for r in regs),
                }
            )
        else:  # stop: leave without revoking (the cluster is discarded); no atexit either
            pipe.send("bye")
            os._exit(0)


class Fleet:
    def __init__(self, url: str, ttl: float, workers: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.processes = []
        for i in range(workers):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(i, url, ttl, child), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        self.size = 0

    def ask(self, command) -> list:
        for pipe in self.pipes:
            pipe.send(command)
        return [pipe.recv() for pipe in self.pipes]

    def grow(self, total: int) -> float:
        per = [
            total // len(self.pipes) + (i < total % len(self.pipes)) for i in range(len(self.pipes))
        ]
        t0 = time.monotonic()
        for pipe, n in zip(self.pipes, per, strict=True):
            pipe.send(("grow", n))
        for pipe in self.pipes:
            pipe.recv()
        self.size = total
        return time.monotonic() - t0

    def stats(self) -> dict:
        replies = self.ask(("stats",))
        return {k: sum(r[k] for r in replies) for k in replies[0]}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT every worker (keepalives stop meanwhile: keep it short)."""
        for process in self.processes:
            os.kill(process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        self.pause(False)
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


# -- measurements in the parent ------------------------------------------------------------


def time_new_watcher(settings: Settings) -> tuple[float, int]:
    """Seconds from a new table's start() until it holds the complete list, and its size.

    ``start()`` returns once the watcher's first snapshot (every engine at one revision,
    read in pages) has been applied to the table, so the table is complete then.
    """
    gc.collect()
    t0 = time.perf_counter()
    table = watch_table(settings)
    try:
        table.start()
        return time.perf_counter() - t0, len(table)
    finally:
        table.stop()


def memory_probe(url: str, queue) -> None:
    """In a fresh process: tracemalloc and RSS cost of a started (complete) table."""
    import tracemalloc  # noqa: PLC0415

    settings = Settings(endpoints=[url], namespace=NAMESPACE, dial_timeout=30)
    conn = Connection(settings)
    conn.call(lambda: conn.get("/"))  # channel and client built outside the measurement
    gc.collect()
    rss0 = proc_rss_bytes(os.getpid())
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = watch_table(connection=conn)
    table.start()
    snapshot = table.snapshot()
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    gc.collect()
    rss = proc_rss_bytes(os.getpid()) - rss0
    queue.put({"n": len(snapshot), "traced": traced, "rss": rss})
    table.stop()
    conn.close()


def measure_memory(url: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=memory_probe, args=(url, queue))
    process.start()
    try:
        return queue.get(timeout=600)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


def unpaginated_read(url: str, prefix: str) -> str:
    """What one plain python3-etcd3 prefix read (default 4 MiB receive limit) returns."""
    client = etcd3.client(*host_port(url))
    try:
        count = sum(1 for _ in client.get_prefix(prefix))
        return f"ok ({count} keys)"
    except Exception as exc:
        code = getattr(getattr(exc, "__cause__", None) or exc, "code", None)
        return f"fails: {code().name if callable(code) else type(exc).__name__}"
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--window", type=float, default=20.0, help="steady window, s (whole TTL/3 periods)"
    )
    parser.add_argument("--watchers", type=int, default=3, help="new-watcher runs per size")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    # Keepalives come in waves (every lease once per TTL/3, phases set at registration):
    # the window is a whole number of keepalive periods.
    period = args.ttl / 3
    window_s = period * max(1, round(args.window / period))
    rows = []
    results = []
    targets = []
    with etcd_cluster(1, extra_args=["--quota-backend-bytes", str(8 * 1024**3)]) as cluster:
        member = cluster.members[0]
        url = member.client_url
        settings = Settings(endpoints=[url], namespace=NAMESPACE, dial_timeout=30)
        fleet = Fleet(url, args.ttl, args.workers)
        try:
            for n in sizes:
                added = n - fleet.size
                setup = fleet.grow(n)
                print(f"{n} engines registered ({added} in {setup:.1f} s)", flush=True)
                # Steady state: every lease has had at least one keepalive cycle.
                time.sleep(args.ttl / 3 + 1)
                etcd_cpu = CpuMeter([member.pid])
                fleet_cpu = CpuMeter(fleet.pids)
                before = fleet.stats()
                renewed0 = etcd_metrics(url, ["etcd_debugging_lease_renewed_total"])
                t0 = time.monotonic()
                time.sleep(window_s)
                window = time.monotonic() - t0
                during = fleet.stats()
                renewed1 = etcd_metrics(url, ["etcd_debugging_lease_renewed_total"])
                etcd_share, fleet_share = etcd_cpu.share(), fleet_cpu.share()
                renew_rate = (
                    renewed1["etcd_debugging_lease_renewed_total"]
                    - renewed0["etcd_debugging_lease_renewed_total"]
                ) / window
                sent_rate = (during["sent"] - before["sent"]) / window
                answered_rate = (during["answered"] - before["answered"]) / window
                watch_runs = [time_new_watcher(settings) for _ in range(args.watchers)]
                watch_times = [t for t, _ in watch_runs]
                watch_sizes = [size for _, size in watch_runs]
                # The same with the fleet paused, as for a router on a machine of its own
                # (etcd still serves; the pause stays well inside TTL - TTL/3).
                fleet.pause(True)
                try:
                    alone = [time_new_watcher(settings)[0] for _ in range(args.watchers)]
                finally:
                    fleet.pause(False)
                memory = measure_memory(url)
                raw_read = unpaginated_read(url, settings.keyspace.prefix)
                after = fleet.stats()  # losses include any caused by the pause
                result = {
                    "engines": n,
                    "setup_s": setup,
                    "setup_rate": added / setup,
                    "etcd_cpu": etcd_share,
                    "fleet_cpu": fleet_share,
                    "etcd_rss_mib": proc_rss_bytes(member.pid) / 2**20,
                    "keepalive_sent_per_s": sent_rate,
                    "keepalive_answered_per_s": answered_rate,
                    "etcd_renewed_per_s": renew_rate,
                    "expected_per_s": n / (args.ttl / 3),
                    "registered": after["registered"],
                    "losses": after["losses"],
                    "watch_s": watch_times,
                    "watch_sizes": watch_sizes,
                    "watch_alone_s": alone,
                    "etcd_us_per_keepalive": etcd_share / max(renew_rate, 1e-9) * 1e6,
                    "fleet_us_per_keepalive": fleet_share / max(answered_rate, 1e-9) * 1e6,
                    "mem_traced_per": memory["traced"] / memory["n"],
                    "mem_rss_per": memory["rss"] / memory["n"],
                    "raw_unpaginated_read": raw_read,
                }
                print(result, flush=True)
                results.append(result)
                rows.append(
                    (
                        f"{n:,}",
                        f"{result['setup_rate']:,.0f}/s",
                        f"{etcd_share * 100:.0f}%",
                        f"{fleet_share * 100:.0f}%",
                        f"{sent_rate:,.0f}/{answered_rate:,.0f}/{renew_rate:,.0f}",
                        f"{result['expected_per_s']:,.0f}",
                        f"{result['etcd_us_per_keepalive']:.0f}/{result['fleet_us_per_keepalive']:.0f}",
                        f"{after['registered']:,}/{after['losses']}",
                        f"{min(watch_times):.2f}/{max(watch_times):.2f} ({min(watch_sizes):,})",
                        f"{min(alone):.2f}/{max(alone):.2f}",
                        f"{result['mem_traced_per']:,.0f}/{result['mem_rss_per']:,.0f}",
                        raw_read,
                    )
                )
                if n in WATCH_TARGETS:
                    limit = WATCH_TARGETS[n]
                    running = f"new watcher complete @ {n:,}, fleet running"
                    targets.append(Target(running, max(watch_times), limit, "s"))
                    paused = f"new watcher complete @ {n:,}, fleet paused"
                    targets.append(Target(paused, max(alone), limit, "s"))
                    targets.append(
                        Target(
                            f"table memory per endpoint @ {n:,}",
                            result["mem_traced_per"] / 1024,
                            2.0,
                            "KiB",
                        )
                    )
        finally:
            fleet.stop()
    header = (
        "engines",
        "register",
        "etcd CPU",
        "fleet CPU",
        "keepalive/s sent/answered/etcd",
        "TTL/3 rate",
        "CPU us/keepalive etcd/fleet",
        "registered/losses",
        "new watcher s best/worst (engines)",
        "same, fleet paused",
        "bytes/endpoint traced/RSS",
        "1 unpaginated read",
    )
    text = table_text(header, rows)
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        record_results(
            "scale",
            text,
            targets=targets,
            about=(
                f"`bench_scale.py`: {args.workers} worker processes, each one Connection shared "
                f"by all its `register_engine(..., ttl={args.ttl:g})` calls (every engine its "
                f"own lease; a keepalive per lease every TTL/3 = {args.ttl / 3:g} s). etcd and "
                f"fleet CPU over a {window_s:g} s steady window (100% = one core). Keepalives "
                "counted in the workers (requests sent / responses handled) and by etcd "
                "(`etcd_debugging_lease_renewed_total`). New watcher: a fresh "
                f"`watch_table(settings)` from `start()` to all N engines, best/worst of "
                f"{args.watchers}, with the fleet's keepalives running on the same 2 cores. "
                "Memory: tracemalloc of a started table (watcher cache + table + one snapshot) "
                "in a fresh process, per endpoint; and that process's RSS growth per endpoint."
            ),
        )
    write_json(
        "scale",
        {"ttl": args.ttl, "workers": args.workers, "results": results, "targets": targets},
    )


if __name__ == "__main__":
    main()
