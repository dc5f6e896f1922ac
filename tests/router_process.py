"""A router process for tests/test_alerts.py: what a real router embeds, with its metrics.

    python -m tests.router_process --metrics-port PORT --fail ENGINE --hold ENGINE \
        [--selector KEY=VALUE ...] [--unconfirmed ENGINE]

Settings come from ``DISCOVERY_*``. It serves a ``Metrics`` registry with
prometheus_client's HTTP server on 127.0.0.1, follows the table (``watch_table``), the
engines' state relays (``EngineStates``, fed this router's in-flight counts) and routes
with a ``Router``: once both engines are in the table it fails requests of ``--fail``
until that engine is fenced (for 600 s), holds one request on ``--hold`` (in flight), and
makes one pick no engine can take and one through a split whose canary group has no engine
(its share goes to the others, counted). With ``--unconfirmed``, a second router on a table fed
by hand (the same registry) loses that engine's ready record unannounced, alone in its
table: a mass lease loss it keeps the engine through, unconfirmed, for 600 s. Then it
prints ``routed`` and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from prometheus_client import CollectorRegistry, start_http_server

from discovery import (
    EngineRecord,
    EngineStates,
    EventType,
    Metrics,
    NoEngineAvailableError,
    PickHandle,
    Router,
    RoutingTable,
    Split,
    StopSignals,
    watch_table,
)
from discovery._reads.store import Change, EngineStore

from .helpers import make_endpoint


def unconfirmed(engine_id: str, metrics: Metrics) -> Router:
    """A router whose only engine's record went unannounced: it keeps it, unconfirmed."""
    table = RoutingTable(EngineStore())
    router = Router(table, metrics=metrics, protect_grace=600)
    record = EngineRecord(engine_id, make_endpoint())
    for revision, kind in enumerate((EventType.ADDED, EventType.REMOVED), start=1):
        kept = None if kind is EventType.REMOVED else record
        table.store.apply([Change(f"/hand/{engine_id}", engine_id, revision, kept)])
        router.health()  # seen at each revision
    assert engine_id in router.health().unconfirmed
    return router


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--fail", required=True)
    parser.add_argument("--hold", required=True)
    parser.add_argument("--selector", action="append", default=[])
    parser.add_argument("--unconfirmed")
    args = parser.parse_args()
    selector = dict(pair.split("=", 1) for pair in args.selector)
    stop = StopSignals()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    # Metrics observe routers weakly: kept alive until the end.
    kept = unconfirmed(args.unconfirmed, metrics) if args.unconfirmed else None
    with watch_table(selector=selector, metrics=metrics) as table:
        router = Router(
            table,
            policy="round_robin",
            metrics=metrics,
            fence_after=1,
            fence_seconds=600,
            fence_max_seconds=600,
        )
        with EngineStates(table, metrics=metrics, load=router.in_flight):
            table.wait_until(
                lambda snap: all(
                    e in snap and snap[e].status == "ready" for e in (args.fail, args.hold)
                ),
                timeout=60,
            )
            held: list[PickHandle] = []
            while args.fail not in router.health().fenced or not held:
                handle = router.pick(list(range(64)), max_tokens=16)
                if handle.engine_id == args.fail:
                    handle.release(failed=True)
                elif not held:
                    held.append(handle)
                else:
                    handle.release()
            with contextlib.suppress(NoEngineAvailableError):
                router.pick([1], max_tokens=10**9)
            router.pick(
                [1], max_tokens=16, split=Split({"track=canary": 5, "model=demo": 95})
            ).release()
            print("routed", flush=True)
            while not stop.wait(None):
                pass
            for handle in held:
                handle.release()
    del kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
