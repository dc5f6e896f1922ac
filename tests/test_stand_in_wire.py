"""Megatron's coordinator wire: the stand-in engine's coordinator and the tests' client.

The frames written out here byte for byte are built as Megatron-LM builds them at main
d98e8a64 (docs/megatron_wire.md names the lines): its client's payloads
(``inference_client.py``), its coordinator's (``handlers.py``), its ``SamplingParams``.
The coordinator runs in the test's process for most tests (a thread); the stand-in engine's
process for the ones marked external.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import subprocess
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import zmq

from discovery import Settings, block_hashes
from discovery.testing.stand_in_client import InferenceClient, serialize_multimodal_data
from discovery.testing.stand_in_coordinator import (
    CoordinatorState,
    MegatronEngineState,
    StandInCoordinator,
    generated_tokens,
)
from discovery.testing.stand_in_wire import (
    Headers,
    SamplingParams,
    Submit,
    SubmitWithKv,
    WireError,
    pack,
    unpack,
)

from .helpers import STAND_IN, Launcher, WatchLog, get_kv, wait_for

# megatron/core/inference/sampling_params.py: SamplingParams().serialize(), in field order.
MEGATRON_DEFAULT_PARAMS = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 0.0,
    "return_log_probs": False,
    "skip_prompt_log_probs": False,
    "return_segments": False,
    "num_tokens_to_generate": None,
    "num_tokens_total": None,
    "termination_id": None,
    "top_n_logprobs": 0,
    "return_prompt_top_n_logprobs": False,
    "add_BOS": False,
    "stop_words": None,
    "detokenize_stop_sequence": False,
    "return_prompt_tokens": False,
    "streaming": False,
    "streaming_interval": 1,
    "do_kv_handoff": False,
}
# DynamicInferenceRequest.serialize(): the fields of InferenceRequest and
# DynamicInferenceRequest (inference_request.py 271-300, 499-575) but event_add_engine.
MEGATRON_REPLY_KEYS = [
    "request_id",
    "prompt",
    "sampling_params",
    "inference_parameters",
    "prompt_tokens",
    "prompt_length",
    "arrival_time",
    "status",
    "encoder_prompt",
    "generated_text",
    "segments",
    "generated_segments",
    "generated_sequence_lengths",
    "generated_tokens",
    "prompt_log_probs",
    "generated_log_probs",
    "prompt_top_n_logprobs",
    "generated_top_n_logprobs",
    "generated_length",
    "tpot",
    "uid",
    "remaining_prompt_tokens",
    "policy_epoch",
    "kv_cache_epoch",
    "latency",
    "routing_indices",
    "finished_chunk_token_count",
    "stop_word_ids",
    "cg_wait_iters",
    "block_size_tokens",
    "enable_prefix_caching",
    "num_cached_tokens",
    "precomputed_block_hashes",
    "disaggregated_params",
    "ttft",
    "events",
]


def tokens(prompt: list[int], count: int, seed: int = 0, images: int = 0, start: int = 0):
    """The stand-in's documented tokens: 32 + (sum(prompt) + 31 seed + images + 7 i) % 95."""
    base = sum(prompt) + 31 * seed + images
    return [32 + (base + 7 * i) % 95 for i in range(start, start + count)]


def packed(message: list) -> bytes:
    """A frame as Megatron packs it."""
    return msgpack.packb(message, use_bin_type=True)


def kinds(reply: dict) -> list[str]:
    return [event["type"] for event in reply["events"]]


def run(body, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(body, timeout))


async def eventually(condition: Callable[[], Any], timeout: float = 10.0, message: str = "it"):
    """Wait (on the loop) for ``condition`` to be true; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        await asyncio.sleep(0.01)
    return value


@contextlib.asynccontextmanager
async def client_of(address: str) -> AsyncIterator[InferenceClient]:
    client = InferenceClient(address)
    client.start(connect_timeout_seconds=10)
    try:
        yield client
    finally:
        client.stop()


@pytest.fixture
def coordinator():
    """``coordinator(**options)``: a started StandInCoordinator and the prompts it cached."""
    made: list[StandInCoordinator] = []

    def make(**options: Any) -> tuple[StandInCoordinator, list[list[int]]]:
        cached: list[list[int]] = []
        made.append(StandInCoordinator(**options).start(cached.append))
        return made[-1], cached

    yield make
    for each in made:
        each.close()


class Raw:
    """A bare DEALER: frames in and out as bytes, for what the client would not send."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, message: list | bytes) -> None:
        self.socket.send(message if isinstance(message, bytes) else pack(message))

    def recv(self, timeout: float = 10.0) -> list:
        if not self.socket.poll(int(timeout * 1000)):
            raise AssertionError(f"no message in {timeout} s")
        return msgpack.unpackb(self.socket.recv(), raw=False)

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
def raw():
    made: list[Raw] = []

    def connect(address: str, handshake: bool = True) -> Raw:
        made.append(Raw(address))
        if handshake:
            made[-1].send([Headers.CONNECT])
            assert made[-1].recv() == [Headers.CONNECT_ACK]
        return made[-1]

    yield connect
    for each in made:
        each.close()


# --- the wire module --------------------------------------------------------------------


@pytest.mark.parametrize("module", ["stand_in_wire", "stand_in_coordinator", "stand_in_client"])
def test_every_public_name_of_the_wire_modules_is_documented(module: str) -> None:
    loaded = importlib.import_module(f"discovery.{module}")
    assert inspect.getdoc(loaded)
    for name in loaded.__all__:
        obj = getattr(loaded, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
            if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


def test_the_headers_are_megatrons() -> None:
    assert {h.name: h.value for h in Headers} == {
        "CONNECT": 0,
        "CONNECT_ACK": 1,
        "SUBMIT_REQUEST": 20,
        "ENGINE_REPLY": 21,
        "ENGINE_REPLY_PARTIAL": 22,
        "ABORT_REQUEST": 23,
        "SUBMIT_REQUEST_WITH_KV": 24,
        "RELEASE_KV": 25,
        "SEND_KV": 26,
        "PAUSE": 40,
        "UNPAUSE": 41,
        "SUSPEND": 42,
        "RESUME": 43,
        "SET_GENERATION_EPOCH": 44,
        "STOP": 45,
        "START_CUDA_PROFILER": 46,
        "STOP_CUDA_PROFILER": 47,
        "DISCONNECT": 60,
        "SHUTDOWN": 61,
        "TP_BROADCAST": 80,
        "KV_HANDOFF_COMPLETE": 81,
    }


def test_sampling_params_serialize_and_deserialize_as_megatrons() -> None:
    params = SamplingParams()
    assert list(params.serialize().items()) == list(MEGATRON_DEFAULT_PARAMS.items())
    assert SamplingParams(top_n_logprobs=2).return_prompt_top_n_logprobs is True
    loaded = SamplingParams.deserialize({"temperature": 0.5, "from_the_future": 1})
    assert loaded.temperature == 0.5 and loaded.serialize()["from_the_future"] == 1  # kept
    with pytest.raises(ValueError, match="streaming_interval must be an integer"):
        SamplingParams(streaming_interval=0)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"a": 1}), "not a \\[header, ...\\] list"),
        (msgpack.packb([]), "not a \\[header, ...\\] list"),
        (msgpack.packb(["PAUSE"]), "the header is not an integer"),
        (msgpack.packb([True]), "the header is not an integer"),
        (msgpack.packb([99]), "unknown header 99"),
    ],
)
def test_unpack_says_what_is_wrong(frame: bytes, problem: str) -> None:
    with pytest.raises(WireError, match=problem):
        unpack(frame)


def test_the_submit_payloads_are_read_as_megatrons_coordinator_reads_them() -> None:
    four = Submit.parse(unpack(msgpack.packb([20, 3, "hi", {}]))[1])
    assert four == Submit(3, "hi", {}, None)
    five = Submit.parse([3, [1, 2], {"top_k": 1}, {"image": [b"x"]}])
    assert five.multi_modal_data == {"image": [b"x"]}
    with pytest.raises(WireError, match="SUBMIT_REQUEST has 2 fields"):
        Submit.parse([3, "hi"])
    with pytest.raises(WireError, match="sampling params are not a map"):
        Submit.parse([3, "hi", None])
    handoff = SubmitWithKv.parse([4, [1], {}, {"x": 1}, [7, 8]])
    assert handoff.src_block_ids == [7, 8] and handoff.kv_meta == {"x": 1}
    with pytest.raises(WireError, match="SUBMIT_REQUEST_WITH_KV has 4 fields, 5 expected"):
        SubmitWithKv.parse([4, [1], {}, {}])
    with pytest.raises(WireError, match="src_block_ids is not a list of integers"):
        SubmitWithKv.parse([4, [1], {}, {}, ["a"]])


def test_multimodal_data_is_serialized_as_megatrons_client_does() -> None:
    assert serialize_multimodal_data(None) is None
    assert serialize_multimodal_data({"image": b"a"}) == {"image": [b"a"]}
    assert serialize_multimodal_data({"image": [b"a", bytearray(b"b")]}) == {"image": [b"a", b"b"]}
    assert serialize_multimodal_data({"image": None}) is None
    with pytest.raises(NotImplementedError, match="only 'image' is currently supported"):
        serialize_multimodal_data({"video": b"v"})
    with pytest.raises(TypeError, match="must be a dict or None"):
        serialize_multimodal_data([b"a"])
    with pytest.raises(TypeError, match="preprocessed tensors"):
        serialize_multimodal_data({"image": {"imgs": [[1.0]]}})


# --- the client against a coordinator that records bytes ---------------------------------


class FakeCoordinator:
    """A ROUTER on a thread: acknowledges CONNECT, records every frame, sends what it is given."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.frames: list[bytes] = []
        self._outbox = self.context.socket(zmq.PAIR)
        self._outbox.bind("inproc://fake-outbox")
        self._inbox = self.context.socket(zmq.PAIR)
        self._inbox.connect("inproc://fake-outbox")
        self._client: bytes | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._inbox in ready:
                frame = self._inbox.recv()
                if frame == b"end":
                    return
                self.router.send_multipart([self._client, frame])
            if self.router in ready:
                self._client, frame = self.router.recv_multipart()
                self.frames.append(frame)
                if frame == packed([0]):
                    self.router.send_multipart([self._client, pack([Headers.CONNECT_ACK])])

    def send(self, frame: bytes) -> None:
        self._outbox.send(frame)

    def close(self) -> None:
        self._outbox.send(b"end")
        self._thread.join(10)
        for sock in (self.router, self._outbox, self._inbox):
            sock.close()
        self.context.term()


def test_the_client_sends_megatrons_frames_byte_for_byte() -> None:
    fake = FakeCoordinator()
    megatron = dict(MEGATRON_DEFAULT_PARAMS, temperature=0.5)
    expected = [
        [0],
        [20, 0, "hello", megatron, None],
        [20, 1, [1, 2], dict(MEGATRON_DEFAULT_PARAMS, streaming=True), {"image": [b"png"]}],
        [24, 2, [1, 2, 3], megatron, {"agent": "prefill"}, [10, 11]],
        [20, 3, "x", {"num_tokens_to_generate": 2}, None],
        [23, 3],
        [25, 7],
        [40],
        [41],
        [42],
        [43],
        [44, 42],
        [45],
        [46],
        [47],
        [61],
    ]

    async def body() -> None:
        async with client_of(fake.address) as client:
            client.add_request("hello", SamplingParams(temperature=0.5))
            streamed = SamplingParams()
            client.add_request_streaming([1, 2], streamed, multi_modal_data={"image": b"png"})
            assert streamed.streaming is True  # set in place, as Megatron's client does
            params = SamplingParams(temperature=0.5)
            client.add_request_with_kv_handoff([1, 2, 3], params, {"agent": "prefill"}, (10, 11))
            client.add_request("x", {"num_tokens_to_generate": 2})
            client.abort_request(3)
            client.release_handoff(7)
            client.pause_engines()
            client.unpause_engines()
            client.suspend_engines()
            client.resume_engines()
            client.set_generation_epoch(42)
            client.stop_engines()
            client.start_cuda_profiler()
            client.stop_cuda_profiler()
            client.shutdown_coordinator()
            await eventually(lambda: len(fake.frames) == len(expected), message="every frame")

    try:
        run(body())
        assert fake.frames == [packed(m) for m in expected]
    finally:
        fake.close()


def test_the_client_reads_replies_built_as_megatrons_coordinator_builds_them(caplog) -> None:
    fake = FakeCoordinator()

    async def body() -> None:
        async with client_of(fake.address) as client:
            future = client.add_request([1], SamplingParams())
            stream = client.add_request_streaming([2], SamplingParams())
            aborted = client.add_request([3], SamplingParams())
            last = client.add_request([4], SamplingParams())
            client.abort_request(2)  # request ids: 0, 1, 2, 3
            fake.send(packed([21, 0, {"foo": "bar"}]))
            fake.send(packed([22, 1, {"request_id": 9, "new_tokens": [5]}]))
            fake.send(packed([21, 1, {"request_id": 9, "status": "COMPLETED"}]))
            fake.send(packed([21, 2, {"dropped": True}]))
            fake.send(packed([21, 99, {}]))  # unknown: dropped
            fake.send(b"\xc1")  # not msgpack: dropped
            fake.send(packed([21, 3, {"last": True}]))  # after the two above: they were read
            reply = await future
            assert reply["foo"] == "bar" and reply["latency"] >= 0
            items = [item async for item in stream]
            assert items[0] == {"partial": {"request_id": 9, "new_tokens": [5]}}
            assert items[1]["final"]["status"] == "COMPLETED" and len(items) == 2
            assert aborted.cancelled()
            assert (await last)["last"] and not client.aborted_request_ids

    try:
        with caplog.at_level(logging.WARNING, logger="discovery.testing.stand_in_client"):
            run(body())
        assert "request 99, which this client does not know" in caplog.text
        assert "not msgpack" in caplog.text
    finally:
        fake.close()


def test_start_times_out_and_needs_a_loop() -> None:
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = InferenceClient(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(RuntimeError, match="needs a running event loop"):
            client.start()

        async def body() -> None:
            with pytest.raises(TimeoutError, match="Timed out connecting"):
                client.start(connect_timeout_seconds=0.2)

        run(body())
    finally:
        client.stop()
        silent.close()
        context.term()


# --- the stand-in's coordinator, in this process ----------------------------------------


def test_handshake_once_per_client_and_nothing_before_it(coordinator, raw) -> None:
    co, _ = coordinator()
    dealer = raw(co.address, handshake=False)
    dealer.send([Headers.SUBMIT_REQUEST, 0, [1, 2, 3], {"num_tokens_to_generate": 1}])  # ignored
    dealer.send([Headers.CONNECT])
    dealer.send([Headers.CONNECT])  # a duplicate is not answered
    dealer.send([Headers.SUBMIT_REQUEST, 1, [1, 2, 3], {"num_tokens_to_generate": 1}])
    assert dealer.recv() == [Headers.CONNECT_ACK]
    header, request_id, reply = dealer.recv()
    assert (header, request_id) == (Headers.ENGINE_REPLY, 1)  # not 0, not a second ACK
    assert reply["request_id"] == 0  # the coordinator's own id: its first request


def test_a_submit_is_answered_deterministically_with_megatrons_reply(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            reply = await client.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=4))
            assert list(reply) == MEGATRON_REPLY_KEYS
            assert reply["generated_tokens"] == [38, 45, 52, 59] == tokens([1, 2, 3], 4)
            assert reply["generated_text"] == "&-4;" and reply["generated_length"] == 4
            assert reply["status"] == "COMPLETED" and reply["request_id"] == 0
            assert reply["prompt"] is None and reply["prompt_tokens"] is None
            assert reply["prompt_length"] == 3
            assert reply["remaining_prompt_tokens"] == ["tensor", [1, 2, 3]]
            assert reply["sampling_params"] == dict(
                MEGATRON_DEFAULT_PARAMS, num_tokens_to_generate=4, termination_id=0
            )
            assert kinds(reply) == ["ADD_ENGINE", "ADD_CONTEXT", "FINISH"]
            assert reply["uid"].startswith("chatcmpl-") and reply["latency"] > 0
            assert reply["ttft"] >= 0 and reply["policy_epoch"] is None
            assert reply["block_size_tokens"] == 256 and reply["enable_prefix_caching"]

            text = await client.add_request(
                "hi", {"num_tokens_to_generate": 2, "add_BOS": True, "return_prompt_tokens": True}
            )
            assert text["prompt"] == "hi" and text["prompt_tokens"] == ["tensor", [1, 104, 105]]
            assert text["generated_tokens"] == tokens([1, 104, 105], 2)

    run(body())


def test_the_engine_seed_shows_which_engine_answered(coordinator) -> None:
    first, _ = coordinator(seed=0)
    second, _ = coordinator(seed=1)

    async def body() -> None:
        async with client_of(first.address) as a, client_of(second.address) as b:
            params = {"num_tokens_to_generate": 4}
            one, two = await asyncio.gather(
                a.add_request([1, 2, 3], params), b.add_request([1, 2, 3], params)
            )
            assert one["generated_tokens"] == [38, 45, 52, 59]
            assert two["generated_tokens"] == [69, 76, 83, 90] == tokens([1, 2, 3], 4, seed=1)
            # what tests of a fleet use to tell the engines apart
            assert generated_tokens([1, 2, 3], 2, seed=1, start=2) == [83, 90]

    run(body())


def test_the_four_and_five_field_submits_as_megatron_builds_them(coordinator, raw) -> None:
    co, cached = coordinator()
    dealer = raw(co.address)
    # Megatron before images: four fields; then main's client with an image.
    dealer.send(packed([20, 5, [1, 2, 3], {"num_tokens_to_generate": 2}]))
    header, request_id, reply = dealer.recv()
    assert (header, request_id, reply["generated_tokens"]) == (21, 5, [38, 45])
    image = {"image": [b"\x89PNG"]}
    dealer.send(packed([20, 6, [1, 2, 3], {"num_tokens_to_generate": 2}, image]))
    header, request_id, reply = dealer.recv()
    digest = zlib.crc32(packed([b"\x89PNG"]))
    assert (header, request_id) == (21, 6)
    assert reply["generated_tokens"] == tokens([1, 2, 3], 2, images=digest)  # it saw the image
    assert reply["enable_prefix_caching"] is False and reply["precomputed_block_hashes"] == []
    assert cached == [[1, 2, 3]]  # an image-bearing request is never prefix-cached
    assert reply["generated_tokens"] == generated_tokens([1, 2, 3], 2, multi_modal_data=image)


def test_a_served_prompt_is_cached_with_megatrons_block_hashes(coordinator) -> None:
    co, cached = coordinator()
    prompt = list(range(600))

    async def body() -> None:
        async with client_of(co.address) as client:
            reply = await client.add_request(prompt, {"num_tokens_to_generate": 1})
            assert reply["precomputed_block_hashes"] == block_hashes(prompt, 256)
            assert len(reply["precomputed_block_hashes"]) == 2

    run(body())
    assert cached == [prompt]


def test_what_megatron_refuses_is_answered_failed(coordinator) -> None:
    co, _ = coordinator(context_length=8)

    async def body() -> None:
        async with client_of(co.address) as client:
            overflow = await client.add_request(list(range(9)), {"num_tokens_to_generate": 1})
            assert overflow["status"] == "FAILED" and overflow["generated_tokens"] == []
            assert kinds(overflow) == ["ADD_ENGINE", "ERROR_NONTRANSIENT", "FAIL"]
            assert overflow["events"][1]["payload"] == {
                "type": "MaxSequenceLengthOverflowError",
                "request_id": overflow["request_id"],
                "message": None,
                "is_transient": False,
            }
            both = {"num_tokens_to_generate": 1, "num_tokens_total": 4}
            placeholder = await client.add_request([1], both)
            assert placeholder["status"] == "FAILED" and kinds(placeholder) == ["FAIL"]
            assert placeholder["prompt_length"] == 0 and placeholder["block_size_tokens"] is None
            no_log_probs = await client.add_request([1], {"top_n_logprobs": 2})
            assert no_log_probs["status"] == "FAILED"
            not_a_count = await client.add_request([1], {"num_tokens_to_generate": "many"})
            assert not_a_count["status"] == "FAILED" and kinds(not_a_count) == ["FAIL"]
            clamped = await client.add_request([1, 2, 3], {"num_tokens_to_generate": 100})
            assert clamped["generated_length"] == 5  # context 8 - prompt 3
            by_default = await client.add_request([1, 2, 3], {})
            assert by_default["sampling_params"]["num_tokens_to_generate"] == 5
            total = await client.add_request([1, 2, 3], {"num_tokens_total": 4})
            assert (
                total["generated_length"] == 1
                and total["sampling_params"]["num_tokens_total"] is None
            )

    run(body())


def test_termination_id_and_log_probabilities(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            stopped = await client.add_request(
                [1, 2, 3], {"num_tokens_to_generate": 9, "termination_id": 45}
            )
            assert stopped["generated_tokens"] == [38, 45]  # the termination token is kept
            with_lp = await client.add_request(
                [7, 8, 9], {"num_tokens_to_generate": 3, "return_log_probs": True}
            )
            generated = with_lp["generated_tokens"]
            assert with_lp["generated_log_probs"] == [-((t % 10) + 1) / 10 for t in generated]
            assert with_lp["prompt_log_probs"] == [-0.9, -1.0]  # tokens 8 and 9
            skip = {
                "num_tokens_to_generate": 1,
                "return_log_probs": True,
                "skip_prompt_log_probs": True,
            }
            skipped = await client.add_request([7, 8, 9], skip)
            assert skipped["prompt_log_probs"] == [] and len(skipped["generated_log_probs"]) == 1

    run(body())


def test_a_stream_has_partials_then_the_final_reply(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            stream = client.add_request_streaming(
                [1, 2, 3], SamplingParams(num_tokens_to_generate=4)
            )
            items = [item async for item in stream]
            partials = [item["partial"] for item in items[:-1]]
            assert [p["new_tokens"] for p in partials] == [[38], [45], [52]]  # the 4th: final only
            assert {p["request_id"] for p in partials} == {0}  # the coordinator's id
            assert items[-1]["final"]["generated_tokens"] == [38, 45, 52, 59]
            params = {
                "num_tokens_to_generate": 5,
                "streaming_interval": 2,
                "return_log_probs": True,
            }
            items = [item async for item in client.add_request_streaming([4, 5], params)]
            assert params == {
                "num_tokens_to_generate": 5,
                "streaming_interval": 2,
                "return_log_probs": True,
            }
            first, second = (item["partial"] for item in items[:2])
            assert first["new_tokens"] == tokens([4, 5], 2) and first["prompt_log_probs"] == [-0.6]
            assert first["new_log_probs"] == [-((t % 10) + 1) / 10 for t in first["new_tokens"]]
            assert (
                second["new_tokens"] == tokens([4, 5], 2, start=2)
                and "prompt_log_probs" not in second
            )
            assert items[2]["final"]["generated_tokens"] == tokens([4, 5], 5) and len(items) == 3

    run(body())


def test_an_abort_ends_the_request_at_the_next_step(coordinator, raw) -> None:
    co, _ = coordinator(token_delay=0.02)
    dealer = raw(co.address)
    dealer.send(
        [Headers.SUBMIT_REQUEST, 4, [1, 2, 3], {"num_tokens_to_generate": 1000, "streaming": True}]
    )
    assert dealer.recv()[0] == Headers.ENGINE_REPLY_PARTIAL  # it runs
    dealer.send([Headers.ABORT_REQUEST, 4])
    while (message := dealer.recv())[0] == Headers.ENGINE_REPLY_PARTIAL:
        pass
    header, request_id, reply = message
    assert (header, request_id, reply["status"]) == (Headers.ENGINE_REPLY, 4, "COMPLETED")
    assert 1 <= reply["generated_length"] < 1000
    assert reply["sampling_params"]["num_tokens_to_generate"] == reply["generated_length"]
    dealer.send([Headers.ABORT_REQUEST, 12345])  # unknown: nothing happens

    async def body() -> None:
        async with client_of(co.address) as client:
            future = client.add_request([5], {"num_tokens_to_generate": 1000})
            stream = client.add_request_streaming([6], {"num_tokens_to_generate": 1000})
            await stream.__anext__()
            client.abort_request(0)
            await stream.aclose()  # aborts it too
            assert future.cancelled() and stream.finished
            await eventually(lambda: not client.aborted_request_ids, message="both replies dropped")
            done = await client.add_request([7], {"num_tokens_to_generate": 1})
            assert done["status"] == "COMPLETED"

    run(body())
    assert co.requests_held() == []


def test_a_hand_off_from_prefill_to_decode_and_its_release(coordinator) -> None:
    prefill, prefill_cached = coordinator(seed=0)
    decode, decode_cached = coordinator(seed=1)
    prompt = list(range(300))

    async def body() -> None:
        async with client_of(prefill.address) as p, client_of(decode.address) as d:
            first = await p.add_request(
                prompt, {"num_tokens_to_generate": 1, "do_kv_handoff": True}
            )
            handoff = first["disaggregated_params"]
            assert first["generated_tokens"] == tokens(prompt, 1)
            assert handoff == {
                "request_id": first["request_id"],
                "block_ids": handoff["block_ids"],
                "kv_meta": {"engine": prefill.address, "resume_tokens": first["generated_tokens"]},
            }
            assert len(handoff["block_ids"]) == 2  # 300 tokens, 256 a block, the tail included
            assert prefill.pinned_handoffs() == {first["request_id"]: handoff["block_ids"]}
            params = {"num_tokens_to_generate": 4}
            reply = await d.add_request_with_kv_handoff(
                prompt, params, handoff["kv_meta"], handoff["block_ids"]
            )
            # the prefill's token, then the decode engine's own (seed 1) from position 1
            assert reply["generated_tokens"] == tokens(prompt, 1) + tokens(
                prompt, 3, seed=1, start=1
            )
            assert reply["num_cached_tokens"] == 300 and reply["disaggregated_params"] is None
            assert kinds(reply) == ["ADD_ENGINE", "ADD_CONTEXT", "FINISH"]
            stream = d.add_request_with_kv_handoff_streaming(
                prompt, {"num_tokens_to_generate": 3}, handoff["kv_meta"], handoff["block_ids"]
            )
            first_partial = await stream.__anext__()
            assert first_partial["partial"]["new_tokens"] == tokens(prompt, 1)  # before any step
            assert [item async for item in stream][-1]["final"]["generated_length"] == 3
            one = await d.add_request_with_kv_handoff(
                prompt, {"num_tokens_to_generate": 1}, handoff["kv_meta"], handoff["block_ids"]
            )
            assert kinds(one) == ["ADD_ENGINE", "FINISH"]  # done without a step
            p.release_handoff(handoff["request_id"])
            await eventually(lambda: prefill.pinned_handoffs() == {}, message="the release")

    run(body())
    assert decode_cached == [] and prefill_cached == [prompt]  # imports store no blocks


@pytest.mark.parametrize(
    ("kv_meta", "blocks", "params"),
    [
        ({"engine": "x", "resume_tokens": [40]}, [1], {}),  # 300 tokens need 2 blocks
        ({"engine": "x"}, [1, 2], {}),  # no resume token
        ({"engine": "x", "resume_tokens": [40, 41]}, [1, 2], {}),  # MTP proposals: none here
        ({"engine": "x", "resume_tokens": [40]}, [1, 2], {"return_log_probs": True}),
        ({"pp_metas": [{"tp_metas": [{}], "block_ids": [1]}], "resume_tokens": [40]}, [1, 2], {}),
        ({"resume_tokens": [40]}, [1, 2], {"num_tokens_to_generate": 1, "num_tokens_total": 9}),
        ({"resume_tokens": [40]}, [1, 2], {"num_tokens_to_generate": "many"}),
    ],
    ids=["blocks", "no-resume", "two-resume", "log-probs", "pp-blocks", "counts", "bad-count"],
)
def test_a_hand_off_megatron_refuses_is_dropped(
    coordinator, kv_meta, blocks, params, caplog
) -> None:
    co, _ = coordinator()
    prompt = list(range(300))

    async def body() -> None:
        async with client_of(co.address) as client:
            refused = client.add_request_with_kv_handoff(prompt, params, kv_meta, blocks)
            good = {"engine": "x", "resume_tokens": [40]}
            answered = await client.add_request_with_kv_handoff(
                prompt, {"num_tokens_to_generate": 2}, good, [1, 2]
            )
            assert answered["generated_tokens"][0] == 40
            assert not refused.done()  # the engine takes messages in order: it dropped it

    with caplog.at_level(logging.WARNING, logger="discovery.testing.stand_in_coordinator"):
        run(body())
    assert "dropped SUBMIT_REQUEST_WITH_KV" in caplog.text
    assert co.requests_held() == []


def _added_and_scheduled(reply: dict) -> tuple[float, float]:
    times = {event["type"]: event["timestamp"] for event in reply["events"]}
    return times["ADD_ENGINE"], times["ADD_CONTEXT"]


def test_a_paused_engine_holds_submits_until_unpause(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            client.pause_engines()
            await eventually(
                lambda: co.engine_state is MegatronEngineState.PAUSED, message="paused"
            )
            assert co.state is CoordinatorState.PAUSED
            future = client.add_request([1, 2, 3], {"num_tokens_to_generate": 2})
            await eventually(lambda: co.requests_held() == [0], message="the submit taken")
            client.pause_engines()  # redundant: ignored
            unpaused_at = time.time()
            client.unpause_engines()
            reply = await future
            added, scheduled = _added_and_scheduled(reply)
            assert added <= unpaused_at <= scheduled  # taken while paused, run after UNPAUSE
            assert co.engine_state is MegatronEngineState.RUNNING

    run(body())


def test_suspend_and_resume_follow_megatrons_transitions(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            for ignored in (client.unpause_engines, client.suspend_engines, client.resume_engines):
                ignored()  # not from RUNNING: the coordinator ignores them
            client.stop_engines()  # nor STOP
            assert (await client.add_request([1], {"num_tokens_to_generate": 1}))[
                "status"
            ] == "COMPLETED"
            assert co.state is CoordinatorState.RUNNING
            client.pause_engines()
            client.suspend_engines()
            await eventually(
                lambda: co.engine_state is MegatronEngineState.SUSPENDED, message="suspended"
            )
            future = client.add_request([1, 2, 3], {"num_tokens_to_generate": 2})
            await eventually(lambda: co.requests_held() == [1], message="the submit taken")
            client.unpause_engines()  # not from SUSPENDED: ignored
            client.resume_engines()
            await eventually(
                lambda: co.engine_state is MegatronEngineState.PAUSED, message="resumed: paused"
            )
            assert not future.done()
            unpaused_at = time.time()
            client.unpause_engines()
            added, scheduled = _added_and_scheduled(await future)
            assert added <= unpaused_at <= scheduled

    run(body())


def test_the_generation_epoch_is_stamped_as_megatron_stamps_it(coordinator) -> None:
    co, _ = coordinator(token_delay=0.01)

    async def body() -> None:
        async with client_of(co.address) as client:
            client.set_generation_epoch(5)
            reply = await client.add_request([1, 2, 3], {"num_tokens_to_generate": 2})
            assert reply["policy_epoch"] == [[0, 5]] == reply["kv_cache_epoch"]
            # 300 steps of 10 ms: still running when the pause comes
            stream = client.add_request_streaming([1, 2, 3], {"num_tokens_to_generate": 300})
            await stream.__anext__()  # it runs: at least one token generated
            client.pause_engines()
            client.set_generation_epoch(6)  # accepted in every state
            client.unpause_engines()
            final = [item async for item in stream][-1]["final"]
            (start, first), (boundary, second) = final["policy_epoch"]
            assert (start, first, second) == (0, 5, 6)
            assert 3 <= boundary < 3 + 300 - 1  # prompt + generated - 1 when it came
            assert final["kv_cache_epoch"] == final["policy_epoch"]
            later = await client.add_request([1], {"num_tokens_to_generate": 1})
            assert later["policy_epoch"] == [[0, 6]]

    run(body())


def test_stop_ends_the_engine_then_the_coordinator(caplog) -> None:
    stopped = threading.Event()
    co = StandInCoordinator(on_stop=stopped.set).start()

    async def body() -> None:
        async with client_of(co.address) as client:
            client.pause_engines()
            held = client.add_request([1], {"num_tokens_to_generate": 1})
            client.stop_engines()
            await eventually(stopped.is_set, message="on_stop")
            assert (
                co.engine_state is MegatronEngineState.STOPPED
                and co.state is CoordinatorState.RUNNING
            )
            assert not held.done() and co.requests_held() == []  # never answered
            client.add_request([2], {"num_tokens_to_generate": 1})  # no engine: the end
            await eventually(lambda: "no reachable engines" in caplog.text, message="the end")

    try:
        with caplog.at_level(logging.INFO, logger="discovery.testing.stand_in_coordinator"):
            run(body())
    finally:
        co.close()


def test_shutdown_ends_the_coordinator_not_the_engine(coordinator, caplog) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            client.shutdown_coordinator()
            await eventually(lambda: "SHUTDOWN" in caplog.text, message="the shutdown")

    with caplog.at_level(logging.INFO, logger="discovery.testing.stand_in_coordinator"):
        run(body())
    assert co.engine_state is MegatronEngineState.RUNNING


def test_a_silent_coordinator_holds_everything_until_it_talks(coordinator) -> None:
    co, _ = coordinator()

    async def body() -> None:
        async with client_of(co.address) as client:
            co.set_talking(False)
            future = client.add_request([1, 2, 3], {"num_tokens_to_generate": 1})
            talked_at = time.time()
            co.set_talking(True)
            added, _ = _added_and_scheduled(await future)
            assert added >= talked_at  # not even read while silent

    run(body())


# --- the stand-in engine's process --------------------------------------------------------


class StandInProcess:
    """``python -m discovery.testing.stand_in_engine`` with a parent socket of the test's own."""

    def __init__(self, *flags: str) -> None:
        self.context = zmq.Context()
        self.events = self.context.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        port = self.events.bind_to_random_port("tcp://127.0.0.1")
        command = [*STAND_IN, "--kv-events", "0", *flags]
        command[command.index("{event_address}")] = f"tcp://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)

    def frame(self, timeout: float = 30.0) -> tuple[str, Any]:
        if not self.events.poll(int(timeout * 1000)):
            raise AssertionError(f"no frame from the stand-in in {timeout} s")
        kind, payload = msgpack.unpackb(self.events.recv(), raw=False)
        return kind, payload

    def frames_until(self, kind: str) -> Any:
        while (frame := self.frame())[0] != kind:
            pass
        return frame[1]

    def stop(self) -> str:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
                os.kill(self.process.pid, signal.SIGKILL)
        _, err = self.process.communicate(timeout=10)
        self.events.close()
        self.context.term()
        return err


@pytest.fixture
def stand_in():
    started: list[StandInProcess] = []

    def start(*flags: str) -> StandInProcess:
        started.append(StandInProcess(*flags))
        return started[-1]

    yield start
    for each in started:
        each.stop()


@pytest.mark.external
def test_the_stand_in_serves_its_coordinator_and_announces_what_it_caches(stand_in) -> None:
    engine = stand_in("--coordinator-port", "0", "--token-delay", "0.05", "--seed", "1")
    kind, ready = engine.frame()
    address = ready["coordinator_address"]
    assert kind == "ready" and address.startswith("tcp://127.0.0.1:")
    assert address != "tcp://127.0.0.1:5555"
    prompt = list(range(600))

    async def body() -> None:
        async with client_of(address) as client:
            began = time.monotonic()
            reply = await client.add_request(prompt, {"num_tokens_to_generate": 10})
            assert time.monotonic() - began >= 10 * 0.05  # each step takes the token delay
            assert reply["generated_tokens"] == tokens(prompt, 10, seed=1)

    run(body())
    stored = engine.frames_until("stored")
    assert stored["block_hashes"] == block_hashes(prompt, 256)


@pytest.mark.external
@pytest.mark.parametrize("how", ["sigstop", "sigusr1"])
def test_a_frozen_or_silent_stand_in_answers_nothing_until_it_is_back(stand_in, how) -> None:
    engine = stand_in("--coordinator-port", "0")
    address = engine.frame()[1]["coordinator_address"]
    halt, back = (
        (signal.SIGSTOP, signal.SIGCONT) if how == "sigstop" else (signal.SIGUSR1, signal.SIGUSR2)
    )

    async def body() -> None:
        async with client_of(address) as client:
            await client.add_request([1], {"num_tokens_to_generate": 1})
            os.kill(engine.process.pid, halt)  # SIGUSR1 reaches the coordinator a bit later
            while True:  # the one way to see that nothing comes: a request that waits
                probe = client.add_request([1, 2, 3], {"num_tokens_to_generate": 1})
                try:
                    await asyncio.wait_for(asyncio.shield(probe), 0.5)
                except TimeoutError:
                    break
            back_at = time.time()
            os.kill(engine.process.pid, back)
            _, scheduled = _added_and_scheduled(await probe)
            assert scheduled >= back_at  # nothing ran in between

    run(body())


@pytest.mark.external
def test_stop_ends_the_stand_in_with_its_exit_status(stand_in) -> None:
    engine = stand_in("--coordinator-port", "0", "--exit-status", "3")
    address = engine.frame()[1]["coordinator_address"]

    async def body() -> None:
        async with client_of(address) as client:
            client.pause_engines()
            client.stop_engines()

    run(body())
    assert engine.process.wait(30) == 3
    assert "stand-in engine: STOP: the engine stopped" in engine.stop()


@pytest.mark.external
@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--serve-port", "0"], "--serve-port and --coordinator-port"),
        (["--token-delay", "-1"], "token_delay must be >= 0"),
    ],
)
def test_bad_coordinator_flags_are_refused_by_name(stand_in, flags, problem) -> None:
    engine = stand_in("--coordinator-port", "0", *flags)
    assert engine.process.wait(30) != 0
    assert problem in engine.stop()


@pytest.mark.external
def test_a_coordinator_port_in_use_is_refused(stand_in) -> None:
    context = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        engine = stand_in("--coordinator-port", str(port))
        assert engine.process.wait(30) != 0
        assert "the port is in use" in engine.stop()
    finally:
        taken.close()
        context.term()


@pytest.mark.external
def test_under_launch_the_record_names_the_coordinator(settings: Settings) -> None:
    watch = WatchLog(settings)
    command = [*STAND_IN, "--coordinator-port", "0"]
    launcher = Launcher(settings, "wire-0", command, "--ttl", "5")
    try:
        watch.wait("wire-0", "added", timeout=60)
        record = json.loads(get_kv(settings.endpoints, launcher.key)["value"])
        address = record["coordinator_address"]
        assert address.startswith("tcp://127.0.0.1:") and address != "tcp://127.0.0.1:5555"

        async def body() -> None:
            async with client_of(address) as client:
                reply = await client.add_request([1, 2, 3], {"num_tokens_to_generate": 4})
                assert reply["generated_tokens"] == [38, 45, 52, 59]
                client.pause_engines()
                client.stop_engines()  # the engine ends: it leaves discovery

        run(body())
        watch.wait("wire-0", "removed", timeout=30)
        assert launcher.wait() == 0, launcher.output()
        wait_for(lambda: "STOP: the engine stopped" in launcher.output(), message="STOP logged")
    finally:
        launcher.stop()
        watch.stop()
