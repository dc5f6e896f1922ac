"""The fleet client: Megatron requests sent through the router, one client per engine.

``FleetClient(router)`` follows the router's engines: for each, one client made by
``client_factory`` (default: Megatron's own ``InferenceClient``, imported when first
needed; any class with its methods will do, such as ``discovery.testing.stand_in_client``'s),
opened when the engine appears (its handshake off the event loop) and stopped when it
leaves. Asyncio first: every method runs on the event loop the client was started on.

**Requests.** ``add_request(prompt, sampling_params, ...)`` returns an asyncio future of the
engine's reply, as Megatron's does; ``add_request_streaming`` an async iterator of
``{"partial": ...}`` items then one ``{"final": ...}``. Each request is routed by the router
(the prompt's tokens for affinity, ``session_key``, images go by load; a pick that must wait
for room, admission's, waits as ``apick`` does) and sent through the chosen engine's client;
``add_request`` runs on callbacks of the engine's reply (no task per request). When the
router sees engines but none ready because they are paused, suspended, starting or stalled
(a refit), a request is held until one is ready again, for ``wait`` seconds (``hold`` when
it gives none), as Megatron's own client holds a request sent to a paused engine. Its handle is
released when the reply comes (a reply, whatever its status, is an engine that answered),
and released as failed when the engine is lost first (``PickHandle.wait_lost``: removed,
stalled, stopping, fenced, unconfirmed and dead; or its client stopped because its record
left or moved, which may come first). A request whose engine is lost before
anything came back is aborted there and sent once more to another engine (excluding the
lost one); a stream that already gave tokens fails with ``RequestLostError`` saying how
many (``resend=False``: every loss fails); each resend is logged. Cancelling the future,
or closing the stream before its final item, aborts the request on its engine; a stream's
handle is released as its final item is handed out (a caller that stops reading then aborts
nothing).

**Disaggregated requests.** When the router sees decode engines, a request is a pair
(``Router.pick_pair``): the prompt to the prefill engine with ``do_kv_handoff`` and one
token, then ``add_request_with_kv_handoff(prompt, params, kv_meta, block_ids)`` to the
decode engine, then ``release_handoff`` of the prefill engine's request (after the decode
engine's reply, or its first partial). An aggregated engine may take a short or cached
prompt alone (conditional disaggregation, ``discovery._routing.pairs``).

**Fleet control for refits** (``pause``, ``suspend``, ``resume``, ``set_generation_epoch``,
over every engine or a selector): Megatron's signals through the engines' clients and
discovery's status and weight version (``discovery.pause`` / ``resume``), in the order that
never lets a router send to an engine that is pausing (the record is ``paused`` before the
signal goes) or to an older version once a newer one is ready (the epoch is set, then the
engine unpaused, then its record says ``ready`` on the new version, in one write).
Megatron acknowledges no signal on the wire; each call reports, engine by engine, what it
could not do (``ControlResult``), and never leaves a record ready on an engine it did not
resume.

**The engines' clients** start on the event loop's thread as far as they are bound to it
(Megatron's ``start()`` creates its receive task on the loop it is given): the blocking
handshake runs on a thread of its own (``discovery-fleet-connect``, one per opening), and
the loop handed to the client's ``start`` passes what it schedules to the loop's own
thread, so asyncio's debug mode holds. A ``start`` that is a coroutine (megatron-core
0.16's) is run to its end there too, a client without ``connect_timeout_seconds`` (0.16's)
is started without it, and a handshake unanswered after ``connect_timeout`` is given up on
(0.16's CONNECT is main's CONNECT_ACK: a main engine never answers it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from discovery._errors import (
    ClosedError,
    ConfigurationError,
    DiscoveryError,
    NoEngineAvailableError,
)
from discovery._etcd.port import EtcdPort
from discovery._records.handoff import EngineRole
from discovery._records.record import EngineRecord, EngineStatus
from discovery._routing.router import PickHandle, PickPair, Router
from discovery._settings import Settings
from discovery._writes.operators import pause as mark_paused
from discovery._writes.operators import resume as mark_ready
from discovery._writes.operators import set_weight_version

__all__ = ["ControlResult", "FleetClient", "RequestLostError"]

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_HOLD = 60.0
"""Seconds a request waits for a ready engine while none is (a refit), unless ``wait`` says."""
_HELD = frozenset({EngineStatus.PAUSED, EngineStatus.STARTING, EngineStatus.STALLED})
"""Not ready now, ready again later: a request waits for such an engine rather than fail."""


class EngineClient(Protocol):
    """What the fleet client calls on an engine's client (Megatron's ``InferenceClient``)."""

    next_request_id: int

    def start(self, loop: Any = ..., connect_timeout_seconds: float | None = ...) -> Any: ...

    def add_request(
        self, prompt: Any, sampling_params: Any, *, multi_modal_data: Any = ...
    ) -> asyncio.Future[Any]: ...

    def add_request_streaming(
        self, prompt: Any, sampling_params: Any, *, multi_modal_data: Any = ...
    ) -> AsyncIterator[Any]: ...

    def add_request_with_kv_handoff(
        self, prompt: Any, sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> asyncio.Future[Any]: ...

    def add_request_with_kv_handoff_streaming(
        self, prompt: Any, sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> AsyncIterator[Any]: ...

    def release_handoff(self, request_id: int) -> None: ...

    def abort_request(self, request_id: int) -> None: ...

    def pause_engines(self) -> Any: ...

    def unpause_engines(self) -> Any: ...

    def suspend_engines(self) -> Any: ...

    def resume_engines(self) -> Any: ...

    def set_generation_epoch(self, generation_epoch: int) -> Any: ...

    def stop(self) -> None: ...


ClientFactory = Callable[[str], EngineClient]


def megatron_client(address: str) -> EngineClient:
    """Megatron's own ``InferenceClient`` for the coordinator at ``address``."""
    try:
        from megatron.core.inference.inference_client import (  # noqa: PLC0415
            InferenceClient,
        )
    except ImportError as exc:
        raise ConfigurationError(
            "the fleet client's default client is Megatron-Core's InferenceClient "
            "(megatron.core.inference.inference_client), which is not installed: install "
            "megatron-core, or pass client_factory= (any class with its methods, e.g. "
            f"discovery.testing.stand_in_client.InferenceClient): {exc}"
        ) from exc
    client: EngineClient = InferenceClient(address)
    return client


class RequestLostError(DiscoveryError):
    """A request's engine was lost before it answered, and it was not (or no more) resent.

    ``engine_id`` and ``reason`` say where and why, ``tokens`` how many a stream had given
    (a stream that gave some is never resent), ``resent`` whether it had been sent again.
    """

    def __init__(self, engine_id: str, reason: str, *, tokens: int, resent: bool) -> None:
        where = f"after {tokens} streamed tokens" if tokens else "before it answered"
        again = " (it had been sent again already)" if resent else ""
        super().__init__(f"engine {engine_id} was lost {where}: {reason}{again}")
        self.engine_id = engine_id
        self.reason = reason
        self.tokens = tokens
        self.resent = resent


@dataclass(frozen=True)
class ControlResult:
    """What a fleet control call did: the engines done, and why the others were not."""

    done: tuple[str, ...]
    failed: Mapping[str, str]

    @property
    def ok(self) -> bool:
        """Whether every engine was done."""
        return not self.failed


class _Lost(Exception):
    """A request's engine was lost (internal: turned into a resend or RequestLostError)."""

    def __init__(self, handle: PickHandle, reason: str) -> None:
        super().__init__(reason)
        self.handle = handle
        self.reason = reason


class _Engine:
    """One engine's client, as it opens (``ready``) and closes."""

    __slots__ = ("address", "client", "ready")

    def __init__(self, address: str, ready: asyncio.Future[EngineClient]) -> None:
        self.address = address
        self.ready = ready
        self.client: EngineClient | None = None


class FleetClient:
    """Megatron requests through ``router`` (see the module docs). ``async with`` it.

    ``client_factory(address)`` makes an engine's client (default: Megatron's);
    ``connect_timeout`` bounds each handshake; ``resend`` sends a request whose engine was
    lost before answering once more, elsewhere; ``hold`` is how long a request without a
    ``wait`` waits for a ready engine while the router's are paused, suspended, starting or
    stalled. ``settings`` / ``connection`` reach etcd for the fleet control calls (default:
    ``DISCOVERY_*``). The router's table must be started.
    """

    def __init__(
        self,
        router: Router,
        *,
        client_factory: ClientFactory | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        resend: bool = True,
        hold: float = DEFAULT_HOLD,
        settings: Settings | None = None,
        connection: EtcdPort | None = None,
    ) -> None:
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout!r}")
        if not hold >= 0:
            raise ValueError(f"hold must be 0 or more seconds, got {hold!r}")
        self._router = router
        self._factory = client_factory or megatron_client
        self._connect_timeout = float(connect_timeout)
        self._resend = resend
        self._hold = float(hold)
        self._changes: list[asyncio.Future[None]] = []  # held picks, woken by table changes
        self._handoffs: dict[int, EngineClient] = {}  # a prefill reply's id -> its client
        self._tasks: set[asyncio.Future[Any]] = set()
        self._settings = settings
        self._connection = connection
        self._engines: dict[str, _Engine] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._disaggregated = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> FleetClient:
        """Open a client for every engine the router sees, and follow its table."""
        return self.bind(asyncio.get_running_loop())

    def bind(self, loop: asyncio.AbstractEventLoop) -> FleetClient:
        """``start`` on ``loop`` from its own thread, for a caller that is not a coroutine.

        Every method runs on ``loop`` from then on; it may not be running yet.
        """
        if self._loop is None:
            self._loop = loop

            def changed(batch: object, snapshot: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._sync)

            self._unsubscribe = self._router._table.subscribe(changed)
            self._sync()
        return self

    async def stop(self) -> None:
        """Stop every engine's client. Requests still waiting fail (RequestLostError)."""
        self.close()

    def close(self) -> None:
        """``stop``, for a caller that is not a coroutine (on the loop's thread)."""
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        engines, self._engines = self._engines, {}
        for engine in engines.values():
            self._close(engine)

    async def __aenter__(self) -> FleetClient:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def clients(self) -> Mapping[str, EngineClient]:
        """The open clients, by engine id."""
        return {e: c.client for e, c in self._engines.items() if c.client is not None}

    # -- the engines' clients ------------------------------------------------------------

    def _sync(self) -> None:
        """Open a client for each new engine (or new address); stop those of engines gone."""
        if self._loop is None:
            return
        changes, self._changes = self._changes, []
        for change in changes:
            if not change.done():
                change.set_result(None)
        records = self._router.engines()
        self._disaggregated = any(r.role is EngineRole.DECODE for r in records.values())
        for engine_id, engine in list(self._engines.items()):
            record = records.get(engine_id)
            if record is None or record.endpoint.coordinator_address != engine.address:
                del self._engines[engine_id]
                self._close(engine)
        for engine_id, record in records.items():
            if engine_id not in self._engines:
                self._open(engine_id, record)

    def _open(self, engine_id: str, record: EngineRecord) -> _Engine:
        assert self._loop is not None
        address = record.endpoint.coordinator_address
        engine = _Engine(address, self._loop.create_future())
        self._engines[engine_id] = engine
        opening: asyncio.Future[EngineClient] = self._loop.create_future()
        threading.Thread(
            target=self._connect_thread,
            args=(address, opening),
            name="discovery-fleet-connect",
            daemon=True,
        ).start()
        opening.add_done_callback(lambda done: self._opened(engine_id, engine, done))
        # A handshake without a timeout of its own (megatron-core 0.16's) is bounded here.
        late = self._loop.call_later(
            self._connect_timeout, self._unanswered, engine_id, engine, opening
        )
        engine.ready.add_done_callback(lambda _: late.cancel())
        return engine

    def _connect_thread(self, address: str, opening: asyncio.Future[EngineClient]) -> None:
        """``_connect`` on a thread of its own, its outcome handed to the loop.

        Not the loop's executor: a handshake that never returns (0.16's has no timeout)
        would hold ``asyncio.run``'s shutdown, which waits for the executor's threads.
        """
        assert self._loop is not None
        client = None
        try:
            client = self._connect(address)
            outcome = functools.partial(_settle, opening, client, None)
        except BaseException as exc:  # handed over, whatever it is
            outcome = functools.partial(_settle, opening, None, exc)
        try:
            self._loop.call_soon_threadsafe(outcome)
        except RuntimeError:  # the loop is closed: nobody will use the client
            if client is not None:
                with contextlib.suppress(Exception):
                    client.stop()

    def _unanswered(self, engine_id: str, engine: _Engine, opening: asyncio.Future[Any]) -> None:
        if engine.ready.done():
            return
        error = TimeoutError(f"no handshake from {engine.address} in {self._connect_timeout} s")
        self._opened(engine_id, engine, _failed(self._loop, error))

    def _connect(self, address: str) -> EngineClient:
        """Make and start a client (off the loop: Megatron's handshake blocks).

        The client is given the loop behind ``_LoopProxy``: its receive task is created on
        the loop's own thread. A coroutine ``start`` (megatron-core 0.16) runs to its end here.
        """
        assert self._loop is not None
        client = self._factory(address)
        try:
            start = client.start
            if "connect_timeout_seconds" in _parameters(start):
                started = start(
                    loop=_LoopProxy(self._loop), connect_timeout_seconds=self._connect_timeout
                )
            else:
                started = start(loop=_LoopProxy(self._loop))
            if inspect.isawaitable(started):
                asyncio.run(_awaited(started))
            if self._closed:  # stopped meanwhile: its loop may be gone, nobody else stops it
                raise ClosedError("the fleet client was stopped while it opened")
        except BaseException:
            with contextlib.suppress(Exception):
                client.stop()
            raise
        return client

    def _opened(self, engine_id: str, engine: _Engine, done: asyncio.Future[EngineClient]) -> None:
        if engine.ready.done():  # given up on (_unanswered): a late client is not kept
            if not done.cancelled() and done.exception() is None:
                with contextlib.suppress(Exception):
                    done.result().stop()
            return
        if done.cancelled():
            engine.ready.cancel()
            return
        error = done.exception()
        if error is not None:
            log.warning("engine %s: no client for %s: %s", engine_id, engine.address, error)
            engine.ready.set_exception(error)
            engine.ready.exception()  # seen here: a request waiting on it sees it too
            if self._engines.get(engine_id) is engine:
                del self._engines[engine_id]  # opened again when next asked for
            return
        client = done.result()
        if self._engines.get(engine_id) is not engine:  # gone meanwhile
            with contextlib.suppress(Exception):
                client.stop()
            engine.ready.cancel()
            return
        engine.client = client
        engine.ready.set_result(client)

    def _close(self, engine: _Engine) -> None:
        if engine.client is not None:
            with contextlib.suppress(Exception):
                engine.client.stop()
        elif not engine.ready.done():
            engine.ready.cancel()

    async def _reach(self, handle: PickHandle) -> EngineClient:
        """``handle``'s engine's client; an engine that cannot be reached is lost (_Lost)."""
        try:
            return await self._client(handle)
        except ConfigurationError:
            handle.release()  # no client factory: nothing to do with the engine
            raise
        except Exception as exc:  # unreachable: nothing was sent
            handle.release(failed=True)
            raise _Lost(handle, f"no client: {exc}") from exc

    async def _client(self, handle: PickHandle) -> EngineClient:
        """The client of ``handle``'s engine, opened now if it is not yet."""
        engine = self._engines.get(handle.engine_id)
        address = handle.endpoint.coordinator_address
        if engine is not None and engine.address == address and engine.client is not None:
            return engine.client  # open: no await (this runs once per request)
        if engine is None or engine.address != address:
            engine = self._open(handle.engine_id, handle.record)
        return await asyncio.shield(engine.ready)

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: Any,
        *,
        multi_modal_data: Any = None,
        prompt_tokens: Sequence[int] | None = None,
        session_key: str | bytes | int | None = None,
        selector: Mapping[str, str] | None = None,
        wait: float | None = None,
        priority: int = 0,
    ) -> asyncio.Future[Any]:
        """Send a request through the router; the future resolves with the engine's reply.

        ``prompt_tokens``: the prompt's token ids, for affinity, when ``prompt`` is text
        (a token list is its own). ``session_key``, ``selector``, ``wait``, ``priority``:
        the pick's (``Router.pick``). With ``multi_modal_data`` (images) the request is
        routed by load alone, as Megatron routes it (``Router.pick(images=True)``).
        Cancelling the future aborts the request.
        """
        route = self._route(prompt, sampling_params, multi_modal_data, prompt_tokens)
        if (
            session_key is None
            and selector is None
            and multi_modal_data is None
            and type(priority) is int
            and priority == 0
        ):
            return _Request(self, route, _NO_OPTIONS, wait)
        options = self._options(session_key, selector, priority, multi_modal_data)
        return _Request(self, route, options, wait)

    def add_request_streaming(
        self,
        prompt: str | Sequence[int],
        sampling_params: Any,
        *,
        multi_modal_data: Any = None,
        prompt_tokens: Sequence[int] | None = None,
        session_key: str | bytes | int | None = None,
        selector: Mapping[str, str] | None = None,
        wait: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]:
        """Send a streamed request: ``{"partial": ...}`` items, then one ``{"final": ...}``.

        Closing the iterator before the end aborts the request.
        """
        route = self._route(prompt, sampling_params, multi_modal_data, prompt_tokens)
        options = self._options(session_key, selector, priority, multi_modal_data)
        return self._stream(route, options, wait)

    def add_request_with_kv_handoff(
        self, prompt: str | Sequence[int], sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> asyncio.Future[Any]:
        """Megatron's decode side of a hand-off, on an engine the router picks (not resent).

        A decode engine when the router sees some; the KV comes from the prefill peer that
        ``kv_meta`` names.
        """
        route = self._route(prompt, sampling_params, None, None)
        return asyncio.ensure_future(self._handoff(route, kv_meta, src_block_ids))

    def add_request_with_kv_handoff_streaming(
        self, prompt: str | Sequence[int], sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> AsyncIterator[Any]:
        """``add_request_with_kv_handoff``, streamed as ``add_request_streaming`` is."""
        route = self._route(prompt, sampling_params, None, None)
        return self._handoff_stream(route, kv_meta, src_block_ids)

    def release_handoff(self, request_id: int) -> None:
        """Release a hand-off's pinned blocks on the engine whose prefill reply named it.

        Megatron's coordinator broadcasts RELEASE_KV to its engines; over a fleet each
        coordinator numbers its own requests, so it goes to the one that made ``request_id``
        only (a reply through this client; an id it never saw is logged and dropped).
        """
        client = self._handoffs.pop(request_id, None)
        if client is None:
            log.warning("release_handoff(%s): no prefill reply of this client had it", request_id)
            return
        client.release_handoff(request_id)

    async def _decode_handle(self, route: _Route) -> PickHandle:
        pair = await self._pick(route, _NO_OPTIONS, None, ())
        if pair.prefill is not None:  # the decode engine only: its prefill peer is given
            pair.prefill.release()
        return pair.decode

    async def _handoff(self, route: _Route, kv_meta: Any, block_ids: Any) -> Any:
        handle = await self._decode_handle(route)
        try:
            return await self._on(
                handle,
                route,
                lambda client: client.add_request_with_kv_handoff(
                    route.prompt, route.params, kv_meta, block_ids
                ),
            )
        except _Lost as lost:
            raise RequestLostError(handle.engine_id, lost.reason, tokens=0, resent=False) from None

    async def _handoff_stream(
        self, route: _Route, kv_meta: Any, block_ids: Any
    ) -> AsyncIterator[Any]:
        handle = await self._decode_handle(route)

        def start(client: EngineClient) -> AsyncIterator[Any]:
            return client.add_request_with_kv_handoff_streaming(
                route.prompt, route.params, kv_meta, block_ids
            )

        try:
            async for item in self._items(handle, start):
                yield item
        except _Lost as lost:
            raise RequestLostError(handle.engine_id, lost.reason, tokens=0, resent=False) from None

    @staticmethod
    def _options(
        session_key: str | bytes | int | None,
        selector: Mapping[str, str] | None,
        priority: int,
        multi_modal_data: Any,
    ) -> dict[str, Any]:
        """The pick's options; a request with images is routed by load alone (``images``)."""
        return {
            "session_key": session_key,
            "selector": selector,
            "priority": priority,
            "images": multi_modal_data is not None,
        }

    def _route(
        self,
        prompt: str | Sequence[int],
        sampling_params: Any,
        multi_modal_data: Any,
        prompt_tokens: Sequence[int] | None,
    ) -> _Route:
        if self._loop is None:
            raise RuntimeError("start the fleet client first (async with FleetClient(...))")
        if self._closed:
            raise RuntimeError("the fleet client is stopped")
        tokens = prompt_tokens if prompt_tokens is not None else prompt
        if isinstance(tokens, str):
            tokens = ()  # no token ids: no affinity, only load
        generate = _get(sampling_params, "num_tokens_to_generate") or 0
        # tuple.__new__: no NamedTuple Python-level __new__ (this runs per request)
        return tuple.__new__(
            _Route, (prompt, sampling_params, multi_modal_data, tokens, int(generate))
        )

    async def _pick(
        self,
        route: _Route,
        options: Mapping[str, Any],
        wait: float | None,
        excluded: Collection[str],
    ) -> PickPair:
        """The engine (or pair) for one attempt; held while no engine is ready but may be."""
        deadline: float | None = None
        while True:
            try:
                return await self._pick_once(route, options, wait, excluded)
            except NoEngineAvailableError:
                if not self._may_be_ready(excluded):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (self._hold if wait is None else wait)
                if now >= deadline:
                    raise
                await self._table_change(deadline - now)

    def statuses(self) -> dict[str, int]:
        """How many engines the router sees, by their records' status (``ready``: 2, ...)."""
        counts: dict[str, int] = {}
        for record in self._router.engines().values():
            counts[record.status.value] = counts.get(record.status.value, 0) + 1
        return counts

    def may_be_ready(self) -> bool:
        """Whether a request would be held now (an engine paused, starting or stalled)."""
        return self._may_be_ready(())

    def _may_be_ready(self, excluded: Collection[str]) -> bool:
        """Whether an engine the router sees is not ready now but may be (a refit)."""
        records = self._router.engines()
        return any(r.status in _HELD for e, r in records.items() if e not in excluded)

    async def _table_change(self, timeout: float) -> None:
        """Return after the router's table next changes, or after ``timeout`` seconds."""
        assert self._loop is not None
        change = self._loop.create_future()
        self._changes.append(change)
        try:
            await asyncio.wait([change], timeout=timeout)
        finally:
            if not change.done():
                change.cancel()
                self._changes.remove(change)

    async def _pick_once(
        self,
        route: _Route,
        options: Mapping[str, Any],
        wait: float | None,
        excluded: Collection[str],
    ) -> PickPair:
        router = self._router
        if not self._disaggregated:
            handle = await router.apick(
                route.tokens, route.max_tokens, exclude=excluded, wait=wait, **options
            )
            return PickPair(None, handle)
        pick = router.pick_pair
        arguments = {
            "exclude_prefill": excluded,
            "exclude_decode": excluded,
            "allow_aggregated": True,
            "session_key": options["session_key"],
            "selector": options["selector"],
            "priority": options["priority"],
            "images": options["images"],
        }
        try:  # at once when there is room: a pair pick waits in a thread, not on the loop
            return pick(route.tokens, route.max_tokens, wait=0, **arguments)
        except NoEngineAvailableError:
            if wait == 0 or (wait is None and not router._admit):
                raise
        return await asyncio.to_thread(pick, route.tokens, route.max_tokens, wait=wait, **arguments)

    def _pick_now(
        self,
        route: _Route,
        options: Mapping[str, Any],
        wait: float | None,
        excluded: Collection[str],
        listener: Callable[[PickHandle], object],
    ) -> PickHandle | None:
        """The engine for an aggregated fleet's request at once; None when it must wait.

        ``listener`` hears of the handle's loss (``PickHandle.on_lost``, on the table's
        event thread), from the pick on.
        """
        router = self._router
        if options is _NO_OPTIONS and wait is None and not excluded:  # most requests
            if not router._admit:  # a pick that never waits: pick's own, the state's picker
                handle = router.pick(route.tokens, route.max_tokens)
                handle.on_lost(listener)
                return handle
            ask, timeout = router._plain_ask(route.tokens, route.max_tokens)
            return router._pick_now(ask, timeout, listener)
        ask, timeout = router._ask(
            route.tokens,
            route.max_tokens,
            selector=options["selector"],
            weight_version=None,
            min_weight_version=None,
            max_version_lag=None,
            block_hashes=None,
            exclude=excluded,
            wait=wait,
            priority=options["priority"],
            session_key=options["session_key"],
            images=options["images"],
        )
        return router._pick_now(ask, timeout, listener)

    async def _send(self, route: _Route, pair: PickPair) -> Any:
        """One attempt on a pair: prefill, then decode; releases its handles."""
        prefill = pair.prefill
        assert prefill is not None  # one engine alone is a _Request's own attempt
        try:
            first = await self._on(prefill, route, _submit(route, _handoff_params(route.params)))
            handoff = first["disaggregated_params"]
            reply = await self._on(
                pair.decode,
                route,
                lambda client: client.add_request_with_kv_handoff(
                    route.prompt, route.params, handoff["kv_meta"], handoff["block_ids"]
                ),
                keep=(prefill,),
            )
            (await self._client(prefill)).release_handoff(handoff["request_id"])
            return reply
        finally:
            if not prefill.released:
                prefill.release()
            if not pair.decode.released:
                pair.decode.release()

    async def _on(
        self,
        handle: PickHandle,
        route: _Route,
        submit: Callable[[EngineClient], asyncio.Future[Any]],
        keep: Sequence[PickHandle] = (),
    ) -> Any:
        """Submit on ``handle``'s engine and await the reply, or raise _Lost first.

        Also lost if an engine of ``keep`` is (the prefill engine a decode engine pulls from).
        """
        client = await self._reach(handle)
        future = submit(client)
        engine_request = client.next_request_id - 1  # as Megatron's own callers learn it
        # Plain futures woken by callbacks, no task per watch: this runs once per request.
        assert self._loop is not None
        woken = self._loop.create_future()

        def wake(_: object) -> None:
            if not woken.done():
                woken.set_result(None)

        future.add_done_callback(wake)
        watched = [self._watch(h, wake) for h in (handle, *keep)]
        try:
            await woken
        except asyncio.CancelledError:
            _abort(client, engine_request, future)
            handle.release()
            raise
        if future.done() and not future.cancelled():
            reply = future.result()
            handle.release()  # it answered, whatever the reply says of the request
            return reply
        if future.cancelled():  # not by us (that is the except above): its client stopped
            handle.release(failed=True)
            raise _Lost(handle, self._stopped_reason(handle))
        _abort(client, engine_request, future)
        lost = next(w for w in watched if w.done())
        handle.release(failed=lost is watched[0])
        raise _Lost(handle if lost is watched[0] else keep[0], lost.result())

    def _watch(self, handle: PickHandle, wake: Callable[[object], None]) -> asyncio.Future[str]:
        """A future of the reason ``handle``'s engine is lost, calling ``wake`` when it is.

        The router resolves it on this loop (``wait_lost`` without its task); it is left to
        the garbage collector: the router forgets it when the handle is released.
        """
        assert self._loop is not None
        lost: asyncio.Future[str] = self._loop.create_future()
        if not self._router._listen(handle, lost):
            lost.set_result(handle.lost or "")
        lost.add_done_callback(wake)
        return lost

    def _stopped_reason(self, handle: PickHandle) -> str:
        """Why ``handle``'s engine's client stopped under a request it had not answered.

        ``_sync`` stops the client of an engine whose record left or moved at once, and
        Megatron's ``stop()`` cancels the futures and ends the streams it holds; the router
        tells the handle later (a record gone while ready is held as unconfirmed first), or
        never (a new address is the same engine): the request is lost there all the same.
        """
        if self._closed:
            return "the fleet client was stopped"
        return handle.lost or "its client was stopped: the engine left the table or moved"

    async def _stream(
        self, route: _Route, options: Mapping[str, Any], wait: float | None
    ) -> AsyncIterator[Any]:
        excluded: set[str] = set()
        resent = False
        while True:
            pair = await self._pick(route, options, wait, excluded)
            tokens = 0
            try:
                async for item in self._stream_on(route, pair):
                    partial = item.get("partial") if isinstance(item, dict) else None
                    if isinstance(partial, dict):
                        tokens += len(partial.get("new_tokens") or ())
                    yield item
                return
            except _Lost as lost:
                excluded.add(lost.handle.engine_id)
                if tokens or not self._resend or resent or self._closed:
                    raise RequestLostError(
                        lost.handle.engine_id, lost.reason, tokens=tokens, resent=resent
                    ) from None
                resent = True
                _log_resend(lost.handle.engine_id, lost.reason, "stream")

    async def _stream_on(self, route: _Route, pair: PickPair) -> AsyncIterator[Any]:
        """One streamed attempt: items until the final one; raises _Lost on a loss."""
        prefill, decode = pair.prefill, pair.decode
        handoff: Any = None
        try:
            if prefill is not None:
                first = await self._on(
                    prefill, route, _submit(route, _handoff_params(route.params))
                )
                handoff = first["disaggregated_params"]

            def start(client: EngineClient) -> AsyncIterator[Any]:
                if handoff is None:
                    if route.images is None:  # as megatron-core 0.16 takes it: no keyword
                        return client.add_request_streaming(route.prompt, route.params)
                    return client.add_request_streaming(
                        route.prompt, route.params, multi_modal_data=route.images
                    )
                return client.add_request_with_kv_handoff_streaming(
                    route.prompt, route.params, handoff["kv_meta"], handoff["block_ids"]
                )

            async for item in self._items(decode, start):
                if handoff is not None and prefill is not None:
                    (await self._client(prefill)).release_handoff(handoff["request_id"])
                    prefill.release()
                    handoff = None  # released after the first output, as Megatron's Dynamo does
                yield item
        finally:
            if prefill is not None and not prefill.released:
                prefill.release()
            if not decode.released:
                decode.release()

    async def _items(
        self, handle: PickHandle, start: Callable[[EngineClient], AsyncIterator[Any]]
    ) -> AsyncIterator[Any]:
        client = await self._reach(handle)
        stream = start(client)
        engine_request = client.next_request_id - 1
        items = stream.__aiter__()
        lost = asyncio.ensure_future(handle.wait_lost())
        try:
            while True:
                following = asyncio.ensure_future(items.__anext__())
                await asyncio.wait([following, lost], return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    _abort(client, engine_request, None)
                    handle.release(failed=True)
                    raise _Lost(handle, lost.result())
                try:
                    item = following.result()
                except StopAsyncIteration:  # ended without its final item: client stopped
                    handle.release(failed=True)
                    raise _Lost(handle, self._stopped_reason(handle)) from None
                if isinstance(item, dict) and "final" in item:
                    # Released before it is handed out: a caller that stops reading here
                    # (a return in its loop) holds nothing, and its close aborts nothing.
                    handle.release()
                    yield item
                    return
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            if not handle.released:  # not after the final item: the engine is done with it
                _abort(client, engine_request, None)
                handle.release()
            raise
        finally:
            lost.cancel()

    # -- fleet control -------------------------------------------------------------------

    async def pause(self, selector: Mapping[str, str] | None = None) -> ControlResult:
        """Pause the engines: each record ``paused`` (routers stop picking it), then PAUSE."""
        return await self._control(selector, _paused_first, "pause_engines")

    async def suspend(self, selector: Mapping[str, str] | None = None) -> ControlResult:
        """Pause the engines (as ``pause``), then SUSPEND: their GPU memory offloaded."""
        return await self._control(selector, _paused_first, "pause_engines", "suspend_engines")

    async def resume(
        self, weight_version: int | None = None, selector: Mapping[str, str] | None = None
    ) -> ControlResult:
        """Resume the engines, on ``weight_version`` if given (Megatron's generation epoch).

        Per engine: SET_GENERATION_EPOCH (with a version), RESUME, UNPAUSE, then its record
        ``ready`` on the version, in one write: no router sees it ready on the old one.
        """
        signals: tuple[str, ...] = ("resume_engines", "unpause_engines")
        if weight_version is not None:
            signals = ("set_generation_epoch", *signals)
        return await self._control(
            selector, _ready_after(weight_version), *signals, epoch=weight_version
        )

    async def set_generation_epoch(
        self, epoch: int, selector: Mapping[str, str] | None = None
    ) -> ControlResult:
        """SET_GENERATION_EPOCH on the engines, then their records' ``weight_version``."""
        return await self._control(
            selector, _ready_after(epoch, status=False), "set_generation_epoch", epoch=epoch
        )

    async def unpause(self, selector: Mapping[str, str] | None = None) -> ControlResult:
        """UNPAUSE the engines (Megatron's ``unpause_engines``), then their records ``ready``."""
        return await self._control(selector, _ready_after(None), "unpause_engines")

    def send(
        self, signal: str, selector: Mapping[str, str] | None = None
    ) -> asyncio.Future[ControlResult]:
        """Megatron's control ``signal`` to each engine; its record is left as it is.

        ``signal`` is a method of Megatron's client that takes no argument
        (``start_cuda_profiler``, ``stop_engines``, ...). It goes at once through every
        client open (as Megatron's client sends it), and to the others once they open;
        the future resolves when it went everywhere it could.
        """
        assert self._loop is not None
        records = self._router.engines()
        sent: dict[str, str | None] = {}
        later = []
        for engine_id, record in sorted(records.items()):
            if not record.matches(selector):
                continue
            engine = self._engines.get(engine_id)
            if engine is not None and engine.client is not None:
                sent[engine_id] = _send_now(engine.client, signal)
            else:
                later.append((engine_id, record))
        result: asyncio.Future[ControlResult] = self._loop.create_future()

        async def rest() -> None:
            outcomes = await asyncio.gather(
                *(self._control_one(e, r, _Mark(), (signal,), None) for e, r in later)
            )
            sent.update(zip((e for e, _ in later), outcomes, strict=True))
            result.set_result(self._result(sent))

        if later:
            self._keep(asyncio.ensure_future(rest()))
        else:
            result.set_result(self._result(sent))
        return result

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)  # kept until done: the loop holds its tasks weakly
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _result(outcomes: Mapping[str, str | None]) -> ControlResult:
        done = tuple(e for e, problem in outcomes.items() if problem is None)
        failed = {e: p for e, p in outcomes.items() if p is not None}
        for engine_id, problem in failed.items():
            log.warning("engine %s: %s", engine_id, problem)
        return ControlResult(done, failed)

    async def _control(
        self,
        selector: Mapping[str, str] | None,
        mark: _Mark,
        *signals: str,
        epoch: int | None = None,
    ) -> ControlResult:
        records = self._router.engines()
        chosen = [e for e, r in sorted(records.items()) if r.matches(selector)]
        outcomes = await asyncio.gather(
            *(self._control_one(e, records[e], mark, signals, epoch) for e in chosen)
        )
        return self._result(dict(zip(chosen, outcomes, strict=True)))

    async def _control_one(
        self,
        engine_id: str,
        record: EngineRecord,
        mark: _Mark,
        signals: Sequence[str],
        epoch: int | None,
    ) -> str | None:
        """One engine's step; None, or what went wrong (and what was left as it was)."""
        if mark.before is not None:
            problem = await self._mark(engine_id, mark.before)
            if problem is not None:
                return f"{problem}; no signal sent"
            # Picks read the table: once it shows the mark, none picks the engine (and
            # every earlier pick of this loop submitted already, with no await between).
            try:
                await asyncio.to_thread(
                    self._router._table.wait_until,
                    lambda snapshot: _not_ready(snapshot.get(engine_id)),
                    self._connect_timeout,
                )
            except TimeoutError:
                return "the router's table did not show its record paused; no signal sent"
        engine = self._engines.get(engine_id) or self._open(engine_id, record)
        try:
            client = await asyncio.shield(engine.ready)
        except Exception as exc:
            return f"no client to send {', '.join(signals)}: {exc}"
        for signal in signals:
            method = getattr(client, signal, None)
            if method is None:
                return f"its client ({type(client).__module__}) has no {signal}"
            sent = method(epoch) if signal == "set_generation_epoch" else method()
            if inspect.isawaitable(sent):  # megatron-core 0.16's pause: PAUSE_ACK
                try:
                    await asyncio.wait_for(sent, self._connect_timeout)
                except TimeoutError:
                    return f"{signal} sent, not acknowledged in {self._connect_timeout} s"
        if mark.after is not None:
            problem = await self._mark(engine_id, mark.after)
            if problem is not None:
                return f"signals sent, but {problem}: its record is left as it was"
        return None

    async def _mark(self, engine_id: str, write: Callable[..., Any]) -> str | None:
        """Write the engine's record (a thread: etcd I/O); None, or why it could not."""
        try:
            written = await asyncio.to_thread(
                write, engine_id, settings=self._settings, connection=self._connection
            )
        except DiscoveryError as exc:
            return f"its record could not be written ({exc})"
        return None if written is not None else "it has no record in etcd"


class _Request(asyncio.Future[Any]):
    """One ``add_request``: the caller's future, driven by callbacks (no task per request).

    Callbacks on the engine's reply and the router's loss notice drive it; a task runs only
    while a pick waits for room, or for a prefill/decode pair. An attempt: the pick, the
    engine's client (opened if need be), the submit, then the reply or the engine's loss,
    whichever comes first; a loss releases the handle as failed, aborts the request there
    and sends it once more elsewhere. ``cancel()`` aborts the request on its engine.
    """

    __slots__ = (
        "_client",
        "_engine_request",
        "_excluded",
        "_fleet",
        "_handle",
        "_options",
        "_reply",
        "_resent",
        "_route",
        "_task",
        "_wait",
    )

    def __init__(
        self, fleet: FleetClient, route: _Route, options: Mapping[str, Any], wait: float | None
    ) -> None:
        super().__init__(loop=fleet._loop)
        self._fleet = fleet
        self._route = route
        self._options = options
        self._wait = wait
        self._excluded: frozenset[str] = frozenset()  # the engines lost under it
        self._resent = False
        self._task: asyncio.Future[Any] | None = None  # a waiting pick, or a pair's attempt
        self._handle: PickHandle | None = None  # the attempt's on one engine
        self._client: EngineClient | None = None
        self._reply: asyncio.Future[Any] | None = None  # the engine's, until it is settled
        self._engine_request = 0
        self._attempt()

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the request: abort it where it is (a waiting pick gives its place up)."""
        if not super().cancel(msg):
            return False
        if self._task is not None:
            self._task.cancel()  # a waiting pick gives its place up; a pair aborts
        reply, handle = self._reply, self._handle
        if reply is not None and handle is not None:
            self._reply = None
            assert self._client is not None
            _abort(self._client, self._engine_request, reply)
            handle.release()
        return True

    def _attempt(self) -> None:
        fleet = self._fleet
        if not fleet._disaggregated:
            try:
                handle = fleet._pick_now(
                    self._route, self._options, self._wait, self._excluded, self._heard_lost
                )
            except NoEngineAvailableError as exc:  # held (``_pick``) if an engine may be ready
                if self._wait == 0 or not fleet._may_be_ready(self._excluded):
                    self._fail(exc)
                    return
            except Exception as exc:
                self._fail(exc)
                return
            else:
                if handle is not None:
                    self._on(handle)
                    return
        self._task = asyncio.ensure_future(
            fleet._pick(self._route, self._options, self._wait, self._excluded)
        )
        self._task.add_done_callback(self._picked)

    def _picked(self, task: asyncio.Future[PickPair]) -> None:
        self._task = None
        if task.cancelled():  # by cancel(): the request is over
            return
        error = task.exception()
        if error is not None:
            self._fail(error)
            return
        pair = task.result()
        if self.done():  # cancelled as the pick was served
            pair.release()
        elif pair.prefill is None:
            if self._fleet._router._listen(pair.decode, self._heard_lost):
                self._on(pair.decode)
            else:  # lost already: nothing was sent
                pair.decode.release(failed=True)
                self._resend(pair.decode, pair.decode.lost or "")
        else:
            self._task = asyncio.ensure_future(self._fleet._send(self._route, pair))
            self._task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Future[Any]) -> None:
        self._task = None
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, _Lost):
            self._resend(error.handle, error.reason)
        elif error is not None:
            self._fail(error)
        elif not self.done():
            self.set_result(task.result())

    def _on(self, handle: PickHandle) -> None:
        """Send on ``handle``'s engine (its loss heard): at once when its client is open."""
        self._handle = handle
        fleet = self._fleet
        record = handle.record  # read once: the handle's shortcuts are properties
        engine = fleet._engines.get(record.engine_id)
        address = record.endpoint.coordinator_address
        if engine is not None and engine.address == address and engine.client is not None:
            self._submit(handle, engine.client)
            return
        if engine is None or engine.address != address:
            engine = fleet._open(record.engine_id, record)
        engine.ready.add_done_callback(lambda ready: self._reached(handle, ready))

    def _reached(self, handle: PickHandle, ready: asyncio.Future[EngineClient]) -> None:
        if self.done():  # cancelled meanwhile: nothing was sent
            handle.release()
            return
        error = None if ready.cancelled() else ready.exception()
        if isinstance(error, ConfigurationError):  # no client factory: not the engine's
            handle.release()
            self._fail(error)
        elif ready.cancelled() or error is not None:  # unreachable: nothing was sent
            handle.release(failed=True)
            reason = "its client was closed" if error is None else str(error)
            self._resend(handle, f"no client: {reason}")
        elif handle.lost is not None:  # lost while its client opened (_lost had no reply)
            handle.release(failed=True)
            self._resend(handle, handle.lost)
        else:
            self._submit(handle, ready.result())

    def _submit(self, handle: PickHandle, client: EngineClient) -> None:
        route = self._route
        try:
            if route.images is None:  # as megatron-core 0.16 takes it: no keyword
                reply = client.add_request(route.prompt, route.params)
            else:
                reply = client.add_request(
                    route.prompt, route.params, multi_modal_data=route.images
                )
        except Exception as exc:
            handle.__exit__(type(exc))  # released, no outcome: it may not be the engine's
            self._fail(exc)
            return
        self._client = client
        self._engine_request = client.next_request_id - 1  # as Megatron's own callers learn it
        self._reply = reply
        reply.add_done_callback(self._replied)

    def _replied(self, reply: asyncio.Future[Any]) -> None:
        handle = self._handle
        if reply is not self._reply or handle is None:  # settled already (lost, cancelled)
            return
        self._reply = None
        if reply.cancelled():  # not by us: its client stopped
            handle.release(failed=True)
            self._resend(handle, self._fleet._stopped_reason(handle))
            return
        error = reply.exception()
        if error is not None:
            handle.__exit__(type(error))
            self._fail(error)
            return
        handle.release()  # it answered, whatever the reply says of the request
        result = reply.result()
        if type(result) is dict and result.get("disaggregated_params"):  # a prefill reply
            assert self._client is not None
            self._fleet._handoffs[result["disaggregated_params"]["request_id"]] = self._client
        if not self.done():
            self.set_result(result)

    def _heard_lost(self, handle: PickHandle) -> None:
        """The router's notice (on the table's event thread): handle it on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.get_loop().call_soon_threadsafe(self._lost, handle)

    def _lost(self, handle: PickHandle) -> None:
        reply = self._reply
        if handle is not self._handle or reply is None or reply.done():
            return  # settled already, or the reply came first (its callback runs next)
        self._reply = None
        assert self._client is not None
        _abort(self._client, self._engine_request, reply)
        handle.release(failed=True)
        self._resend(handle, handle.lost or "")

    def _resend(self, handle: PickHandle, reason: str) -> None:
        """The attempt on ``handle``'s engine was lost: send it again elsewhere, or fail."""
        fleet = self._fleet
        self._excluded = self._excluded | {handle.engine_id}
        if self.done():
            return
        if not fleet._resend or self._resent or fleet._closed:
            self.set_exception(
                RequestLostError(handle.engine_id, reason, tokens=0, resent=self._resent)
            )
            return
        self._resent = True
        _log_resend(handle.engine_id, reason, "request")
        self._attempt()

    def _fail(self, error: BaseException) -> None:
        if not self.done():
            self.set_exception(error)


class _Route(NamedTuple):
    prompt: str | Sequence[int]
    params: Any
    images: Any
    tokens: Sequence[int]
    max_tokens: int


_NO_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {"session_key": None, "selector": None, "priority": 0, "images": False}
)
"""A request's pick options when it gives none (``Router._plain_ask``'s case)."""


@dataclass(frozen=True)
class _Mark:
    """A control call's record writes: before the signals, after them."""

    before: Callable[..., Any] | None = None
    after: Callable[..., Any] | None = None


_paused_first = _Mark(before=mark_paused)


def _ready_after(version: int | None, *, status: bool = True) -> _Mark:
    """Ready on ``version`` after the signals (``status`` False: the version only)."""

    def write(engine_id: str, **where: Any) -> EngineRecord | None:
        if status:
            return mark_ready(engine_id, version, **where)
        assert version is not None
        return set_weight_version(engine_id, version, **where)

    return _Mark(after=write)


def _not_ready(record: EngineRecord | None) -> bool:
    return record is None or record.status is not EngineStatus.READY


def _submit(route: _Route, params: Any) -> Callable[[EngineClient], asyncio.Future[Any]]:
    def submit(client: EngineClient) -> asyncio.Future[Any]:
        if route.images is None:
            return client.add_request(route.prompt, params)
        return client.add_request(route.prompt, params, multi_modal_data=route.images)

    return submit


def _send_now(client: EngineClient, signal: str) -> str | None:
    """Call ``signal`` on ``client`` now; None, or why it could not."""
    method = getattr(client, signal, None)
    if method is None:
        return f"its client ({type(client).__module__}) has no {signal}"
    try:
        method()
    except Exception as exc:  # a client that closed meanwhile
        return f"{signal} failed: {exc}"
    return None


def _log_resend(engine_id: str, reason: str, what: str) -> None:
    log.warning(
        "engine %s lost before it answered (%s): sending the %s again", engine_id, reason, what
    )


def _abort(client: EngineClient, request_id: int, future: asyncio.Future[Any] | None) -> None:
    """Abort a request on its engine, best effort (a dead engine hears nothing)."""
    if future is not None and future.done():
        return
    with contextlib.suppress(Exception):
        client.abort_request(request_id)


def _get(params: Any, name: str) -> Any:
    # Per request: a dict or Megatron's SamplingParams first, the Mapping ABC check (slow
    # for any other class) last.
    if type(params) is dict:
        return params.get(name)
    value = getattr(params, name, _ABSENT)
    if value is not _ABSENT:
        return value
    return params.get(name) if isinstance(params, Mapping) else None


_ABSENT = object()


def _handoff_params(params: Any) -> Any:
    """The prefill side's sampling params: one token, the blocks pinned for the hand-off."""
    changes = {"do_kv_handoff": True, "num_tokens_to_generate": 1}
    if isinstance(params, Mapping):
        return {**params, **changes}
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.replace(params, **changes)
    copied = copy.copy(params)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


class _LoopProxy:
    """The event loop as an engine's client sees it while it starts on a thread of its own.

    What the client schedules with ``create_task`` (Megatron's receive task) is created on
    the loop's own thread (``_LoopTask``); everything else is the loop's.
    """

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def create_task(self, coro: Any, **options: Any) -> Any:
        """The task on the loop: at once on its thread, else through ``call_soon_threadsafe``."""
        if _on_thread_of(self._loop):
            return self._loop.create_task(coro, **options)
        return _LoopTask(self._loop, coro, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class _LoopTask:
    """A task created on ``loop``'s thread for a caller on another, as a task to its owner.

    ``cancel()`` on the loop's thread cancels the task then and there: Megatron's ``stop()``
    cancels its receive task and closes the socket next, and a cancellation still on its way
    (``run_coroutine_threadsafe``'s) let the task read the closed socket once more
    (ZMQError, and Megatron's ``trace_async_exceptions`` exits the process).
    """

    __slots__ = ("_cancelled", "_coro", "_loop", "_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Any, options: Any) -> None:
        self._loop = loop
        self._coro = coro
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        loop.call_soon_threadsafe(self._create, options)

    def _create(self, options: Any) -> None:
        if self._cancelled:
            self._coro.close()  # never started: nothing to cancel
            return
        self._task = self._loop.create_task(self._coro, **options)

    def cancel(self) -> bool:
        """Cancel the task (at once on the loop's thread)."""
        if not _on_thread_of(self._loop):
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing runs
                self._loop.call_soon_threadsafe(self.cancel)
            return True
        self._cancelled = True
        return self._task.cancel() if self._task is not None else True

    def done(self) -> bool:
        """Whether the task is done (or was cancelled before it started)."""
        return self._task.done() if self._task is not None else self._cancelled


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


_PARAMETERS: dict[Any, frozenset[str]] = {}


def _parameters(method: Callable[..., Any]) -> frozenset[str]:
    """The names ``method`` takes (cached by its function: this runs once per client)."""
    function = getattr(method, "__func__", method)
    names = _PARAMETERS.get(function)
    if names is None:
        names = _PARAMETERS[function] = frozenset(inspect.signature(method).parameters)
    return names


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _failed(loop: asyncio.AbstractEventLoop | None, error: BaseException) -> asyncio.Future[Any]:
    assert loop is not None
    future: asyncio.Future[Any] = loop.create_future()
    future.set_exception(error)
    return future
