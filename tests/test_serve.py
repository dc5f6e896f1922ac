"""``discovery serve`` (issue 42): Megatron's own OpenAI server over the fleet, one command.

Megatron's server files come from the Megatron tier (``tests/megatron_files.py``: main's
files and the labelled shims, its tokenizer the shims' in-memory Hugging Face one); the
engines are stand-ins in real etcd; the requests come from the real ``openai`` package, or
plain HTTP where a test reads what the server sends byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from discovery import FleetClient, Router, Settings, watch_table
from discovery.testing.embedded import _free_ports

from . import megatron_files
from .helpers import ChildLog, cli_env, wait_for
from .test_fleet import kill_engine, launched
from .test_megatron import fleet_of, fleet_string, through_openai

megatron = pytest.mark.megatron


class Server:
    """``discovery serve`` as a user runs it; stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, settings: Settings, *flags: str, fleet: str | None = None) -> None:
        self.port, self.metrics_port = _free_ports(2)
        self._log = ChildLog()
        self._output: str | None = None  # once stopped
        env = {
            **cli_env(settings),
            "PYTHONPATH": megatron_files.python_path(megatron_files.main_root()),
        }
        command = [
            sys.executable, "-m", "discovery", "serve", fleet or fleet_string(settings),
            "--tokenizer", "in-memory", "--host", "127.0.0.1", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), *flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env, stdout=self._log.file, stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self._output if self._output is not None else self._log.read()

    def get(self, path: str) -> tuple[int, dict[str, str], Any]:
        return http("GET", self.url + path)

    def wait_ready(self, engines: int) -> dict[str, Any]:
        def ready() -> Any:
            assert self.process.poll() is None, self.output()[-3000:]
            with contextlib.suppress(OSError):
                status, _, body = self.get("/health")
                if status == 200 and body["engines"]["ready"] == engines:
                    return body
            return None

        return wait_for(ready, 60, f"/health with {engines} engines ready")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if self._output is None:
                self._output = self._log.read()
                self._log.close()


def http(method: str, url: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    """One request: status, headers, the JSON body (or its text)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, headers, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = error.code, error.headers, error.read()
    headers = {name.lower(): value for name, value in headers.items()}
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, raw.decode()


@contextlib.contextmanager
def serving(settings: Settings, *flags: str, fleet: str | None = None) -> Iterator[Server]:
    server = Server(settings, *flags, fleet=fleet)
    try:
        yield server
    finally:
        status = server.stop()
        assert status == 0, f"discovery serve exited {status}: {server.output()[-3000:]}"


@megatron
def test_discovery_serve_is_megatrons_server_over_the_whole_fleet(settings: Settings) -> None:
    with (
        fleet_of(settings, 3, token_delay=0.001) as (engines, _),
        serving(settings, "--replicas", "2") as server,
    ):
        health = server.wait_ready(3)
        assert health["status"] == "ok" and health["ready"] is True
        assert health["engines"] == {"ready": 3, "total": 3}
        texts = asyncio.run(through_openai(server.url + "/v1", 12))
        for name, replies in texts.items():
            assert len(replies) == 12 and all(len(t) == 5 for t in replies), (name, replies)
        status, _, body = http("POST", server.url + "/v1/start_profile", {})
        assert (status, body["status"]) == (200, "ok")
        for coordinator in engines.engines.values():  # one replica's client: every engine
            wait_for(lambda c=coordinator: "START_CUDA_PROFILER" in c.signals, 10, "profiler")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as m:
            metrics = m.read().decode()
        assert 'discovery_routing_engines{selector="",status="ready"} 3.0' in metrics
    assert "with 2 replicas" in server.output()


@megatron
def test_no_engine_ready_is_503_with_retry_after(settings: Settings) -> None:
    with serving(settings, "--replicas", "1", "--retry-after", "7") as server:
        wait_for(lambda: _answers(server), 60, "the server to answer")
        status, headers, body = server.get("/health")
        assert (status, headers["retry-after"]) == (503, "7")
        assert body["ready"] is False and body["engines"] == {"ready": 0, "total": 0}
        for path in ("/v1/completions", "/v1/chat/completions"):
            request = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "x"}]}
            status, headers, body = http("POST", server.url + path, request)
            assert (status, headers["retry-after"]) == (503, "7"), body
            assert body["error"]["type"] == "service_unavailable", body


def _answers(server: Server) -> bool:
    assert server.process.poll() is None, server.output()[-3000:]
    try:
        server.get("/health")
    except OSError:
        return False
    return True


@pytest.mark.external
def test_without_megatron_serve_exits_2_naming_the_package_and_the_extra() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "discovery", "serve", "etcd://127.0.0.1:1/x", "--tokenizer", "t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "megatron-core" in result.stderr and "discovery[serve]" in result.stderr, result.stderr


@megatron
def test_etcd_down_at_start_is_a_clear_error(settings: Settings) -> None:
    (port,) = _free_ports(1)
    server = Server(settings, fleet=f"etcd://127.0.0.1:{port}/nowhere")
    status = server.process.wait(120)
    server.stop()
    output = server.output()
    assert status == 1, output
    assert f"127.0.0.1:{port}" in output and "etcd" in output.lower(), output
    assert "Traceback" not in output, output


@megatron
def test_an_engine_killed_mid_flight_fails_no_request_that_had_streamed_nothing(
    settings: Settings,
) -> None:
    """Plain and streamed completions on two engines under ``discovery launch``; one engine
    SIGKILLed with requests on it. Every plain request and every stream that had sent no
    token is answered 200 (resent); a stream that had sent tokens on the killed engine ends
    with an OpenAI-shaped error event."""
    engines = [launched(settings, f"l{i}", seed=i) for i in range(2)]
    try:
        with serving(settings, "--replicas", "1") as server:
            server.wait_ready(2)
            outcome = asyncio.run(_kill_under_load(server, engines))
    finally:
        for engine in engines:
            engine.stop()
    plain, streams = outcome
    assert plain == [200] * len(plain), plain
    errors = [s for s in streams if s["error"]]
    assert errors, "no stream had streamed tokens from the killed engine"
    assert all(s["tokens"] > 0 and "was lost after" in s["error"] for s in errors), errors
    assert all(s["done"] for s in streams if not s["error"]), streams


async def _kill_under_load(server: Server, engines: list[Any]) -> tuple[list[int], list[Any]]:
    import httpx  # noqa: PLC0415 - the openai package's HTTP client

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

        async def plain() -> int:
            body = {"model": "m", "prompt": "hello", "max_tokens": 60}
            return (await client.post("/v1/completions", json=body)).status_code

        async def stream() -> dict[str, Any]:
            body = {"model": "m", "prompt": "hello", "max_tokens": 60, "stream": True}
            seen: dict[str, Any] = {"tokens": 0, "error": None, "done": False}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        seen["done"] = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        seen["error"] = event["error"]["message"]
                    else:
                        seen["tokens"] += len(event["choices"][0].get("text") or "")
            return seen

        plains = [asyncio.ensure_future(plain()) for _ in range(20)]
        streams = [asyncio.ensure_future(stream()) for _ in range(10)]
        await asyncio.sleep(0.4)  # not a synchronisation: the kill lands mid-flight either way
        kill_engine(engines[0])
        return list(await asyncio.gather(*plains)), list(await asyncio.gather(*streams))


@megatron
def test_sigterm_lets_requests_in_flight_finish(settings: Settings) -> None:
    with fleet_of(settings, 1, token_delay=0.02):
        server = Server(settings, "--replicas", "1")
        try:
            server.wait_ready(1)

            async def body() -> tuple[int, int]:
                import httpx  # noqa: PLC0415

                async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                    request = {"model": "m", "prompt": "hello", "max_tokens": 100}  # 2 s
                    long = asyncio.ensure_future(client.post("/v1/completions", json=request))
                    await asyncio.sleep(0.5)  # not a synchronisation: it is under way
                    server.process.send_signal(signal.SIGTERM)
                    reply = await long
                    return reply.status_code, len(reply.json()["choices"][0]["text"])

            assert asyncio.run(body()) == (200, 100)
        finally:
            assert server.stop() == 0, server.output()[-3000:]


@megatron
def test_a_running_server_keeps_serving_from_its_table_when_etcd_goes(etcd: Any) -> None:
    settings = Settings(endpoints=etcd.endpoints, namespace="serve-etcd-down")
    with fleet_of(settings, 2, token_delay=0.001), serving(settings, "--replicas", "1") as server:
        server.wait_ready(2)
        etcd.stop()
        time.sleep(1)  # not a synchronisation: etcd is gone whatever the server does now
        replies = asyncio.run(through_openai(server.url + "/v1", 5))
        assert all(len(t) == 5 for kind in replies.values() for t in kind)


@megatron
def test_a_refit_under_load_through_the_server_fails_no_request(settings: Settings) -> None:
    with (
        fleet_of(settings, 2, token_delay=0.002) as (engines, _),
        serving(settings, "--replicas", "2") as server,
    ):
        server.wait_ready(2)

        async def body() -> list[int]:
            import httpx  # noqa: PLC0415

            from discovery.testing.stand_in_client import InferenceClient  # noqa: PLC0415

            statuses: list[int] = []
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

                async def load() -> None:
                    while not stop.is_set():
                        body = {"model": "m", "prompt": "hello", "max_tokens": 8}
                        statuses.append(
                            (await client.post("/v1/completions", json=body)).status_code
                        )

                runners = [asyncio.ensure_future(load()) for _ in range(8)]
                await asyncio.sleep(0.5)
                with watch_table(settings) as table:
                    table.wait_until(lambda s: len(s) == 2, timeout=30)
                    router = Router(table)
                    async with FleetClient(
                        router, client_factory=InferenceClient, settings=settings
                    ) as trainer:  # the RL loop's refit, from another process's view
                        assert (await trainer.pause()).ok
                        await asyncio.sleep(1.0)  # requests arrive while the fleet is paused
                        assert (await trainer.resume(weight_version=2)).ok
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*runners)
            return statuses

        statuses = asyncio.run(body())
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert all(c.paused_submits == 0 for c in engines.engines.values())


@megatron
def test_replicas_stop_when_discovery_serve_is_killed(settings: Settings) -> None:
    """SIGKILL leaves the parent no chance to pass SIGTERM on: the replicas see it gone."""
    from pathlib import Path  # noqa: PLC0415

    from .helpers import gone  # noqa: PLC0415

    server = Server(settings, "--replicas", "2")
    replicas: list[int] = []
    try:
        wait_for(lambda: _answers(server), 60, "the server to answer")
        pid = server.process.pid
        replicas = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert len(replicas) == 2
        server.process.kill()
        server.process.wait(10)
        for replica in replicas:
            wait_for(lambda r=replica: gone(r), 30, f"replica {replica} to stop")
    finally:
        server.stop()
        for replica in replicas:  # by pid, should the test have failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica, signal.SIGKILL)
