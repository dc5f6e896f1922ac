"""A client of Megatron's coordinator for tests and benchmarks: ``InferenceClient``'s methods.

Test support (nothing in the library imports it). ``InferenceClient`` has the public
methods, arguments and results of Megatron's ``megatron.core.inference.inference_client.
InferenceClient`` (main d98e8a64) and speaks the same wire (``stand_in_wire``): a ZeroMQ
DEALER (SNDHWM and RCVHWM 0) connected to the coordinator's ROUTER, one msgpack list a
frame. So it talks to Megatron's coordinator as well as to the stand-in engine's, and code
written against it runs against Megatron's client unchanged::

    client = InferenceClient(address)
    client.start(connect_timeout_seconds=5)    # [CONNECT] -> [CONNECT_ACK]; on the loop
    reply = await client.add_request([5, 6, 7], {"num_tokens_to_generate": 4})
    async for item in client.add_request_streaming("hi", SamplingParams(num_tokens_to_generate=3)):
        ...                                    # {"partial": {...}} ..., then {"final": reply}
    client.stop()

``sampling_params`` is Megatron's ``SamplingParams``, ``stand_in_wire.SamplingParams``, or
any object whose ``serialize()`` returns the wire map; a plain mapping is sent as given
(keys left out take Megatron's defaults at the engine). As in Megatron, the streaming calls
set ``streaming = True`` on the object (on a copy of a mapping). ``multi_modal_data`` takes
Megatron's raw forms, ``{"image": bytes}`` or ``{"image": [bytes, ...]}`` (preprocessed
tensors need torch). A request's id is ``next_request_id`` before the call (a stream's
``request_id``); ``release_handoff`` takes the prefill reply's
``disaggregated_params["request_id"]``, the coordinator's id, not the client's.

Where it differs from Megatron's client: replies arrive when the socket has them (a reader
on the event loop, not a 5 ms poll), ``start()`` needs a running loop (or ``loop=``) instead
of making one, replies are always the raw dicts (Megatron's default, ``deserialize=False``),
an unexpected handshake reply is a ``WireError`` (an assertion in Megatron), and a reply for
a request it does not know is logged and dropped (Megatron's listener would die of it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from discovery.testing.stand_in_wire import Headers, WireError, pack, read, unpack

if TYPE_CHECKING:
    import zmq

__all__ = ["AsyncStream", "InferenceClient", "serialize_multimodal_data"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()  # the end of a stream


class SerializableParams(Protocol):
    """Sampling parameters as Megatron's client takes them: ``serialize()`` gives the map."""

    def serialize(self) -> Mapping[str, Any]:
        """The wire form."""
        ...


SamplingParamsLike = SerializableParams | Mapping[str, Any]


class AsyncStream(Generic[T]):
    """Megatron's ``AsyncStream``: a request's outputs as an async iterator."""

    def __init__(self, request_id: int, cancel: Callable[[], None]) -> None:
        self._request_id = request_id
        self._cancel = cancel
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._finished = False

    @property
    def request_id(self) -> int:
        """The request this stream belongs to."""
        return self._request_id

    @property
    def finished(self) -> bool:
        """Whether the stream has ended."""
        return self._finished

    def put(self, item: T | BaseException) -> None:
        """Add an item (an exception is raised to the reader) unless finished."""
        if not self._finished:
            self._queue.put_nowait(item)

    def finish(self, exception: BaseException | None = None) -> None:
        """End the stream, with ``exception`` raised to the reader if given."""
        if not self._finished:
            self._finished = True
            self._queue.put_nowait(_STOP if exception is None else exception)

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._queue.get()
        if item is _STOP:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        result: T = item
        return result

    async def aclose(self) -> None:
        """Cancel the request if the stream is still open."""
        if not self._finished:
            self._cancel()

    async def generator(self) -> AsyncGenerator[T, None]:
        """The stream as an async generator; closing it early cancels the request."""
        try:
            async for item in self:
                yield item
        except GeneratorExit:
            await self.aclose()
            raise asyncio.CancelledError from None


def serialize_multimodal_data(data: Any) -> dict[str, Any] | None:
    """Megatron's ``serialize_multimodal_data`` for raw image bytes."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"multi_modal_data must be a dict or None, got {type(data)}.")
    unsupported = set(data) - {"image"}
    if unsupported:
        raise NotImplementedError(
            f"Unsupported multimodal modalities: {sorted(unsupported)}; "
            "only 'image' is currently supported."
        )
    image = data.get("image")
    if image is None:
        return None
    if isinstance(image, bytes | bytearray):
        return {"image": [bytes(image)]}
    if isinstance(image, list):
        if any(not isinstance(item, bytes | bytearray) for item in image):
            raise TypeError("multi_modal_data['image'] list must contain only bytes.")
        return {"image": [bytes(item) for item in image]}
    raise TypeError(
        "multi_modal_data['image'] must be bytes or list[bytes] here (preprocessed tensors "
        f"need Megatron's client and torch); got {type(image)}."
    )


def _params_map(sampling_params: SamplingParamsLike, streaming: bool) -> dict[str, Any]:
    if isinstance(sampling_params, Mapping):
        data = dict(sampling_params)
        if streaming:
            data["streaming"] = True
        return data
    if not callable(getattr(sampling_params, "serialize", None)):
        raise TypeError(
            "sampling_params must be a mapping or have serialize() (Megatron's "
            f"SamplingParams), got {type(sampling_params).__name__}"
        )
    if streaming:
        setattr(sampling_params, "streaming", True)  # noqa: B010 - in place, as Megatron's client
    serialized = sampling_params.serialize()
    if not isinstance(serialized, Mapping):
        raise TypeError(f"sampling_params.serialize() gave {type(serialized).__name__}, not a map")
    return dict(serialized)


class InferenceClient:
    """Megatron's ``InferenceClient``: requests and control signals to a coordinator."""

    def __init__(self, inference_coordinator_address: str) -> None:
        import zmq  # noqa: PLC0415 - the launch extra

        self.context = zmq.Context()
        self.socket: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(inference_coordinator_address)
        self.completion_futures: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.request_submission_times: dict[int, float] = {}
        self.next_request_id = 0
        self.streams: dict[int, AsyncStream[dict[str, Any]]] = {}
        self.aborted_request_ids: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    def start(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        connect_timeout_seconds: float | None = None,
    ) -> None:
        """Handshake with the coordinator (blocking), then take replies on the loop."""
        import zmq  # noqa: PLC0415

        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("start() needs a running event loop, or loop=") from None
        self.socket.send(pack([Headers.CONNECT]))
        if connect_timeout_seconds is not None and not self.socket.poll(
            timeout=max(0, int(connect_timeout_seconds * 1000))
        ):
            raise TimeoutError("Timed out connecting to the Megatron inference coordinator")
        header, _ = unpack(self.socket.recv())
        if header is not Headers.CONNECT_ACK:
            raise WireError(f"the coordinator answered CONNECT with {header.name}, not CONNECT_ACK")
        self._loop = loop
        self._fd = int(self.socket.getsockopt(zmq.FD))
        # From any thread (a fleet client handshakes off its loop): the loop adds the reader.
        loop.call_soon_threadsafe(self._listen)

    def _listen(self) -> None:
        if self._loop is not None and self._fd is not None:  # not stopped meanwhile
            self._loop.add_reader(self._fd, self._receive)
            self._receive()  # replies that came with the handshake's

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParamsLike,
        *,
        multi_modal_data: Any = None,
    ) -> asyncio.Future[dict[str, Any]]:
        """Submit a request; the future resolves with the engine's reply dict."""
        request_id = self._new_id()
        payload = [
            Headers.SUBMIT_REQUEST,
            request_id,
            prompt,
            _params_map(sampling_params, streaming=False),
            serialize_multimodal_data(multi_modal_data),
        ]
        return self._submit_request(payload, request_id)

    def add_request_streaming(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParamsLike,
        *,
        multi_modal_data: Any = None,
    ) -> AsyncStream[dict[str, Any]]:
        """Submit a streamed request: ``{"partial": ...}`` items, then one ``{"final": ...}``."""
        request_id = self._new_id()
        payload = [
            Headers.SUBMIT_REQUEST,
            request_id,
            prompt,
            _params_map(sampling_params, streaming=True),
            serialize_multimodal_data(multi_modal_data),
        ]
        return self._submit_stream(payload, request_id)

    def add_request_with_kv_handoff(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParamsLike,
        kv_meta: dict[str, Any],
        src_block_ids: Sequence[int],
    ) -> asyncio.Future[dict[str, Any]]:
        """Submit a decode request that pulls its KV from the prefill peer ``kv_meta`` names."""
        request_id, payload = self._handoff(prompt, sampling_params, kv_meta, src_block_ids, False)
        return self._submit_request(payload, request_id)

    def add_request_with_kv_handoff_streaming(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParamsLike,
        kv_meta: dict[str, Any],
        src_block_ids: Sequence[int],
    ) -> AsyncStream[dict[str, Any]]:
        """The streamed form of ``add_request_with_kv_handoff``."""
        request_id, payload = self._handoff(prompt, sampling_params, kv_meta, src_block_ids, True)
        return self._submit_stream(payload, request_id)

    def release_handoff(self, request_id: int) -> None:
        """Release the prefill blocks pinned for ``request_id`` (the coordinator's id)."""
        self._send([Headers.RELEASE_KV, int(request_id)])

    def abort_request(self, request_id: int) -> None:
        """Cancel a request: its future is cancelled, its stream ends, its reply dropped."""
        request_id = int(request_id)
        self.aborted_request_ids.add(request_id)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.finish()
        future = self.completion_futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self.request_submission_times.pop(request_id, None)
        self._send([Headers.ABORT_REQUEST, request_id])

    def pause_engines(self) -> None:
        """Send PAUSE (nothing acknowledges it)."""
        self._send([Headers.PAUSE])

    def unpause_engines(self) -> None:
        """Send UNPAUSE."""
        self._send([Headers.UNPAUSE])

    def suspend_engines(self) -> None:
        """Send SUSPEND (applied to paused engines)."""
        self._send([Headers.SUSPEND])

    def resume_engines(self) -> None:
        """Send RESUME (suspended engines become paused)."""
        self._send([Headers.RESUME])

    def set_generation_epoch(self, generation_epoch: int) -> None:
        """Send SET_GENERATION_EPOCH: requests are stamped with it from now on."""
        self._send([Headers.SET_GENERATION_EPOCH, generation_epoch])

    def stop_engines(self) -> None:
        """Send STOP (applied to paused or suspended engines)."""
        self._send([Headers.STOP])

    def start_cuda_profiler(self) -> None:
        """Send START_CUDA_PROFILER."""
        self._send([Headers.START_CUDA_PROFILER])

    def stop_cuda_profiler(self) -> None:
        """Send STOP_CUDA_PROFILER."""
        self._send([Headers.STOP_CUDA_PROFILER])

    def shutdown_coordinator(self) -> None:
        """Send SHUTDOWN: the coordinator ends, the engines stay."""
        self._send([Headers.SHUTDOWN])

    def stop(self) -> None:
        """Cancel what waits, end the streams, close the socket."""
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        for future in self.completion_futures.values():
            if not future.done():
                future.cancel()
        self.completion_futures.clear()
        for stream in self.streams.values():
            stream.finish()
        self.streams.clear()
        self.aborted_request_ids.clear()
        self.socket.close(linger=0)
        self.context.term()

    def _new_id(self) -> int:
        request_id = self.next_request_id
        self.next_request_id += 1
        return request_id

    def _handoff(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParamsLike,
        kv_meta: dict[str, Any],
        src_block_ids: Sequence[int],
        streaming: bool,
    ) -> tuple[int, list[Any]]:
        request_id = self._new_id()
        params = _params_map(sampling_params, streaming=streaming)
        payload = [
            Headers.SUBMIT_REQUEST_WITH_KV,
            request_id,
            prompt,
            params,
            kv_meta,
            list(src_block_ids),
        ]
        return request_id, payload

    def _submit_request(
        self, payload: list[Any], request_id: int
    ) -> asyncio.Future[dict[str, Any]]:
        self._send(payload)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.completion_futures[request_id] = future
        self.request_submission_times[request_id] = time.perf_counter()
        return future

    def _submit_stream(self, payload: list[Any], request_id: int) -> AsyncStream[dict[str, Any]]:
        self._send(payload)
        stream: AsyncStream[dict[str, Any]] = AsyncStream(
            request_id, lambda: self.abort_request(request_id)
        )
        self.streams[request_id] = stream
        self.request_submission_times[request_id] = time.perf_counter()
        return stream

    def _send(self, payload: list[Any]) -> None:
        import zmq  # noqa: PLC0415

        self.socket.send(pack(payload))
        # A send can take the socket's wake-up for replies already queued: look now.
        if self._loop is not None and int(self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._loop.call_soon(self._receive)

    def _receive(self) -> None:
        """Take every frame waiting (the socket's descriptor signals edges, not levels)."""
        import zmq  # noqa: PLC0415

        while not self.socket.closed:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = read(frame, log)
            if message is None:
                continue
            header, fields = message
            if header is Headers.ENGINE_REPLY and len(fields) == 2 and isinstance(fields[1], dict):
                self._on_reply(fields[0], fields[1])
            elif header is Headers.ENGINE_REPLY_PARTIAL and len(fields) == 2:
                stream = self.streams.get(fields[0])
                if stream is not None:
                    stream.put({"partial": fields[1]})
            else:
                log.warning(
                    "dropped %s with %d fields from the coordinator", header.name, len(fields)
                )

    def _on_reply(self, request_id: int, reply: dict[str, Any]) -> None:
        if request_id in self.aborted_request_ids:
            self.aborted_request_ids.discard(request_id)
            return
        submitted = self.request_submission_times.pop(request_id, None)
        if submitted is not None:
            reply["latency"] = time.perf_counter() - submitted
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.put({"final": reply})
            stream.finish()
            return
        future = self.completion_futures.pop(request_id, None)
        if future is None:
            log.warning(
                "dropped a reply for request %r, which this client does not know", request_id
            )
        elif future.done():
            log.warning("Client: The future for %s has been cancelled!", request_id)
        else:
            future.set_result(reply)
