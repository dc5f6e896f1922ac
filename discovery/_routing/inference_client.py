"""A client Megatron's code accepts: ``FleetInferenceClient``, its ``InferenceClient`` over a fleet.

Code written for Megatron's ``InferenceClient(coordinator_address)`` runs over every engine
of a fleet by changing one name: ``FleetInferenceClient(fleet)``, ``fleet`` being one string
that names the fleet (``parse_fleet``)::

    etcd://HOST:PORT[,HOST:PORT...]/NAMESPACE?selector=SELECTOR&policy=POLICY&hold=S

``etcds://`` for etcd over TLS (its CA, certificate and credentials come from the
``DISCOVERY_*`` variables, never from the string); no hosts (``etcd:///prod``) takes them
from ``DISCOVERY_ETCD_ENDPOINTS``, no namespace from ``DISCOVERY_NAMESPACE``. The query is
optional: ``selector`` a label selector in Kubernetes' syntax, URL-encoded (repeated: all
must hold), ``policy`` the router's (``RoutingPolicy``), ``hold`` the seconds a request
waits for a ready engine during a refit, ``connect_timeout`` each engine's handshake.

``start()`` is what both of Megatron's callers expect: main's server calls it and goes on
(the table is listed before it returns: etcd down is an error there), the release's RL loop
awaits it (it returns an awaitable, already done). ``stop()`` stops every engine's client
and the watch. The requests (``add_request``, ``add_request_streaming``, the hand-off
calls, ``abort_request`` by the id ``next_request_id`` gave) go through ``FleetClient``:
routed, sent through the chosen engine's own Megatron client, resent once if that engine is
lost first, held while the fleet is paused. Each control signal goes to every engine, with
discovery's records written around it in the order that keeps routers off a pausing engine
(``FleetClient.pause`` and the others), and returns an awaitable of the ``ControlResult``
that a caller of Megatron's synchronous signals may ignore (failures are logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from discovery._errors import ConfigurationError
from discovery._reads.table import RoutingTable, watch_table
from discovery._records.selector import Selector
from discovery._routing.fleet import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HOLD,
    ClientFactory,
    ControlResult,
    EngineClient,
    FleetClient,
    megatron_client,
)
from discovery._routing.policies import RoutingPolicy
from discovery._routing.router import Router
from discovery._settings import Settings

__all__ = ["FleetAddress", "FleetInferenceClient", "parse_fleet"]

log = logging.getLogger(__name__)

_SCHEMES = {"etcd": "http", "etcds": "https"}
_QUERY = ("selector", "policy", "hold", "connect_timeout")


@dataclass(frozen=True)
class FleetAddress:
    """What a fleet string names (``parse_fleet``): None is "from ``DISCOVERY_*``"."""

    endpoints: tuple[str, ...] | None
    namespace: str | None
    selector: Selector | None = None
    policy: RoutingPolicy | None = None
    hold: float | None = None
    connect_timeout: float | None = None

    def settings(self, base: Settings | None = None) -> Settings:
        """``base`` (default ``Settings.from_env()``) with this address's endpoints, namespace."""
        overrides: dict[str, Any] = {}
        if self.endpoints is not None:
            overrides["endpoints"] = self.endpoints
        if self.namespace is not None:
            overrides["namespace"] = self.namespace
        if base is None:
            return Settings.from_env(**overrides)
        return dataclasses.replace(base, **overrides) if overrides else base


def parse_fleet(fleet: str) -> FleetAddress:
    """Read a fleet string; ``ConfigurationError`` naming what is wrong with it."""

    def bad(problem: str) -> ConfigurationError:
        return ConfigurationError(
            f"fleet {_shown(fleet)!r}: {problem} (expected "
            "etcd[s]://HOST:PORT[,HOST:PORT...]/NAMESPACE[?selector=...&policy=...&hold=S])"
        )

    if not isinstance(fleet, str):
        raise ConfigurationError(f"the fleet must be a string, got {type(fleet).__name__}")
    parts = urllib.parse.urlsplit(fleet)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None:
        raise bad(f"the scheme must be etcd:// or etcds://, not {parts.scheme or 'none'!r}")
    if "@" in parts.netloc:
        raise bad("credentials do not go in the fleet string: use DISCOVERY_ETCD_USERNAME")
    if parts.fragment:
        raise bad(f"a fragment (#{parts.fragment}) means nothing here")
    endpoints = None
    if parts.netloc:
        endpoints = tuple(_endpoint(host, scheme, bad) for host in parts.netloc.split(","))
    namespace = urllib.parse.unquote(parts.path.strip("/")) or None
    if namespace is not None and "/" in namespace:
        raise bad(f"the namespace {namespace!r} has a '/'")
    try:
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        if parts.query:
            raise bad(f"the query is malformed ({exc})") from None
        query = {}
    unknown = sorted(set(query) - set(_QUERY))
    if unknown:
        raise bad(f"unknown option {', '.join(unknown)} (known: {', '.join(_QUERY)})")
    for name, values in query.items():
        if name != "selector" and len(values) > 1:
            raise bad(f"{name} is given {len(values)} times")
    selector = None
    if "selector" in query:
        selector = Selector()
        for text in query["selector"]:
            try:
                selector &= Selector.parse(text)
            except ValueError as exc:
                raise bad(f"selector {text!r}: {exc}") from None
    policy = None
    if "policy" in query:
        try:
            policy = RoutingPolicy(query["policy"][0])
        except ValueError:
            known = ", ".join(p.value for p in RoutingPolicy)
            raise bad(f"unknown policy {query['policy'][0]!r} (known: {known})") from None
    return FleetAddress(
        endpoints,
        namespace,
        selector,
        policy,
        _seconds(query, "hold", bad, zero=True),
        _seconds(query, "connect_timeout", bad, zero=False),
    )


def _shown(fleet: object) -> str:
    """The fleet string as an error shows it: without anything before an ``@``."""
    text = str(fleet)
    scheme, sep, rest = text.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://...@{rest.split('@', 1)[1]}"
    return text


def _endpoint(host: str, scheme: str, bad: Any) -> str:
    name, colon, port = host.rpartition(":")
    if not host or not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"{host!r} is not HOST:PORT")
    return f"{scheme}://{host}"


def _seconds(query: Mapping[str, list[str]], name: str, bad: Any, *, zero: bool) -> float | None:
    if name not in query:
        return None
    text = query[name][0]
    try:
        value = float(text)
    except ValueError:
        raise bad(f"{name}={text!r} is not a number of seconds") from None
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise bad(f"{name}={text!r} must be {'0 or more' if zero else 'more than 0'} seconds")
    return value


class _Started:
    """What ``start()`` returns: nothing to wait for, awaited or not.

    Both of Megatron's callers: main's server does not await it, the release's RL loop does.
    """

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # a generator: awaiting it returns at once


class FleetInferenceClient:
    """Megatron's ``InferenceClient`` over a fleet (see the module docs).

    ``fleet`` names it (``parse_fleet``); ``deserialize`` is handed to each engine's
    Megatron client (main's: replies as ``DynamicInferenceRequest``). ``settings`` is the
    base the fleet string's endpoints and namespace go on (default ``DISCOVERY_*``);
    ``client_factory`` makes an engine's client (default: Megatron's own).
    """

    def __init__(
        self,
        fleet: str,
        deserialize: bool = False,
        *,
        settings: Settings | None = None,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.address = parse_fleet(fleet)
        self.settings = self.address.settings(settings)
        self.deserialize = deserialize
        self.next_request_id = 0
        self._factory = client_factory
        self._table: RoutingTable | None = None
        self._fleet: FleetClient | None = None
        self._requests: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Future[None]] = {}  # a stream's abort
        self._tasks: set[asyncio.Future[Any]] = set()  # kept until done: the loop holds
        # its tasks weakly, and a caller of Megatron's signals keeps nothing

    @property
    def fleet(self) -> FleetClient:
        """The ``FleetClient`` underneath (after ``start()``)."""
        if self._fleet is None:
            raise RuntimeError("start the client first (FleetInferenceClient.start())")
        return self._fleet

    @property
    def table(self) -> RoutingTable:
        """The routing table the client follows (after ``start()``)."""
        if self._table is None:
            raise RuntimeError("start the client first (FleetInferenceClient.start())")
        return self._table

    def start(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        connect_timeout_seconds: float | None = None,
    ) -> _Started:
        """List the fleet, follow it, and bind to ``loop`` (default: the running one).

        Blocks until the first listing is in (bounded by the etcd dial timeout: etcd down
        raises ``EtcdUnavailableError``); engines' clients open in the background.
        """
        if self._fleet is not None:
            return _Started()
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = asyncio.new_event_loop()
                asyncio.set_event_loop(loop)
        address = self.address
        table = watch_table(self.settings, selector=address.selector)
        table.start()
        try:
            router = Router(table, policy=address.policy or RoutingPolicy.AUTO)
            timeout = connect_timeout_seconds or address.connect_timeout
            self._fleet = FleetClient(
                router,
                client_factory=self._factory or self._default_factory,
                connect_timeout=timeout or DEFAULT_CONNECT_TIMEOUT,
                hold=DEFAULT_HOLD if address.hold is None else address.hold,
                settings=self.settings,
            ).bind(loop)
        except BaseException:
            table.stop()
            raise
        self._table = table
        return _Started()

    def _default_factory(self, address: str) -> EngineClient:
        if not self.deserialize:
            return megatron_client(address)
        from megatron.core.inference.inference_client import (  # noqa: PLC0415
            InferenceClient,
        )

        client: EngineClient = InferenceClient(address, deserialize=True)
        return client

    def stop(self) -> None:
        """Stop every engine's client and the watch. Requests still waiting fail."""
        fleet, self._fleet = self._fleet, None
        table, self._table = self._table, None
        if fleet is not None:
            fleet.close()
        if table is not None:
            table.stop()

    # -- requests ------------------------------------------------------------------------

    def _next_id(self) -> int:
        request_id = self.next_request_id
        self.next_request_id = request_id + 1
        return request_id

    def add_request(
        self, prompt: str | list[int], sampling_params: Any, *, multi_modal_data: Any = None
    ) -> asyncio.Future[Any]:
        """Send a request to the engine the router picks; a future of its reply."""
        future = self.fleet.add_request(prompt, sampling_params, multi_modal_data=multi_modal_data)
        return self._tracked_future(future)

    def add_request_streaming(
        self, prompt: str | list[int], sampling_params: Any, *, multi_modal_data: Any = None
    ) -> AsyncIterator[Any]:
        """A streamed request: ``{"partial": ...}`` items, then one ``{"final": ...}``."""
        stream = self.fleet.add_request_streaming(
            prompt, sampling_params, multi_modal_data=multi_modal_data
        )
        return self._tracked(self._next_id(), stream)

    def add_request_with_kv_handoff(
        self, prompt: str | list[int], sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> asyncio.Future[Any]:
        """The decode side of a hand-off (``FleetClient.add_request_with_kv_handoff``)."""
        future = self.fleet.add_request_with_kv_handoff(
            prompt, sampling_params, kv_meta, src_block_ids
        )
        return self._tracked_future(future)

    def _tracked_future(self, future: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """``future`` under the next request id (``abort_request``) until it is done."""
        request_id = self._next_id()
        self._requests[request_id] = future
        future.add_done_callback(lambda _: self._requests.pop(request_id, None))
        return future

    def add_request_with_kv_handoff_streaming(
        self, prompt: str | list[int], sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> AsyncIterator[Any]:
        """``add_request_with_kv_handoff``, streamed."""
        stream = self.fleet.add_request_with_kv_handoff_streaming(
            prompt, sampling_params, kv_meta, src_block_ids
        )
        return self._tracked(self._next_id(), stream)

    async def _tracked(self, request_id: int, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``stream``'s items until it ends, or ``abort_request`` ends it.

        As Megatron's ``finish()`` ends its stream: no final item; the request is aborted
        on its engine (the fleet's stream, cancelled, aborts it).
        """
        aborted = asyncio.get_running_loop().create_future()
        self._streams[request_id] = aborted
        items = stream.__aiter__()
        try:
            while True:
                following = asyncio.ensure_future(items.__anext__())
                await asyncio.wait([following, aborted], return_when=asyncio.FIRST_COMPLETED)
                if not following.done():  # aborted: the fleet's stream aborts on its engine
                    following.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await following
                    return
                try:
                    item = following.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self._streams.pop(request_id, None)

    def release_handoff(self, request_id: int) -> None:
        """Release a hand-off's pinned blocks on the engine that made it."""
        self.fleet.release_handoff(request_id)

    def abort_request(self, request_id: int) -> None:
        """Abort a request (the id ``next_request_id`` had when it was sent) where it is."""
        future = self._requests.pop(int(request_id), None)
        if future is not None:
            future.cancel()
            return
        aborted = self._streams.pop(int(request_id), None)
        if aborted is not None and not aborted.done():
            aborted.set_result(None)

    # -- control signals, to every engine -------------------------------------------------

    def _signal(self, what: str, control: Any) -> asyncio.Future[ControlResult]:
        """``control`` (a coroutine, or ``FleetClient.send``'s future) on its way, logged.

        Megatron's callers of signals keep nothing: failures are logged here.
        """
        task: asyncio.Future[ControlResult] = asyncio.ensure_future(control)

        def report(done: asyncio.Future[ControlResult]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                log.error("%s over the fleet failed: %s", what, error)
            elif not done.result().ok:
                log.warning("%s: not done on %s", what, dict(done.result().failed))

        task.add_done_callback(report)
        return self._keep(task)

    def _keep(self, task: asyncio.Future[Any]) -> asyncio.Future[Any]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def pause_engines(self) -> asyncio.Future[ControlResult]:
        """Each engine's record ``paused`` (routers stop picking it), then PAUSE."""
        return self._signal("pause_engines", self.fleet.pause())

    def unpause_engines(self) -> asyncio.Future[ControlResult]:
        """UNPAUSE, then each engine's record ``ready``."""
        return self._signal("unpause_engines", self.fleet.unpause())

    def suspend_engines(self) -> asyncio.Future[ControlResult]:
        """Each record ``paused``, PAUSE (a paused engine ignores it), then SUSPEND."""
        return self._signal("suspend_engines", self.fleet.suspend())

    def resume_engines(self) -> asyncio.Future[ControlResult]:
        """RESUME (back to paused: ``unpause_engines`` makes them ready)."""
        return self._signal("resume_engines", self.fleet.send("resume_engines"))

    def set_generation_epoch(self, generation_epoch: int) -> asyncio.Future[ControlResult]:
        """SET_GENERATION_EPOCH, then each record's ``weight_version``."""
        return self._signal(
            "set_generation_epoch", self.fleet.set_generation_epoch(generation_epoch)
        )

    def start_cuda_profiler(self) -> asyncio.Future[ControlResult]:
        """START_CUDA_PROFILER to every engine."""
        return self._signal("start_cuda_profiler", self.fleet.send("start_cuda_profiler"))

    def stop_cuda_profiler(self) -> asyncio.Future[ControlResult]:
        """STOP_CUDA_PROFILER to every engine."""
        return self._signal("stop_cuda_profiler", self.fleet.send("stop_cuda_profiler"))

    def stop_engines(self) -> asyncio.Future[ControlResult]:
        """STOP to every engine (Megatron's needs PAUSED or SUSPENDED)."""
        return self._signal("stop_engines", self.fleet.send("stop_engines"))

    def shutdown_coordinator(self) -> asyncio.Future[ControlResult]:
        """SHUTDOWN to every engine's coordinator."""
        return self._signal("shutdown_coordinator", self.fleet.send("shutdown_coordinator"))
