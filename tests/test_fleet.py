"""The fleet client (issue 35): Megatron requests through the router, on real etcd.

Engines are stand-ins speaking Megatron's coordinator wire (docs/megatron_wire.md): in this
process (``StandInCoordinator``, registered with ``register_engine``: their state can be
looked at) or as processes under ``discovery launch`` (for deaths). Each answers tokens
that depend on its seed, so a reply says which engine made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from discovery import (
    ConfigurationError,
    EngineStatus,
    FleetClient,
    InferenceEngineEndpoint,
    Registration,
    RequestLostError,
    Router,
    Settings,
    register_engine,
    watch_table,
)
from discovery.testing.stand_in_client import InferenceClient
from discovery.testing.stand_in_coordinator import (
    MegatronEngineState,
    StandInCoordinator,
    generated_tokens,
)

from .helpers import STAND_IN, Launcher, make_endpoint, make_layout, run_python, wait_for

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "fleet.md"
PROMPT = [1, 2, 3]
PARAMS = {"num_tokens_to_generate": 4}


def run(body: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(body, 120))


async def until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "it") -> Any:
    """Poll ``condition`` on the loop until it holds (the loop keeps running meanwhile)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
    return value


def seed_of(reply: dict[str, Any], prompt: list[int] = PROMPT, images: Any = None) -> int:
    """Which engine answered: the seed whose tokens these are (for a request with ``images``)."""
    tokens = reply["generated_tokens"]
    for seed in range(16):
        if generated_tokens(prompt, len(tokens), seed=seed, multi_modal_data=images) == tokens:
            return seed
    raise AssertionError(f"no stand-in seed makes {tokens}")


class Coordinators:
    """In-process stand-in engines, each registered under its coordinator's address."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engines: dict[str, StandInCoordinator] = {}
        self.registrations: dict[str, Registration] = {}

    def add(self, engine_id: str, seed: int, token_delay: float = 0.0, **record: Any) -> None:
        coordinator = StandInCoordinator(seed=seed, token_delay=token_delay).start()
        self.engines[engine_id] = coordinator
        caps = make_endpoint(seed).capabilities
        endpoint = InferenceEngineEndpoint(coordinator.address, caps)
        self.registrations[engine_id] = register_engine(
            endpoint, engine_id=engine_id, settings=self.settings, ttl=10, **record
        )

    def remove(self, engine_id: str) -> None:
        self.registrations.pop(engine_id).close()
        self.engines.pop(engine_id).close()

    def close(self) -> None:
        for engine_id in list(self.engines):
            self.remove(engine_id)


@contextlib.contextmanager
def fleet_of(
    settings: Settings, count: int, **router: Any
) -> Iterator[tuple[Coordinators, Router]]:
    engines = Coordinators(settings)
    try:
        for i in range(count):
            engines.add(f"e{i}", seed=i)
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == count, timeout=30)
            yield engines, Router(table, **router)
    finally:
        engines.close()


def test_requests_spread_by_policy_through_each_engines_own_client(settings: Settings) -> None:
    with fleet_of(settings, 3, policy="round_robin") as (_, router):

        async def body() -> list[dict[str, Any]]:
            async with FleetClient(router, client_factory=InferenceClient) as fleet:
                await until(lambda: len(fleet.clients) == 3, what="a client per engine")
                return await asyncio.gather(*(fleet.add_request(PROMPT, PARAMS) for _ in range(30)))

        replies = run(body())
        assert Counter(seed_of(r) for r in replies) == {0: 10, 1: 10, 2: 10}
        assert all(r["status"] == "COMPLETED" for r in replies)
        assert set(router.in_flight().values()) == {0}  # every handle released


def test_clients_open_and_close_as_engines_come_and_go(settings: Settings) -> None:
    with fleet_of(settings, 1) as (engines, router):

        async def body() -> None:
            async with FleetClient(router, client_factory=InferenceClient) as fleet:
                await until(lambda: set(fleet.clients) == {"e0"}, what="e0's client")
                await asyncio.to_thread(engines.add, "e1", 1)
                await until(lambda: set(fleet.clients) == {"e0", "e1"}, what="e1's client")
                await asyncio.to_thread(engines.remove, "e0")
                await until(lambda: set(fleet.clients) == {"e1"}, what="e0's client stopped")
                reply = await fleet.add_request(PROMPT, PARAMS)
                assert seed_of(reply) == 1

        run(body())


def test_a_cancelled_request_is_aborted_on_its_engine(settings: Settings) -> None:
    engines = Coordinators(settings)
    try:
        engines.add("slow", seed=0, token_delay=0.05)
        with watch_table(settings) as table:
            table.wait_until(lambda s: "slow" in s, timeout=30)
            router = Router(table)
            coordinator = engines.engines["slow"]

            async def body() -> None:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    request = fleet.add_request(PROMPT, {"num_tokens_to_generate": 1000})
                    await until(coordinator.requests_held, what="the request on the engine")
                    request.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await request
                    await until(lambda: not coordinator.requests_held(), what="the abort")

            run(body())
            assert router.in_flight() == {"slow": 0}
    finally:
        engines.close()


def test_a_request_waits_for_room_and_a_cancelled_wait_gives_its_place_up(
    settings: Settings,
) -> None:
    """Admission through the fleet: one request an engine; the next waits for the reply."""
    engines = Coordinators(settings)
    try:
        engines.add("slow", seed=0, token_delay=0.02)
        with watch_table(settings) as table:
            table.wait_until(lambda s: "slow" in s, timeout=30)
            router = Router(table, capacity=1, wait=30)
            long = {"num_tokens_to_generate": 20}

            async def body() -> None:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    await until(lambda: fleet.clients, what="the engine's client")
                    first = fleet.add_request(PROMPT, long)
                    given_up = fleet.add_request(PROMPT, long)
                    waiting = fleet.add_request(PROMPT, long)
                    await until(lambda: router.health().waiting == 2, what="two picks waiting")
                    assert not (given_up.done() or waiting.done())
                    given_up.cancel()
                    await until(lambda: router.health().waiting == 1, what="its place given up")
                    replies = [await first, await waiting]
                    assert [len(r["generated_tokens"]) for r in replies] == [20, 20]
                    assert given_up.cancelled()

            run(body())
            assert router.in_flight() == {"slow": 0}
    finally:
        engines.close()


def kill_engine(launcher: Launcher) -> None:
    """SIGKILL the stand-in itself (its launcher sees it die and removes its record)."""
    os.kill(launcher.child_pid(), signal.SIGKILL)


def launched(settings: Settings, engine_id: str, seed: int) -> Launcher:
    command = [*STAND_IN, "--coordinator-port", "0", "--token-delay", "0.02", "--seed", str(seed)]
    return Launcher(settings, engine_id, command, "--ttl", "5")


def test_a_request_whose_engine_dies_before_answering_is_sent_again(settings: Settings) -> None:
    engines = [launched(settings, f"l{i}", seed=i) for i in range(2)]
    try:
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == 2, timeout=60)
            router = Router(table)

            async def body() -> tuple[dict[str, Any], str]:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    await until(lambda: len(fleet.clients) == 2, what="both clients")
                    request = fleet.add_request(PROMPT, {"num_tokens_to_generate": 300})
                    busy = await until(
                        lambda: [e for e, n in router.in_flight().items() if n],
                        what="the request in flight",
                    )
                    kill_engine(next(e for e in engines if e.engine_id == busy[0]))
                    return await request, busy[0]

            reply, victim = run(body())
            assert seed_of(reply) == (1 if victim == "l0" else 0)  # the other one answered
            assert reply["status"] == "COMPLETED" and len(reply["generated_tokens"]) == 300
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_whose_engine_client_is_stopped_first_is_sent_again(
    settings: Settings, streamed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's client can stop before, or without, the router telling the handle.

    Here the engine restarts on another port: its record goes and comes back with a new
    address. The fleet client stops the old client at once, and Megatron's ``stop()`` cancels
    the futures it holds; the router tells the handle later, if at all (a record removed
    while ready may be held as unconfirmed). The request is lost there and sent again to the
    other engine, never a CancelledError (the flaky failure of the test above, made certain).
    A stream that gave nothing yet (it ends without its final item) is sent again likewise.
    """
    engines = Coordinators(settings)
    try:
        engines.add("e0", seed=0, token_delay=0.02)
        engines.add("e1", seed=1, token_delay=0.02)
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == 2, timeout=30)
            router = Router(table)

            async def body() -> tuple[dict[str, Any], str]:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    await until(lambda: len(fleet.clients) == 2, what="both clients")
                    if streamed:  # no partial before the final item
                        params = {"num_tokens_to_generate": 50, "streaming_interval": 100}
                        items = fleet.add_request_streaming(PROMPT, params)
                        request = asyncio.ensure_future(_last(items))
                    else:
                        request = fleet.add_request(PROMPT, {"num_tokens_to_generate": 50})
                    busy = await until(
                        lambda: [e for e, c in engines.engines.items() if c.requests_held()],
                        what="the request on an engine",
                    )
                    moved = StandInCoordinator(seed=7).start()  # the restarted engine
                    engines.engines[busy[0]].close()
                    engines.engines[busy[0]] = moved
                    caps = make_endpoint(7).capabilities
                    await asyncio.to_thread(engines.registrations[busy[0]].close)
                    engines.registrations[busy[0]] = await asyncio.to_thread(
                        lambda: register_engine(
                            InferenceEngineEndpoint(moved.address, caps),
                            engine_id=busy[0],
                            settings=settings,
                            ttl=10,
                            replace=True,
                        )
                    )
                    return await request, busy[0]

            with caplog.at_level(logging.WARNING, logger="discovery._routing.fleet"):
                reply, victim = run(body())
            assert seed_of(reply) in ({0, 1} - {int(victim[1])})  # the other engine answered
            assert reply["status"] == "COMPLETED" and len(reply["generated_tokens"]) == 50
            what = "stream" if streamed else "request"  # a resent stream is logged as one is
            resent = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
            assert len(resent) == 1, resent
            assert resent[0].startswith(f"engine {victim} lost before it answered"), resent
            assert resent[0].endswith(f"sending the {what} again"), resent
    finally:
        engines.close()


async def _last(items: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A stream's final reply (its only item when no partial comes first)."""
    (item,) = [i async for i in items]
    reply: dict[str, Any] = item["final"]
    return reply


def test_a_stream_that_gave_tokens_fails_saying_how_many(settings: Settings) -> None:
    engines = [launched(settings, "s0", seed=0)]
    try:
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == 1, timeout=60)
            router = Router(table)

            async def body() -> tuple[int, RequestLostError]:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    got = 0
                    killed: list[None] = []
                    params = {"num_tokens_to_generate": 500, "streaming_interval": 1}
                    with pytest.raises(RequestLostError) as lost:
                        async for item in fleet.add_request_streaming(PROMPT, params):
                            got += len(item.get("partial", {}).get("new_tokens", ()))
                            if got >= 5 and not killed:
                                killed.append(kill_engine(engines[0]))
                    return got, lost.value

            got, error = run(body())
            assert error.engine_id == "s0" and error.tokens == got >= 5
            assert f"after {got} streamed tokens" in str(error)
    finally:
        for engine in engines:
            engine.stop()


def test_a_streamed_request_gives_partials_then_its_final_reply(settings: Settings) -> None:
    with fleet_of(settings, 1) as (_, router):

        async def body() -> list[dict[str, Any]]:
            async with FleetClient(router, client_factory=InferenceClient) as fleet:
                params = {"num_tokens_to_generate": 8, "streaming_interval": 1}
                return [item async for item in fleet.add_request_streaming(PROMPT, params)]

        items = run(body())
        assert "final" in items[-1] and all("partial" in i for i in items[:-1])
        streamed = [t for i in items[:-1] for t in i["partial"]["new_tokens"]]
        assert streamed == items[-1]["final"]["generated_tokens"][: len(streamed)]


def test_a_disaggregated_request_follows_megatrons_hand_off(settings: Settings) -> None:
    engines = Coordinators(settings)
    try:
        pd = {"kv_transfer_backend": "nixl", "kv_layout": make_layout()}
        engines.add("prefill", seed=1, role="prefill", **pd)
        engines.add("decode", seed=2, role="decode", **pd)
        with watch_table(settings) as table:
            table.wait_until(lambda s: len(s) == 2, timeout=30)
            router = Router(table)

            async def body() -> dict[str, Any]:
                async with FleetClient(router, client_factory=InferenceClient) as fleet:
                    return await fleet.add_request(PROMPT, PARAMS)

            reply = run(body())
            # The first token is the prefill engine's; the rest the decode engine's.
            tokens = reply["generated_tokens"]
            assert tokens[0] == generated_tokens(PROMPT, 1, seed=1)[0]
            assert len(tokens) == 4 and reply["status"] == "COMPLETED"
            wait_for(lambda: not engines.engines["prefill"].pinned_handoffs(), message="release")
            assert router.in_flight() == {"prefill": 0, "decode": 0}
    finally:
        engines.close()


def test_a_refit_pauses_before_the_signal_and_is_ready_on_the_new_version_after(
    settings: Settings,
) -> None:
    with fleet_of(settings, 2, weight_version="latest") as (engines, router):
        table = router._table

        async def body() -> list[dict[str, Any]]:
            async with FleetClient(
                router, client_factory=InferenceClient, settings=settings
            ) as fleet:
                stop = asyncio.Event()
                replies: list[dict[str, Any]] = []

                async def load() -> None:  # continuous requests through the refit
                    while not stop.is_set():
                        with contextlib.suppress(Exception):
                            replies.append(await fleet.add_request(PROMPT, PARAMS, wait=5))
                        await asyncio.sleep(0.005)

                runner = asyncio.create_task(load())
                await until(lambda: len(replies) > 10, what="requests before the refit")
                paused = await fleet.pause()
                assert paused.ok, paused.failed
                for engine_id, coordinator in engines.engines.items():
                    assert table.get(engine_id).status is EngineStatus.PAUSED
                    await until(
                        lambda c=coordinator: c.engine_state is MegatronEngineState.PAUSED,
                        what="paused",
                    )
                resumed = await fleet.resume(weight_version=8)
                assert resumed.ok, resumed.failed
                await until(lambda: all(r.weight_version == 8 for r in table.snapshot().values()))
                count = len(replies)
                await until(lambda: len(replies) > count + 10, what="requests after the refit")
                stop.set()
                await runner
                return replies

        replies = run(body())
        assert all(c.paused_submits == 0 for c in engines.engines.values())
        epochs = [r["policy_epoch"] for r in replies if r["policy_epoch"]]
        assert epochs and all(e == [[0, 8]] or e == [(0, 8)] for e in epochs[-10:])
        assert all(r.status is EngineStatus.READY for r in table.snapshot().values())


def test_without_megatron_the_default_client_says_what_is_missing(settings: Settings) -> None:
    with fleet_of(settings, 1) as (_, router):

        async def body() -> None:
            async with FleetClient(router) as fleet:
                with pytest.raises(ConfigurationError, match=r"megatron\.core\.inference"):
                    await fleet.add_request(PROMPT, PARAMS)

        run(body())
        assert router.in_flight() == {"e0": 0}


def test_a_request_before_start_is_refused(settings: Settings) -> None:
    with (
        fleet_of(settings, 1) as (_, router),
        pytest.raises(RuntimeError, match="start the fleet client first"),
    ):
        FleetClient(router).add_request(PROMPT, PARAMS)


@pytest.mark.external
def test_the_fleet_guide_runs_as_written() -> None:
    """docs/fleet.md's python blocks, in order in one interpreter (its first starts etcd)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 4, "setup, frontend, rollout loop, teardown"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISCOVERY_")}
    returncode, _, err = run_python("\n".join(blocks), env, timeout=120)
    assert returncode == 0, err[-4000:]


def test_a_request_with_images_is_routed_by_load_not_by_its_cached_prompt(
    settings: Settings,
) -> None:
    # Megatron (881f489f) never prefix-caches a request with images: affinity would only
    # pile them on one engine. Text requests of the same prompt all go to one engine.
    prompt = list(range(1, 1025))  # four 256-token blocks
    with fleet_of(settings, 3, policy="longest_prefix") as (_, router):

        async def body() -> tuple[list[int], list[int]]:
            async with FleetClient(router, client_factory=InferenceClient) as fleet:
                await until(lambda: len(fleet.clients) == 3, what="a client per engine")
                text = [seed_of(await fleet.add_request(prompt, PARAMS), prompt) for _ in range(6)]
                image = {"image": [b"png"]}
                images = [
                    seed_of(
                        await fleet.add_request(prompt, PARAMS, multi_modal_data=image),
                        prompt,
                        image,
                    )
                    for _ in range(6)
                ]
                return text, images

        text, images = run(body())
    assert len(set(text)) == 1, "text: the engine holding the prompt"
    assert Counter(images) == {0: 2, 1: 2, 2: 2}, "images: by load, in turn"
