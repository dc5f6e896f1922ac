"""Megatron's coordinator wire, for the stand-in engine and the tests' client: headers, frames.

Test support (nothing in the library imports it), read from Megatron-LM main at d98e8a64
(docs/megatron_wire.md has every payload with its file and line):

* a message is one ZeroMQ frame, ``msgpack.packb([header, *fields], use_bin_type=True)``,
  the header's integer first (``megatron/core/inference/headers.py``): ``Headers`` here has
  the same names and values, flat (Megatron groups them in five ``IntEnum`` categories,
  ``Connection`` 0-1, ``Request`` 20-26, ``Control`` 40-47, ``Lifecycle`` 60-61,
  ``Transport`` 80-81, whose members compare equal to these integers);
* ``pack`` / ``unpack`` make and read a frame; ``unpack`` refuses what is not such a list,
  naming the problem (``WireError``);
* ``Submit`` and ``SubmitWithKv`` read the two request payloads as Megatron's coordinator
  does (``data_parallel_inference_coordinator/handlers.py``);
* ``SamplingParams``: Megatron's dataclass of the same name (``sampling_params.py``), its
  fields and defaults, ``serialize()`` (the instance's ``__dict__``) and ``deserialize()``
  (the defaults, then every key given, unknown ones included, as ``add_attributes`` does).

The released megatron-core 0.16.1 speaks another wire (its ``headers.py``,
``inference_client.py``, ``data_parallel_inference_coordinator.py``, ``inference_request.py``):
``RELEASED_HEADERS`` are its header values (an ``Enum`` of ``auto()`` values, from 1), its
submit has three fields (no ``multi_modal_data``), PAUSE and STOP are acknowledged
(``PAUSE_ACK`` / ``STOP_ACK`` to every client), there is no streaming, hand-off, epoch or
profiler, and a reply is a ``DynamicInferenceRequestRecord`` (``released_record``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RELEASED_HEADERS",
    "RELEASED_REQUEST_FIELDS",
    "Headers",
    "SamplingParams",
    "Submit",
    "SubmitWithKv",
    "WireError",
    "pack",
    "read",
    "released_record",
    "unpack",
]


class Headers(enum.IntEnum):
    """Megatron's message headers (``headers.py``): the integer a message starts with."""

    CONNECT = 0
    CONNECT_ACK = 1
    SUBMIT_REQUEST = 20
    ENGINE_REPLY = 21
    ENGINE_REPLY_PARTIAL = 22
    ABORT_REQUEST = 23
    SUBMIT_REQUEST_WITH_KV = 24
    RELEASE_KV = 25
    SEND_KV = 26
    PAUSE = 40
    UNPAUSE = 41
    SUSPEND = 42
    RESUME = 43
    SET_GENERATION_EPOCH = 44
    STOP = 45
    START_CUDA_PROFILER = 46
    STOP_CUDA_PROFILER = 47
    DISCONNECT = 60
    SHUTDOWN = 61
    TP_BROADCAST = 80
    KV_HANDOFF_COMPLETE = 81


RELEASED_HEADERS: Mapping[str, int] = {
    name: value
    for value, name in enumerate(
        (
            "CONNECT",
            "CONNECT_ACK",
            "SUBMIT_REQUEST",
            "ENGINE_REPLY",
            "PAUSE",
            "PAUSE_ACK",
            "UNPAUSE",
            "SUSPEND",
            "RESUME",
            "STOP",
            "STOP_ACK",
        ),
        start=1,
    )
}
"""megatron-core 0.16.1's headers (``headers.py``: ``Enum`` members with ``auto()`` values)."""

RELEASED_REQUEST_FIELDS = (
    # InferenceRequest's fields, then DynamicInferenceRequest's (inference_request.py, 0.16.1)
    *("request_id", "prompt", "sampling_params", "inference_parameters", "prompt_tokens"),
    *("arrival_time", "status", "encoder_prompt", "generated_text", "segments"),
    *("generated_segments", "generated_sequence_lengths", "generated_tokens"),
    *("prompt_log_probs", "generated_log_probs", "prompt_top_n_logprobs"),
    *("generated_top_n_logprobs", "generated_length", "tpot", "remaining_prompt_tokens"),
    *("latency", "finished_chunk_token_count", "stop_word_ids", "events"),
)
"""The keys of 0.16.1's ``DynamicInferenceRequest.serialize()``: its dataclass's fields."""


def released_record(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A reply of main's form as 0.16.1's engine sends it: a request record's ``serialize()``.

    ``{"requests": [request], "latency": None}``, the request with exactly 0.16.1's fields
    (main's others dropped, those main lacks None), tensors as ``["tensor", list]``, no
    events (the stand-in's events are main's).
    """
    request: dict[str, Any] = dict.fromkeys(RELEASED_REQUEST_FIELDS)
    request.update({k: v for k, v in reply.items() if k in request})
    # 0.16.1's engine always sends the prompt's tokens (main's keeps them in its
    # remaining_prompt_tokens, ["tensor", tokens]); nothing remains once prefilled.
    request["prompt_tokens"] = reply.get("remaining_prompt_tokens")
    request["remaining_prompt_tokens"] = ["tensor", []]
    request["finished_chunk_token_count"] = 0
    request["events"] = []
    return {"requests": [request], "latency": None}


class WireError(ValueError):
    """A frame that is not one of Megatron's messages; the message says why."""


def pack(message: Sequence[Any]) -> bytes:
    """One frame: ``message`` (header first) packed as Megatron packs it."""
    import msgpack  # noqa: PLC0415 - the launch extra

    return bytes(msgpack.packb(list(message), use_bin_type=True))


def unpack(frame: bytes) -> tuple[Headers, list[Any]]:
    """The header and the fields after it, or ``WireError`` saying what is wrong."""
    import msgpack  # noqa: PLC0415

    try:
        message = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(message, list) or not message:
        raise WireError(f"not a [header, ...] list: {message!r:.80}")
    header = message[0]
    if isinstance(header, bool) or not isinstance(header, int):
        raise WireError(f"the header is not an integer: {header!r:.80}")
    try:
        return Headers(header), message[1:]
    except ValueError:
        raise WireError(f"unknown header {header} (Megatron's headers.py has none)") from None


def read(frame: bytes, logger: logging.Logger) -> tuple[Headers, list[Any]] | None:
    """``unpack(frame)``, or None with a warning on ``logger`` saying what was dropped."""
    try:
        return unpack(frame)
    except WireError as exc:
        logger.warning("dropped a message: %s", exc)
        return None


def _request_id(value: Any, message: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{message}: the request id is not an integer: {value!r:.80}")
    return value


@dataclass(frozen=True)
class Submit:
    """``[SUBMIT_REQUEST, request_id, prompt, sampling_params, multi_modal_data]``.

    The four-field form (no ``multi_modal_data``, Megatron before images) is read with
    ``multi_modal_data`` None, as the coordinator does; fields after the fifth are ignored.
    """

    request_id: int
    prompt: Any
    sampling_params: dict[str, Any]
    multi_modal_data: Any = None

    @classmethod
    def parse(cls, fields: Sequence[Any]) -> Submit:
        """Read the fields after the header; ``WireError`` if they are not a submit."""
        if len(fields) < 3:
            raise WireError(f"SUBMIT_REQUEST has {len(fields)} fields, at least 3 expected")
        if not isinstance(fields[2], dict):
            raise WireError(f"SUBMIT_REQUEST's sampling params are not a map: {fields[2]!r:.80}")
        multi_modal_data = fields[3] if len(fields) > 3 else None
        request_id = _request_id(fields[0], "SUBMIT_REQUEST")
        return cls(request_id, fields[1], fields[2], multi_modal_data)


@dataclass(frozen=True)
class SubmitWithKv:
    """``[SUBMIT_REQUEST_WITH_KV, request_id, prompt, sampling_params, kv_meta, src_block_ids]``.

    Exactly five fields after the header: Megatron's coordinator logs any other count as
    malformed and drops the message.
    """

    request_id: int
    prompt: Any
    sampling_params: dict[str, Any]
    kv_meta: Any
    src_block_ids: list[int]

    @classmethod
    def parse(cls, fields: Sequence[Any]) -> SubmitWithKv:
        """Read the fields after the header; ``WireError`` if they are not a hand-off."""
        if len(fields) != 5:
            raise WireError(f"SUBMIT_REQUEST_WITH_KV has {len(fields)} fields, 5 expected")
        request_id, prompt, sampling_params, kv_meta, src_block_ids = fields
        if not isinstance(sampling_params, dict):
            raise WireError(f"SUBMIT_REQUEST_WITH_KV's sampling params are not a map: {fields[2]}")
        if not isinstance(src_block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in src_block_ids
        ):
            raise WireError(f"src_block_ids is not a list of integers: {src_block_ids!r:.80}")
        request_id = _request_id(request_id, "SUBMIT_REQUEST_WITH_KV")
        return cls(request_id, prompt, sampling_params, kv_meta, src_block_ids)


@dataclass
class SamplingParams:
    """Megatron's ``SamplingParams`` (main d98e8a64): the same fields, defaults and wire form.

    ``serialize()`` is the instance's ``__dict__`` (keys added with ``add_attributes``
    included); ``deserialize()`` starts from the defaults and sets every key of the map.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_to_generate: int | None = None
    num_tokens_total: int | None = None
    termination_id: int | None = None
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    add_BOS: bool = False
    stop_words: list[str] | None = None
    detokenize_stop_sequence: bool = False
    return_prompt_tokens: bool = False
    streaming: bool = False
    streaming_interval: int = 1
    do_kv_handoff: bool = False

    def __post_init__(self) -> None:
        self._sync_and_check()

    def _sync_and_check(self) -> None:
        # Megatron's _sync_prompt_logprobs_fields and _validate_streaming_interval.
        if self.return_prompt_top_n_logprobs and self.skip_prompt_log_probs:
            raise ValueError("return_prompt_top_n_logprobs requires skip_prompt_log_probs False")
        self.return_prompt_top_n_logprobs = (
            not self.skip_prompt_log_probs if self.top_n_logprobs > 0 else False
        )
        interval = self.streaming_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError("streaming_interval must be an integer greater than or equal to 1")

    def add_attributes(self, attribute_value_pair: Mapping[str, Any]) -> None:
        """Set each key as an attribute (unknown keys too), then check as Megatron does."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)
        self._sync_and_check()

    def serialize(self) -> dict[str, Any]:
        """The wire form: a copy of the instance's attributes."""
        return self.__dict__.copy()

    @classmethod
    def deserialize(cls, data: Mapping[str, Any]) -> SamplingParams:
        """From the wire form: the defaults, then every key of ``data``."""
        params = cls()
        params.add_attributes(data)
        return params
