"""The commands: register, launch, deregister, list, watch, top, and the status ones.

The status ones are ``drain``, ``undrain``, ``pause`` and ``resume``. Each command is a thin
layer over the public API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator

from discovery import (
    Connection,
    EndpointEvent,
    EndpointWatcher,
    EngineEventReceiver,
    EngineRecord,
    EngineStates,
    ListedEngine,
    Metrics,
    RecordDecodeError,
    RegistrationState,
    Router,
    Selector,
    ServeOptions,
    Settings,
    Split,
    StopSignals,
    deregister,
    drain,
    drain_and_close,
    launch,
    list_engines,
    pause,
    record_schema,
    register_engine,
    resume,
    serve_fleet,
    undrain,
    watch_table,
)

from ._args import (
    UsageError,
    endpoint_from_args,
    handoff_from_args,
    metrics_from_args,
    parse_labels,
    selector_from_args,
    settings_from_args,
    split_from_args,
)
from ._top import HEADERS as TOP_HEADERS
from ._top import cells as top_cells
from ._top import engine_rows, run_top, split_line

log = logging.getLogger("discovery.cli")

EXIT_FAILURE = 1


# -- register / deregister ----------------------------------------------------------------


def cmd_register(args: argparse.Namespace) -> int:
    """Register an engine and keep it registered until SIGTERM/SIGINT."""
    endpoint, meta = endpoint_from_args(args)
    labels = {**(meta.get("labels") or {}), **parse_labels(args.label)}
    engine_id = args.engine_id or meta.get("engine_id")
    settings = settings_from_args(args)
    stop = StopSignals()
    metrics = metrics_from_args(args)
    registration = register_engine(
        endpoint,
        metrics=metrics,
        engine_id=engine_id,
        ttl=args.ttl,
        labels=labels,
        weight_version=args.weight_version,
        **handoff_from_args(args),
        settings=settings,
        replace=args.replace,
    )
    log.info(
        "registered %s at %s (lease %016x, ttl %d s)",
        registration.engine_id,
        registration.key,
        registration.lease_id,
        registration.ttl,
    )

    def on_state(state: RegistrationState) -> None:
        if state is RegistrationState.REGISTERED:
            log.info("%s registered again after losing its lease", registration.engine_id)
        elif state is RegistrationState.CLOSED:
            stop.note()  # a drain's deadline passed (an operator's `discovery drain`)

    registration.subscribe(on_state)
    while registration.state is not RegistrationState.CLOSED and not stop.wait(None):
        pass
    if registration.state is RegistrationState.CLOSED:
        registration.close()  # waits for the revoke the drain deadline started
        log.info("%s drained and deregistered; exiting", registration.engine_id)
        return 0
    if args.drain_timeout > 0:
        log.info("%s: draining for %g s", registration.engine_id, args.drain_timeout)
    drain_and_close(registration, args.drain_timeout, stop.signalled_within)  # 2nd: at once
    log.info("deregistered %s; exiting", registration.engine_id)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Start an engine command and register it from its ready message (``_engine/launch.py``)."""
    try:
        EngineEventReceiver.require_libraries()  # the launch extra
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    command = args.engine_command
    given = {"stall_timeout": args.stall_timeout} if args.stall_timeout is not None else {}
    return launch(
        command[1:] if command[:1] == ["--"] else command,
        event_host=args.event_host,
        event_address=args.event_address,
        state_address=True if args.state_address is None else args.state_address,
        stall_action=args.stall_action,
        **given,
        ready_timeout=args.ready_timeout,
        stop_timeout=args.stop_timeout,
        drain_timeout=args.drain_timeout,
        engine_id=args.engine_id,
        ttl=args.ttl,
        labels=parse_labels(args.label),
        weight_version=args.weight_version,
        **handoff_from_args(args),
        settings=settings_from_args(args),
        replace=args.replace,
        metrics=metrics_from_args(args),
    )


def cmd_deregister(args: argparse.Namespace) -> int:
    """Remove an engine's record by id."""
    settings = settings_from_args(args)
    key = settings.keyspace.key(args.engine_id)
    lease = deregister(args.engine_id, settings)
    if lease is None:
        print(f"no engine {args.engine_id!r} at {key}", file=sys.stderr)
        return EXIT_FAILURE
    how = (
        f"revoked lease {lease:016x}"
        if lease
        else "deleted the key (it had no lease, or shares its lease with other engines)"
    )
    print(f"removed engine {args.engine_id!r} at {key}: {how}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Mark an engine draining (routers stop picking it); revoked at the deadline, if any."""
    settings = settings_from_args(args)
    record = drain(args.engine_id, args.timeout, settings)
    return _print_status(args.engine_id, settings.keyspace.key(args.engine_id), record)


def cmd_undrain(args: argparse.Namespace) -> int:
    """Put a draining engine back to ready."""
    settings = settings_from_args(args)
    record = undrain(args.engine_id, settings)
    return _print_status(args.engine_id, settings.keyspace.key(args.engine_id), record)


def cmd_pause(args: argparse.Namespace) -> int:
    """Mark an engine paused (routers stop picking it; it keeps its lease and id)."""
    settings = settings_from_args(args)
    record = pause(args.engine_id, settings)
    return _print_status(args.engine_id, settings.keyspace.key(args.engine_id), record)


def cmd_resume(args: argparse.Namespace) -> int:
    """Put a paused engine back to ready, on a new weight version if given (one write)."""
    settings = settings_from_args(args)
    record = resume(args.engine_id, args.weight_version, settings, force=args.force)
    return _print_status(args.engine_id, settings.keyspace.key(args.engine_id), record)


def _print_status(engine_id: str, key: str, record: EngineRecord | None) -> int:
    if record is None:
        print(f"no engine {engine_id!r} at {key}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"engine {engine_id!r} is {_cells(record, lead=True)}")
    return 0


def _cells(record: EngineRecord, *, lead: bool) -> str:
    """The record's metadata cells (its declared columns), lead or trailing ones."""
    return " ".join(cell for cell in record.column_cells(lead=lead) if cell != "-")


# -- list / watch ---------------------------------------------------------------------------


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema of the stored value (docs/record.schema.json holds the same)."""
    print(json.dumps(record_schema(), indent=2))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the live engines as a table (``wide``: reasons, relayed state) or as JSON."""
    settings = settings_from_args(args)
    selector = selector_from_args(args)
    split = split_from_args(args)
    listing = list_engines(settings, selector=selector, lease_ttls=True)
    if args.format == "json":
        # The tables show refused values as rows; JSON's reader is a tool: warn its user too.
        for skipped in listing.skipped:
            print(f"warning: skipping {skipped}", file=sys.stderr)
        out = [
            {
                **engine.record.to_value(),
                "key": engine.key,
                "lease": engine.lease_id,
                "ttl": engine.ttl,
            }
            for engine in listing.engines
        ]
        # A list of their own: tools reading "engines" stay as they were.
        refused = [{"key": s.key, "reason": s.reason} for s in listing.skipped]
        print(
            json.dumps({"revision": listing.revision, "engines": out, "refused": refused}, indent=2)
        )
        return 0
    if args.format == "wide":
        with _reported(listing.skipped):
            cells, shares = _relayed(settings, selector, listing.engines, split)
        print(_table(listing.engines, cells) + _refused(listing.skipped))
        if shares:
            print(shares)
        return 0
    print(_table(listing.engines) + _refused(listing.skipped))
    return 0


def _refused(skipped: tuple[RecordDecodeError, ...]) -> str:
    """The refused values' rows (key as etcdctl shows it, and why), after the engines'."""
    if not skipped:
        return ""
    width = max(len("REFUSED KEY"), *(len(s.key) for s in skipped))
    rows = [f"{'REFUSED KEY':<{width}}  WHY", *(f"{s.key:<{width}}  {s.reason}" for s in skipped)]
    return "\n" + "\n".join(rows) + f"\n({len(skipped)} refused)"


@contextlib.contextmanager
def _reported(skipped: tuple[RecordDecodeError, ...]) -> Iterator[None]:
    """Without the watcher's warnings of the values already reported as skipped.

    ``-o wide`` lists the engines once more through a watcher, which warns of each bad
    value again: each warning is printed once.
    """
    said = {str(exc) for exc in skipped}

    def fresh(record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and any(str(a) in said for a in record.args))

    watcher_log = logging.getLogger(EndpointWatcher.__module__)  # where it logs skips
    watcher_log.addFilter(fresh)
    try:
        yield
    finally:
        watcher_log.removeFilter(fresh)


# How long `list -o wide` waits for the engines' state relays to answer.
WIDE_WAIT = 3.0
LOAD = TOP_HEADERS.index("LOAD")  # top's LOAD and CACHED cells, side by side


def _relayed(
    settings: Settings,
    selector: Selector,
    engines: tuple[ListedEngine, ...],
    split: Split | None = None,
) -> tuple[dict[str, tuple[str, ...]], str]:
    """Engine id -> (WHY, LOAD, CACHED, STATE) cells, and the split's line (or "").

    Why it is or is not a candidate (a router's filters, on the table as it is now), and
    what its state relay says; with a split, each group's share and candidates.
    """
    relaying = [e.engine_id for e in engines if e.record.state_address]
    cells: dict[str, tuple[str, ...]] = {e.engine_id: ("-", "-", "-", "-") for e in engines}
    with (
        Connection(settings) as connection,
        watch_table(settings, selector=selector, connection=connection) as table,
        EngineStates(table) as states,
    ):
        # Passive: never picks, reports nothing.
        router = Router(table, selector=selector, split=split)
        present = [e for e in relaying if e in table]
        if present:
            with contextlib.suppress(TimeoutError):  # unsynced ones show as syncing
                states.wait_synced(present, timeout=WIDE_WAIT)
        snapshot = table.snapshot()
        for row in engine_rows(snapshot, {}, states, router):
            if row.engine_id in cells:
                load, cached = top_cells(row)[LOAD : LOAD + 2]
                relay = snapshot[row.engine_id].state_address or "-"
                cells[row.engine_id] = (row.why, load, cached, relay)
        shares = split_line(router)
    return cells, shares


def _table(
    engines: tuple[ListedEngine, ...], relayed: dict[str, tuple[str, ...]] | None = None
) -> str:
    # The record's own columns come from its declaration: lead ones after the id, the
    # rest at the end; the endpoint's (Megatron's fields) and the lease's in between; with
    # ``relayed`` (-o wide), what the engine's state relay says before the trailing ones.
    header = (
        "ENGINE", *EngineRecord.column_headers(lead=True),
        "ADDRESS", "CTX", "BLOCK", "KV BLOCKS", "SEQS", "POLICY", "TTL",
        *(("WHY", "LOAD", "CACHED", "STATE RELAY") if relayed is not None else ()),
        *EngineRecord.column_headers(lead=False),
    )  # fmt: skip
    lines = [header]
    for engine in engines:
        caps = engine.endpoint.capabilities
        policy = caps.prefix_caching_coordinator_policy
        lines.append(
            (
                engine.engine_id,
                *engine.record.column_cells(lead=True),
                engine.endpoint.coordinator_address,
                str(caps.context_length),
                str(caps.kv_cache_block_size),
                str(caps.total_kv_blocks),
                str(caps.max_num_seqs),
                str(policy) if policy else ("-" if caps.enable_prefix_caching else "off"),
                "-" if engine.ttl is None else f"{engine.ttl}s",
                *(relayed[engine.engine_id] if relayed is not None else ()),
                *engine.record.column_cells(lead=False),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines
    ]
    return "\n".join(t.rstrip() for t in text) + f"\n({len(engines)} engines)"


def format_event(event: EndpointEvent, fmt: str) -> str:
    """One output line for ``discovery watch``."""
    if fmt == "jsonl":
        return json.dumps(event.to_dict(), separators=(",", ":"))
    trailing = _cells(event.record, lead=False)
    return (
        f"{event.type.value:<8} {event.engine_id} {event.endpoint.coordinator_address} "
        f"{_cells(event.record, lead=True)} rev={event.revision}"
        f"{' ' + trailing if trailing else ''}"
    )


def cmd_watch(args: argparse.Namespace) -> int:
    """Print one line per event until SIGTERM/SIGINT."""
    settings = settings_from_args(args)
    selector = selector_from_args(args)
    stop = StopSignals()
    return _print_events(settings, selector, args.format, stop, metrics_from_args(args))


def _print_events(
    settings: Settings,
    selector: Selector,
    fmt: str,
    stop: StopSignals,
    metrics: Metrics | None = None,
) -> int:
    watcher = EndpointWatcher(settings, selector=selector, metrics=metrics)
    watcher.start()

    def emit(event: EndpointEvent) -> None:
        print(format_event(event, fmt), flush=True)

    watcher.subscribe(emit)
    while not stop.wait(None):
        pass
    watcher.stop()
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """The live table in the terminal until ``q`` or SIGTERM/SIGINT (``_top.py``).

    Without a terminal, one line per event as ``watch`` prints them.
    """
    settings = settings_from_args(args)
    selector = selector_from_args(args)
    split = split_from_args(args)
    stop = StopSignals()
    if not sys.stdout.isatty():
        return _print_events(settings, selector, "text", stop)
    return run_top(settings, selector, args.sort, stop, split)


def cmd_serve(args: argparse.Namespace) -> int:
    """Megatron's OpenAI-compatible server over the fleet, until SIGTERM/SIGINT."""
    chat_template = args.chat_template
    if chat_template is not None and os.path.isfile(chat_template):  # as Megatron reads it
        with open(chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    options = ServeOptions(
        fleet=args.fleet,
        tokenizer=args.tokenizer,
        tokenizer_library=args.tokenizer_library,
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        parsers=tuple(args.parsers),
        chat_template=chat_template,
        verbose=args.verbose,
        grace=args.grace,
        retry_after=args.retry_after,
    )
    stop = StopSignals()
    return serve_fleet(
        options, lambda timeout: bool(stop.wait(timeout)), metrics=metrics_from_args(args)
    )
