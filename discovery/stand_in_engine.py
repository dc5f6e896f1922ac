r"""A stand-in for Megatron's rank zero, for the demo and the tests: no model, same frames.

    python -m discovery.stand_in_engine --dynamo-parent-event-address tcp://HOST:PORT \
        [--ready JSON] [--kv-events N] [--exit-status N]

It does on the wire exactly what Megatron's ``EngineEventReporter`` does
(``megatron/inference/integrations/dynamo/telemetry.py``): a PUSH socket with LINGER 0
connected to the parent's address, frames ``msgpack.packb([kind, payload],
use_bin_type=True)``: first ``"ready"`` with ``InferenceEngineEndpoint.to_dict()`` (or the
``--ready`` JSON as given, valid or not), then ``--kv-events`` KV-cache events (``"stored"``
and ``"removed"``). Then it runs until SIGTERM or SIGINT and exits with ``--exit-status``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ._endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
)

_BLOCK_TOKENS = 256


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


def kv_events(count: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` KV-cache events of Megatron's kinds: blocks stored, then removed."""
    events: list[tuple[str, dict[str, Any]]] = []
    for n in range(count):
        block_hashes = [0x5EED0000 + n]
        if n % 2 == 0:
            events.append(
                ("stored", {"block_hashes": block_hashes, "token_ids": list(range(_BLOCK_TOKENS))})
            )
        else:
            events.append(("removed", {"block_hashes": [0x5EED0000 + n - 1]}))
    return events


def main(argv: Sequence[str] | None = None) -> int:
    """Send the frames, then wait for SIGTERM/SIGINT; returns ``--exit-status``."""
    import msgpack  # noqa: PLC0415 - the launch extra; the demo imports default_endpoint
    import zmq  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m discovery.stand_in_engine")
    parser.add_argument("--dynamo-parent-event-address", required=True)
    parser.add_argument("--ready", type=json.loads, help="ready payload as JSON")
    parser.add_argument("--kv-events", type=int, default=4)
    parser.add_argument("--exit-status", type=int, default=0)
    args = parser.parse_args(argv)
    stop = {signal.SIGTERM, signal.SIGINT}
    # Blocked before ZeroMQ starts its threads, so sigwait() below gets them.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.dynamo_parent_event_address)
    ready = default_endpoint() if args.ready is None else args.ready
    for kind, payload in [("ready", ready), *kv_events(args.kv_events)]:
        sock.send(msgpack.packb([kind, payload], use_bin_type=True))
    received = signal.Signals(signal.sigwait(stop))
    print(f"stand-in engine: {received.name}, exiting {args.exit_status}", file=sys.stderr)
    sock.close()
    context.term()
    return int(args.exit_status)


if __name__ == "__main__":
    sys.exit(main())
