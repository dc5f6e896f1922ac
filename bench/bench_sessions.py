"""Sessions: a mass lease loss, and keepalive cost, with and without a shared Session.

Run: ``.venv/bin/python bench/bench_sessions.py [--count 2000] [--ttl 3] [--stall 4]``.

* Mass loss (issue 16 target): one process holds ``--count`` registrations on one
  Connection, either each on its own lease (the default, ``register_engine(...,
  connection=conn)``) or all on one ``Session``. Two CPU-burning processes (``python -c
  'while True: pass'``) run for the whole scenario, stopped by pid at its end. etcd (one
  private member) is stopped with SIGSTOP for ``--stall`` s, longer than the TTL, so every
  lease expires; then SIGCONT. Measured from SIGCONT: the time until every registration is
  ``registered`` again (its record written on a live lease), how many times each was
  lost (over two more TTLs: a second loss would be a cascade), and the etcd requests the
  recovery cost (lease grants, record writes and batches, revokes, lease reads), counted by
  wrapping the Connection's methods. Target, with a session: back within TTL + 1 s, each
  lost exactly once.
* Keepalive cost: N registrations (1 to ``--count``) in steady state for two TTLs, with
  and without a session: keepalives sent per second (counted at the keeper's send), the
  holding process's CPU and etcd's CPU (1.0 = one core busy). Measured without burners.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from _common import (
    LABELS,
    CpuMeter,
    Target,
    burners,
    etcd_cluster,
    make_endpoint,
    record_results,
    table_text,
    write_json,
)

from discovery import Connection, RegistrationState, Session, Settings, register_engine
from discovery._writes import lease as lease_module

COUNTED = ("grant", "create", "create_many", "update", "revoke", "lease_info")


class CountingConnection(Connection):
    """A Connection that counts its etcd requests (one per port call)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.counts: collections.Counter[str] = collections.Counter()
        self.batched = 0  # records written through create_many


def _counted(name: str):
    def method(self: CountingConnection, *args, **kwargs):
        self.counts[name] += 1
        if name == "create_many":
            self.batched += len(args[0])
        return getattr(Connection, name)(self, *args, **kwargs)

    return method


for _name in COUNTED:
    setattr(CountingConnection, _name, _counted(_name))


def register_many(conn: Connection, count: int, ttl: int, session: Session | None) -> list:
    def one(i: int):
        kwargs = {"session": session} if session else {"ttl": ttl, "connection": conn}
        return register_engine(make_endpoint(i), engine_id=f"m{i}", labels=LABELS, **kwargs)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def close_all(conn: Connection, session: Session | None, regs: list) -> None:
    """Revoke every registration (one revoke with a session), then the connection."""
    if session is not None:
        session.close()
    else:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: r.close(), regs))
    conn.close()


def wait_until(condition: Callable[[], bool], timeout: float, step: float = 0.01) -> float:
    """Seconds until ``condition`` held (polled every ``step``); raise after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not met")
        time.sleep(step)
    return time.monotonic() - t0


def mass_loss(count: int, ttl: int, stall: float, shared: bool, burn: int) -> dict:
    with burners(burn) as burner_pids, etcd_cluster(1) as cluster:
        member = cluster.members[0]
        settings = Settings(endpoints=[member.client_url], namespace="sessions", dial_timeout=30)
        conn = CountingConnection(settings)
        session = Session(ttl=ttl, connection=conn) if shared else None
        regs = register_many(conn, count, ttl, session)
        wait_until(lambda: all(r.health().last_keepalive for r in regs), 30)
        conn.counts.clear()
        conn.batched = 0
        member.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(stall)  # the fault itself: etcd frozen this long
        finally:
            member.process.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        try:
            wait_until(lambda: all(r.health().losses >= 1 for r in regs), 120)
            wait_until(lambda: all(r.state is RegistrationState.REGISTERED for r in regs), 300)
            back = time.monotonic() - resumed
            # Two more TTLs: a registration lost again would be a cascade.
            time.sleep(2 * ttl)
            losses = collections.Counter(r.health().losses for r in regs)
            leases = {r.lease_id for r in regs}
            _, kvs = conn.list_prefix(settings.keyspace.prefix)
            live = sum(1 for kv in kvs if kv.lease in leases)
            return {
                "mode": "session" if shared else "per-registration leases",
                "count": count,
                "back_s": back,
                "losses": dict(losses),
                "keys_on_live_leases": live,
                "requests": dict(conn.counts),
                "batched_records": conn.batched,
                "burners": len(burner_pids),
                "load": os.getloadavg()[0],
            }
        finally:
            close_all(conn, session, regs)


def keepalive_cost(sizes: list[int], ttl: int) -> list[dict]:
    sent = [0]
    original = lease_module.LeaseKeeper.send_keepalive

    def counted(self, lease_id):
        stream = original(self, lease_id)
        sent[0] += stream is not None
        return stream

    lease_module.LeaseKeeper.send_keepalive = counted
    rows = []
    with etcd_cluster(1) as cluster:
        member = cluster.members[0]
        for shared in (False, True):
            for n in sizes:
                settings = Settings(
                    endpoints=[member.client_url],
                    namespace=f"cost-{'s' if shared else 'p'}-{n}",
                    dial_timeout=30,
                )
                conn = Connection(settings)
                session = Session(ttl=ttl, connection=conn) if shared else None
                regs = register_many(conn, n, ttl, session)
                time.sleep(ttl)  # steady state: every lease has been kept alive
                window = 2 * ttl
                etcd_cpu = CpuMeter([member.pid])
                cpu0, sent0, t0 = time.process_time(), sent[0], time.monotonic()
                time.sleep(window)
                elapsed = time.monotonic() - t0
                rows.append(
                    {
                        "mode": "session" if shared else "per-registration",
                        "n": n,
                        "keepalives_per_s": (sent[0] - sent0) / elapsed,
                        "process_cpu": (time.process_time() - cpu0) / elapsed,
                        "etcd_cpu": etcd_cpu.share(),
                    }
                )
                print(rows[-1], flush=True)
                close_all(conn, session, regs)
    lease_module.LeaseKeeper.send_keepalive = original
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--ttl", type=int, default=3)
    parser.add_argument("--stall", type=float, default=4.0)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--sizes", default="1,100,1000,2000", help="keepalive cost sizes")
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    losses = []
    for shared in (True, False):
        result = mass_loss(args.count, args.ttl, args.stall, shared, args.burners)
        print(result, flush=True)
        losses.append(result)
    cost = keepalive_cost([int(s) for s in args.sizes.split(",")], args.ttl)

    rows = [
        [
            r["mode"],
            r["count"],
            f"{r['back_s']:.2f}",
            " ".join(f"{k}x:{v}" for k, v in sorted(r["losses"].items())),
            r["keys_on_live_leases"],
            r["requests"].get("grant", 0),
            r["requests"].get("create", 0) + r["batched_records"],
            sum(r["requests"].get(k, 0) for k in ("create", "create_many", "update")),
            r["requests"].get("revoke", 0),
            r["requests"].get("lease_info", 0),
            f"{r['load']:.1f}",
        ]
        for r in losses
    ]
    text = table_text(
        (
            f"mass loss (TTL {args.ttl} s, etcd stopped {args.stall:g} s, "
            f"{args.burners} CPU burners)",
            "n",
            "back after SIGCONT, s",
            "losses per registration",
            "keys",
            "grants",
            "records written",
            "write requests",
            "revokes",
            "lease reads",
            "load 1m",
        ),
        rows,
    )
    text += "\n\n" + table_text(
        (
            f"keepalive cost (TTL {args.ttl} s, steady state)",
            "registrations",
            "keepalives/s",
            "process CPU",
            "etcd CPU",
        ),
        [
            [
                r["mode"],
                r["n"],
                f"{r['keepalives_per_s']:.1f}",
                f"{r['process_cpu']:.3f}",
                f"{r['etcd_cpu']:.3f}",
            ]
            for r in cost
        ],
    )
    shared = losses[0]
    targets = [
        Target(
            "session mass loss back after SIGCONT (TTL + 1 s)",
            shared["back_s"],
            args.ttl + 1,
            "s",
        ),
        Target(
            "session mass loss: losses per registration",
            max(shared["losses"]),
            1,
            "x",
        ),
        Target("session mass loss: lease grants", shared["requests"].get("grant", 0), 1, ""),
    ]
    biggest = [r for r in cost if r["n"] == max(x["n"] for x in cost)]
    smallest = [r for r in cost if r["n"] == min(x["n"] for x in cost)]
    growth = next(r for r in biggest if r["mode"] == "session")["keepalives_per_s"] / max(
        next(r for r in smallest if r["mode"] == "session")["keepalives_per_s"], 1e-9
    )
    targets.append(
        Target("session keepalives/s, largest / smallest registration count", growth, 1.5, "x")
    )
    text += "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    about = (
        "`bench_sessions.py`: one process holds the registrations on one Connection; "
        f"{args.burners} `python -c 'while True: pass'` processes run during the mass-loss "
        "scenarios (stopped by pid after each); etcd is one private member, frozen with "
        "SIGSTOP past the TTL. *back* is from SIGCONT until every registration is "
        "`registered` again (its record written on a live lease); losses are counted over "
        "two more TTLs; requests are the etcd calls the recovery made (records written = "
        "single creates + records in batched creates). Keepalive cost is measured without "
        "burners over two TTLs of steady state."
    )
    if not args.no_results:
        record_results("sessions", text, about=about, targets=targets)
    write_json("sessions", {"losses": losses, "cost": cost, "targets": targets})


if __name__ == "__main__":
    main()
