"""The fleet client: its cost against direct clients, requests through engine losses, a refit.

Run: ``.venv/bin/python bench/bench_fleet.py`` (``--no-results``: print, record nothing).

Real etcd (a private member), stand-in engines speaking Megatron's coordinator wire
(docs/megatron_wire.md) and ``discovery.testing.stand_in_client`` (the same wire as Megatron's
``InferenceClient``) on both paths; the client side runs in this process.

* **Overhead.** ``OVERHEAD_ENGINES`` stand-in coordinators in two engine-host processes
  (each registers its engines with ``register_engine``, token delay 0). The same short
  requests (a 16-token prompt, 1 token generated), ``CONCURRENCY`` at a time, are sent
  directly (one started client per engine, taken in turn), through ``FleetClient``
  (``round_robin``, and the router's default policy), and two ways between, to show
  where the cost is: the direct path with a ``Router.pick`` released at once before each
  request (the router's pick alone), and as a frontend does it by hand without the fleet
  client (``Router.pick``, ``round_robin``, the engine's client, the handle released on
  the reply). Rounds alternate. Figures: requests/s and this process's CPU (user +
  system, every thread) per request, the medians of the rounds; "x direct", the median
  (and range) of each round's CPU per request over that of the direct round just before
  it. Target: fleet CPU per request <= 1.15 x direct (``round_robin``, the same spread as
  the direct path's).
* **Losses.** ``LOSS_ENGINES`` stand-in engines each under ``discovery launch`` (``--ttl
  3``, ``--stall-timeout 2``: the stand-in sends progress every 0.5 s). ``IN_FLIGHT``
  requests of ``LOSS_TOKENS`` tokens (``LOSS_DELAY`` s a token) are sent through the fleet
  client (``load_balanced``); once every one is held on an engine, one engine is SIGKILLed
  (its launcher sees it die and revokes its record), and in a second round another is
  SIGSTOPped (frozen: its launcher marks it stalled). Figures: requests lost (an error
  instead of a reply; target 0), requests that were on the lost engine, and the time from
  the signal to the last completion (a resent request starts over).
* **Refit.** ``REFIT_ENGINES`` stand-in coordinators in an engine-host process (they count
  the submits that reach them while paused), a router on ``weight_version="latest"``, and
  ``REFIT_LOAD`` request loops sending through the fleet client without pause. ``REFITS``
  times: ``pause()`` all, ``REFIT_HOLD`` s of "setting weights", ``resume(weight_version=
  v)``. Figures: submits that reached a paused engine (target 0), replies received once
  the table showed an engine ready on ``v`` whose last generation epoch is older than
  ``v`` (target 0), requests that failed, and each refit's pause and resume durations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from _common import ROOT, Target, etcd_cluster, record_results, table_text

sys.path.insert(0, str(ROOT))  # the stand-in launcher helpers live with the tests

from discovery import (
    EngineStatus,
    FleetClient,
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    NoEngineAvailableError,
    Router,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.stand_in_client import InferenceClient
from discovery.testing.stand_in_coordinator import StandInCoordinator
from tests.helpers import STAND_IN, Launcher, cli_env

OVERHEAD_ENGINES = 64
CONCURRENCY = 128
REQUESTS = 3000  # per round
ROUNDS = 25  # of each path, alternating
SHORT = {"num_tokens_to_generate": 1}
LOSS_ENGINES = 8
IN_FLIGHT = 100
LOSS_TOKENS = 100
LOSS_DELAY = 0.02
REFIT_ENGINES = 16
REFIT_LOAD = 32
REFITS = 3
REFIT_HOLD = 0.5
REFIT_PARAMS = {"num_tokens_to_generate": 4}
REFIT_DELAY = 0.005
CAPS = InferenceEngineCapabilities(
    context_length=8192,
    kv_cache_block_size=16,
    total_kv_blocks=4096,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    bos_token_id=1,
    enable_prefix_caching=True,
)


def prompt(i: int) -> list[int]:
    """A 16-token prompt, distinct per request."""
    return [(i * 7 + k) % 30000 + 2 for k in range(16)]


# -- an engine-host process --------------------------------------------------------------------


def host_main(args: argparse.Namespace) -> int:
    """Serve ``--engines`` stand-in coordinators; "report": their paused submits; EOF: end."""
    settings = Settings.from_env()
    coordinators: dict[str, StandInCoordinator] = {}
    registrations = []
    try:
        for i in range(args.engines):
            engine_id = f"{args.prefix}{i:02d}"
            coordinator = StandInCoordinator(
                seed=i % 16, token_delay=args.token_delay, max_running=args.max_running
            ).start()
            coordinators[engine_id] = coordinator
            endpoint = InferenceEngineEndpoint(coordinator.address, CAPS)
            registrations.append(
                register_engine(
                    endpoint, engine_id=engine_id, settings=settings, ttl=10, weight_version=1
                )
            )
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "report":
                counts = {e: c.paused_submits for e, c in coordinators.items()}
                print(json.dumps(counts), flush=True)
    finally:
        for registration in registrations:
            registration.close()
        for coordinator in coordinators.values():
            coordinator.close()
    return 0


class Hosts:
    """Engine-host processes (``host_main``), stopped by pid at the end."""

    def __init__(
        self,
        settings: Settings,
        prefix: str,
        engines: int,
        processes: int,
        token_delay: float,
        max_running: int | None = None,
    ) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        share = engines // processes
        for p in range(processes):
            command = [sys.executable, __file__, "--host", "--engines", str(share)]
            command += ["--prefix", f"{prefix}{p}-", "--token-delay", f"{token_delay:g}"]
            if max_running is not None:
                command += ["--max-running", str(max_running)]
            self.processes.append(
                subprocess.Popen(
                    command,
                    env=cli_env(settings),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
            )
        for process in self.processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"

    def paused_submits(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for process in self.processes:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write("report\n")
            process.stdin.flush()
            counts.update(json.loads(process.stdout.readline()))
        return counts

    def stop(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


# -- overhead ----------------------------------------------------------------------------------


async def _drive(send: Callable[[int], Any]) -> tuple[float, float]:
    """Send REQUESTS, CONCURRENCY at a time: (requests/s, CPU seconds per request)."""
    next_request = 0

    async def worker() -> None:
        nonlocal next_request
        while next_request < REQUESTS:
            i = next_request
            next_request += 1
            reply = await send(i)
            assert reply["status"] == "COMPLETED", reply

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return REQUESTS / wall, cpu / REQUESTS


async def _overhead(settings: Settings) -> dict[str, list[tuple[float, float]]]:
    rounds: dict[str, list[tuple[float, float]]] = {
        "direct": [],
        "pick_only": [],
        "by_hand": [],
        "fleet": [],
        "default": [],
    }
    with watch_table(settings) as table:
        table.wait_until(lambda s: len(s) == OVERHEAD_ENGINES, timeout=60)
        records = table.snapshot()
        loop = asyncio.get_running_loop()
        by_id = {e: InferenceClient(r.endpoint.coordinator_address) for e, r in records.items()}
        direct = list(by_id.values())
        for client in direct:
            await asyncio.to_thread(client.start, loop, 10.0)
        fleets = {
            "fleet": FleetClient(
                Router(table, policy="round_robin"), client_factory=InferenceClient
            ),
            "default": FleetClient(Router(table), client_factory=InferenceClient),
        }
        try:
            for fleet in fleets.values():
                await fleet.start()
                await _until(lambda f=fleet: len(f.clients) == OVERHEAD_ENGINES, "clients")
            paths: dict[str, Callable[[int], Any]] = {
                "direct": lambda i: direct[i % len(direct)].add_request(prompt(i), SHORT),
                "pick_only": _pick_only(Router(table, policy="round_robin"), direct),
                "by_hand": _by_hand(Router(table, policy="round_robin"), by_id),
                **{name: _sender(fleet) for name, fleet in fleets.items()},
            }
            for send in paths.values():  # a warm-up round each, not counted
                await _drive(send)
            for _ in range(ROUNDS):
                for name, send in paths.items():
                    rounds[name].append(await _drive(send))
        finally:
            for fleet in fleets.values():
                await fleet.stop()
            for client in direct:
                client.stop()
    return rounds


def _pick_only(router: Router, clients: list[InferenceClient]) -> Callable[[int], Any]:
    """The direct path, with a pick released at once before each request."""

    def send(i: int) -> Any:
        tokens = prompt(i)
        router.pick(tokens, 1).release()
        return clients[i % len(clients)].add_request(tokens, SHORT)

    return send


def _by_hand(router: Router, clients: dict[str, InferenceClient]) -> Callable[[int], Any]:
    """A request as a frontend sends it without the fleet client: pick, send, release."""

    def send(i: int) -> Any:
        tokens = prompt(i)
        handle = router.pick(tokens, 1)
        reply = clients[handle.engine_id].add_request(tokens, SHORT)
        reply.add_done_callback(
            lambda r: handle.release(failed=r.cancelled() or r.exception() is not None)
        )
        return reply

    return send


def _sender(fleet: FleetClient) -> Callable[[int], Any]:
    return lambda i: fleet.add_request(prompt(i), SHORT)


async def _until(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- losses ------------------------------------------------------------------------------------


async def _loss_round(
    fleet: FleetClient, router: Router, launchers: Sequence[Launcher], how: signal.Signals
) -> dict[str, Any]:
    """IN_FLIGHT requests; once all are held, ``how`` to the busiest engine."""
    params = {"num_tokens_to_generate": LOSS_TOKENS}
    requests = [fleet.add_request(prompt(i), params) for i in range(IN_FLIGHT)]
    await _until(lambda: sum(router.in_flight().values()) == IN_FLIGHT, "every request held")
    load = router.in_flight()
    victim_id = max(load, key=lambda e: load[e])
    victim = next(launcher for launcher in launchers if launcher.engine_id == victim_id)
    pid = victim.child_pid()
    signalled = time.monotonic()
    os.kill(pid, how)
    lost = 0
    last = signalled
    for outcome in asyncio.as_completed(requests):
        try:
            reply = await outcome
            lost += reply["status"] != "COMPLETED" or len(reply["generated_tokens"]) != LOSS_TOKENS
        except Exception:  # RequestLostError, or any other: the request got no reply
            lost += 1
        last = time.monotonic()
    return {
        "engine": victim_id,
        "pid": pid,
        "on_it": load[victim_id],
        "lost": lost,
        "last": last - signalled,
    }


async def _losses(settings: Settings, launchers: Sequence[Launcher]) -> list[dict[str, Any]]:
    with watch_table(settings) as table:
        table.wait_until(lambda s: len(s) == LOSS_ENGINES, timeout=60)
        router = Router(table, policy="load_balanced")
        async with FleetClient(router, client_factory=InferenceClient) as fleet:
            await _until(lambda: len(fleet.clients) == LOSS_ENGINES, "clients")
            killed = await _loss_round(fleet, router, launchers, signal.SIGKILL)
            await _until(lambda: killed["engine"] not in table.snapshot(), "the record revoked")
            frozen = await _loss_round(fleet, router, launchers, signal.SIGSTOP)
            os.kill(frozen["pid"], signal.SIGCONT)
    return [{"row": "engine SIGKILLed", **killed}, {"row": "engine SIGSTOPped", **frozen}]


# -- refit -------------------------------------------------------------------------------------


def _epoch(reply: dict[str, Any]) -> int:
    """The generation epoch a reply ends on (registered engines start on 1)."""
    epochs = reply.get("policy_epoch") or []
    return int(epochs[-1][1]) if epochs else 1


async def _refit(settings: Settings, hosts: Hosts) -> dict[str, Any]:
    with watch_table(settings) as table:
        table.wait_until(lambda s: len(s) == REFIT_ENGINES, timeout=60)
        router = Router(table, policy="load_balanced", weight_version="latest")
        ready_on: dict[int, float] = {}  # version -> when the table first showed it ready

        def seen(batch: object, snapshot: Any) -> None:
            for record in snapshot.values():
                version = record.weight_version
                if record.status is EngineStatus.READY and version is not None:
                    ready_on.setdefault(version, time.monotonic())

        unsubscribe = table.subscribe(seen)
        stale = failed = refused = answered = 0
        took: list[tuple[float, float]] = []
        problems: list[str] = []
        async with FleetClient(router, client_factory=InferenceClient, settings=settings) as fleet:
            await _until(lambda: len(fleet.clients) == REFIT_ENGINES, "clients")
            stop = asyncio.Event()

            async def load(n: int) -> None:
                nonlocal stale, failed, refused, answered
                i = n
                while not stop.is_set():
                    i += REFIT_LOAD
                    try:
                        reply = await fleet.add_request(prompt(i), REFIT_PARAMS, wait=30)
                    except NoEngineAvailableError:  # the whole fleet is paused: try again
                        refused += 1
                        await asyncio.sleep(0.02)
                        continue
                    except Exception:
                        failed += 1
                        continue
                    answered += 1
                    now = time.monotonic()
                    newest = max((v for v, t in ready_on.items() if t <= now), default=1)
                    stale += _epoch(reply) < newest

            loops = [asyncio.create_task(load(n)) for n in range(REFIT_LOAD)]
            await asyncio.sleep(2)
            for version in range(2, 2 + REFITS):
                t0 = time.monotonic()
                paused = await fleet.pause()
                t1 = time.monotonic()
                await asyncio.sleep(REFIT_HOLD)  # the trainer sets the weights
                t2 = time.monotonic()
                resumed = await fleet.resume(weight_version=version)
                took.append((t1 - t0, time.monotonic() - t2))
                problems += [
                    f"v{version} {e}: {p}" for r in (paused, resumed) for e, p in r.failed.items()
                ]
                await asyncio.sleep(2)
            stop.set()
            await asyncio.gather(*loops)
        unsubscribe()
    submits = hosts.paused_submits()
    return {
        "paused_submits": sum(submits.values()),
        "stale": stale,
        "failed": failed,
        "refused": refused,
        "answered": answered,
        "took": took,
        "problems": problems,
    }


# -- the run -----------------------------------------------------------------------------------


def run() -> tuple[str, list[Target]]:
    with etcd_cluster(1) as cluster:
        base = Settings(endpoints=cluster.endpoints)
        print("overhead ...", flush=True)
        hosts = Hosts(base.with_namespace("overhead"), "o", OVERHEAD_ENGINES, 2, 0.0)
        try:
            rounds = asyncio.run(_overhead(base.with_namespace("overhead")))
        finally:
            hosts.stop()
        print("losses ...", flush=True)
        losses_at = base.with_namespace("losses")
        command = [*STAND_IN, "--coordinator-port", "0", "--token-delay", f"{LOSS_DELAY:g}"]
        launchers = [
            Launcher(
                losses_at, f"l{i}", [*command, "--seed", str(i)], "--ttl", "3",
                "--stall-timeout", "2",
            )
            for i in range(LOSS_ENGINES)
        ]  # fmt: skip
        try:
            losses = asyncio.run(_losses(losses_at, launchers))
        finally:
            for launcher in launchers:
                launcher.stop()
        print("refit ...", flush=True)
        refit_at = base.with_namespace("refit")
        hosts = Hosts(refit_at, "r", REFIT_ENGINES, 1, REFIT_DELAY)
        try:
            refit = asyncio.run(_refit(refit_at, hosts))
        finally:
            hosts.stop()
    return figures(rounds, losses, refit)


def figures(
    rounds: dict[str, list[tuple[float, float]]],
    losses: list[dict[str, Any]],
    refit: dict[str, Any],
) -> tuple[str, list[Target]]:
    median = {
        name: (statistics.median(r for r, _ in each), statistics.median(c for _, c in each))
        for name, each in rounds.items()
    }
    # Each round against the direct round just before it: the machine's speed drifts
    # between runs and within one (the direct path's CPU per request moved 77-127 us, 2026-12-06).
    ratio = {
        name: sorted(c / d for (_, c), (_, d) in zip(each, rounds["direct"], strict=True))
        for name, each in rounds.items()
    }
    names = {
        "direct": "direct (a client per engine, in turn)",
        "pick_only": "direct, a pick and its release before each",
        "by_hand": "by hand: Router.pick, released on the reply",
        "fleet": "FleetClient, round_robin",
        "default": "FleetClient, default policy",
    }
    rows = [
        (
            names[n],
            f"{rps:.0f}",
            f"{cpu * 1e6:.0f}",
            f"{statistics.median(ratio[n]):.2f}",
            f"{ratio[n][0]:.2f}-{ratio[n][-1]:.2f}",
        )
        for n, (rps, cpu) in median.items()
    ]
    loss_rows = [(x["row"], IN_FLIGHT, x["on_it"], x["lost"], f"{x['last']:.2f}") for x in losses]
    pauses = ", ".join(f"{p:.2f}/{r:.2f}" for p, r in refit["took"])
    body = "\n".join(
        [
            f"overhead: {OVERHEAD_ENGINES} engines, {CONCURRENCY} requests at a time, "
            f"{REQUESTS} a round, median of {ROUNDS} rounds",
            "",
            table_text(
                ("path", "requests/s", "CPU us/request", "x direct", "x direct, rounds"), rows
            ),
            "",
            f"losses: {LOSS_ENGINES} engines, {IN_FLIGHT} requests of {LOSS_TOKENS} tokens "
            f"({LOSS_DELAY * LOSS_TOKENS:g} s each) in flight",
            "",
            table_text(
                ("failure", "in flight", "on the engine", "lost", "s to last completion"),
                loss_rows,
            ),
            "",
            f"refit: {REFIT_ENGINES} engines, {REFIT_LOAD} request loops, {REFITS} refits",
            f"answered {refit['answered']}, failed {refit['failed']}, picks refused while "
            f"every engine was paused {refit['refused']} (tried again 20 ms later)",
            f"submits reaching a paused engine {refit['paused_submits']}; answered on an older "
            f"version once a newer was ready {refit['stale']}",
            f"pause/resume seconds per refit: {pauses}",
            *(f"not done: {p}" for p in refit["problems"]),
        ]
    )
    targets = [
        Target("fleet CPU per request / direct", statistics.median(ratio["fleet"]), 1.15, "x"),
        *(Target(f"requests lost, {x['row']}", x["lost"], 0, "requests") for x in losses),
        Target("submits reaching a paused engine", refit["paused_submits"], 0, "submits"),
        Target("answered on an older version", refit["stale"], 0, "replies"),
    ]
    return body, targets


ABOUT = __doc__.split("\n\n", 2)[2] if __doc__ else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--no-results", action="store_true", help="record nothing")
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="e", help=argparse.SUPPRESS)
    parser.add_argument("--token-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--max-running", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        return host_main(args)
    logging.basicConfig(level=logging.ERROR)  # not a line per resent request
    body, targets = run()
    print(body)
    for target in targets:
        print(target.line())
    if not args.no_results:
        record_results("fleet", body, about=ABOUT, targets=targets)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
