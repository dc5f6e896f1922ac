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


def fleet_string(settings: Settings) -> str:
    """The fleet string naming ``settings``' etcd and namespace."""
    hosts = ",".join(e.split("://", 1)[1] for e in settings.endpoints)
    return f"etcd://{hosts}/{settings.namespace}"


async def written_for_megatron(client_class: Any, address: str, params_module: Any) -> Any:
    """Code written for Megatron's ``InferenceClient``, as its server and Dynamo use it."""
    client = client_class(address)
    client.start()  # main's: synchronous, in the running loop
    try:
        params = params_module.SamplingParams
        replies = await asyncio.gather(
            *(client.add_request(PROMPT, params(num_tokens_to_generate=4)) for _ in range(30))
        )
        items = [
            i async for i in client.add_request_streaming(PROMPT, params(num_tokens_to_generate=3))
        ]
        long = client.add_request(PROMPT, params(num_tokens_to_generate=8000))
        client.abort_request(client.next_request_id - 1)  # the id, as Megatron's callers learn it
        with pytest.raises(asyncio.CancelledError):
            await long
        stream = client.add_request_streaming(PROMPT, params(num_tokens_to_generate=8000))
        streamed = client.next_request_id - 1
        aborted = []
        async for item in stream:
            aborted.append(item)
            client.abort_request(streamed)  # ends the stream: no final item
        assert aborted and all("partial" in i for i in aborted), aborted
        client.start_cuda_profiler()
        client.stop_cuda_profiler()
        await asyncio.sleep(0)
        return replies, items
    finally:
        client.stop()


def test_code_written_for_megatrons_client_runs_over_the_fleet_by_changing_one_name(
    settings: Settings, megatron: Any
) -> None:
    from discovery import FleetInferenceClient  # noqa: PLC0415

    client_module, params_module = modules(megatron)
    with fleet_of(settings, 3) as (engines, _):
        one = engines.engines["e0"]
        alone, _ = run(
            written_for_megatron(client_module.InferenceClient, one.address, params_module)
        )
        assert {seed_of(r) for r in alone} == {0}
        replies, items = run(
            written_for_megatron(FleetInferenceClient, fleet_string(settings), params_module)
        )
        assert all(r["status"] == "COMPLETED" for r in replies)
        assert len({seed_of(r) for r in replies}) == 3, "spread over the three engines"
        assert "final" in items[-1] and all("partial" in i for i in items[:-1])
        profiled = ["START_CUDA_PROFILER", "STOP_CUDA_PROFILER"]
        wait_for_signals(one, [*profiled, *profiled])  # Megatron's own client, then the fleet's
        for engine_id in ("e1", "e2"):
            wait_for_signals(engines.engines[engine_id], profiled)
        assert all(not c.requests_held() for c in engines.engines.values()), "the abort"


def wait_for_signals(coordinator: Any, expected: list[str]) -> None:
    from .helpers import wait_for  # noqa: PLC0415

    wait_for(lambda: coordinator.signals == expected, 10, f"signals {expected}")


def test_the_release_loop_awaits_start_and_refits_the_whole_fleet(
    settings: Settings, megatron: Any
) -> None:
    """Megatron's RL loop: ``await start()``, pause, suspend, (weights), resume,
    ``set_generation_epoch``, unpause; each signal to every engine, the records around it."""
    from discovery import FleetInferenceClient  # noqa: PLC0415

    _, params_module = modules(megatron)
    with fleet_of(settings, 2) as (engines, router):
        table = router._table

        async def body() -> list[Any]:
            client = FleetInferenceClient(fleet_string(settings), settings=settings)
            await client.start()
            try:
                params = params_module.SamplingParams(num_tokens_to_generate=2)
                await client.add_request(PROMPT, params)
                assert (await client.pause_engines()).ok
                assert all(
                    r.status is EngineStatus.PAUSED for r in client.table.snapshot().values()
                )
                held = client.add_request(PROMPT, params)  # held through the refit
                assert (await client.suspend_engines()).ok
                await until(
                    lambda: all(
                        c.engine_state is MegatronEngineState.SUSPENDED
                        for c in engines.engines.values()
                    ),
                    what="suspended",
                )
                assert (await client.resume_engines()).ok
                assert (await client.set_generation_epoch(5)).ok
                assert not held.done()
                assert (await client.unpause_engines()).ok
                return [await held, await client.add_request(PROMPT, params)]
            finally:
                client.stop()

        replies = run(body())
        assert [r["policy_epoch"][-1][1] for r in replies] == [5, 5]
        table.wait_until(
            lambda s: all(
                r.status is EngineStatus.READY and r.weight_version == 5 for r in s.values()
            ),
            timeout=10,
        )
        for coordinator in engines.engines.values():
            assert coordinator.signals == [
                "PAUSE", "PAUSE", "SUSPEND", "RESUME", "SET_GENERATION_EPOCH", "UNPAUSE"
            ]  # fmt: skip
            assert coordinator.paused_submits == 0


MEGATRONS_SERVER = """
import sys

from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
    text_generation_server as server,
)
from megatron.core.tokenizers import MegatronTokenizer

from discovery import FleetInferenceClient

server.InferenceClient = FleetInferenceClient  # the one name changed
tokenizer = MegatronTokenizer.from_pretrained("in-memory", {"library": "huggingface"})
server._server_process_worker(sys.argv[1], tokenizer, 0, int(sys.argv[2]), hostname="127.0.0.1")
"""


@contextlib.contextmanager
def megatrons_own_server(fleet: str, port: int) -> Iterator[None]:
    """Megatron's server replica (``_server_process_worker``, as its ``start_text_gen_server``
    runs each) with one name changed: its ``InferenceClient`` is ``FleetInferenceClient`` (what
    a user without ``discovery serve`` would do). SIGTERM stops it, as Megatron stops them."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = {**os.environ, "PYTHONPATH": megatron_files.python_path(megatron_files.main_root())}
    child = subprocess.Popen(
        [sys.executable, "-c", MEGATRONS_SERVER, fleet, str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", child)
        yield
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            _, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
            raise AssertionError(f"Megatron's server ignored SIGTERM: {err[-2000:]!r}") from None


def wait_for_http(url: str, child: Any = None) -> None:
    import urllib.request  # noqa: PLC0415

    from .helpers import wait_for  # noqa: PLC0415

    def answers() -> bool:
        if child is not None and child.poll() is not None:
            raise AssertionError(f"the server exited: {child.stderr.read()[-3000:]!r}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status)
        except OSError:
            return False

    wait_for(answers, 30, f"{url} to answer")


async def through_openai(base_url: str, count: int) -> dict[str, list[str]]:
    """Completions and chat completions, streamed and not, ``count`` of each concurrently."""
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)

    async def completion(i: int) -> str:
        reply = await client.completions.create(model="m", prompt=f"hello {i}", max_tokens=5)
        return reply.choices[0].text

    async def completion_streamed(i: int) -> str:
        stream = await client.completions.create(
            model="m", prompt=f"hello {i}", max_tokens=5, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def chat(i: int) -> str:
        messages = [{"role": "user", "content": f"hi {i}"}]
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
        return reply.choices[0].message.content or ""

    async def chat_streamed(i: int) -> str:
        messages = [{"role": "user", "content": f"hi {i}"}]
        stream = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=5, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    kinds = {
        "completions": completion,
        "completions streamed": completion_streamed,
        "chat": chat,
        "chat streamed": chat_streamed,
    }
    try:
        results = await asyncio.gather(*(kind(i) for kind in kinds.values() for i in range(count)))
    finally:
        await client.close()
    return {name: results[k * count : (k + 1) * count] for k, name in enumerate(kinds)}


def test_megatrons_own_server_serves_the_fleet_with_one_name_changed(
    settings: Settings, megatron: Any
) -> None:
    from discovery.testing.embedded import _free_ports  # noqa: PLC0415

    modules(megatron)
    (port,) = _free_ports(1)
    with (
        fleet_of(settings, 3, token_delay=0.001),
        megatrons_own_server(fleet_string(settings), port),
    ):
        texts = run(through_openai(f"http://127.0.0.1:{port}/v1", 15))
    for name, replies in texts.items():
        assert len(replies) == 15 and all(len(t) == 5 for t in replies), (name, replies)
    for kind in ("completions", "completions streamed"):
        seeds = [text_seed(f"hello {i}", text) for i, text in enumerate(texts[kind])]
        assert len(set(seeds)) > 1, f"{kind}: all from one engine ({seeds})"


def text_seed(prompt: str, text: str) -> int:
    """The stand-in engine that generated ``text`` for ``prompt`` (its seed)."""
    from discovery.testing.stand_in_coordinator import generated_tokens  # noqa: PLC0415

    tokens = [ord(c) for c in prompt]
    for seed in range(8):
        if "".join(map(chr, generated_tokens(tokens, len(text), seed=seed))) == text:
            return seed
    raise AssertionError(f"no stand-in engine writes {text!r} after {prompt!r}")


def test_megatrons_client_stopped_as_its_engine_leaves_reads_no_closed_socket(
    settings: Settings, megatron: Any
) -> None:
    """Megatron's ``stop()`` cancels its receive task, then closes the socket: a cancel still
    on its way let the task read the closed socket once more (ZMQError; Megatron's
    ``trace_async_exceptions`` then exits the process: a ``discovery serve`` replica died)."""
    from discovery import InferenceEngineEndpoint, register_engine  # noqa: PLC0415
    from discovery.testing.stand_in_coordinator import StandInCoordinator  # noqa: PLC0415

    from .helpers import make_endpoint  # noqa: PLC0415

    _, params_module = modules(megatron)
    with fleet_of(settings, 1) as (_, router):

        async def body() -> int:
            stopped = 0
            async with FleetClient(router) as fleet:
                params = params_module.SamplingParams(num_tokens_to_generate=1)
                for i in range(12):
                    engine = StandInCoordinator(seed=1).start()
                    endpoint = InferenceEngineEndpoint(
                        engine.address, make_endpoint(1).capabilities
                    )
                    registration = await asyncio.to_thread(
                        register_engine, endpoint, engine_id=f"x{i}", settings=settings, ttl=10
                    )
                    await until(lambda i=i: f"x{i}" in fleet.clients, what="its client")
                    await fleet.add_request(PROMPT, params)
                    await asyncio.to_thread(registration.close)  # its client is stopped
                    await until(lambda i=i: f"x{i}" not in fleet.clients, what="stopped")
                    for _ in range(5):  # the receive task's next turns
                        await asyncio.sleep(0.006)
                    engine.close()
                    stopped += 1
            return stopped

        assert run(body()) == 12
