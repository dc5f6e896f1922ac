"""The released megatron-core (0.16.1, the newest on the index) over the fleet (issue 42).

Its client speaks another wire than main's (``discovery.testing.stand_in_wire``:
``RELEASED_HEADERS``, ``released_record``): the stand-in engines speak it
(``StandInCoordinator(wire="0.16.1")``), the fleet client runs the release's own
``InferenceClient`` (its ``start()`` a coroutine, no connect timeout, no
``multi_modal_data``, ``pause_engines()`` awaited until PAUSE_ACK, replies deserialized into
``DynamicInferenceRequestRecord``). What the release's files say is compared with what the
stand-in speaks, and with main's files: a release that changes its wire fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from discovery import (
    EngineStatus,
    FleetClient,
    InferenceEngineEndpoint,
    Router,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.stand_in_coordinator import (
    RELEASE,
    MegatronEngineState,
    StandInCoordinator,
    generated_tokens,
)
from discovery.testing.stand_in_wire import RELEASED_HEADERS, RELEASED_REQUEST_FIELDS

from . import megatron_files
from .helpers import make_endpoint
from .test_fleet import PROMPT, until

pytestmark = pytest.mark.megatron_release


def test_the_tier_tests_the_newest_release_the_stand_in_speaks() -> None:
    assert megatron_files.RELEASE == RELEASE


@pytest.fixture
def release() -> Iterator[Any]:
    with megatron_files.importable(megatron_files.release_root()):
        from megatron.core.inference import (  # noqa: PLC0415  # noqa: PLC0415
            headers,
            inference_client,
            inference_request,
            sampling_params,
        )

        yield headers, inference_client, inference_request, sampling_params


@contextlib.contextmanager
def released_fleet(settings: Settings, count: int) -> Iterator[tuple[list[Any], Router]]:
    engines: list[StandInCoordinator] = []
    registrations = []
    try:
        for i in range(count):
            engine = StandInCoordinator(seed=i, wire=RELEASE).start()
            engines.append(engine)
            endpoint = InferenceEngineEndpoint(engine.address, make_endpoint(i).capabilities)
            registrations.append(
                register_engine(endpoint, engine_id=f"r{i}", settings=settings, ttl=10)
            )
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == count, timeout=30)
            yield engines, Router(table, policy="round_robin")
    finally:
        for registration in registrations:
            registration.close()
        for engine in engines:
            engine.close()


def seed(record: Any) -> int:
    tokens = list(record.requests[0].generated_tokens)
    return next(s for s in range(4) if generated_tokens(PROMPT, len(tokens), seed=s) == tokens)


def test_the_fleet_client_runs_the_released_client(settings: Settings, release: Any) -> None:
    _, client_module, request_module, params_module = release
    with released_fleet(settings, 2) as (_, router):

        async def body() -> tuple[list[Any], dict[str, Any]]:
            async with FleetClient(router) as fleet:  # the default factory: the release's
                params = params_module.SamplingParams(num_tokens_to_generate=4)
                replies = await asyncio.gather(
                    *(fleet.add_request(PROMPT, params) for _ in range(20))
                )
                return replies, dict(fleet.clients)

        replies, clients = asyncio.run(asyncio.wait_for(body(), 60), debug=True)
    assert all(type(c) is client_module.InferenceClient for c in clients.values())
    assert all(type(r) is request_module.DynamicInferenceRequestRecord for r in replies)
    assert all(r.requests[0].status.name == "COMPLETED" for r in replies)
    assert sorted(seed(r) for r in replies) == [0] * 10 + [1] * 10
    assert set(router.in_flight().values()) == {0}


def test_a_refit_with_the_released_client_waits_for_pause_ack(
    settings: Settings, release: Any
) -> None:
    _, _, _, params_module = release
    with released_fleet(settings, 2) as (engines, router):

        async def body() -> tuple[Any, Any]:
            async with FleetClient(router, settings=settings) as fleet:
                await until(lambda: len(fleet.clients) == 2, what="both clients")
                paused = await fleet.pause()  # each client's pause_engines(): its PAUSE_ACK
                assert paused.ok, paused.failed
                assert all(c.paused.is_set() for c in fleet.clients.values())
                params = params_module.SamplingParams(num_tokens_to_generate=2)
                held = fleet.add_request(PROMPT, params)  # held while the fleet is paused
                epoch = await fleet.set_generation_epoch(3)  # 0.16.1 has none
                resumed = await fleet.resume()
                return epoch, resumed, await held

        epoch, resumed, reply = asyncio.run(asyncio.wait_for(body(), 60))
    assert not epoch.ok and all("has no set_generation_epoch" in p for p in epoch.failed.values())
    assert resumed.ok, resumed.failed
    assert reply.requests[0].status.name == "COMPLETED"
    assert all(e.engine_state is MegatronEngineState.RUNNING for e in engines)
    assert all(e.paused_submits == 0 for e in engines)
    assert all(r.status is EngineStatus.READY for r in router._table.snapshot().values())


@pytest.mark.megatron
def test_the_releases_wire_is_what_the_stand_in_speaks_and_differs_from_mains(
    release: Any,
) -> None:
    headers, _, request_module, _ = release
    released = {h.name: h.value for h in headers.Headers}
    assert released == RELEASED_HEADERS  # a release that renumbers fails here
    fields = tuple(f.name for f in dataclasses.fields(request_module.DynamicInferenceRequest))
    assert sorted(fields) == sorted(RELEASED_REQUEST_FIELDS)
    with megatron_files.importable(megatron_files.main_root()):
        from megatron.core.inference.headers import Headers as MainHeaders  # noqa: PLC0415

        main = {h.name: int(h.value) for h in MainHeaders}
    common = released.keys() & main.keys()
    assert {n for n in common if released[n] == main[n]} == set(), "same name, same value"
    assert released.keys() - main.keys() == {"PAUSE_ACK", "STOP_ACK"}  # main acknowledges none


RELEASE_AGAINST_MAIN = """
import asyncio, os, sys
from discovery import FleetClient, InferenceEngineEndpoint, Router, Settings, register_engine
from discovery import watch_table
from discovery.testing.stand_in_coordinator import StandInCoordinator
from megatron.core.inference.sampling_params import SamplingParams

settings = Settings(endpoints=sys.argv[1].split(","), namespace=sys.argv[2])
engine = StandInCoordinator().start()  # main's wire
caps = {caps}
registration = register_engine(
    InferenceEngineEndpoint(engine.address, caps), engine_id="main-engine", settings=settings
)

async def body():
    with watch_table(settings) as table:
        table.wait_until(lambda s: len(s) == 1, timeout=30)
        async with FleetClient(Router(table), connect_timeout=1, resend=False) as fleet:
            try:
                await fleet.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=2))
            except Exception as exc:
                print(type(exc).__name__, exc, flush=True)

asyncio.run(asyncio.wait_for(body(), 60))  # returns: the handshake's thread is not the loop's
registration.close()
engine.close()
"""


def test_the_released_client_against_a_main_engine_fails_saying_so(settings: Settings) -> None:
    """0.16.1's CONNECT is main's CONNECT_ACK: main's coordinator never answers it. The
    request fails in a second, naming the handshake, instead of waiting for ever."""
    caps = "__import__('tests.helpers', fromlist=['x']).make_endpoint(0).capabilities"
    code = RELEASE_AGAINST_MAIN.replace("{caps}", caps)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [megatron_files.python_path(megatron_files.release_root()), str(megatron_files.ROOT)]
        ),
    }
    returncode, out, err = _run(code, env, settings)
    assert returncode == 0, err[-3000:]
    assert "RequestLostError" in out and "no handshake from tcp://" in out, (out, err[-2000:])


def _run(code: str, env: dict[str, str], settings: Settings) -> tuple[int, str, str]:
    import subprocess  # noqa: PLC0415

    result = subprocess.run(
        [sys.executable, "-c", code, ",".join(settings.endpoints), settings.namespace],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return result.returncode, result.stdout, result.stderr
