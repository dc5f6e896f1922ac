"""The fleet client over Megatron's own InferenceClient, against that client used directly.

Run: ``.venv/bin/python bench/bench_megatron.py`` (``--no-results``: print, record nothing;
``--profile FILE``: a cProfile of the fleet rounds).

Megatron-LM's real client (main d98e8a64: the files of ``tests/megatron_files.py``, with the
tests' labelled shims), real etcd (a private member), one stand-in engine in an engine-host
process (``bench_fleet.py``'s, token delay 0): the client side alone runs in this process.
The same short requests (a 16-token prompt, 1 token generated, Megatron's ``SamplingParams``),
``CONCURRENCY`` at a time, ``REQUESTS`` a round, go through Megatron's ``InferenceClient``
on the engine directly, and through ``FleetClient`` (its default factory: one Megatron client
per engine, here the one engine) with the router's default policy; rounds alternate,
``ROUNDS`` of each, idle and then with one CPU-burning process. Figures: requests/s and this
process's CPU (user + system) per request, the medians of the rounds; "x direct", the median
(and range) of each fleet round's CPU per request over that of the direct round just before
it. Target: <= 1.2 x direct (issue 42), idle and busy.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from _common import ROOT, Target, burners, etcd_cluster, record_results, table_text
from bench_fleet import Hosts, _drive, _until, prompt

sys.path.insert(0, str(ROOT))  # the tier's helpers live with the tests

from discovery import FleetClient, Router, Settings, watch_table
from tests import megatron_files

ROUNDS = 9
PHASES = ("idle", "1 burner")


async def _rounds(
    settings: Settings, profile: dict[str, cProfile.Profile], count: int
) -> dict[str, list]:
    from megatron.core.inference.inference_client import InferenceClient  # noqa: PLC0415
    from megatron.core.inference.sampling_params import SamplingParams  # noqa: PLC0415

    params = SamplingParams(num_tokens_to_generate=1)
    rounds: dict[str, list[tuple[float, float]]] = {"direct": [], "fleet": []}
    with watch_table(settings) as table:
        table.wait_until(lambda s: len(s) == 1, timeout=60)
        (record,) = table.snapshot().values()
        direct = InferenceClient(record.endpoint.coordinator_address)
        direct.start(connect_timeout_seconds=10)
        fleet = await FleetClient(Router(table)).start()
        try:
            await _until(lambda: len(fleet.clients) == 1, "the fleet's client")
            paths: dict[str, Callable[[int], Any]] = {
                "direct": lambda i: direct.add_request(prompt(i), params),
                "fleet": lambda i: fleet.add_request(prompt(i), params),
            }
            for send in paths.values():  # a warm-up round each, not counted
                await _drive(send)
            for _ in range(count):
                for name, send in paths.items():
                    if name in profile:
                        profile[name].enable()
                    rounds[name].append(await _drive(send))
                    if name in profile:
                        profile[name].disable()
        finally:
            await fleet.stop()
            direct.stop()
    return rounds


def run(
    profile: dict[str, cProfile.Profile], phases_run: tuple[str, ...], rounds: int
) -> dict[str, dict[str, list]]:
    problem = megatron_files.main_problem()
    if problem:
        raise SystemExit(f"bench_megatron: {problem}")
    phases = {}
    with etcd_cluster(1) as cluster, megatron_files.importable(megatron_files.main_root()):
        settings = Settings(endpoints=cluster.endpoints, namespace="megatron")
        hosts = Hosts(settings, "m", 1, 1, 0.0)
        try:
            for phase in phases_run:
                print(f"{phase} ...", flush=True)
                with burners(0 if phase == "idle" else 1):
                    phases[phase] = asyncio.run(_rounds(settings, profile, rounds))
        finally:
            hosts.stop()
    return phases


def figures(phases: dict[str, dict[str, list]]) -> tuple[str, list[Target]]:
    from bench_fleet import CONCURRENCY, REQUESTS  # noqa: PLC0415

    rows, targets = [], []
    for phase, rounds in phases.items():
        ratio = sorted(
            c / d for (_, c), (_, d) in zip(rounds["fleet"], rounds["direct"], strict=True)
        )
        for name, label in (("direct", "Megatron's InferenceClient"), ("fleet", "FleetClient")):
            rps = statistics.median(r for r, _ in rounds[name])
            cpu = statistics.median(c for _, c in rounds[name])
            x = f"{statistics.median(ratio):.2f}" if name == "fleet" else ""
            spread = f"{ratio[0]:.2f}-{ratio[-1]:.2f}" if name == "fleet" else ""
            rows.append((phase, label, f"{rps:.0f}", f"{cpu * 1e6:.0f}", x, spread))
        targets.append(
            Target(f"fleet CPU per request / direct, {phase}", statistics.median(ratio), 1.2, "x")
        )
    body = "\n".join(
        [
            f"one engine, {CONCURRENCY} requests at a time, {REQUESTS} a round, median of "
            f"the rounds of each path",
            "",
            table_text(
                ("load", "path", "requests/s", "CPU us/request", "x direct", "x direct, rounds"),
                rows,
            ),
        ]
    )
    return body, targets


ABOUT = __doc__.split("\n\n", 2)[2] if __doc__ else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--no-results", action="store_true", help="record nothing")
    parser.add_argument(
        "--profile", help="cProfiles of each path's rounds: PREFIX.direct, PREFIX.fleet"
    )
    parser.add_argument("--idle-only", action="store_true", help="no burner phase")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of each path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    profile = {p: cProfile.Profile() for p in ("direct", "fleet")} if args.profile else {}
    body, targets = figures(run(profile, PHASES[:1] if args.idle_only else PHASES, args.rounds))
    for name, each in profile.items():
        each.dump_stats(f"{args.profile}.{name}")
    print(body)
    for target in targets:
        print(target.line())
    if not args.no_results:
        record_results("megatron", body, about=ABOUT, targets=targets)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
