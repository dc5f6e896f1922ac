"""Megatron's engine events: a receiver that registers the engine, watches it, relays it.

The wire contract (Megatron-LM, ``megatron/inference/integrations/dynamo/telemetry.py``):
the parent binds a ZeroMQ PULL socket (a random port, or a fixed one for engines started by
another launcher) and hands its address to the engine (``--dynamo-parent-event-address``);
global rank zero connects a PUSH socket (LINGER 0) and sends ``msgpack.packb([kind,
payload], use_bin_type=True)`` frames. PUSH/PULL says nothing when the engine dies: whoever
started the engine watches the process (``discovery launch`` does, in ``_engine/launch.py``).

What the receiver does with each kind, each outcome counted in ``health()`` and in
``discovery_engine_events_total{outcome}``:

- ``ready`` (outcome ``ready``): in either shape Megatron sends (``READY_SHAPES``). The
  first valid one registers the engine; a later one with another endpoint or role updates
  the record atomically, on the same lease. The payload's ``role`` (the nested shape
  always has one; Megatron's flat shape none) becomes the record's ``role``: it wins over
  the one given to the receiver, with a warning, and a role this version does not know is
  kept. Keys this version does not know are stored too. A payload of no known shape, or
  an invalid one, is ``rejected``: logged with the shapes accepted, nothing written.
- ``stored`` / ``removed`` / ``cleared`` (outcome ``kv``): the engine's prefix cache
  (``_state/kvstate.py``), kept from the first frame on (before ready too) and relayed to routers
  (``_state/relay.py``); a payload without a list of 64-bit block hashes is ``malformed``.
- ``progress`` (outcome ``progress``): a heartbeat Megatron sends from its scheduling loop
  while the engine runs (at most every 0.5 s).
- anything else (``handoff_imported``, a kind from the future): ``ignored``.
- ``malformed``: not msgpack, or not a ``[str, payload]`` pair; logged with the reason.

**Hung engines.** Once an engine has sent ``progress``, the receiver expects to keep hearing
from it (any frame) while its record is ``ready``: after ``stall_timeout`` seconds of
silence (default ``DEFAULT_STALL_TIMEOUT``: twice the 5 s Megatron's own parent waits for a
heartbeat) the record becomes ``stalled`` (routers skip it, as ``draining``), with one
WARNING and the ``discovery_engine_stalled`` metric; the next frame makes it ``ready``
again. An engine that never sends progress (Megatron before its heartbeat) is never marked;
silence while the record is not ``ready`` (draining, paused, starting) is no stall, and the
silence is counted from when it became ``ready`` again. A status change never overrides one
made meanwhile from outside (an operator's drain wins).

Pause, suspend and resume: Megatron's dynamic engine can be paused or suspended (for a
weight update, or to free memory for training) and resumed, but no public Megatron code
sends an event for that to this socket (it tells its own coordinator and clients, not the
parent). So there is nothing to map to the record's ``paused`` status here: such a frame
would be ``ignored`` like any other kind. A rollout framework that pauses the engine marks
it through the API instead (``Registration.pause()`` / ``resume()`` on the receiver's
``registration``, or ``discovery pause`` / ``resume`` from outside).

When the first registration is refused (conflict, permission, etcd unavailable past the
dial timeout) the receiver is ``failed`` and registers nothing more.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from discovery._dispatch import Dispatcher, Listeners
from discovery._errors import ClosedError, ConfigurationError, DiscoveryError, InvalidRecordError
from discovery._metrics import NO_METRICS, MetricsHooks
from discovery._records.codec import encode
from discovery._records.endpoint import InferenceEngineEndpoint
from discovery._records.handoff import (
    EngineRole,
    KvLayout,
    KvTransferBackend,
    read_role,
    validate_backend,
    validate_layout,
    validate_role,
)
from discovery._records.record import (
    EngineRecord,
    EngineStatus,
    endpoint_from_dict,
    validate_engine_id,
    validate_weight_version,
)
from discovery._records.selector import validate_labels
from discovery._state.kvstate import KV_KINDS, kv_change
from discovery._state.relay import StateRelay, bind_socket
from discovery._writes.registration import Registration, default_engine_id, register_record
from discovery._writes.session import check_ttl

if TYPE_CHECKING:
    import zmq

    from discovery._etcd.port import EtcdPort
    from discovery._settings import Settings

__all__ = ["DEFAULT_STALL_TIMEOUT", "EngineEventReceiver", "ReceiverHealth", "ReceiverState"]

log = logging.getLogger(__name__)

READY = "ready"
PROGRESS = "progress"
EXTRA = "launch"
DEFAULT_STALL_TIMEOUT = 10.0
READY_SHAPES = (
    "flat {coordinator_address, capabilities} (InferenceEngineEndpoint.to_dict()) or nested "
    "{coordinator_address, engine: {...capabilities, role}} (engine_metadata() of Megatron's "
    "dynamo integration), each with or without version"
)
_LOUD_PROBLEMS = 10  # malformed/rejected frames logged at WARNING; the rest at DEBUG
_MAX_FRAME = 64 << 20  # a stored event of a 128k-token prompt is ~1.2 MB; a flood is not
_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def _brief(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_frame(frame: bytes) -> tuple[str, Any]:
    """``(kind, payload)`` from one frame, or ValueError saying what is wrong with it."""
    import msgpack  # noqa: PLC0415

    try:
        message = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(message, list) or len(message) != 2 or not isinstance(message[0], str):
        raise ValueError(f"not a [kind, payload] pair: {_brief(message)}")
    return message[0], message[1]


@dataclass(frozen=True)
class ReadyMessage:
    """What a ready payload says, in either of Megatron's shapes."""

    endpoint: InferenceEngineEndpoint
    role: EngineRole | str | None
    """The engine's role, if the payload has one (kept when this version does not know it)."""
    extra: Mapping[str, Any]
    """Top-level keys this version does not know (stored with the record)."""
    extra_capabilities: Mapping[str, Any]
    """Capability keys this version does not know (stored with the record)."""
    version: object = None
    """The payload's ``version``, if it has one (not stored)."""


def parse_ready(payload: object) -> ReadyMessage:
    """The ready message in ``payload``, or InvalidRecordError naming what is wrong.

    Flat: ``InferenceEngineEndpoint.to_dict()`` (a ``role`` key too, if present). Nested:
    ``{"coordinator_address", "engine": {...capabilities, "role"}}``. Either may carry
    ``version``. See ``READY_SHAPES``.
    """
    if not isinstance(payload, Mapping):
        raise InvalidRecordError(
            f"ready payload is a {type(payload).__name__}, not a map: accepted are {READY_SHAPES}"
        )
    payload = dict(payload)
    version = payload.pop("version", None)
    if isinstance(payload.get("engine"), Mapping) and "capabilities" not in payload:
        shape = "nested ready payload"
        capabilities = dict(payload.pop("engine"))
        role = capabilities.pop("role", None)
        payload["capabilities"] = capabilities
    elif isinstance(payload.get("capabilities"), Mapping):
        shape = "flat ready payload"
        role = payload.pop("role", None)
    else:
        raise InvalidRecordError(
            f"ready payload fits no shape: accepted are {READY_SHAPES}; "
            f"its keys: {_brief(sorted(map(str, payload)))}"
        )
    try:
        role = None if role is None else read_role(role)
    except InvalidRecordError as exc:
        raise InvalidRecordError(f"{shape}: {exc}") from None
    endpoint, extra, extra_capabilities = endpoint_from_dict(payload, shape)
    return ReadyMessage(endpoint, role, extra, extra_capabilities, version)


def parse_address(address: str, what: str) -> str:
    """``address`` if it is ``tcp://HOST:PORT`` (port 1-65535 or ``*``), else ConfigurationError."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if (
        not address.startswith("tcp://")
        or not host
        or not (port == "*" or (port.isdigit() and 1 <= int(port) <= 65535))
    ):
        raise ConfigurationError(f"{what} {address!r} must be tcp://HOST:PORT (PORT 1-65535 or *)")
    return address


def advertised(bound: str, coordinator_address: str) -> str:
    """Where routers reach a socket bound at ``bound``.

    A wildcard host becomes the coordinator's host: routers reach that one already.
    """
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return bound
    engine_host = (
        coordinator_address.rsplit("://", maxsplit=1)[-1].rpartition(":")[0] or "127.0.0.1"
    )
    return f"tcp://{engine_host}:{port}"


class ReceiverState(enum.StrEnum):
    """Where an EngineEventReceiver is."""

    WAITING = "waiting"
    """Listening; no valid ready message yet."""
    REGISTERED = "registered"
    """Registered from a ready message."""
    STALLED = "stalled"
    """Registered, but silent past the stall timeout: its record is ``stalled``."""
    FAILED = "failed"
    """The registration was refused (conflict, permission, etcd unavailable)."""
    CLOSED = "closed"


@dataclass(frozen=True)
class ReceiverHealth:
    """A point-in-time view of an EngineEventReceiver: state, frame counts, relay."""

    engine_id: str
    address: str | None
    state: ReceiverState
    frames: int
    ready: int
    ignored: int
    malformed: int
    rejected: int
    last_error: str | None
    kv: int = 0
    """KV-cache events (stored, removed, cleared) taken."""
    progress: int = 0
    """Progress heartbeats received."""
    stalls: int = 0
    """Times the engine was marked stalled."""
    silence: float = 0.0
    """Seconds since the last frame from the engine."""
    state_address: str | None = None
    """Where routers read the engine's relayed state, if relayed."""
    cached_blocks: int = 0
    """Block hashes the engine holds, as its KV events say."""


_OUTCOMES = ("frames", "ready", "kv", "progress", "ignored", "malformed", "rejected", "stalls")


class EngineEventReceiver:
    """Receives a Megatron engine's events: registers it, watches it, relays its state.

    For launchers other than ``discovery launch`` (Slurm wrappers, Ray actors): start it
    (or enter it), pass ``address`` to the engine as ``--dynamo-parent-event-address``,
    and close it when the engine exits; docs/launch.md has a complete example.

    The keyword arguments are those of ``register_engine``, plus: ``host`` to bind on a
    random port (a routable address when rank zero runs on another node), or ``address``
    (``tcp://HOST:PORT``) to bind a fixed port, for engines started by another launcher;
    ``state_address`` where the state relay binds (``tcp://HOST:PORT``, ``*`` for a random
    port; True: the event host, a random port; False: no relay); ``stall_timeout``
    seconds of silence that mark a ready engine ``stalled`` (None or 0: never). ``role``
    is the engine's when its ready payload has none (Megatron's nested shape always has
    one, and it wins). Thread-safe;
    from asyncio use ``async with`` and ``await receiver.await_registered()``. The
    registration lives until ``close()``: tie that to the engine process, which the socket
    cannot tell about.
    """

    def __init__(
        self,
        *,
        host: str | None = None,
        address: str | None = None,
        state_address: str | bool = True,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        engine_id: str | None = None,
        ttl: float = 10.0,
        labels: Mapping[str, str] | None = None,
        weight_version: int | None = None,
        role: EngineRole | str | None = None,
        kv_transfer_backend: KvTransferBackend | str | None = None,
        kv_layout: KvLayout | None = None,
        settings: Settings | None = None,
        connection: EtcdPort | None = None,
        replace: bool = False,
        metrics: MetricsHooks | None = None,
    ) -> None:
        self.require_libraries()
        if host is not None and address is not None:
            raise ConfigurationError("give host (a random port) or address (a fixed one), not both")
        self.engine_id = default_engine_id() if engine_id is None else validate_engine_id(engine_id)
        self._labels = dict(validate_labels(labels))
        self._weight_version = validate_weight_version(weight_version)
        self._role = None if role is None else validate_role(role)
        self._backend = (
            None if kv_transfer_backend is None else validate_backend(kv_transfer_backend)
        )
        self._layout = validate_layout(kv_layout)
        self._ttl = check_ttl(ttl)
        host = host or "127.0.0.1"
        self._bind = parse_address(address, "event address") if address else f"tcp://{host}:*"
        if state_address is True:
            state_address = f"tcp://{self._bind.removeprefix('tcp://').rpartition(':')[0]}:*"
        self._relay = (
            StateRelay(parse_address(state_address, "state address"), name=self.engine_id)
            if state_address
            else None
        )
        if stall_timeout is not None and not stall_timeout >= 0:
            raise ConfigurationError(f"stall timeout must be >= 0 seconds, got {stall_timeout}")
        self._stall_timeout = stall_timeout or None
        self._settings = settings
        self._connection = connection
        self._replace = replace
        self._metrics = metrics
        self._hooks = metrics or NO_METRICS
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._state = ReceiverState.WAITING
        self._counts = dict.fromkeys(_OUTCOMES, 0)
        self._last_error: str | None = None
        self._error: DiscoveryError | None = None
        self._registration: Registration | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._closed = False
        self._heard = time.monotonic()  # the last frame
        self._ready_since = self._heard  # when the record last became ready (the stall clock)
        self._progress_seen = False
        self._ignored_kinds: set[str] = set()
        self._listeners: Listeners[Callable[[ReceiverState], None]] = Listeners()
        self._dispatcher = Dispatcher("discovery-receiver-events")

    @staticmethod
    def require_libraries() -> None:
        """Raise ImportError naming the extra to install when pyzmq or msgpack is missing."""
        try:
            import msgpack  # noqa: F401, PLC0415
            import zmq  # noqa: F401, PLC0415
        except ImportError as exc:
            raise ImportError(
                f"engine events need pyzmq and msgpack ({exc.name or exc} is missing): "
                f"pip install 'discovery[{EXTRA}]'"
            ) from exc

    # -- public view ------------------------------------------------------------------

    @property
    def address(self) -> str | None:
        """The socket's address (``tcp://host:port``) for the engine, once started."""
        return self._address

    @property
    def state_address(self) -> str | None:
        """Where the state relay listens, once started (None without a relay)."""
        return None if self._relay is None else self._relay.address

    @property
    def state(self) -> ReceiverState:
        """The current state."""
        return self._state

    @property
    def registration(self) -> Registration | None:
        """The registration made from the ready message, if any."""
        return self._registration

    @property
    def error(self) -> DiscoveryError | None:
        """Why the registration was refused, in state FAILED."""
        return self._error

    def health(self) -> ReceiverHealth:
        """State, frame counts, silence and the relayed state, for a health endpoint."""
        relay = self._relay.health() if self._relay is not None else None
        with self._lock:
            return ReceiverHealth(
                engine_id=self.engine_id,
                address=self._address,
                state=self._state,
                last_error=self._last_error,
                silence=time.monotonic() - self._heard,
                state_address=None if relay is None else relay.address,
                cached_blocks=0 if relay is None else relay.blocks,
                **self._counts,
            )

    def subscribe(self, callback: Callable[[ReceiverState], None]) -> Callable[[], None]:
        """Call ``callback(new_state)`` on a background thread on every state change."""
        return self._listeners.add(callback)

    def wait_registered(self, timeout: float | None = None) -> Registration:
        """Block until registered; returns the Registration.

        Raises TimeoutError when no valid ready message came within ``timeout`` seconds,
        the registration's error (e.g. EngineConflictError) when it was refused, and
        ClosedError once closed.
        """
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._state is not ReceiverState.WAITING, timeout
            ):
                raise TimeoutError(f"no valid ready message from the engine within {timeout} s")
            registration, error = self._registration, self._error
        if registration is not None and self._state is not ReceiverState.CLOSED:
            return registration
        if error is not None:
            raise error
        raise ClosedError(f"engine-event receiver of {self.engine_id!r} is closed")

    async def await_registered(self, timeout: float | None = None) -> Registration:
        """wait_registered() without blocking the event loop."""
        return await asyncio.to_thread(self.wait_registered, timeout)

    def __repr__(self) -> str:
        return f"<EngineEventReceiver {self.engine_id!r} {self._state} at {self._address}>"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Bind the PULL socket (and the state relay) and start receiving; the address."""
        import zmq  # noqa: PLC0415

        with self._lock:
            if self._closed:
                raise ClosedError(f"engine-event receiver of {self.engine_id!r} is closed")
            if self._address is not None:
                return self._address
            context = zmq.Context()
            sock = context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
            try:
                self._address = bind_socket(sock, self._bind, "engine-event socket")
                if self._relay is not None:
                    self._relay.start()
            except BaseException:
                self._address = None
                sock.close()
                context.term()
                raise
            self._wake = os.pipe()
            self._heard = time.monotonic()
            self._thread = threading.Thread(
                target=self._run,
                args=(context, sock, self._wake[0]),
                name="discovery-engine-events",
                daemon=True,
            )
            self._thread.start()
        log.info("%s: listening for engine events on %s", self.engine_id, self._address)
        return self._address

    def stop_receiving(self) -> Registration | None:
        """Stop receiving engine events; returns the registration, if one was made.

        A registration in progress completes first (within the dial timeout), so the
        answer is final: a record already visible in etcd is never missed. The
        registration stays up until ``close()``. Idempotent.
        """
        with self._lock:
            thread, wake = self._thread, self._wake
            self._thread = self._wake = None
        if thread is not None and wake is not None:
            os.write(wake[1], b"\0")
            thread.join()
            for fd in wake:
                os.close(fd)
        return self._registration

    def close(self) -> None:
        """Stop receiving and relaying, revoke the registration's lease. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        registration = self.stop_receiving()
        if self._relay is not None:
            # First: its goodbye reaches routers directly, also when etcd cannot be reached.
            self._relay.close()
        if registration is not None:
            registration.close()
        self._set_state(ReceiverState.CLOSED)
        self._dispatcher.stop()

    async def aclose(self) -> None:
        """close() without blocking the event loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> EngineEventReceiver:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> EngineEventReceiver:
        self.start()  # binds local sockets: does not block
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the receiving thread ----------------------------------------------------------

    def _run(self, context: zmq.Context[Any], sock: zmq.Socket[Any], wake: int) -> None:
        import zmq  # noqa: PLC0415

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._watch_for_silence()))
                if wake in ready:
                    return
                if sock not in ready:
                    continue
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    self._handle(frame)
                except Exception:  # a bug here must not end the registration's updates
                    log.exception("%s: handling an engine-event frame failed", self.engine_id)
        finally:
            sock.close()
            context.term()

    def _watch_for_silence(self) -> int | None:
        """Mark a silent engine stalled; how long to wait for the next frame (ms)."""
        timeout = self._stall_timeout
        registration = self._registration
        if timeout is None or not self._progress_seen or registration is None:
            return None
        now = time.monotonic()
        if registration.status not in (EngineStatus.READY, EngineStatus.STALLED):
            self._ready_since = now  # not a stall while draining or paused; counted from ready
            return int(min(timeout / 4, 1.0) * 1000)
        quiet_since = max(self._heard, self._ready_since)
        if self._state is ReceiverState.REGISTERED and now - quiet_since >= timeout:
            self._stall(now - self._heard)
        return int(max(0.0, min(quiet_since + timeout - now, timeout / 4, 1.0)) * 1000)

    def _handle(self, frame: bytes) -> None:
        self._heard = time.monotonic()
        self._tally("frames")
        if self._state is ReceiverState.STALLED:
            self._resume()
        try:
            kind, payload = decode_frame(frame)
        except ValueError as exc:
            self._problem("malformed", f"malformed engine-event frame ({len(frame)} bytes): {exc}")
            return
        if kind in KV_KINDS:
            try:
                hashes = kv_change(kind, payload)
            except ValueError as exc:
                self._problem("malformed", f"malformed KV event: {exc}")
                return
            self._tally("kv")
            if self._relay is not None:
                self._relay.publish(kind, hashes)
        elif kind == PROGRESS:
            if not self._progress_seen and self._stall_timeout is not None:
                log.info(
                    "%s: the engine sends progress heartbeats: watching for stalls (%g s)",
                    self.engine_id,
                    self._stall_timeout,
                )
            self._progress_seen = True
            self._tally("progress")
        elif kind == READY:
            self._ready(payload)
        else:
            self._tally("ignored")
            if kind not in self._ignored_kinds and len(self._ignored_kinds) < 64:
                self._ignored_kinds.add(kind)
                log.info("%s: ignoring engine events of kind %r", self.engine_id, kind)

    def _ready(self, payload: object) -> None:
        try:
            message = parse_ready(payload)
            record = EngineRecord(
                self.engine_id,
                message.endpoint,
                self._labels,
                role=self._role_from(message.role),
                kv_transfer_backend=self._backend,
                kv_layout=self._layout,
                extra=message.extra,
                extra_capabilities=message.extra_capabilities,
                weight_version=self._weight_version,
                state_address=(
                    None
                    if self._relay is None or self._relay.address is None
                    else advertised(self._relay.address, message.endpoint.coordinator_address)
                ),
            )
            encode(record)  # the size limit, before anything is written
        except InvalidRecordError as exc:
            self._problem("rejected", f"ready message rejected, nothing registered: {exc}")
            return
        self._tally("ready")
        if message.version is not None and self._state is ReceiverState.WAITING:
            log.info("%s: ready message version %s", self.engine_id, _brief(message.version))
        if self._relay is not None and record.endpoint.capabilities.total_kv_blocks:
            self._relay.resize(record.endpoint.capabilities.total_kv_blocks)
        if self._state is ReceiverState.WAITING:
            self._register(record)
        elif self._registration is not None:
            self._dispatcher.submit(self._update, self._registration, record)

    def _tally(self, outcome: str) -> int:
        with self._lock:
            self._counts[outcome] += 1
            count = self._counts[outcome]
        if outcome not in ("frames", "stalls"):
            self._hooks.engine_event(outcome)
        return count

    def _problem(self, outcome: str, message: str) -> None:
        count = self._tally(outcome)
        with self._lock:
            self._last_error = message
        level = logging.WARNING if count <= _LOUD_PROBLEMS else logging.DEBUG
        quiet = (
            f" (further {outcome} frames are logged at DEBUG)" if count == _LOUD_PROBLEMS else ""
        )
        log.log(level, "%s: %s%s", self.engine_id, message, quiet)

    def _role_from(self, said: EngineRole | str | None) -> EngineRole | str:
        """The record's role: the engine's, else the one given, else aggregated."""
        if said is None or said == self._role:
            return self._role or EngineRole.AGGREGATED
        if self._role is not None:
            log.warning(
                "%s: the engine says role %r; it replaces the role %r given",
                self.engine_id,
                str(said),
                str(self._role),
            )
        return said

    def _register(self, record: EngineRecord) -> None:
        try:
            registration = register_record(
                record,
                ttl=self._ttl,
                settings=self._settings,
                connection=self._connection,
                replace=self._replace,
                metrics=self._metrics,
            )
        except DiscoveryError as exc:
            log.error("%s: registration refused: %s", self.engine_id, exc)
            with self._lock:
                self._error = exc
                self._last_error = str(exc)
            self._set_state(ReceiverState.FAILED)
            return
        self._registration = registration
        self._heard = time.monotonic()
        log.info(
            "%s: ready; registered %s at %s (lease %016x, ttl %d s)%s",
            self.engine_id,
            record.endpoint.coordinator_address,
            registration.key,
            registration.lease_id or 0,
            registration.ttl,
            f"; state relayed on {record.state_address}" if record.state_address else "",
        )
        self._set_state(ReceiverState.REGISTERED)

    def _update(self, registration: Registration, record: EngineRecord) -> None:
        """A later ready message: publish what changed (on the dispatcher's thread)."""
        current = registration.record
        if current.endpoint == record.endpoint and current.role == record.role:
            return
        try:
            registration.update(endpoint=record.endpoint, role=record.role)
        except DiscoveryError as exc:
            # Kept by the registration and published as soon as etcd answers.
            log.warning("%s: publishing the new ready message is delayed: %s", self.engine_id, exc)
            return
        log.info(
            "%s: a new ready message; record updated (%s)",
            self.engine_id,
            record.endpoint.coordinator_address,
        )

    # -- stalls ------------------------------------------------------------------------

    def _stall(self, silence: float) -> None:
        self._tally("stalls")
        self._set_state(ReceiverState.STALLED)
        self._hooks.engine_stalled(self.engine_id, True)
        log.warning(
            "%s: no word from the engine for %.1f s (stall timeout %g s): marking it stalled; "
            "routers skip it until it is heard from again",
            self.engine_id,
            silence,
            self._stall_timeout,
        )
        self._switch_status(EngineStatus.READY, EngineStatus.STALLED)

    def _resume(self) -> None:
        self._set_state(ReceiverState.REGISTERED)
        self._hooks.engine_stalled(self.engine_id, False)
        log.info("%s: the engine is heard from again: ready", self.engine_id)
        self._switch_status(EngineStatus.STALLED, EngineStatus.READY)

    def _switch_status(self, before: EngineStatus, after: EngineStatus) -> None:
        """``before`` -> ``after`` on the dispatcher's thread (etcd never delays a frame)."""
        registration = self._registration
        if registration is None:
            return

        def switch() -> None:
            try:
                registration.switch_status(before, after)
            except DiscoveryError as exc:
                log.warning("%s: status %s is delayed: %s", self.engine_id, after, exc)

        self._dispatcher.submit(switch)

    def _set_state(self, state: ReceiverState) -> None:
        with self._lock:
            if self._state is ReceiverState.CLOSED or self._state is state:
                return
            self._state = state
            self._changed.notify_all()
        for listener in self._listeners:
            self._dispatcher.submit(listener, state)
