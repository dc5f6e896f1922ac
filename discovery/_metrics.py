"""Prometheus metrics, only when asked for: ``Metrics(registry)`` and pass it along.

Nothing is registered anywhere unless a caller builds a ``Metrics`` on a
``prometheus_client.CollectorRegistry`` and hands it to ``register_engine``,
``EndpointWatcher``, ``RoutingTable``, ``Router`` or ``Connection`` (``metrics=``).
Components call the hooks of ``MetricsHooks``, a typed protocol (a misspelled hook is a
type error); given no ``Metrics`` they use ``NO_METRICS``, whose hooks do nothing.

Names follow Prometheus conventions: ``discovery_`` prefix, ``_total`` counters, seconds.
Labels stay bounded: ``engine_id`` (engines this process registers or routes to),
``prefix`` (watched prefixes), small enums (``state``, ``status``, ``type``, ``cause``,
``policy``, ``change``), and ``weight_version``: per table, only the ``MAX_VERSION_LABELS``
highest versions present get a value of their own; lower ones count as ``older`` and engines
without a version as ``none`` (so at most ``MAX_VERSION_LABELS + 2`` values per table, and
a version's series go once no engine carries it).
Gauges that describe live objects are read at scrape time, so hot paths pay nothing.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from discovery._records.record import EngineStatus

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["NO_METRICS", "Metrics", "MetricsHooks"]

_REGISTRATION_STATES = ("registering", "registered", "lost", "closed")
_STATUSES = tuple(status.value for status in EngineStatus)
MAX_VERSION_LABELS = 4
"""Weight versions per table with a label value of their own (the highest ones present)."""


class MetricsHooks(Protocol):
    """What discovery's components report; ``Metrics`` exports it to Prometheus.

    Every hook does nothing by default: subclass it to send some figures elsewhere.
    """

    def registration_state(self, engine_id: str, state: str) -> None:
        """A registration changed state (``closed``: forget it)."""
        return None

    def registration_status(self, engine_id: str, status: str) -> None:
        """A registration's record has this status (its own write or an adopted one)."""
        return None

    def lease_granted(self) -> None:
        """A lease was granted."""
        return None

    def keepalive_ok(self, engine_id: str) -> None:
        """A keepalive of ``engine_id`` was answered."""
        return None

    def keepalive_failed(self) -> None:
        """A keepalive could not be sent or went unanswered."""
        return None

    def reregistered(self) -> None:
        """A record was written again after a loss."""
        return None

    def revoked(self, seconds: float) -> None:
        """A lease was revoked on close, taking ``seconds``."""
        return None

    def cluster_replaced(self) -> None:
        """A session found another etcd cluster (data wiped or restored).

        It writes its records again on a fresh lease.
        """
        return None

    def engine_event(self, outcome: str) -> None:
        """An engine-event frame arrived, by outcome.

        ``ready``, ``kv``, ``progress``, ``ignored``, ``malformed`` or ``rejected``.
        """
        return None

    def engine_stalled(self, engine_id: str, stalled: bool) -> None:
        """A launcher marked its engine stalled (True) or heard from it again (False)."""
        return None

    def engine_state_resync(self, reason: str) -> None:
        """A router asked a relay for a snapshot: ``start``, ``gap``, ``epoch``."""
        return None

    def observe_engine_states(self, states: Any) -> None:
        """Read ``states`` (an ``EngineStates``) at scrape time: ages and blocks."""
        return None

    def etcd_endpoints(self, known: int, *, added: int = 0, removed: int = 0) -> None:
        """A connection knows ``known`` etcd endpoints.

        ``added`` and ``removed``: what following the cluster's membership just changed.
        """
        return None

    def watcher_connected(self, prefix: str, connected: bool) -> None:
        """The watch stream of ``prefix`` went up or down."""
        return None

    def watcher_reconnect(self, prefix: str, cause: str) -> None:
        """A watch reconnected: ``stream_error``, ``compaction``, ``timeout``, ``no_leader``."""
        return None

    def watcher_relist(self, prefix: str, cause: str) -> None:
        """A watch listed its prefix again."""
        return None

    def events_applied(self, prefix: str, types: Iterator[str], seconds: float) -> None:
        """Events of these types were applied, taking ``seconds``."""
        return None

    def malformed_value(self, prefix: str) -> None:
        """A value under ``prefix`` did not decode."""
        return None

    def watcher_revision(self, prefix: str, applied: int, newest: int) -> None:
        """The revision applied, and the newest one seen."""
        return None

    def picked(self, policy: str) -> None:
        """A router picked an engine with ``policy``."""
        return None

    def no_engine(self) -> None:
        """A pick found no engine."""
        return None

    def unknown_policy(self) -> None:
        """A router read an engine record whose policy this version does not know."""
        return None

    def request_failed(self, outcome: str) -> None:
        """A routed request failed; what fencing did: ``fenced``, ``limited`` or ``""``."""
        return None

    def overloaded(self) -> None:
        """A pick found no engine with room within its wait (admission)."""
        return None

    def unconfirmed(self, engines: int) -> None:
        """A mass lease loss: ``engines`` more engines kept routable as unconfirmed."""
        return None

    def split_empty(self, group: str) -> None:
        """A pick found no candidate in a split's group: its share went to the others."""
        return None

    def observe_router(self, router: Any) -> None:
        """Read ``router``'s in-flight requests at scrape time."""
        return None

    def observe_table(self, table: Any) -> None:
        """Read ``table``'s size at scrape time."""
        return None

    def observe_watcher(self, watcher: Any) -> None:
        """Read ``watcher``'s staleness at scrape time."""
        return None


class NoMetrics(MetricsHooks):
    """Every hook of ``MetricsHooks``, doing nothing."""


NO_METRICS: MetricsHooks = NoMetrics()


class Metrics(MetricsHooks):
    """discovery's Prometheus metrics, registered in ``registry``.

    Build one per registry and pass it as ``metrics=`` to the objects to observe.
    Requires ``prometheus-client`` (``pip install 'discovery[metrics]'``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        try:
            from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "discovery metrics need prometheus-client: pip install 'discovery[metrics]'"
            ) from exc
        self.registry = registry
        self._lock = threading.Lock()
        self._keepalives: dict[str, float] = {}
        self._stated: set[str] = set()
        self._statused: set[str] = set()
        self._routers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._tables: weakref.WeakSet[Any] = weakref.WeakSet()
        self._watchers: weakref.WeakSet[Any] = weakref.WeakSet()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(name, doc, labels, registry=registry)

        # registration
        self._state = gauge(
            "discovery_registration_state",
            "1 for the current state of each registration, else 0.",
            ("engine_id", "state"),
        )
        self._status = gauge(
            "discovery_registration_status",
            "1 for the current status of each registration's record (starting, ready, "
            "draining, paused), else 0.",
            ("engine_id", "status"),
        )
        self._grants = counter("discovery_lease_grants_total", "Leases granted for registrations.")
        self._keepalive_failures = counter(
            "discovery_keepalive_failures_total",
            "Keepalives that could not be sent or were not answered in time.",
        )
        self._reregistrations = counter(
            "discovery_reregistrations_total",
            "Records written again after a lease was lost.",
        )
        self._cluster_replaced = counter(
            "discovery_registrar_cluster_changes_total",
            "Sessions that found another etcd cluster (data wiped or restored) and wrote "
            "their records again on a fresh lease.",
        )
        self._revoke = Histogram(
            "discovery_revoke_duration_seconds",
            "Time to revoke a registration's lease on close.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        # watcher
        self._connected = gauge(
            "discovery_watcher_connected", "1 while the watch stream is up.", ("prefix",)
        )
        self._reconnects = counter(
            "discovery_watcher_reconnects_total",
            "Watch streams re-established, by cause.",
            ("prefix", "cause"),
        )
        self._relists = counter(
            "discovery_watcher_relists_total",
            "Prefix listed again after the start, by cause.",
            ("prefix", "cause"),
        )
        self._events = counter(
            "discovery_watcher_events_total", "Events applied, by type.", ("prefix", "type")
        )
        self._malformed = counter(
            "discovery_watcher_malformed_values_total",
            "Values under the prefix that could not be decoded.",
            ("prefix",),
        )
        self._revision = gauge(
            "discovery_watcher_revision", "etcd revision the watcher has applied.", ("prefix",)
        )
        self._lag = gauge(
            "discovery_watcher_lag_revisions",
            "Newest etcd revision seen minus the revision applied.",
            ("prefix",),
        )
        self._apply = Histogram(
            "discovery_watcher_apply_duration_seconds",
            "Time to decode and apply one watch response.",
            ("prefix",),
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1),
        )
        # engine events (discovery launch, EngineEventReceiver)
        self._engine_events = counter(
            "discovery_engine_events_total",
            "Engine-event frames received, by outcome: ready, kv, progress, ignored, "
            "malformed, rejected.",
            ("outcome",),
        )
        self._stalled = gauge(
            "discovery_engine_stalled",
            "1 while the launcher has marked its engine stalled (silent past the stall timeout).",
            ("engine_id",),
        )
        self._stalls = counter(
            "discovery_engine_stalls_total", "Times an engine was marked stalled.", ("engine_id",)
        )
        self._state_resyncs = counter(
            "discovery_engine_state_resyncs_total",
            "Snapshots a router asked engines' state relays for, by reason: start, gap, epoch.",
            ("reason",),
        )
        self._engine_states: weakref.WeakSet[Any] = weakref.WeakSet()
        # routing
        self._picks = counter(
            "discovery_router_picks_total", "Engines picked, by the policy that chose.", ("policy",)
        )
        self._unknown_policies = counter(
            "discovery_router_unknown_policy_total",
            "Engine records a router read advertising a prefix_caching_coordinator_policy "
            "this version does not know (auto routes them as load_balanced; each value is "
            "logged once).",
        )
        self._no_fit = counter(
            "discovery_router_no_engine_total", "Picks that found no engine passing the filters."
        )
        self._failed = counter(
            "discovery_router_failed_requests_total", "Handles released with failed=True."
        )
        self._fences = counter(
            "discovery_router_fences_total", "Engines fenced after consecutive failed requests."
        )
        self._fence_limited = counter(
            "discovery_router_fence_limited_total",
            "Failed requests whose engine stayed in rotation: max_fenced_share was reached.",
        )
        self._overloaded = counter(
            "discovery_router_overloaded_total",
            "Picks refused by admission: no engine had room within the pick's wait.",
        )
        self._split_empty = counter(
            "discovery_router_split_empty_total",
            "Picks that found no candidate in a split's group (its share went to the others).",
            ("group",),
        )
        self._unconfirmed = counter(
            "discovery_router_unconfirmed_total",
            "Engines kept routable as unconfirmed after their records went in a mass lease loss.",
        )
        # etcd connection
        self._endpoint_changes = counter(
            "discovery_etcd_endpoint_changes_total",
            "etcd endpoints added to or removed from a connection, following the cluster's "
            "membership.",
            ("change",),
        )
        self._endpoints = gauge(
            "discovery_etcd_endpoints",
            "etcd endpoints a connection knows: the configured ones, then the members' "
            "client URLs (the last connection to change).",
        )
        registry.register(_LiveCollector(self))

    # -- registration ------------------------------------------------------------------

    def registration_state(self, engine_id: str, state: str) -> None:
        """Set the state gauge of ``engine_id``; a closed registration's series go away."""
        with self._lock:
            if state == "closed":
                self._keepalives.pop(engine_id, None)
                if engine_id in self._stated:
                    self._stated.discard(engine_id)
                    for name in _REGISTRATION_STATES:
                        self._state.remove(engine_id, name)
                if engine_id in self._statused:
                    self._statused.discard(engine_id)
                    for name in _STATUSES:
                        self._status.remove(engine_id, name)
                return
            self._stated.add(engine_id)
        for name in _REGISTRATION_STATES:
            self._state.labels(engine_id, name).set(1 if name == state else 0)

    def registration_status(self, engine_id: str, status: str) -> None:
        """Set the status gauge of ``engine_id`` (its series go when it closes)."""
        with self._lock:
            if engine_id not in self._stated:
                return  # closed (or never registered): no series to keep
            self._statused.add(engine_id)
        for name in _STATUSES:
            self._status.labels(engine_id, name).set(1 if name == status else 0)

    def lease_granted(self) -> None:
        """Count a lease grant."""
        self._grants.inc()

    def keepalive_ok(self, engine_id: str) -> None:
        """Remember when ``engine_id`` last had a keepalive answered."""
        with self._lock:
            self._keepalives[engine_id] = time.monotonic()

    def keepalive_failed(self) -> None:
        """Count a keepalive that could not be sent or went unanswered."""
        self._keepalive_failures.inc()

    def reregistered(self) -> None:
        """Count a record written again after a loss."""
        self._reregistrations.inc()

    def revoked(self, seconds: float) -> None:
        """Observe how long a revoke took."""
        self._revoke.observe(seconds)

    def cluster_replaced(self) -> None:
        """Count a session that found another etcd cluster."""
        self._cluster_replaced.inc()

    def engine_event(self, outcome: str) -> None:
        """Count one engine-event frame by its outcome."""
        self._engine_events.labels(outcome).inc()

    def engine_stalled(self, engine_id: str, stalled: bool) -> None:
        """Set the stalled gauge; count a stall."""
        self._stalled.labels(engine_id).set(1 if stalled else 0)
        if stalled:
            self._stalls.labels(engine_id).inc()

    def engine_state_resync(self, reason: str) -> None:
        """Count a snapshot asked for."""
        self._state_resyncs.labels(reason).inc()

    def observe_engine_states(self, states: Any) -> None:
        """Export ``states``' per-engine ages and block counts at scrape time."""
        self._engine_states.add(states)

    # -- etcd connection ---------------------------------------------------------------

    def etcd_endpoints(self, known: int, *, added: int = 0, removed: int = 0) -> None:
        """Set the known-endpoints gauge; count the endpoints added and removed."""
        self._endpoints.set(known)
        if added:
            self._endpoint_changes.labels("added").inc(added)
        if removed:
            self._endpoint_changes.labels("removed").inc(removed)

    # -- watcher -----------------------------------------------------------------------

    def observe_watcher(self, watcher: Any) -> None:
        """Export ``watcher``'s staleness (and whether it is stale) at scrape time."""
        self._watchers.add(watcher)

    def watcher_connected(self, prefix: str, connected: bool) -> None:
        """Set the connected gauge."""
        self._connected.labels(prefix).set(1 if connected else 0)

    def watcher_reconnect(self, prefix: str, cause: str) -> None:
        """Count a reconnect: ``stream_error``, ``compaction``, ``timeout``, ``no_leader``."""
        self._reconnects.labels(prefix, cause).inc()

    def watcher_relist(self, prefix: str, cause: str) -> None:
        """Count a relist after the first list."""
        self._relists.labels(prefix, cause).inc()

    def events_applied(self, prefix: str, types: Iterator[str], seconds: float) -> None:
        """Count applied events by type and observe the apply time."""
        for kind in types:
            self._events.labels(prefix, kind).inc()
        self._apply.labels(prefix).observe(seconds)

    def malformed_value(self, prefix: str) -> None:
        """Count a value that did not decode."""
        self._malformed.labels(prefix).inc()

    def watcher_revision(self, prefix: str, applied: int, newest: int) -> None:
        """Set the applied revision and the lag behind the newest revision seen."""
        self._revision.labels(prefix).set(applied)
        self._lag.labels(prefix).set(max(0, newest - applied))

    # -- routing -----------------------------------------------------------------------

    def picked(self, policy: str) -> None:
        """Count a pick by the policy that chose."""
        self._picks.labels(policy).inc()

    def no_engine(self) -> None:
        """Count a pick that found no engine."""
        self._no_fit.inc()

    def unknown_policy(self) -> None:
        """Count an engine record advertising a policy this version does not know."""
        self._unknown_policies.inc()

    def overloaded(self) -> None:
        """Count a pick refused for want of room (admission)."""
        self._overloaded.inc()

    def unconfirmed(self, engines: int) -> None:
        """Count engines kept routable as unconfirmed after a mass lease loss."""
        self._unconfirmed.inc(engines)

    def split_empty(self, group: str) -> None:
        """Count a pick whose split group had no candidate."""
        self._split_empty.labels(group).inc()

    def request_failed(self, outcome: str) -> None:
        """Count a failed request and what it did: ``fenced``, ``limited`` or nothing."""
        self._failed.inc()
        if outcome == "fenced":
            self._fences.inc()
        elif outcome == "limited":
            self._fence_limited.inc()

    def observe_router(self, router: Any) -> None:
        """Export ``router``'s in-flight requests and fenced engines at scrape time."""
        self._routers.add(router)

    def observe_table(self, table: Any) -> None:
        """Export ``table``'s engine count (labelled by its selector) at scrape time."""
        self._tables.add(table)


class _LiveCollector:
    """Gauges read from live objects when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = weakref.ref(metrics)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        metrics = self._metrics()
        if metrics is None:
            return
        now = time.monotonic()
        age = GaugeMetricFamily(
            "discovery_keepalive_age_seconds",
            "Seconds since the registration's last answered keepalive.",
            labels=["engine_id"],
        )
        with metrics._lock:
            for engine_id, at in metrics._keepalives.items():
                age.add_metric([engine_id], now - at)
        yield age
        yield from _staleness(list(metrics._watchers))
        engines = GaugeMetricFamily(
            "discovery_routing_engines",
            "Engines in the routing table, by status (routers pick ready ones).",
            labels=["selector", "status"],
        )
        for table in list(metrics._tables):
            selector = str(table.selector)
            counts = Counter(record.status.value for record in table.snapshot().values())
            for status in _STATUSES:
                engines.add_metric([selector, status], counts[status])
        yield engines
        yield _by_version(list(metrics._tables))
        in_flight = GaugeMetricFamily(
            "discovery_router_in_flight",
            "Unreleased pick handles per engine.",
            labels=["engine_id"],
        )
        fenced = GaugeMetricFamily(
            "discovery_router_fenced_seconds",
            "Seconds until a fenced engine's fence ends (fenced engines only).",
            labels=["engine_id"],
        )
        unconfirmed = GaugeMetricFamily(
            "discovery_router_unconfirmed_seconds",
            "Seconds since an unconfirmed engine's record went (kept routable after a mass "
            "lease loss; unconfirmed engines only).",
            labels=["engine_id"],
        )
        waiting = GaugeMetricFamily(
            "discovery_router_waiting", "Picks waiting for room (admission), over every router."
        )
        reasons = GaugeMetricFamily(
            "discovery_router_engines",
            "Engines a router sees, by why they are or are not candidates (Router.explain).",
            labels=["reason"],
        )
        totals: dict[str, int] = {}
        fences: dict[str, float] = {}
        kept: dict[str, float] = {}
        waits = 0
        why: Counter[str] = Counter()
        for router in list(metrics._routers):
            for engine_id, count in router.in_flight().items():
                totals[engine_id] = totals.get(engine_id, 0) + count
            health = router.health()
            for engine_id, seconds in health.fenced.items():
                fences[engine_id] = max(fences.get(engine_id, 0.0), seconds)
            for engine_id, seconds in health.unconfirmed.items():
                kept[engine_id] = max(kept.get(engine_id, 0.0), seconds)
            waits += health.waiting
            why.update(router.reasons())
        for engine_id, count in sorted(totals.items()):
            in_flight.add_metric([engine_id], count)
        yield in_flight
        for engine_id, seconds in sorted(fences.items()):
            fenced.add_metric([engine_id], seconds)
        yield fenced
        for engine_id, seconds in sorted(kept.items()):
            unconfirmed.add_metric([engine_id], seconds)
        yield unconfirmed
        waiting.add_metric([], waits)
        yield waiting
        for reason, count in sorted(why.items()):
            reasons.add_metric([reason], count)
        yield reasons
        yield from _engine_states(list(metrics._engine_states))


def _engine_states(followers: list[Any]) -> Iterator[Any]:
    """Per engine, the age of the relayed state a router holds (the oldest across followers)."""
    from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

    ages: dict[str, float] = {}
    blocks = 0
    for states in followers:
        for engine_id, age in states.ages().items():
            ages[engine_id] = max(age, ages.get(engine_id, 0.0))
        blocks += states.health().blocks
    age_family = GaugeMetricFamily(
        "discovery_engine_state_age_seconds",
        "Seconds since an engine's state relay last said anything (routers' view).",
        labels=["engine_id"],
    )
    for engine_id, age in sorted(ages.items()):
        age_family.add_metric([engine_id], age)
    yield age_family
    yield GaugeMetricFamily(
        "discovery_engine_state_blocks",
        "Cached block hashes the routers hold, over every engine.",
        value=blocks,
    )


def _version_label(version: int | None, kept: Collection[int]) -> str:
    if version is None:
        return "none"
    return str(version) if version in kept else "older"


def _by_version(tables: list[Any]) -> Any:
    """Engines per table by (status, weight version), the version label bounded."""
    from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

    family = GaugeMetricFamily(
        "discovery_routing_engines_by_version",
        "Engines in the routing table by status and weight version: the "
        f"{MAX_VERSION_LABELS} highest versions present, lower ones as 'older', engines "
        "without one as 'none'.",
        labels=["selector", "status", "weight_version"],
    )
    for table in tables:
        selector = str(table.selector)
        records = list(table.snapshot().values())
        present = {r.weight_version for r in records if r.weight_version is not None}
        kept = set(sorted(present)[-MAX_VERSION_LABELS:])
        counts = Counter(
            (record.status.value, _version_label(record.weight_version, kept)) for record in records
        )
        labels = sorted({label for _, label in counts}, key=_label_order)
        for label in labels:
            for status in _STATUSES:
                family.add_metric([selector, status, label], counts[status, label])
    return family


def _label_order(label: str) -> tuple[int, int]:
    """``none``, ``older``, then the versions in order."""
    return (2, int(label)) if label.isdigit() else (0 if label == "none" else 1, 0)


def _staleness(watchers: list[Any]) -> Iterator[Any]:
    """Per prefix, the stalest watcher: its staleness in seconds, and 1 if it is stale."""
    from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

    worst: dict[str, tuple[float, bool]] = {}
    for watcher in watchers:
        freshness = watcher.freshness
        if not freshness.running:
            continue
        age = freshness.age()
        previous = worst.get(watcher.prefix, (0.0, False))
        worst[watcher.prefix] = (max(age, previous[0]), previous[1] or freshness.stale)
    staleness = GaugeMetricFamily(
        "discovery_watcher_staleness_seconds",
        "Seconds since an etcd member with a leader last answered the watcher.",
        labels=["prefix"],
    )
    stale = GaugeMetricFamily(
        "discovery_watcher_stale",
        "1 while the watcher's staleness exceeds its threshold (fail-static: last table served).",
        labels=["prefix"],
    )
    for prefix, (age, is_stale) in sorted(worst.items()):
        staleness.add_metric([prefix], age)
        stale.add_metric([prefix], 1 if is_stale else 0)
    yield staleness
    yield stale
