"""``discovery serve`` against Megatron's own server on one engine, and over four engines.

Run: ``.venv/bin/python bench/bench_serve.py`` (``--no-results``: print, record nothing;
``--rounds N``, ``--requests N``: smaller runs).

Megatron-LM's real server (main d98e8a64: the files of ``tests/megatron_files.py``, with the
tests' labelled shims and their in-memory Hugging Face tokenizer), real etcd (a private
member), stand-in engines in an engine-host process (``bench_fleet.py``'s); the HTTP load
comes from this process (``httpx``, ``CONCURRENCY`` requests at a time, non-streamed
completions), the servers are processes of their own, one replica each.

* **Overhead.** One engine, token delay 0, one generated token. Megatron's server replica
  (``_server_process_worker``, its own ``InferenceClient`` on the engine's coordinator)
  and ``discovery serve --replicas 1`` over a fleet of that one engine both run; rounds of
  ``REQUESTS`` alternate between them, ``ROUNDS`` of each, idle and with one CPU-burning
  process. Figures: requests/s and the server's CPU (its processes, user + system) per
  request, medians of the rounds; "x Megatron", the median of each ``discovery serve``
  round's requests/s over that of the Megatron round just before it. Target: >= 0.9.
* **Engines the bottleneck.** ``SCALE_DELAY`` s a token, ``SCALE_TOKENS`` tokens a
  request, each engine running ``SCALE_BATCH`` requests at a time (the others wait, as
  beyond Megatron's ``max_requests``): ``discovery serve --replicas 2`` over one engine,
  then over four. Figure: the four engines' requests/s over the one engine's, each the
  median of its rounds. Target: >= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from _common import (
    ROOT,
    Target,
    burners,
    etcd_cluster,
    proc_cpu_seconds,
    record_results,
    table_text,
)
from bench_fleet import Hosts

sys.path.insert(0, str(ROOT))  # the tier's helpers live with the tests

from discovery import Settings, watch_table
from discovery.testing.embedded import _free_ports
from tests import megatron_files
from tests.helpers import cli_env

CONCURRENCY = 64
REQUESTS = 2000
ROUNDS = 7
PHASES = ("idle", "1 burner")
SCALE_DELAY = 0.02
SCALE_TOKENS = 8
SCALE_BATCH = 4
SCALE_REQUESTS = 600

MEGATRONS_SERVER = """
import sys
from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
    text_generation_server as server,
)
from megatron.core.tokenizers import MegatronTokenizer

tokenizer = MegatronTokenizer.from_pretrained("in-memory", {"library": "huggingface"})
server._server_process_worker(sys.argv[1], tokenizer, 0, int(sys.argv[2]), hostname="127.0.0.1")
"""


class Server:
    """A server process (and its children), its CPU read from /proc; SIGTERM at the end."""

    def __init__(self, command: list[str], env: dict[str, str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"bench_serve: {command[:4]} did not come up")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def cpu(self) -> float:
        """CPU seconds of the server and its replica processes."""
        pids = [self.process.pid]
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        with contextlib.suppress(OSError):
            pids += [int(p) for p in children.read_text().split()]
        return sum(proc_cpu_seconds(p) for p in pids)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def megatrons_server(coordinator: str, env: dict[str, str]) -> Server:
    (port,) = _free_ports(1)
    command = [sys.executable, "-c", MEGATRONS_SERVER, coordinator, str(port)]
    return Server(command, env, port)


def discovery_serve(settings: Settings, env: dict[str, str], replicas: int) -> Server:
    (port,) = _free_ports(1)
    hosts = ",".join(e.split("://", 1)[1] for e in settings.endpoints)
    command = [
        sys.executable, "-m", "discovery", "serve", f"etcd://{hosts}/{settings.namespace}",
        "--tokenizer", "in-memory", "--host", "127.0.0.1", "--port", str(port),
        "--replicas", str(replicas), "--log-level", "ERROR",
    ]  # fmt: skip
    return Server(command, env, port)


async def load(server: Server, requests: int, tokens: int) -> tuple[float, float]:
    """``requests`` completions, CONCURRENCY at a time: (requests/s, server CPU s/request)."""
    import httpx  # noqa: PLC0415 - the test extra

    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    body = {"model": "m", "prompt": "hello there", "max_tokens": tokens}
    sent = 0
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < requests:
                sent += 1
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text

        cpu, wall = server.cpu(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        wall, cpu = time.perf_counter() - wall, server.cpu() - cpu
    return requests / wall, cpu / requests


@contextlib.contextmanager
def servers(*started: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for server in started:
            server.stop()


def overhead(base: Settings, env: dict[str, str], rounds: int, requests: int) -> dict:
    settings = base.with_namespace("overhead")
    hosts = Hosts(settings, "o", 1, 1, 0.0)
    phases: dict[str, dict[str, list[tuple[float, float]]]] = {}
    try:
        with watch_table(settings) as table:
            (record,) = table.wait_until(lambda s: len(s) == 1, timeout=60).values()
            address = record.endpoint.coordinator_address
        megatron = megatrons_server(address, env)
        serve = discovery_serve(settings, env, 1)
        with servers(megatron, serve):
            for phase in PHASES:
                print(f"overhead, {phase} ...", flush=True)
                each: dict[str, list[tuple[float, float]]] = {"megatron": [], "serve": []}
                with burners(0 if phase == "idle" else 1):
                    for server in (megatron, serve):  # a warm-up round each
                        asyncio.run(load(server, requests // 4, 1))
                    for _ in range(rounds):
                        each["megatron"].append(asyncio.run(load(megatron, requests, 1)))
                        each["serve"].append(asyncio.run(load(serve, requests, 1)))
                phases[phase] = each
    finally:
        hosts.stop()
    return phases


def scale(base: Settings, env: dict[str, str], rounds: int) -> dict[str, list]:
    results: dict[str, list[tuple[float, float]]] = {}
    for engines in (1, 4):
        settings = base.with_namespace(f"scale-{engines}")
        print(f"scale, {engines} engines ...", flush=True)
        hosts = Hosts(settings, f"s{engines}-", engines, 1, SCALE_DELAY, SCALE_BATCH)
        try:
            with watch_table(settings) as table:
                table.wait_until(lambda s, n=engines: len(s) == n, timeout=60)
            serve = discovery_serve(settings, env, 2)
            with servers(serve):
                asyncio.run(load(serve, SCALE_REQUESTS // 4, SCALE_TOKENS))  # warm-up
                results[f"{engines}"] = [
                    asyncio.run(load(serve, SCALE_REQUESTS, SCALE_TOKENS)) for _ in range(rounds)
                ]
        finally:
            hosts.stop()
    return results


def figures(phases: dict, scaled: dict[str, list]) -> tuple[str, list[Target]]:
    rows, targets = [], []
    for phase, each in phases.items():
        ratio = sorted(
            s / m for (s, _), (m, _) in zip(each["serve"], each["megatron"], strict=True)
        )
        for name, label in (
            ("megatron", "Megatron's server, one engine"),
            ("serve", "discovery serve"),
        ):
            rps = statistics.median(r for r, _ in each[name])
            cpu = statistics.median(c for _, c in each[name])
            x = (
                f"{statistics.median(ratio):.2f} ({ratio[0]:.2f}-{ratio[-1]:.2f})"
                if name == "serve"
                else ""
            )
            rows.append((phase, label, f"{rps:.0f}", f"{cpu * 1e6:.0f}", x))
        targets.append(
            Target(
                f"discovery serve requests/s / Megatron's server, {phase}",
                statistics.median(ratio),
                0.9,
                "x",
                at_least=True,
            )
        )
    one = statistics.median(r for r, _ in scaled["1"])
    four = statistics.median(r for r, _ in scaled["4"])
    targets.append(Target("4 engines / 1 engine requests/s", four / one, 3.0, "x", at_least=True))
    body = "\n".join(
        [
            f"overhead: one engine, {CONCURRENCY} completions at a time (1 token each), "
            "one replica each, median of the rounds",
            "",
            table_text(
                ("load", "server", "requests/s", "CPU us/request", "x Megatron (rounds)"), rows
            ),
            "",
            f"engines the bottleneck: {SCALE_TOKENS} tokens of {SCALE_DELAY:g} s, "
            f"{SCALE_BATCH} requests running per engine, discovery serve --replicas 2, "
            f"{CONCURRENCY} at a time",
            "",
            table_text(
                ("engines", "requests/s", "server CPU us/request"),
                [
                    (
                        n,
                        f"{statistics.median(r for r, _ in each):.0f}",
                        f"{statistics.median(c for _, c in each) * 1e6:.0f}",
                    )
                    for n, each in scaled.items()
                ],
            ),
            f"4 engines / 1 engine: {four / one:.2f} x",
        ]
    )
    return body, targets


ABOUT = __doc__.split("\n\n", 2)[2] if __doc__ else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--no-results", action="store_true", help="record nothing")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    problem = megatron_files.main_problem()
    if problem:
        raise SystemExit(f"bench_serve: {problem}")
    with etcd_cluster(1) as cluster:
        base = Settings(endpoints=cluster.endpoints)
        env = {
            **cli_env(base),
            "PYTHONPATH": megatron_files.python_path(megatron_files.main_root()),
        }
        phases = overhead(base, env, args.rounds, args.requests)
        scaled = scale(base, env, max(3, args.rounds // 2))
    body, targets = figures(phases, scaled)
    print(body)
    for target in targets:
        print(target.line())
    if not args.no_results:
        record_results("serve", body, about=ABOUT, targets=targets)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
