"""What only the in-memory etcd has (faults, compaction, its sweeper), and the package's
own registration and watch logic running on it in milliseconds instead of seconds.

The port contract itself is tests/test_port_conformance.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from discovery import (
    ClosedError,
    EndpointEvent,
    EtcdUnavailableError,
    Metrics,
    RegistrationState,
    RoutingSnapshot,
    RoutingTable,
    Settings,
    register_engine,
    watch_table,
)
from discovery._etcd.port import Compacted, NoLeaderError, WatchStream
from discovery.testing.memory import MemoryEtcd, MemoryPort

from .helpers import make_endpoint, wait_for
from .test_port_conformance import Reader

QUIET = 30.0


@pytest.fixture
def ports(memory_etcd: MemoryEtcd) -> Iterator[list[MemoryPort]]:
    """Two clients of ``etcd`` (more with ``ports.append``), closed after the test."""
    opened = [MemoryPort(memory_etcd), MemoryPort(memory_etcd)]
    yield opened
    for port in opened:
        port.close()


SETTINGS = Settings(namespace="memory")


# -- what only the memory port has ------------------------------------------------------


def test_an_outage_fails_every_call_and_stream_of_every_port_until_restored(
    memory_etcd: MemoryEtcd, ports: list[MemoryPort]
) -> None:
    one, two = ports
    one.replace("/k", b"1", 0)
    watch = Reader(
        one.open_watch("/", memory_etcd.revision, heartbeat=QUIET, progress_interval=QUIET)
    )
    watch.next()  # created
    keepalive = Reader(two.open_keepalive())
    with memory_etcd.outage():
        assert isinstance(watch.error(), EtcdUnavailableError)
        assert isinstance(keepalive.error(), EtcdUnavailableError)
        for call in (
            lambda: one.get("/k"),
            lambda: two.grant(5),
            lambda: two.open_watch("/", 1, heartbeat=QUIET, progress_interval=QUIET),
            two.open_keepalive,
        ):
            with pytest.raises(EtcdUnavailableError):
                call()
    kv = two.get("/k")
    assert kv is not None and kv.value == b"1"
    watch = Reader(
        one.open_watch("/", memory_etcd.revision + 1, heartbeat=QUIET, progress_interval=1)
    )
    watch.next()
    memory_etcd.outage(no_leader=True)  # a member without a leader: streams say so
    assert isinstance(watch.error(), NoLeaderError)
    with pytest.raises(NoLeaderError):
        one.open_keepalive()
    with pytest.raises(EtcdUnavailableError) as refused:
        one.get("/k")
    assert not isinstance(refused.value, NoLeaderError)
    memory_etcd.restore()
    assert one.get("/k") == kv


def test_compaction_forgets_the_history_before_its_revision(
    memory_etcd: MemoryEtcd, ports: list[MemoryPort]
) -> None:
    port = ports[0]
    assert memory_etcd.revision == 1  # a new etcd is at revision 1
    for value in (b"1", b"2", b"3"):
        port.replace("/k", value, 0)
    assert memory_etcd.revision == 4
    with pytest.raises(ValueError, match="future"):
        memory_etcd.compact(5)
    memory_etcd.compact(3)
    memory_etcd.compact(2)  # older than the last compaction: nothing to do
    stream = port.open_watch("/", 2, heartbeat=QUIET, progress_interval=QUIET)
    error = Reader(stream).error()
    assert isinstance(error, Compacted) and error.compact_revision == 3
    responses = Reader(port.open_watch("/", 3, heartbeat=QUIET, progress_interval=QUIET)).until(4)
    assert [e.kv.value for r in responses for e in r.events] == [b"2", b"3"]
    assert port.list_prefix("/") == (4, [port.get("/k")])


def _sweepers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "discovery-memory-leases"}


def test_closing_the_etcd_stops_its_lease_sweeper_and_ends_every_stream() -> None:
    before = _sweepers()
    etcd = MemoryEtcd()
    port = MemoryPort(etcd)
    port.replace("/k", b"1", 0)
    assert _sweepers() == before  # no thread until a lease needs one
    port.grant(60)
    (sweeper,) = _sweepers() - before
    keepalive = Reader(port.open_keepalive())
    etcd.close()
    assert not sweeper.is_alive()
    assert isinstance(keepalive.error(), ClosedError)
    with pytest.raises(ClosedError):
        port.grant(60)
    # A port without an etcd of its own has a private one, closed with it.
    alone = MemoryPort()
    alone.grant(60)
    (sweeper,) = _sweepers() - before
    alone.close()
    assert not sweeper.is_alive()


def test_many_ports_share_one_etcd(memory_etcd: MemoryEtcd, ports: list[MemoryPort]) -> None:
    ports.extend(MemoryPort(memory_etcd) for _ in range(8))
    start = memory_etcd.revision + 1
    watch = Reader(ports[0].open_watch("/p/", start, heartbeat=QUIET, progress_interval=QUIET))
    watch.next()
    for index, port in enumerate(ports):
        assert port.create(f"/p/{index}", b"x", port.grant(60)).revision == start + index
    ports[1].close()  # one client going away ends its streams, not the others'
    seen = [e.kv.key for r in watch.until(start + len(ports) - 1) for e in r.events]
    assert seen == [f"/p/{index}".encode() for index in range(len(ports))]
    assert len(ports[-1].list_prefix("/p/")[1]) == len(ports)


# -- the package's logic on the memory port ---------------------------------------------


class Events:
    """Every (type, engine id) a routing table reports, in order, and in its batches."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.seen: list[tuple[str, str]] = []
        self.batches: list[list[tuple[str, str]]] = []

    def __call__(self, batch: tuple[EndpointEvent, ...], snapshot: RoutingSnapshot) -> None:
        with self._cond:
            self.batches.append([(event.type.value, event.engine_id) for event in batch])
            self.seen.extend(self.batches[-1])
            self._cond.notify_all()

    def wait(self, *expected: tuple[str, str], timeout: float = 5.0) -> None:
        """Until ``expected`` are the last events seen."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.seen[-len(expected) :] == [*expected], timeout):
                raise AssertionError(f"saw {self.seen}, not ending with {list(expected)}")


def _table(port: MemoryPort, events: Events, metrics: Metrics | None = None) -> RoutingTable:
    """A table on ``port`` reporting to ``events``; ``with`` starts it."""
    table = watch_table(
        SETTINGS, connection=port, heartbeat=QUIET, progress_interval=QUIET, metrics=metrics
    )
    table.subscribe(events)
    return table


def test_a_registration_is_seen_by_a_table_in_milliseconds(ports: list[MemoryPort]) -> None:
    registrar, watcher = ports
    events = Events()
    started = time.monotonic()
    with _table(watcher, events) as table:
        registration = register_engine(
            make_endpoint(), engine_id="e0", connection=registrar, settings=SETTINGS
        )
        events.wait(("added", "e0"))
        record = table.get("e0")
        assert record is not None and record.endpoint == make_endpoint()
        registration.close()  # marks it stopping, then revokes the lease
        events.wait(("added", "e0"), ("updated", "e0"), ("removed", "e0"))
    assert time.monotonic() - started < 1.0


def test_a_lease_revoked_from_outside_is_replaced_and_the_record_written_again(
    ports: list[MemoryPort],
) -> None:
    registrar, other = ports
    events = Events()
    with (
        _table(other, events),
        register_engine(
            make_endpoint(), engine_id="e0", connection=registrar, settings=SETTINGS
        ) as registration,
    ):
        events.wait(("added", "e0"))
        old = registration.lease_id
        assert old is not None
        other.revoke(old)
        events.wait(("added", "e0"), ("removed", "e0"), ("added", "e0"))
        kv = other.get(registration.key)
        assert kv is not None and kv.lease == registration.lease_id != old
        assert registration.state is RegistrationState.REGISTERED


def test_an_outage_longer_than_the_ttl_loses_the_lease_and_the_record_comes_back(
    memory_etcd: MemoryEtcd, ports: list[MemoryPort]
) -> None:
    registrar, other = ports
    events = Events()
    with (
        _table(other, events),
        register_engine(
            make_endpoint(), engine_id="e0", ttl=2, connection=registrar, settings=SETTINGS
        ) as registration,
    ):
        events.wait(("added", "e0"))
        old, before = registration.lease_id, memory_etcd.revision
        with memory_etcd.outage():
            # The cluster keeps time: the lease expires, deleting the record (a revision).
            wait_for(lambda: memory_etcd.revision > before, timeout=5, message="the lease's expiry")
            assert registration.wait_for_state(RegistrationState.LOST, timeout=5)
        assert registration.wait_for_state(RegistrationState.REGISTERED, timeout=5)
        events.wait(("added", "e0"), ("removed", "e0"), ("added", "e0"))
        kv = other.get(registration.key)
        assert kv is not None and kv.lease == registration.lease_id != old


class _Unwatchable(MemoryPort):
    """A client whose watches can be cut (``cut()``) and refused until ``heal()``."""

    def __init__(self, etcd: MemoryEtcd) -> None:
        super().__init__(etcd)
        self._cut = threading.Event()
        self._streams: list[WatchStream] = []

    def open_watch(
        self, prefix: str, start_revision: int, *, heartbeat: float, progress_interval: float
    ) -> WatchStream:
        if self._cut.is_set():
            raise EtcdUnavailableError("watches cut by the test", "cut")
        stream = super().open_watch(
            prefix, start_revision, heartbeat=heartbeat, progress_interval=progress_interval
        )
        self._streams.append(stream)
        return stream

    def cut(self) -> None:
        self._cut.set()
        for stream in self._streams:
            stream.close()

    def heal(self) -> None:
        self._cut.clear()


def test_a_compaction_while_the_watch_is_down_relists_the_exact_difference(
    memory_etcd: MemoryEtcd, ports: list[MemoryPort]
) -> None:
    registrar = ports[0]
    watcher = _Unwatchable(memory_etcd)
    ports.append(watcher)
    events = Events()
    registry = CollectorRegistry()

    def metric(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"prefix": SETTINGS.keyspace.prefix, **labels})

    with (
        _table(watcher, events, Metrics(registry)) as table,
        register_engine(
            make_endpoint(0), engine_id="e0", connection=registrar, settings=SETTINGS
        ) as e0,
        register_engine(
            make_endpoint(1), engine_id="e1", connection=registrar, settings=SETTINGS
        ) as e1,
    ):
        wait_for(lambda: set(table.snapshot()) == {"e0", "e1"}, message="both engines")
        watcher.cut()
        wait_for(
            lambda: (
                metric("discovery_watcher_connected") == 0
                and metric("discovery_watcher_reconnects_total", cause="stream_error")
            ),
            message="the watch down, and said so",
        )
        e1.close()
        e0.set_status("draining")
        wait_for(lambda: b"draining" in registrar.get(e0.key).value, message="e0 draining")
        # Came and went while the watch was down: nothing to report.
        register_engine(
            make_endpoint(3), engine_id="e3", connection=registrar, settings=SETTINGS
        ).close()
        with register_engine(
            make_endpoint(2), engine_id="e2", connection=registrar, settings=SETTINGS
        ):
            memory_etcd.compact(memory_etcd.revision)
            seen = len(events.seen)
            watcher.heal()
            wait_for(lambda: table.watcher.health().relists == 1, message="a relist")
            wait_for(lambda: len(events.seen) == seen + 3, message="the difference")
            # The exact difference, in one batch (one atomic apply).
            assert sorted(events.batches[-1]) == [
                ("added", "e2"),
                ("removed", "e1"),
                ("updated", "e0"),
            ]
            record = table.get("e0")
            assert record is not None and record.status.value == "draining"
            assert set(table.snapshot()) == {"e0", "e2"}
            wait_for(
                lambda: (
                    (
                        metric("discovery_watcher_relists_total", cause="compaction"),
                        metric("discovery_watcher_reconnects_total", cause="compaction"),
                        metric("discovery_watcher_events_total", type="added"),  # e0, e1, e2
                        metric("discovery_watcher_connected"),
                    )
                    == (1, 1, 3, 1)
                ),
                message="the metrics: one relist after one compaction, 3 added, connected",
            )
