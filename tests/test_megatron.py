"""The fleet over Megatron's real files (issue 42): its client, its server, its release.

The tier of ``tests/megatron_files.py``: tests marked ``megatron`` import Megatron-LM's own
files of main d98e8a64 (``InferenceClient``, ``SamplingParams``, the OpenAI-compatible
server) with the labelled shims of ``tests/megatron_shims/``; ``megatron_release`` ones the
released megatron-core wheel. Engines are stand-ins speaking Megatron's coordinator wire
(``discovery.testing.stand_in_coordinator``), registered in real etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest

from discovery import EngineStatus, FleetClient, Router, Settings, watch_table
from discovery.testing.stand_in_coordinator import MegatronEngineState

from . import megatron_files
from .test_fleet import PROMPT, Coordinators, seed_of, until

pytestmark = pytest.mark.megatron


def run(body: Awaitable[Any], *, debug: bool = False) -> Any:
    return asyncio.run(asyncio.wait_for(body, 120), debug=debug)


@pytest.fixture
def megatron() -> Iterator[Any]:
    """Megatron's own modules (main's files), importable for the test."""
    with megatron_files.importable(megatron_files.main_root()):
        from megatron.core.inference import inference_client, sampling_params  # noqa: PLC0415

        yield contextlib.nullcontext((inference_client, sampling_params))


@contextlib.contextmanager
def fleet_of(
    settings: Settings, count: int, token_delay: float = 0.0, **router: Any
) -> Iterator[tuple[Coordinators, Router]]:
    engines = Coordinators(settings)
    try:
        for i in range(count):
            engines.add(f"e{i}", seed=i, token_delay=token_delay)
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == count, timeout=30)
            yield engines, Router(table, **router)
    finally:
        engines.close()


def modules(megatron: Any) -> tuple[Any, Any]:
    with megatron as found:
        return found  # type: ignore[no-any-return]


def test_the_fleet_client_runs_megatrons_own_client(settings: Settings, megatron: Any) -> None:
    client_module, params_module = modules(megatron)
    with fleet_of(settings, 3, policy="round_robin") as (_, router):

        async def body() -> tuple[list[Any], list[Any], dict[str, Any]]:
            async with FleetClient(router) as fleet:  # the default factory: Megatron's
                await until(lambda: len(fleet.clients) == 3, what="a client per engine")
                params = params_module.SamplingParams(num_tokens_to_generate=4)
                replies = await asyncio.gather(
                    *(fleet.add_request(PROMPT, params) for _ in range(60))
                )
                streamed = params_module.SamplingParams(num_tokens_to_generate=4)
                items = [i async for i in fleet.add_request_streaming(PROMPT, streamed)]
                return replies, items, dict(fleet.clients)

        replies, items, clients = run(body())
    assert all(type(c) is client_module.InferenceClient for c in clients.values())
    assert Counter(seed_of(r) for r in replies) == {0: 20, 1: 20, 2: 20}
    assert all(r["status"] == "COMPLETED" for r in replies)
    assert [len(i["partial"]["new_tokens"]) for i in items[:-1]] == [1, 1, 1]
    assert items[-1]["final"]["generated_tokens"] == replies[0]["generated_tokens"]
    assert set(router.in_flight().values()) == {0}


def test_megatrons_clients_start_on_the_loops_thread_in_debug_mode(
    settings: Settings, megatron: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Megatron's ``start()`` creates its receive task on the loop it is given: started on an
    executor thread, asyncio's debug mode refuses it ("Non-thread-safe operation")."""
    _, params_module = modules(megatron)
    with fleet_of(settings, 2) as (_, router):

        async def body() -> list[Any]:
            async with FleetClient(router) as fleet:
                params = params_module.SamplingParams(num_tokens_to_generate=3)
                return await asyncio.gather(*(fleet.add_request(PROMPT, params) for _ in range(8)))

        with caplog.at_level(logging.WARNING):
            replies = run(body(), debug=True)
    assert all(r["status"] == "COMPLETED" for r in replies)
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not problems, problems
    assert not [r for r in caplog.records if "no client" in r.getMessage()]


def test_a_stream_read_to_its_end_and_left_releases_at_once_and_aborts_nothing(
    settings: Settings, megatron: Any
) -> None:
    _, params_module = modules(megatron)
    with fleet_of(settings, 1) as (_, router):

        async def body() -> tuple[list[int], Any]:
            async with FleetClient(router) as fleet:
                in_flight = []
                streams = []
                for _ in range(5):
                    params = params_module.SamplingParams(num_tokens_to_generate=3)
                    stream = fleet.add_request_streaming(PROMPT, params)
                    streams.append(stream)  # kept: not finalized by the collector meanwhile
                    async for item in stream:
                        if "final" in item:
                            break  # a caller that returns with its final item
                    in_flight.append(router.in_flight()["e0"])
                for stream in streams:
                    await stream.aclose()  # type: ignore[attr-defined]
                return in_flight, fleet.clients["e0"]

        in_flight, client = run(body())
    assert in_flight == [0, 0, 0, 0, 0]
    assert client.aborted_request_ids == set()  # no ABORT_REQUEST for a finished request


def test_a_paused_fleet_holds_requests_until_it_is_ready_again(
    settings: Settings, megatron: Any
) -> None:
    _, params_module = modules(megatron)
    with fleet_of(settings, 2) as (engines, router):

        async def body() -> tuple[list[Any], bool]:
            async with FleetClient(router, settings=settings) as fleet:
                await until(lambda: len(fleet.clients) == 2, what="both clients")
                paused = await fleet.pause()
                assert paused.ok, paused.failed
                params = params_module.SamplingParams(num_tokens_to_generate=2)
                held = [fleet.add_request(PROMPT, params, wait=20) for _ in range(6)]
                held.append(fleet.add_request(PROMPT, params))  # no wait: the fleet's hold
                await asyncio.sleep(0.2)  # not a synchronisation: the requests must still wait
                waiting = not any(h.done() for h in held)
                resumed = await fleet.resume()
                assert resumed.ok, resumed.failed
                return await asyncio.gather(*held), waiting

        replies, waiting = run(body())
        assert waiting, "a request failed or was answered while the fleet was paused"
        assert all(r["status"] == "COMPLETED" for r in replies)
        assert all(c.paused_submits == 0 for c in engines.engines.values())
        assert all(c.engine_state is MegatronEngineState.RUNNING for c in engines.engines.values())
        assert all(r.status is EngineStatus.READY for r in router._table.snapshot().values())


def test_a_paused_fleet_fails_a_request_when_its_wait_runs_out(
    settings: Settings, megatron: Any
) -> None:
    from discovery import NoEngineAvailableError  # noqa: PLC0415

    _, params_module = modules(megatron)
    with fleet_of(settings, 1) as (_, router):

        async def body() -> None:
            async with FleetClient(router, settings=settings) as fleet:
                assert (await fleet.pause()).ok
                params = params_module.SamplingParams(num_tokens_to_generate=2)
                with pytest.raises(NoEngineAvailableError, match="paused"):
                    await fleet.add_request(PROMPT, params, wait=0.3)
                with pytest.raises(NoEngineAvailableError, match="paused"):
                    await fleet.add_request(PROMPT, params, wait=0)  # at once
                assert (await fleet.resume()).ok

        run(body())
