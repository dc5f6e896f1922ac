r"""A stand-in for Megatron's coordinator with one dynamic engine behind it: no model, same wire.

Test support (nothing in the library imports it); ``python -m discovery.testing.stand_in_engine
--coordinator-port P`` runs one, and tests run one in their own process. It binds a ZeroMQ
ROUTER and answers Megatron's ``InferenceClient`` as ``DataParallelInferenceCoordinator``
and one ``DynamicInferenceEngine`` (a ``DisaggDynamicInferenceEngine`` with its transfer
set up, for the hand-off) do at Megatron-LM main d98e8a64; docs/megatron_wire.md gives each
payload with its source line. In short:

* ``[CONNECT]`` -> ``[CONNECT_ACK]`` once per client; anything else from a client that has
  not connected is ignored.
* ``SUBMIT_REQUEST`` (four or five fields) and ``SUBMIT_REQUEST_WITH_KV`` -> one
  ``[ENGINE_REPLY, client_request_id, reply]``, ``reply`` being the engine's serialized
  request (every key of ``DynamicInferenceRequest.serialize()``) plus the coordinator's
  ``generated_text``; with ``sampling_params.streaming``, ``[ENGINE_REPLY_PARTIAL,
  client_request_id, {"request_id", "new_tokens", ...}]`` after each step but the last.
  ``reply["request_id"]`` is the coordinator's own id (the one ``release_handoff`` takes).
* ``ABORT_REQUEST``: the request ends at the engine's next step with the tokens it has (its
  reply is still sent: Megatron's client drops it). ``RELEASE_KV`` frees a hand-off's
  pinned blocks.
* ``PAUSE`` / ``UNPAUSE`` / ``SUSPEND`` / ``RESUME`` / ``STOP`` / ``SET_GENERATION_EPOCH``
  pass the coordinator's transition table (``state.py``) or are ignored; no signal is
  acknowledged. A paused or suspended engine takes submits and aborts but runs no step, so
  nothing is answered until ``UNPAUSE``; ``RESUME`` leads back to paused. ``STOP`` (from
  paused or suspended) ends the engine: what it holds is never answered, the coordinator
  forgets it, and the next submit finds no engine and ends the coordinator (``on_stop`` is
  called first: the stand-in process exits). ``SET_GENERATION_EPOCH e`` stamps ``e`` on
  every request held (``policy_epoch`` / ``kv_cache_epoch``: ``[[0, e]]``, or a boundary
  ``[prompt + generated - 1, e]`` appended) and on every later request. ``SHUTDOWN`` closes
  the coordinator's socket; the engine stays.

The engine's replies are deterministic. The stand-in's tokenizer maps a text prompt's
characters to their code points (``add_BOS`` puts BOS 1 first; EOD is 0), and generated
token ``i`` (from 0) of a prompt is ``32 + (sum(prompt tokens) + 31 * seed + images + 7 * i)
% 95`` (printable ASCII, so ``generated_text`` reads), ``images`` being the CRC-32 of the
request's ``multi_modal_data["image"]`` packed with msgpack (0 without images;
``generated_tokens()`` gives them, for a test to tell engines apart by seed). Each engine
step takes ``token_delay`` seconds and gives every running request one token (the first
``max_running`` by arrival, when given: the others wait, as beyond Megatron's
``max_requests``); a request ends
at ``num_tokens_to_generate`` (by default the context length minus the prompt, Megatron's
rule) or on its ``termination_id``. With ``return_log_probs`` each token's log probability
is ``-(token % 10 + 1) / 10``. A prompt longer than the context length fails as Megatron's
does (status ``FAILED``, a ``MaxSequenceLengthOverflowError`` event), as do the submissions
Megatron refuses before admission. Not modelled: stop words, top-n log probabilities (always
``None``), image token expansion, token-budget batch limits.

A prefill request (``do_kv_handoff``) ends with ``disaggregated_params = {"request_id",
"block_ids", "kv_meta": {"engine": coordinator address, "resume_tokens": [last token]}}``
and its blocks pinned until ``RELEASE_KV``; a hand-off (the decode side) starts from the
resume token and generates the rest with its own seed, so a test sees which engine made
which token. Where Megatron's coordinator or engine would raise (a malformed message, an
unknown header, a hand-off it refuses), the stand-in logs the reason and drops the message.

Text prompts and requests without images are prefix-cached at the engine: ``on_prompt``
gets their tokens when they are scheduled (the stand-in sends the KV events).

``wire="0.16.1"`` speaks the released megatron-core 0.16.1's wire instead
(``stand_in_wire.RELEASED_HEADERS``): its header values, its three-field submit, its reply
(``released_record``), PAUSE and STOP acknowledged to every client (``[PAUSE_ACK,
engine identity]``, ``[STOP_ACK, ...]``, as its coordinator sends them once its engines
acknowledged), and none of main's other messages.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from discovery._state.blockhash import block_hashes
from discovery._state.relay import bind_socket
from discovery.testing.stand_in_wire import (
    RELEASED_HEADERS,
    Headers,
    SamplingParams,
    Submit,
    SubmitWithKv,
    WireError,
    pack,
    read,
    released_record,
)

__all__ = [
    "BOS",
    "EOD",
    "CoordinatorState",
    "MegatronEngineState",
    "StandInCoordinator",
    "detokenize",
    "generated_tokens",
    "tokenize",
]

log = logging.getLogger(__name__)

BOS = 1
EOD = 0
_PRINTABLE = 32  # the first generated token value; 95 values from there
_CONTROL = (
    Headers.PAUSE,
    Headers.UNPAUSE,
    Headers.SUSPEND,
    Headers.RESUME,
    Headers.SET_GENERATION_EPOCH,
    Headers.STOP,
)
_SIGNALS = frozenset(
    {*_CONTROL, Headers.START_CUDA_PROFILER, Headers.STOP_CUDA_PROFILER, Headers.SHUTDOWN}
)


class CoordinatorState(enum.Enum):
    """Megatron's ``CoordinatorState`` (``state.py``)."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPING = "stopping"


class MegatronEngineState(enum.Enum):
    """The engine's settled states (one rank: Megatron's transitional states pass at once)."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPED = "stopped"


_ALL = frozenset(CoordinatorState)
# Megatron's CONTROL_TRANSITIONS: signal -> (states it is applied from, the state after).
_TRANSITIONS: dict[Headers, tuple[frozenset[CoordinatorState], CoordinatorState | None]] = {
    Headers.PAUSE: (frozenset({CoordinatorState.RUNNING}), CoordinatorState.PAUSED),
    Headers.UNPAUSE: (frozenset({CoordinatorState.PAUSED}), CoordinatorState.RUNNING),
    Headers.SUSPEND: (frozenset({CoordinatorState.PAUSED}), CoordinatorState.SUSPENDED),
    Headers.RESUME: (frozenset({CoordinatorState.SUSPENDED}), CoordinatorState.PAUSED),
    Headers.STOP: (
        frozenset({CoordinatorState.PAUSED, CoordinatorState.SUSPENDED}),
        CoordinatorState.STOPPING,
    ),
    Headers.SET_GENERATION_EPOCH: (_ALL, None),
}
# The engine's side of the same signals (dynamic_engine.py schedule_requests).
_ENGINE_SIGNALS = {
    Headers.PAUSE: (MegatronEngineState.RUNNING, MegatronEngineState.PAUSED),
    Headers.UNPAUSE: (MegatronEngineState.PAUSED, MegatronEngineState.RUNNING),
    Headers.SUSPEND: (MegatronEngineState.PAUSED, MegatronEngineState.SUSPENDED),
    Headers.RESUME: (MegatronEngineState.SUSPENDED, MegatronEngineState.PAUSED),
}


def tokenize(text: str, add_bos: bool) -> list[int]:
    """The stand-in tokenizer: code points, BOS first if asked (Megatron's tokenize_prompt)."""
    tokens = [ord(c) for c in text]
    while tokens and tokens[0] == BOS:
        tokens.pop(0)
    return [BOS, *tokens] if add_bos else tokens


def detokenize(tokens: Sequence[int], remove_eod: bool = True) -> str:
    """Text of ``tokens``, trailing EOD dropped as Megatron's coordinator drops it."""
    end = len(tokens)
    while remove_eod and end and tokens[end - 1] == EOD:
        end -= 1
    return "".join(chr(t) if 0 <= t < 0x110000 else "\ufffd" for t in tokens[:end])


def generated_tokens(
    prompt_tokens: Sequence[int],
    count: int,
    *,
    seed: int = 0,
    multi_modal_data: Any = None,
    start: int = 0,
) -> list[int]:
    """The tokens ``start`` to ``start + count`` a stand-in engine of ``seed`` generates."""
    base = _base(prompt_tokens, seed, _image_digest(multi_modal_data))
    return [_token(base, i) for i in range(start, start + count)]


def _base(prompt_tokens: Sequence[int], seed: int, images: int | None) -> int:
    return sum(prompt_tokens) + 31 * seed + (images or 0)


def _token(base: int, position: int) -> int:
    return _PRINTABLE + (base + 7 * position) % 95


def _log_prob(token: int) -> float:
    return -((token % 10) + 1) / 10


def _event(kind: str, payload: Any = None) -> dict[str, Any]:
    """``DynamicInferenceEvent.serialize()``."""
    return {"timestamp": time.time(), "type": kind, "payload": payload}


def _image_digest(multi_modal_data: Any) -> int | None:
    """CRC-32 of the packed ``"image"`` entry, or None for a request without images."""
    import msgpack  # noqa: PLC0415 - the launch extra

    if not isinstance(multi_modal_data, dict) or not multi_modal_data.get("image"):
        return None
    return zlib.crc32(msgpack.packb(multi_modal_data["image"], use_bin_type=True))


def _transfer_block_count(kv_meta: Any, src_block_ids: Sequence[int]) -> int:
    """Megatron's ``transfer_block_count``: the blocks a hand-off's metadata names."""
    if isinstance(kv_meta, dict) and "pp_metas" in kv_meta:
        entries = kv_meta["pp_metas"]
        if not entries:
            return 0
        first = entries[0]
        metas = first.get("tp_metas", first)
        default = first.get("block_ids", [])
    else:
        tp = isinstance(kv_meta, dict) and "tp_metas" in kv_meta
        metas = kv_meta["tp_metas"] if tp else kv_meta
        default = src_block_ids
    meta = metas[0] if isinstance(metas, list) else metas
    if not isinstance(meta, dict):
        raise ValueError("transfer peer metadata entries must be dictionaries")
    return len(meta.get("block_ids", default))


class _Refused(Exception):
    """What Megatron raises for a message (its process would stop); the stand-in drops it."""


@dataclass(eq=False)
class _Request:
    """One request in the engine: what ``DynamicInferenceRequest`` holds, for its reply."""

    rid: int
    params: SamplingParams
    tokens: list[int]
    text: str | None = None
    base: int = 0  # the token formula's offset for this request at this engine
    caching: bool = False
    block_size: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None
    generated_log_probs: list[float] | None = None
    policy_epoch: list[list[int]] | None = None
    kv_cache_epoch: list[list[int]] | None = None
    status: str | None = None
    scheduled: bool = False
    emitted: int = 0
    ttft: float | None = None
    num_cached_tokens: int = 0
    disaggregated_params: dict[str, Any] | None = None
    uid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")

    def serialize(self) -> dict[str, Any]:
        """``DynamicInferenceRequest.serialize()`` of the merged record, every key."""
        tensor = ["tensor", list(self.tokens)]
        return {
            "request_id": self.rid,
            "prompt": self.text,
            "sampling_params": self.params.serialize(),
            "inference_parameters": None,
            "prompt_tokens": tensor if self.params.return_prompt_tokens else None,
            "prompt_length": len(self.tokens),
            "arrival_time": None,
            "status": self.status,
            "encoder_prompt": None,
            "generated_text": None,  # the coordinator's to fill
            "segments": None,
            "generated_segments": None,
            "generated_sequence_lengths": None,
            "generated_tokens": list(self.generated),
            "prompt_log_probs": self.prompt_log_probs,
            "generated_log_probs": self.generated_log_probs,
            "prompt_top_n_logprobs": None,
            "generated_top_n_logprobs": None,
            "generated_length": len(self.generated),
            "tpot": [],
            "uid": self.uid,
            "remaining_prompt_tokens": tensor,
            "policy_epoch": self.policy_epoch,
            "kv_cache_epoch": self.kv_cache_epoch,
            "latency": None,
            "routing_indices": None,
            "finished_chunk_token_count": 0,
            "stop_word_ids": None,
            "cg_wait_iters": 0,
            "block_size_tokens": self.block_size,
            "enable_prefix_caching": self.caching,
            "num_cached_tokens": self.num_cached_tokens,
            "precomputed_block_hashes": (
                block_hashes(self.tokens, self.block_size)
                if self.caching and self.block_size
                else []
            ),
            "disaggregated_params": self.disaggregated_params,
            "ttft": self.ttft,
            "events": self.events,
        }

    def stamp(self, epoch: int) -> None:
        """Megatron's stamping of a held request with a new generation epoch."""
        total = len(self.tokens) + len(self.generated)
        if total == 0:
            return
        for name in ("policy_epoch", "kv_cache_epoch"):
            stamps = getattr(self, name)
            if stamps is None:
                setattr(self, name, [[0, epoch]])
            else:
                stamps.append([total - 1, epoch])


class _Engine:
    """Megatron's dynamic engine, one rank: requests in, serialized records and partials out.

    Its replies go to ``outbox`` as ``(ENGINE_REPLY or ENGINE_REPLY_PARTIAL, payload)``, in
    the order the engine sends them to its coordinator.
    """

    def __init__(
        self,
        *,
        seed: int,
        token_delay: float,
        context_length: int,
        block_size: int,
        prefix_caching: bool,
        transfer_meta: dict[str, Any],
        max_running: int | None = None,
    ) -> None:
        self.state = MegatronEngineState.RUNNING
        self._max_running = max_running
        self.epoch: Any = None
        self.requests: dict[int, _Request] = {}
        self.pinned: dict[int, list[int]] = {}
        self.outbox: list[tuple[Headers, dict[str, Any]]] = []
        self._seed = seed
        self._token_delay = token_delay
        self._context_length = context_length
        self._block_size = block_size
        self._prefix_caching = prefix_caching
        self._transfer_meta = transfer_meta
        self.on_prompt: Callable[[list[int]], None] | None = None
        self._blocks = itertools.count(1)
        self._step_started: float | None = None

    def submit(
        self, rid: int, prompt: str | list[Any], params_map: dict[str, Any], mm: Any
    ) -> None:
        """``SUBMIT_REQUEST``: admit the request, or answer it failed as Megatron does."""
        params = _params(params_map)
        reason = _refusal(prompt, params)
        if reason is not None:
            self._fail_submission(rid, params, reason)
            return
        images = _image_digest(mm)
        tokens = tokenize(prompt, bool(params.add_BOS)) if isinstance(prompt, str) else prompt
        request = self._request(rid, params, list(tokens), images)
        request.text = prompt if isinstance(prompt, str) else None
        request.caching = self._prefix_caching and images is None
        self._add(request)

    def submit_with_kv(self, rid: int, handoff: SubmitWithKv) -> None:
        """``SUBMIT_REQUEST_WITH_KV``: the decode side starts from the prefill's token."""
        params = _params(handoff.sampling_params)
        prompt, resume = handoff.prompt, _resume_tokens(handoff.kv_meta)
        self._check_handoff(prompt, params, resume, handoff)
        request = self._request(rid, params, list(prompt), None)
        request.caching = True
        if not self._add(request):
            return
        first = resume[0]
        if (params.num_tokens_to_generate or 0) > 0:
            self._append(request, first)
            if first == params.termination_id:
                params.num_tokens_to_generate = len(request.generated)
        request.num_cached_tokens = len(request.tokens)
        if len(request.generated) >= (params.num_tokens_to_generate or 0):
            self._finish(request)  # Megatron completes it without a forward step
            return
        request.scheduled = True
        request.events.append(_event("ADD_CONTEXT"))
        self._partials()

    def _check_handoff(
        self, prompt: Any, params: SamplingParams, resume: list[int], handoff: SubmitWithKv
    ) -> None:
        """What ``add_request_with_kv_handoff`` raises on (inference_state_handoff.py)."""
        if not isinstance(prompt, list):
            raise _Refused(f"a hand-off's prompt must be token ids, got {prompt!r:.60}")
        reason = _refusal(prompt, params)
        if reason is not None:  # asserted at admission, in the engine's loop: it would die
            raise _Refused(reason)
        if not self._prefix_caching:
            raise _Refused("a hand-off needs prefix caching on the decode engine")
        if len(resume) != 1:
            raise _Refused(
                "Decode-only handoff requires one sampled token plus the configured MTP "
                f"proposals: expected 1, got {len(resume)}"
            )
        if params.return_log_probs or params.top_n_logprobs > 0:
            raise _Refused("Decode-only handoff does not yet transfer log probabilities")
        try:
            blocks = _transfer_block_count(handoff.kv_meta, handoff.src_block_ids)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise _Refused(f"unreadable kv_meta ({exc})") from exc
        expected = math.ceil(len(prompt) / self._block_size)
        if blocks != expected:
            raise _Refused(
                "Decode-only handoff requires every prompt KV block, including the partial "
                f"tail: expected {expected}, got {blocks}"
            )

    def _request(
        self, rid: int, params: SamplingParams, tokens: list[int], images: int | None
    ) -> _Request:
        base = _base(tokens, self._seed, images)
        return _Request(rid, params, tokens, base=base, block_size=self._block_size)

    def _add(self, request: _Request) -> bool:
        """Megatron's ``_add_request``: stamp, resolve the lengths, fail an overflow."""
        self.requests[request.rid] = request
        request.events.append(_event("ADD_ENGINE"))
        if self.epoch is not None:
            request.policy_epoch = [[0, self.epoch]]
            request.kv_cache_epoch = [[0, self.epoch]]
        params, length = request.params, len(request.tokens)
        if params.num_tokens_total is not None:
            params.num_tokens_to_generate = params.num_tokens_total - length
            params.num_tokens_total = None
        if params.num_tokens_to_generate is None:
            params.num_tokens_to_generate = self._context_length - length
        if params.termination_id is None:
            params.termination_id = EOD
        remaining = self._context_length - length
        if params.num_tokens_to_generate < 0 or remaining < 0:
            error = {
                "type": "MaxSequenceLengthOverflowError",
                "request_id": request.rid,
                "message": None,
                "is_transient": False,
            }
            request.events.append(_event("ERROR_NONTRANSIENT", error))
            self._fail(request)
            return False
        params.num_tokens_to_generate = min(params.num_tokens_to_generate, remaining)
        return True

    def _fail_submission(self, rid: int, params: SamplingParams, reason: str) -> None:
        """Megatron's ``_fail_submission``: a placeholder request answered failed at once."""
        log.warning("Request %d rejected before admission: %s", rid, reason)
        self._fail(_Request(rid, params, []))

    def _fail(self, request: _Request) -> None:
        request.status = "FAILED"
        request.events.append(_event("FAIL"))
        self.requests.pop(request.rid, None)
        self.outbox.append((Headers.ENGINE_REPLY, request.serialize()))

    def abort(self, rid: int) -> None:
        """``ABORT_REQUEST``: the request ends at the next step with the tokens it has."""
        request = self.requests.get(rid)
        if request is not None:
            request.params.num_tokens_to_generate = len(request.generated)

    def release(self, rid: int) -> None:
        """``RELEASE_KV``: free a hand-off's pinned blocks; an unknown id is a no-op."""
        blocks = self.pinned.pop(rid, None)
        if blocks:
            log.info("DISAGG_PREFILL_RELEASE request_id=%d released_blocks=%d", rid, len(blocks))

    def signal(self, header: Headers, args: list[Any]) -> None:
        """A control signal the coordinator let through."""
        if header is Headers.SET_GENERATION_EPOCH:
            if not args:
                raise _Refused("SET_GENERATION_EPOCH without an epoch")
            self.epoch = args[0]
            for request in self.requests.values():
                request.stamp(self.epoch)
        elif header is Headers.STOP:
            self.state = MegatronEngineState.STOPPED
            self.requests.clear()  # their futures are cancelled: never answered
        else:
            before, after = _ENGINE_SIGNALS[header]
            if self.state is before:
                self.state = after

    def step_due(self, now: float) -> float | None:
        """When the step under way ends (one starts now if there is work), or None."""
        if self.state is not MegatronEngineState.RUNNING or not self.requests:
            self._step_started = None
            return None
        if self._step_started is None:
            self._step_started = now
        return self._step_started + self._token_delay

    def step(self) -> None:
        """One engine step: schedule what waits, one token for each request, replies."""
        self._step_started = None
        finished = []
        # The first max_running requests (Megatron's max_requests: the others wait).
        for request in itertools.islice(list(self.requests.values()), self._max_running):
            if not request.scheduled:
                self._schedule(request)
            if self._advance(request):
                finished.append(request)
        for request in finished:
            self._finish(request)
        self._partials()

    def _schedule(self, request: _Request) -> None:
        request.scheduled = True
        request.events.append(_event("ADD_CONTEXT"))
        if request.caching and self.on_prompt is not None:
            self.on_prompt(request.tokens)  # its blocks are stored: KV events
        params = request.params
        if params.return_log_probs:
            skip = params.skip_prompt_log_probs
            request.prompt_log_probs = [] if skip else [_log_prob(t) for t in request.tokens[1:]]
            request.generated_log_probs = []

    def _advance(self, request: _Request) -> bool:
        """Generate the request's next token; whether it is finished."""
        params = request.params
        limit = params.num_tokens_to_generate or 0
        if len(request.generated) >= limit:
            return True
        token = _token(request.base, len(request.generated))
        self._append(request, token)
        return token == params.termination_id or len(request.generated) >= limit

    @staticmethod
    def _append(request: _Request, token: int) -> None:
        request.generated.append(token)
        if request.generated_log_probs is not None:
            request.generated_log_probs.append(_log_prob(token))
        if request.ttft is None:
            request.ttft = time.time() - request.events[0]["timestamp"]

    def _finish(self, request: _Request) -> None:
        del self.requests[request.rid]
        request.status = "COMPLETED"
        request.events.append(_event("FINISH"))
        if request.params.do_kv_handoff:
            try:
                self._pin(request)
            except _Refused as exc:
                log.warning("request %d dropped: %s", request.rid, exc)
                return
        self.outbox.append((Headers.ENGINE_REPLY, request.serialize()))

    def _pin(self, request: _Request) -> None:
        """The prefill side of a hand-off: pin the prompt's blocks, say where they are."""
        if not request.generated:
            raise _Refused("Cannot create a decode-only handoff without one sampled token")
        count = math.ceil(len(request.tokens) / self._block_size)
        if count == 0:
            raise _Refused("Cannot create a decode-only handoff without the prompt KV state")
        blocks = [next(self._blocks) for _ in range(count)]
        self.pinned[request.rid] = blocks
        kv_meta = {**self._transfer_meta, "resume_tokens": [request.generated[-1]]}
        request.disaggregated_params = {
            "request_id": request.rid,
            "block_ids": blocks,
            "kv_meta": kv_meta,
        }
        log.info("DISAGG_PREFILL_HANDOFF request_id=%d pinned_blocks=%d", request.rid, count)

    def _partials(self) -> None:
        """Megatron's ``_try_send_streaming_partials``: the tokens not streamed yet."""
        for rid, request in self.requests.items():
            params = request.params
            already, total = request.emitted, len(request.generated)
            if not params.streaming or total - already < params.streaming_interval:
                continue
            partial: dict[str, Any] = {
                "request_id": rid,
                "new_tokens": request.generated[already:total],
            }
            if params.return_log_probs:
                partial["new_log_probs"] = (request.generated_log_probs or [])[already:total]
                partial["new_top_n_logprobs"] = []
                if already == 0 and not params.skip_prompt_log_probs:
                    partial["prompt_log_probs"] = list(request.prompt_log_probs or [])
                    partial["prompt_top_n_logprobs"] = []
            request.emitted = total
            self.outbox.append((Headers.ENGINE_REPLY_PARTIAL, partial))


def _refusal(prompt: str | list[Any], params: SamplingParams) -> str | None:
    """Why Megatron's engine refuses a submission before admission (its asserts), or None."""
    if not isinstance(prompt, str) and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return "the prompt is not a list of token ids"
    for name in ("num_tokens_to_generate", "num_tokens_total", "termination_id", "top_n_logprobs"):
        value = getattr(params, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name} is not an integer: {value!r:.40}"
    if params.num_tokens_to_generate is not None and params.num_tokens_total is not None:
        return "num_tokens_to_generate and num_tokens_total are both set"
    if params.top_n_logprobs > 0 and not params.return_log_probs:
        return "top_n_logprobs requires return_log_probs"
    return None


def _params(data: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams.deserialize(data)
    except (ValueError, TypeError) as exc:
        raise _Refused(f"bad sampling params ({exc})") from exc


def _resume_tokens(kv_meta: Any) -> list[int]:
    if not isinstance(kv_meta, dict):
        return []
    try:
        return [int(token) for token in kv_meta.get("resume_tokens", [])]
    except (TypeError, ValueError) as exc:
        raise _Refused(f"resume_tokens are not token ids ({exc})") from exc


def _int(fields: list[Any], what: str) -> int:
    if not fields:
        raise WireError(f"{what} without a request id")
    try:
        return int(fields[0])
    except (TypeError, ValueError) as exc:
        raise WireError(f"{what}'s request id is not an integer: {fields[0]!r:.60}") from exc


RELEASE = "0.16.1"
"""The released megatron-core whose wire ``wire=RELEASE`` speaks."""
_FROM_RELEASED = {value: name for name, value in RELEASED_HEADERS.items()}
_RELEASED_TAKES = frozenset(
    {"CONNECT", "SUBMIT_REQUEST", "PAUSE", "UNPAUSE", "SUSPEND", "RESUME", "STOP"}
)


class StandInCoordinator:
    """Megatron's coordinator with one stand-in engine, on a ROUTER socket and a thread.

    ``start(on_prompt)`` serves on the thread ``stand-in-coordinator`` until ``close()``,
    calling ``on_prompt(tokens)`` there for each prompt the engine caches;
    ``set_talking(False)`` makes it answer nothing (messages wait in their queue, steps do
    not run) until ``set_talking(True)``. ``on_stop()`` is called when ``STOP`` has stopped
    the engine.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        seed: int = 0,
        token_delay: float = 0.0,
        context_length: int = 8192,
        block_size: int = 256,
        prefix_caching: bool = True,
        on_stop: Callable[[], None] | None = None,
        wire: str = "main",
        max_running: int | None = None,
    ) -> None:
        import zmq  # noqa: PLC0415 - the launch extra

        if wire not in ("main", RELEASE):
            raise ValueError(f"wire must be 'main' or {RELEASE!r}, got {wire!r}")
        self.wire = wire

        if token_delay < 0 or context_length <= 0 or block_size <= 0:
            raise ValueError("token_delay must be >= 0, context_length and block_size > 0")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be 1 or more, got {max_running}")
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # as Megatron's: a gone client raises
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self.address = bind_socket(self._router, f"tcp://{host}:{port}", "coordinator")
        except Exception:
            self._router.close()
            self._context.term()
            raise
        inproc = f"inproc://stand-in-coordinator-{id(self)}"
        self._inbox = self._context.socket(zmq.PAIR)
        self._inbox.bind(inproc)
        self._control = self._context.socket(zmq.PAIR)
        self._control.connect(inproc)
        self._control_lock = threading.Lock()
        self._lock = threading.Lock()  # the engine and the routes, for the views
        self._state = CoordinatorState.RUNNING
        self._engine: _Engine | None = _Engine(
            seed=seed,
            token_delay=token_delay,
            context_length=context_length,
            block_size=block_size,
            prefix_caching=prefix_caching,
            transfer_meta={"engine": self.address},
            max_running=max_running,
        )
        self._on_stop = on_stop
        self._clients: set[bytes] = set()
        self._routes: dict[int, tuple[bytes, int]] = {}  # our id -> (client, client's id)
        self._ids: dict[tuple[bytes, int], int] = {}
        self._next_id = itertools.count()
        self._talking = True
        self._serving = True  # the ROUTER socket is open
        self._paused_submits = 0
        self._signals: list[str] = []  # the control signals heard, in order
        self._thread = threading.Thread(target=self._run, name="stand-in-coordinator", daemon=True)
        self._handlers: dict[Headers, Callable[[bytes, list[Any], Headers], None]] = {
            Headers.CONNECT: self._on_connect,
            Headers.SUBMIT_REQUEST: self._on_submit,
            Headers.SUBMIT_REQUEST_WITH_KV: self._on_submit_with_kv,
            Headers.RELEASE_KV: self._on_release,
            Headers.ABORT_REQUEST: self._on_abort,
            Headers.SHUTDOWN: self._on_shutdown,
            Headers.START_CUDA_PROFILER: _ignore,
            Headers.STOP_CUDA_PROFILER: _ignore,
            Headers.DISCONNECT: _ignore,  # Megatron removes an engine that sends it
            **dict.fromkeys(_CONTROL, self._on_control),
        }

    @property
    def state(self) -> CoordinatorState:
        """The coordinator's state (its transition table's)."""
        with self._lock:
            return self._state

    @property
    def engine_state(self) -> MegatronEngineState:
        """The engine's state (``STOPPED`` once ``STOP`` ended it)."""
        with self._lock:
            return MegatronEngineState.STOPPED if self._engine is None else self._engine.state

    def requests_held(self) -> list[int]:
        """The ids (the coordinator's) of the requests the engine holds, waiting or running."""
        with self._lock:
            return [] if self._engine is None else list(self._engine.requests)

    @property
    def paused_submits(self) -> int:
        """Submits that arrived while the engine was paused or suspended."""
        with self._lock:
            return self._paused_submits

    @property
    def signals(self) -> list[str]:
        """The names of the control and profiler signals heard from clients, in order."""
        with self._lock:
            return list(self._signals)

    def pinned_handoffs(self) -> dict[int, list[int]]:
        """Hand-offs whose blocks are pinned: request id -> block ids."""
        with self._lock:
            return {} if self._engine is None else dict(self._engine.pinned)

    def start(self, on_prompt: Callable[[list[int]], None] | None = None) -> StandInCoordinator:
        """Serve on a thread of its own, telling ``on_prompt`` what is cached; returns self."""
        if self._engine is not None:
            self._engine.on_prompt = on_prompt
        self._thread.start()
        return self

    def set_talking(self, talking: bool) -> None:
        """Answer nothing (False) until told to talk again (True)."""
        with self._control_lock:
            self._control.send(b"talk" if talking else b"silent")

    def close(self) -> None:
        """Stop serving and close the sockets (idempotent)."""
        with self._control_lock:
            if self._control.closed:
                return
            if self._thread.is_alive():
                self._control.send(b"close")
                self._thread.join()
            else:
                self._router.close()
                self._inbox.close()
            self._control.close()
            self._context.term()

    def _run(self) -> None:
        import zmq  # noqa: PLC0415

        self._everything = zmq.Poller()
        self._everything.register(self._router, zmq.POLLIN)
        self._everything.register(self._inbox, zmq.POLLIN)
        self._controls = zmq.Poller()
        self._controls.register(self._inbox, zmq.POLLIN)
        try:
            while self._turn():
                pass
        finally:
            self._router.close()
            self._inbox.close()

    def _turn(self) -> bool:
        """One turn: a step if one is due, then what came meanwhile; False once closed."""
        if not (self._talking and self._serving):
            return self._wait(everything=False, timeout=None)
        with self._lock:
            due = None if self._engine is None else self._engine.step_due(time.monotonic())
        if due is None:
            return self._wait(everything=True, timeout=None)
        left = due - time.monotonic()
        if left > 0:  # a step under way: what arrives waits for it, as in Megatron's loop
            return self._wait(everything=False, timeout=left)
        with self._lock:
            if self._engine is not None:
                self._engine.step()
            self._flush()
        return self._wait(everything=True, timeout=0)

    def _wait(self, *, everything: bool, timeout: float | None) -> bool:
        poller = self._everything if everything else self._controls
        ready = dict(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))
        if self._inbox in ready:
            command = self._inbox.recv()
            if command == b"close":
                return False
            self._talking = command == b"talk"
        if everything and self._talking and self._router in ready:
            self._drain()
        return True

    def _drain(self) -> None:
        """Handle every message waiting (Megatron's engine drains its socket each turn)."""
        import zmq  # noqa: PLC0415

        while self._serving:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (Megatron's are one)", len(frames) - 1)
                continue
            self._handle(frames[0], frames[1])

    def _handle(self, identity: bytes, frame: bytes) -> None:
        if frame == b"":
            log.info("ignored a data-parallel rank's registration: the stand-in has its engine")
            return
        message = read(frame, log) if self.wire == "main" else self._read_released(frame)
        if message is None:
            return
        header, fields = message
        handler = self._handlers.get(header)
        if handler is None:
            log.warning("dropped %s: Megatron's coordinator takes it from no client", header.name)
            return
        if header is not Headers.CONNECT and identity not in self._clients:
            log.info("ignored %s from a client that has not connected", header.name)
            return
        with self._lock:
            if header in _SIGNALS:
                self._signals.append(header.name)
            try:
                handler(identity, fields, header)
            except (_Refused, WireError) as exc:
                log.warning("dropped %s: %s", header.name, exc)
            except Exception:  # what else Megatron would die of: the stand-in stays up
                log.exception("dropped %s: it raised", header.name)
            self._flush()

    def _read_released(self, frame: bytes) -> tuple[Headers, list[Any]] | None:
        """A 0.16.1 frame as main's header and fields (None, logged: what it does not take)."""
        import msgpack  # noqa: PLC0415

        try:
            message = msgpack.unpackb(frame, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            log.warning("dropped a message: not msgpack (%s)", exc)
            return None
        name = _FROM_RELEASED.get(message[0]) if isinstance(message, list) and message else None
        if name not in _RELEASED_TAKES:
            log.warning("dropped a message megatron-core %s's coordinator does not take", RELEASE)
            return None
        if name == "SUBMIT_REQUEST" and len(message) != 4:  # it unpacks exactly three
            log.warning("dropped a %d-field SUBMIT_REQUEST: %s takes 3", len(message) - 1, RELEASE)
            return None
        return Headers[name], message[1:]

    def _send(self, identity: bytes, message: list[Any]) -> None:
        import zmq  # noqa: PLC0415

        if self.wire != "main":
            header = Headers(message[0]).name
            if header == "ENGINE_REPLY":
                message = [RELEASED_HEADERS[header], message[1], released_record(message[2])]
            elif header in RELEASED_HEADERS:
                message = [RELEASED_HEADERS[header], *message[1:]]
            else:
                return  # no such message in 0.16.1 (a partial: it has no streaming)

        try:
            self._router.send_multipart([identity, pack(message)])
        except zmq.ZMQError as exc:  # the client is gone (Megatron's coordinator would raise)
            log.info("dropped a %s to a client that is gone: %s", Headers(message[0]).name, exc)

    def _flush(self) -> None:
        """Route what the engine sent to the clients that asked (the coordinator's part)."""
        if self._engine is None:
            return
        for header, payload in self._engine.outbox:
            rid = payload["request_id"]
            route = self._routes.get(rid)
            if route is None:
                continue
            if header is Headers.ENGINE_REPLY:
                del self._routes[rid], self._ids[route]
                keep_eod = (payload["sampling_params"] or {}).get("detokenize_stop_sequence")
                payload["generated_text"] = detokenize(payload["generated_tokens"], not keep_eod)
            if self._serving:
                self._send(route[0], [header, route[1], payload])
        self._engine.outbox.clear()

    def _on_connect(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        if identity in self._clients:
            log.info("a client sent a duplicate connect request; ignored")
            return
        self._clients.add(identity)
        self._send(identity, [Headers.CONNECT_ACK])

    def _route(
        self, identity: bytes, client_request_id: int, prompt: Any
    ) -> tuple[_Engine, int] | None:
        """Our id for a client's request and the engine to take it; None if it has none."""
        if not isinstance(prompt, (str, list)):
            raise _Refused(f"specialize for <{type(prompt).__name__}> prompt")
        if self._engine is None:  # STOP ended it: Megatron's coordinator ends too
            log.error("Coordinator: no reachable engines for request; the coordinator ends")
            self._serving = False
            self._router.close()
            return None
        rid = next(self._next_id)
        self._routes[rid] = (identity, client_request_id)
        self._ids[(identity, client_request_id)] = rid
        return self._engine, rid

    def _on_submit(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        submit = Submit.parse(fields)
        self._count_paused_locked()
        if routed := self._route(identity, submit.request_id, submit.prompt):
            engine, rid = routed
            engine.submit(rid, submit.prompt, submit.sampling_params, submit.multi_modal_data)

    def _on_submit_with_kv(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        handoff = SubmitWithKv.parse(fields)
        self._count_paused_locked()
        if routed := self._route(identity, handoff.request_id, handoff.prompt):
            routed[0].submit_with_kv(routed[1], handoff)

    def _count_paused_locked(self) -> None:
        """A submit that reached the engine while it was not running (a refit's check).

        Called by a handler, under the lock.
        """
        if self._engine is not None and self._engine.state is not MegatronEngineState.RUNNING:
            self._paused_submits += 1

    def _on_release(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        rid = _int(fields, "RELEASE_KV")
        if self._engine is not None:
            self._engine.release(rid)

    def _on_abort(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        rid = self._ids.get((identity, _int(fields, "ABORT_REQUEST")))
        if rid is not None and self._engine is not None:
            self._engine.abort(rid)

    def _on_control(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        allowed, after = _TRANSITIONS[header]
        if self._state not in allowed:
            log.info("Coordinator: ignoring %s in state %s", header.name, self._state.name)
            return
        if after is not None:
            self._state = after
        if self._engine is not None:
            self._engine.signal(header, fields)
        if self.wire != "main" and header in (Headers.PAUSE, Headers.STOP):
            self._acknowledge(f"{header.name}_ACK")
        if header is Headers.STOP:
            self._state = CoordinatorState.RUNNING  # ready for engines to come
            if self._engine is not None:
                self._engine = None  # its DISCONNECT: the coordinator forgets it
                log.info("STOP: the engine stopped")
                if self._on_stop is not None:
                    self._on_stop()

    def _acknowledge(self, name: str) -> None:
        """0.16.1's PAUSE_ACK / STOP_ACK to every client (its one engine acknowledged)."""
        import zmq  # noqa: PLC0415

        frame = pack([RELEASED_HEADERS[name], b"stand-in-engine"])
        for client in self._clients:
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart([client, frame])

    def _on_shutdown(self, identity: bytes, fields: list[Any], header: Headers) -> None:
        log.info("SHUTDOWN: the coordinator ends; the engine stays")
        self._serving = False
        self._router.close()


def _ignore(identity: bytes, fields: list[Any], header: Headers) -> None:
    log.debug("%s: nothing to do in the stand-in", header.name)
