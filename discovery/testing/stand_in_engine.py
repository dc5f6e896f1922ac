r"""A stand-in for Megatron's rank zero, for the demo and the tests: no model, same frames.

    python -m discovery.testing.stand_in_engine --dynamo-parent-event-address tcp://HOST:PORT \
        [--ready JSON] [--ready-shape flat|nested] [--role ROLE] [--version V] \
        [--kv-events N] [--kv-rate R] [--no-progress] [--truth FILE] [--exit-status N] \
        [--serve-port P [--serve-host H]] [--max-num-seqs N] [--policy NAME] \
        [--coordinator-port P [--coordinator-host H] [--token-delay S]]

It does on the wire exactly what Megatron's ``EngineEventReporter`` does
(``megatron/inference/integrations/dynamo/telemetry.py``): a PUSH socket with LINGER 0
connected to the parent's address, frames ``msgpack.packb([kind, payload],
use_bin_type=True)``:

* ``"ready"`` first: ``InferenceEngineEndpoint.to_dict()`` (``flat``, as Megatron's
  ``engine_service.py`` sends it since its endpoint module), or ``{"coordinator_address",
  "engine": engine_metadata}`` (``nested``, as the dynamo integration's pull request sends
  it: the capabilities and the ``--role`` it plays, no policy), optionally with
  ``"version"``; or the ``--ready`` JSON as given, valid or not;
* the KV-cache events of ``DynamoHelper``: ``"stored"`` (``block_hashes`` with Megatron's
  SHA-256 block hash of the prompt's complete blocks, ``token_ids``, ``num_block_tokens``,
  ``parent_hash``), ``"removed"`` (LRU evictions beyond ``total_kv_blocks``) and
  ``"cleared"``: ``--kv-events N`` prompts at start, then ``--kv-rate R`` prompts a
  second; prompts share a few system prompts, as chat traffic does;
* ``"progress"`` ``{}`` at most every 0.5 s while running (``--no-progress``: an older
  Megatron that sends none).

``--serve-port P`` (0: a free port) gives it something clients can send requests to, an
HTTP port on ``--serve-host`` (default 127.0.0.1): ``GET /?hold=S`` answers ``200 ok``
after S seconds (the request's own length, at most 60), and the ready payload's
``coordinator_address`` becomes ``tcp://H:P`` (unless ``--ready`` gives the payload).
What a client sees is what it would see of a real engine: a dead process refuses the
connection, a frozen one (SIGSTOP) accepts it (the kernel does) and never answers.
``GET /stats`` says how many requests run now and the most that ever ran at once;
``--max-num-seqs N`` is the capacity its ready payload declares, ``--policy NAME`` the
``prefix_caching_coordinator_policy`` of its flat payload (any string, as a Megatron of
another version would send: ``round_robin`` from 0.17/0.18/dev).

``--coordinator-port P`` (0: a free port; not with ``--serve-port``) makes it speak
Megatron's coordinator protocol instead, to Megatron's ``InferenceClient`` or
``discovery.testing.stand_in_client``: a ZeroMQ ROUTER on ``--coordinator-host`` (default
127.0.0.1), its address ``tcp://H:P`` the ready payload's ``coordinator_address``; it
answers with deterministic replies computed from the prompt and ``--seed``, each engine
step taking ``--token-delay`` seconds (``discovery/testing/stand_in_coordinator.py`` says exactly
what it does, docs/megatron_wire.md what Megatron does). The prompts it serves are cached:
their KV events go out as above. ``STOP`` ends it as SIGTERM does.

SIGUSR1 makes it go silent (no frame at all, and no answer on the request port or the
coordinator's: a hung engine) and SIGUSR2 talk again (requests held meanwhile are answered
then);
SIGSTOP freezes it for real. ``--truth FILE`` keeps the block hashes it holds in FILE
(JSON, rewritten atomically on every change) for tests to compare routers' views with. It
runs until SIGTERM or SIGINT and exits with ``--exit-status``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from discovery._records.endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
)
from discovery._state.blockhash import block_hashes
from discovery.testing.stand_in_coordinator import StandInCoordinator

__all__ = ["StandInCache", "default_endpoint", "main", "nested_ready"]

_BLOCK_TOKENS = 256
_MAX_HOLD = 60.0  # seconds a request may ask to be held
_PROGRESS_EVERY = 0.5  # Megatron's rate limit on progress heartbeats
_SYSTEM_PROMPTS = 4
_VOCABULARY = 32_000


def default_endpoint(address: str = "tcp://127.0.0.1:5555", **capabilities: Any) -> dict[str, Any]:
    """A plausible engine's ``InferenceEngineEndpoint.to_dict()``; ``capabilities`` override."""
    values: dict[str, Any] = {
        "context_length": 8192,
        "kv_cache_block_size": _BLOCK_TOKENS,
        "total_kv_blocks": 4095,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "bos_token_id": 1,
        "enable_prefix_caching": True,
        "prefix_caching_coordinator_policy": PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK,
    }
    values.update(capabilities)
    return InferenceEngineEndpoint(address, InferenceEngineCapabilities(**values)).to_dict()


def nested_ready(endpoint: dict[str, Any], role: str) -> dict[str, Any]:
    """The nested ready payload of Megatron's dynamo integration for ``endpoint``.

    Its ``engine_metadata(engine, role)``: the capabilities, ``role`` after
    ``max_num_batched_tokens``, ``logical_data_parallel_size`` 1, and no policy.
    """
    caps = endpoint["capabilities"]
    engine = {
        key: caps[key]
        for key in (
            "context_length",
            "kv_cache_block_size",
            "total_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
        )
    }
    engine["role"] = role
    engine["bos_token_id"] = caps["bos_token_id"]
    engine["enable_prefix_caching"] = caps["enable_prefix_caching"]
    engine["logical_data_parallel_size"] = 1
    return {"coordinator_address": endpoint["coordinator_address"], "engine": engine}


class StandInCache:
    """An engine's prefix cache: LRU over ``capacity`` blocks, with Megatron's KV events.

    ``serve(tokens)`` caches the prompt's complete blocks; it returns the events Megatron
    would send: ``"stored"`` for the blocks not cached yet (a cache hit is not announced
    again), ``"removed"`` for the blocks evicted to make room.
    """

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, tokens: Sequence[int]) -> list[tuple[str, dict[str, Any]]]:
        """Cache ``tokens``' complete blocks; the KV events that says."""
        hashes = block_hashes(tokens, self.block_size)
        for block_hash in hashes:
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
        new = [i for i, block_hash in enumerate(hashes) if block_hash not in self.blocks]
        events: list[tuple[str, dict[str, Any]]] = []
        if not new:
            return events
        start = new[0]  # blocks after the first miss are new too: the hash chains
        for block_hash in hashes[start:]:
            self.blocks[block_hash] = None
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        size = self.block_size
        events.append(
            (
                "stored",
                {
                    "block_hashes": hashes[start:],
                    "token_ids": list(tokens[start * size : len(hashes) * size]),
                    "num_block_tokens": [size] * (len(hashes) - start),
                    "parent_hash": hashes[start - 1] if start > 0 else None,
                },
            )
        )
        if evicted:
            events.append(("removed", {"block_hashes": evicted}))
        return events

    def clear(self) -> list[tuple[str, dict[str, Any]]]:
        """Drop everything (a reset): Megatron's ``"cleared"``."""
        self.blocks.clear()
        return [("cleared", {})]


def chat_prompt(rng: random.Random, block_size: int) -> list[int]:
    """A prompt: one of a few system prompts, then a user's own turns."""
    system = random.Random(rng.randrange(_SYSTEM_PROMPTS))
    head = [system.randrange(_VOCABULARY) for _ in range(block_size * 2)]
    return head + [rng.randrange(_VOCABULARY) for _ in range(block_size * rng.randint(1, 4))]


def _write_truth(path: str, cache: StandInCache) -> None:
    partial = f"{path}.part"
    with open(partial, "w") as handle:
        json.dump(list(cache.blocks), handle)
    os.replace(partial, path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m discovery.testing.stand_in_engine")
    parser.add_argument("--dynamo-parent-event-address", required=True)
    parser.add_argument("--ready", type=json.loads, help="ready payload as JSON, sent as is")
    parser.add_argument(
        "--ready-shape", choices=("flat", "nested"), help="default: nested with --role, else flat"
    )
    parser.add_argument(
        "--role",
        choices=("aggregated", "prefill", "decode"),
        help="play this role: the nested shape carries it, as Megatron's engine service sends "
        "it (its flat shape has none); nested without --role: aggregated, Megatron's default",
    )
    parser.add_argument("--version", type=int, help="a version key in the ready payload")
    parser.add_argument("--kv-events", type=int, default=4, help="prompts served at start")
    parser.add_argument("--kv-rate", type=float, default=0.0, help="prompts served a second")
    parser.add_argument("--no-progress", action="store_true", help="send no progress frames")
    parser.add_argument("--truth", help="keep the held block hashes in this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exit-status", type=int, default=0)
    parser.add_argument("--serve-port", type=int, help="answer requests on this port (0: free)")
    parser.add_argument("--serve-host", default="127.0.0.1", help="the request port's address")
    _coordinator_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, help="the capacity the ready payload says")
    parser.add_argument(
        "--policy",
        help="the flat ready payload's prefix_caching_coordinator_policy, any string "
        "(Megatron 0.17/0.18/dev send round_robin, main load_balanced)",
    )
    return parser


def _coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator-port", type=int, help="speak Megatron's coordinator protocol (0: free)"
    )
    parser.add_argument("--coordinator-host", default="127.0.0.1", help="the coordinator's address")
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="seconds an engine step takes (one token)"
    )


def _coordinator(args: argparse.Namespace) -> StandInCoordinator | None:
    """The coordinator ``--coordinator-port`` asks for (not serving yet), or None."""
    if args.coordinator_port is None:
        return None
    if args.serve_port is not None:
        raise SystemExit("--serve-port and --coordinator-port each give the coordinator address")
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="stand-in engine: %(message)s"
    )
    caps = default_endpoint()["capabilities"]
    try:
        return StandInCoordinator(
            args.coordinator_host,
            args.coordinator_port,
            seed=args.seed,
            token_delay=args.token_delay,
            context_length=caps["context_length"],
            block_size=caps["kv_cache_block_size"],
            prefix_caching=caps["enable_prefix_caching"],
            on_stop=lambda: os.kill(os.getpid(), signal.SIGTERM),  # the engine stopped: exit
        )
    except ValueError as exc:  # a bad --token-delay, a port in use (ConfigurationError)
        raise SystemExit(f"stand-in engine: {exc}") from exc


class _RequestPort:
    """The engine's request port: ``GET /?hold=S`` answers ``200 ok`` after S seconds.

    While ``talking`` is clear (the engine is silent) requests are held unanswered.
    ``GET /stats`` answers ``{"running", "peak", "served"}``: requests running now, the
    most that ever ran at once, and requests answered (what an overload test checks).
    """

    def __init__(self, host: str, port: int, talking: threading.Event) -> None:
        lock = threading.Lock()
        counts = {"running": 0, "peak": 0, "served": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path == "/stats":
                    with lock:
                        self._answer(json.dumps(counts).encode())
                    return
                hold = parse_qs(url.query).get("hold", ["0"])[0]
                try:
                    seconds = min(max(float(hold), 0.0), _MAX_HOLD)
                except ValueError:
                    seconds = 0.0
                with lock:
                    counts["running"] += 1
                    counts["peak"] = max(counts["peak"], counts["running"])
                try:
                    time.sleep(seconds)  # the request's own length: the engine at work
                    talking.wait()
                finally:
                    with lock:
                        counts["running"] -= 1
                        counts["served"] += 1
                self._answer(b"ok\n")

            def _answer(self, body: bytes) -> None:
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up waiting: what it does with a hung engine

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"tcp://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="stand-in-requests", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    """Send the frames until SIGTERM/SIGINT; returns ``--exit-status``."""
    import zmq  # noqa: PLC0415 - the launch extra; the demo imports default_endpoint

    parser = _parser()
    args = parser.parse_args(argv)
    if args.role is not None and args.ready_shape == "flat":
        parser.error("--role: Megatron's flat ready shape carries no role; use the nested one")
    # Blocked before ZeroMQ (and the request port) start their threads, so sigtimedwait()
    # gets them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP | _TALK)
    talking = threading.Event()
    talking.set()
    requests = None
    if args.serve_port is not None:
        requests = _RequestPort(args.serve_host, args.serve_port, talking)
    coordinator = _coordinator(args)
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.dynamo_parent_event_address)
    try:
        address = requests.address if requests is not None else None
        if coordinator is not None:
            address = coordinator.address
        received = _StandIn(args, sock, talking, address, coordinator).run()
    finally:
        if coordinator is not None:
            coordinator.close()
        sock.close()
        context.term()
        if requests is not None:
            requests.close()
    print(f"stand-in engine: {received.name}, exiting {args.exit_status}", file=sys.stderr)
    return int(args.exit_status)


_STOP = {signal.SIGTERM, signal.SIGINT}
_TALK = {signal.SIGUSR1, signal.SIGUSR2}  # go silent, talk again


class _StandIn:
    """The engine's side of the socket: ready, KV events, progress, silence on demand."""

    def __init__(
        self,
        args: argparse.Namespace,
        sock: Any,
        talking: threading.Event,
        address: str | None = None,
        coordinator: StandInCoordinator | None = None,
    ) -> None:
        import msgpack  # noqa: PLC0415

        self._args = args
        self._sock = sock
        self._talking = talking
        self._coordinator = coordinator
        self._lock = threading.RLock()  # the socket and the cache: the coordinator serves too
        self._pack = msgpack.Packer(use_bin_type=True).pack
        seqs = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
        endpoint = default_endpoint(address or "tcp://127.0.0.1:5555", **seqs)
        caps = endpoint["capabilities"]
        if args.policy is not None:
            caps["prefix_caching_coordinator_policy"] = args.policy  # sent as given
        self._cache = StandInCache(caps["total_kv_blocks"], caps["kv_cache_block_size"])
        self._rng = random.Random(args.seed)
        if args.ready is not None:
            self._ready = args.ready
        elif args.ready_shape == "nested" or args.role is not None:
            self._ready = nested_ready(endpoint, args.role or "aggregated")
        else:
            self._ready = endpoint
        if args.version is not None and isinstance(self._ready, dict):
            self._ready = {**self._ready, "version": args.version}

    def send(self, kind: str, payload: object) -> None:
        with self._lock:
            self._sock.send(self._pack([kind, payload]))

    def serve(self) -> None:
        """Serve one chat prompt: its KV events go out."""
        self.serve_tokens(chat_prompt(self._rng, self._cache.block_size))

    def serve_tokens(self, tokens: Sequence[int]) -> None:
        """Cache a prompt the engine serves: its KV events go out."""
        with self._lock:
            for kind, payload in self._cache.serve(tokens):
                self.send(kind, payload)
            if self._args.truth:
                _write_truth(self._args.truth, self._cache)

    def set_talking(self, talking: bool) -> None:
        """Talk (frames, answers) or go silent, as a hung engine."""
        if talking:
            self._talking.set()
        else:
            self._talking.clear()
        if self._coordinator is not None:
            self._coordinator.set_talking(talking)

    def run(self) -> signal.Signals:
        """Talk until a stop signal; the signal."""
        args = self._args
        self.send("ready", self._ready)
        if self._coordinator is not None:
            self._coordinator.start(self.serve_tokens)
        for _ in range(args.kv_events):
            self.serve()
        period = 1 / args.kv_rate if args.kv_rate > 0 else 3600.0
        silent = False
        next_prompt = time.monotonic() + period
        next_progress = time.monotonic() if not args.no_progress else math.inf
        while True:
            wait = max(0.0, min(next_progress, next_prompt) - time.monotonic())
            received = signal.sigtimedwait(_STOP | _TALK, wait)
            if received is not None and received.si_signo in _STOP:
                return signal.Signals(received.si_signo)
            if received is not None:
                silent = received.si_signo == signal.SIGUSR1
                self.set_talking(not silent)
                continue
            now = time.monotonic()
            if now >= next_prompt:
                if not silent:
                    self.serve()
                next_prompt = now + period
            if now >= next_progress:
                if not silent:
                    self.send("progress", {})
                next_progress = now + _PROGRESS_EVERY


if __name__ == "__main__":
    sys.exit(main())
