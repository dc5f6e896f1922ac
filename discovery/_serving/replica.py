"""One replica of ``discovery serve``: Megatron's own endpoints over a ``FleetInferenceClient``.

``python -m discovery._serving.replica OPTIONS FD PARENT`` (``serve_fleet`` starts each): what
Megatron's ``_run_text_gen_server`` (main d98e8a64, ``text_generation_server.py``) does in
each of its replica processes, its client being the fleet's: a Quart app with Megatron's
blueprints (``completions``, ``chat_completions``, ``health``, ``profile``) and
``app.config`` as Megatron sets it (``client``, ``tokenizer``, ``parsers``, ``verbose``,
``chat_template``), served by hypercorn on the listening socket ``FD`` that every replica
shares, with Megatron's hypercorn settings. Megatron's tokenizer is built by its own
``MegatronTokenizer.from_pretrained``.

Two answers come before Megatron's endpoints (``before_request``): ``/health`` says how
many engines are ready (200 with at least one, else 503 with ``Retry-After``), keeping
Megatron's ``status`` / ``ready`` keys; and a generation request (completions, chat
completions) finding no engine ready, and none that may be soon (paused, starting, stalled:
those hold it), is answered 503 with ``Retry-After`` and an OpenAI-shaped error, where
Megatron's endpoint would answer 500. SIGTERM stops taking connections; requests in flight
finish within ``grace`` seconds (hypercorn's graceful shutdown), then the client stops; a
replica whose parent is gone (SIGKILLed) stops likewise within a second.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from discovery._routing.inference_client import FleetInferenceClient
from discovery._serving.options import MEGATRON_SERVER, ServeOptions

__all__ = ["main"]

log = logging.getLogger(__name__)

GENERATION = frozenset(
    {"/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions"}
)
HEALTH = frozenset({"/health", "/v1/health"})


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; 0 once stopped."""
    args = sys.argv[1:] if argv is None else list(argv)
    options, fd, parent = ServeOptions.from_json(args[0]), int(args[1]), int(args[2])
    logging.basicConfig(
        level=logging.INFO if options.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(_serve(options, fd, parent))
    return 0


async def _serve(options: ServeOptions, fd: int, parent: int) -> None:
    from hypercorn.asyncio import serve  # noqa: PLC0415 - the serve extra
    from hypercorn.config import Config  # noqa: PLC0415
    from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415 - the user's
    from quart import Quart  # noqa: PLC0415

    endpoints = importlib.import_module(f"{MEGATRON_SERVER}.endpoints")
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=options.tokenizer, metadata_path={"library": options.tokenizer_library}
    )
    client = FleetInferenceClient(options.fleet)
    client.start()
    try:
        app = Quart("discovery.serve")
        app.config["MAX_CONTENT_LENGTH"] = 2**30  # Megatron's: large prompts
        app.config["client"] = client
        app.config["tokenizer"] = tokenizer
        app.config["parsers"] = list(options.parsers)
        app.config["verbose"] = options.verbose
        app.config["chat_template"] = options.chat_template
        app.before_request(_gate(client, options.retry_after))
        for blueprint in endpoints.__all__:
            app.register_blueprint(blueprint)
        config = Config()
        config.keep_alive_timeout = 30.0  # Megatron's three settings
        config.backlog = 2**14
        config.h2_max_concurrent_streams = 2**14
        config.bind = [f"fd://{fd}"]
        config.graceful_timeout = options.grace
        config.accesslog = "-" if options.verbose else None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        orphaned = asyncio.ensure_future(_parent_gone(stop, parent))
        try:
            await serve(app, config, shutdown_trigger=stop.wait)
        finally:
            orphaned.cancel()
    finally:
        client.stop()


async def _parent_gone(stop: asyncio.Event, parent: int) -> None:
    """Stop as SIGTERM does once ``parent`` is gone (SIGKILLed: it could not pass it on)."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("discovery serve's parent process is gone: stopping")
    stop.set()


def _gate(client: FleetInferenceClient, retry_after: int) -> Any:
    """The answers given before Megatron's endpoints: health, and 503 with no engine."""
    from quart import Response, request  # noqa: PLC0415

    def unavailable(body: dict[str, Any]) -> Response:
        return Response(
            json.dumps(body),
            status=503,
            headers={"Retry-After": str(retry_after)},
            content_type="application/json",
        )

    async def gate() -> Response | None:
        path = request.path
        if path in HEALTH:
            counts = client.fleet.statuses()
            ready = counts.get("ready", 0)
            body = {
                "status": "ok" if ready else "unavailable",
                "service": "Megatron Inference Server",
                "ready": bool(ready),
                "engines": {"ready": ready, "total": sum(counts.values()), **counts},
            }
            if ready:
                return Response(json.dumps(body), status=200, content_type="application/json")
            return unavailable(body)
        if path in GENERATION and not client.fleet.statuses().get("ready"):
            if client.fleet.may_be_ready():  # a refit: the fleet client holds the request
                return None
            message = "no engine of the fleet is ready: retry later"
            return unavailable(
                {"error": {"message": message, "type": "service_unavailable", "code": 503}}
            )
        return None

    return gate


if __name__ == "__main__":
    sys.exit(main())
