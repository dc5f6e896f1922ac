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
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest

from discovery import FleetClient, Router, Settings, watch_table

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
