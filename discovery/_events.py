"""Megatron's engine-event protocol: frames, and a receiver that registers the engine.

The wire contract (Megatron-LM, ``megatron/inference/integrations/dynamo/telemetry.py``):
the parent binds a ZeroMQ PULL socket on a random port and hands its address to the engine
(``--dynamo-parent-event-address``); global rank zero connects a PUSH socket (LINGER 0) and
sends ``msgpack.packb([kind, payload], use_bin_type=True)`` frames. The first has kind
``"ready"`` and payload ``InferenceEngineEndpoint.to_dict()``; later ones are KV-cache events
(``"stored"``, ``"removed"``). PUSH/PULL says nothing when the engine dies: whoever started
the engine watches the process (``discovery launch`` does, in ``_launch.py``).

What the receiver does with each frame, each outcome counted in ``health()`` and in
``discovery_engine_events_total{outcome}``:

- ``malformed``: not msgpack, or not a ``[str, payload]`` pair; logged with the reason.
- ``ignored``: a kind other than ``"ready"`` (Megatron's KV-cache events).
- ``ready``: a valid ready message. The first one registers the engine; a later one with
  another endpoint or role updates the record atomically, on the same lease.
- ``rejected``: a ready payload that fails validation; logged naming the shape received
  (an endpoint, Megatron's capabilities-with-a-role metadata, or neither). Nothing is written.

Pause, suspend and resume: Megatron's dynamic engine can be paused or suspended (for a
weight update, or to free memory for training) and resumed, but no public Megatron code
sends an event for that to this socket (it tells its own coordinator and clients, not the
parent). So there is nothing to map to the record's ``paused`` status here: such a frame
would be ``ignored`` like any other kind. A rollout framework that pauses the engine marks
it through the API instead (``Registration.pause()`` / ``resume()`` on the receiver's
``registration``, or ``discovery pause`` / ``resume`` from outside).

A ``"role"`` key in a ready payload goes into the ``role`` label (it wins over a ``role``
label given to the receiver, with a warning). When the first registration is refused
(conflict, permission, etcd unavailable past the dial timeout) the receiver is ``failed``
and registers nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._codec import encode
from ._dispatch import Dispatcher, Listeners
from ._endpoint import InferenceEngineCapabilities, InferenceEngineEndpoint
from ._errors import ClosedError, ConfigurationError, DiscoveryError, InvalidRecordError
from ._metrics import NO_METRICS, MetricsHooks
from ._record import (
    EngineRecord,
    validate_engine_id,
    validate_labels,
    validate_weight_version,
)
from ._registration import Registration, default_engine_id, register_engine
from ._session import check_ttl

if TYPE_CHECKING:
    import zmq

    from ._port import EtcdPort
    from ._settings import Settings

__all__ = ["EngineEventReceiver", "ReceiverHealth", "ReceiverState"]

log = logging.getLogger(__name__)

READY = "ready"
EXTRA = "launch"
_CAPABILITY_KEYS = frozenset(f.name for f in dataclasses.fields(InferenceEngineCapabilities))
_LOUD_PROBLEMS = 10  # malformed/rejected frames logged at WARNING; the rest at DEBUG


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


def endpoint_from_ready(payload: object) -> tuple[InferenceEngineEndpoint, str | None]:
    """The endpoint and optional role of a ready payload, or InvalidRecordError naming its shape."""
    if not isinstance(payload, Mapping):
        raise InvalidRecordError(f"ready payload is a {type(payload).__name__}, not a map")
    if "coordinator_address" not in payload and "capabilities" not in payload:
        if _CAPABILITY_KEYS & payload.keys():
            shape = (
                "Megatron's engine metadata (capabilities with a role, protocol.engine_metadata)"
                if "role" in payload
                else "bare capabilities (InferenceEngineCapabilities.to_dict())"
            )
            raise InvalidRecordError(
                f"ready payload has the shape of {shape}, not of an endpoint "
                "(InferenceEngineEndpoint.to_dict()): there is no coordinator_address to route to"
            )
        raise InvalidRecordError(
            "ready payload is not an endpoint (InferenceEngineEndpoint.to_dict()); "
            f"its keys: {_brief(sorted(map(str, payload)))}"
        )
    try:
        endpoint = InferenceEngineEndpoint.from_dict(payload)
    except KeyError as exc:
        raise InvalidRecordError(
            f"ready payload (endpoint shape) is missing field {exc.args[0]!r}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"ready payload (endpoint shape) is invalid: {exc}") from None
    role = payload.get("role")
    if role is not None and not isinstance(role, str):
        raise InvalidRecordError(f"ready payload: role must be a string, not {_brief(role)}")
    return endpoint, role


class ReceiverState(enum.StrEnum):
    """Where an EngineEventReceiver is."""

    WAITING = "waiting"
    """Listening; no valid ready message yet."""
    REGISTERED = "registered"
    """Registered from a ready message."""
    FAILED = "failed"
    """The registration was refused (conflict, permission, etcd unavailable)."""
    CLOSED = "closed"


@dataclass(frozen=True)
class ReceiverHealth:
    """A point-in-time view of an EngineEventReceiver: state and frame counts."""

    engine_id: str
    address: str | None
    state: ReceiverState
    frames: int
    ready: int
    ignored: int
    malformed: int
    rejected: int
    last_error: str | None


class EngineEventReceiver:
    """Receives a Megatron engine's events and registers the engine from its ready message.

    For launchers other than ``discovery launch`` (Slurm wrappers, Ray actors): start it
    (or enter it), pass ``address`` to the engine as ``--dynamo-parent-event-address``,
    and close it when the engine exits; README.md has a complete example.

    The keyword arguments are those of ``register_engine``, plus ``host`` to bind (a
    routable address when rank zero runs on another node). Thread-safe; from asyncio use
    ``async with`` and ``await receiver.await_registered()``. The registration lives until
    ``close()``: tie that to the engine process, which the socket cannot tell about.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        engine_id: str | None = None,
        ttl: float = 10.0,
        labels: Mapping[str, str] | None = None,
        weight_version: int | None = None,
        settings: Settings | None = None,
        connection: EtcdPort | None = None,
        replace: bool = False,
        metrics: MetricsHooks | None = None,
    ) -> None:
        self.require_libraries()
        self.engine_id = default_engine_id() if engine_id is None else validate_engine_id(engine_id)
        self._labels = dict(validate_labels(labels))
        self._weight_version = validate_weight_version(weight_version)
        self._ttl = check_ttl(ttl)
        self._host = host
        self._settings = settings
        self._connection = connection
        self._replace = replace
        self._metrics = metrics
        self._count = (metrics or NO_METRICS).engine_event
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._state = ReceiverState.WAITING
        self._counts = dict.fromkeys(("frames", "ready", "ignored", "malformed", "rejected"), 0)
        self._last_error: str | None = None
        self._error: DiscoveryError | None = None
        self._registration: Registration | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._closed = False
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
        """State and frame counts, for a health endpoint."""
        with self._lock:
            return ReceiverHealth(
                engine_id=self.engine_id,
                address=self._address,
                state=self._state,
                last_error=self._last_error,
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
            state, registration, error = self._state, self._registration, self._error
        if state is ReceiverState.REGISTERED and registration is not None:
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
        """Bind the PULL socket on a random port and start receiving; returns the address."""
        import zmq  # noqa: PLC0415

        with self._lock:
            if self._closed:
                raise ClosedError(f"engine-event receiver of {self.engine_id!r} is closed")
            if self._address is not None:
                return self._address
            context = zmq.Context()
            sock = context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind_to_random_port(f"tcp://{self._host}")
            except zmq.ZMQError as exc:
                sock.close()
                context.term()
                raise ConfigurationError(
                    f"cannot bind the engine-event socket on tcp://{self._host}: {exc}"
                ) from exc
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._wake = os.pipe()
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
        """Stop receiving and revoke the registration's lease (the key is gone). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        registration = self.stop_receiving()
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
        self.start()  # binds a local socket: does not block
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
                ready = dict(poller.poll())
                if wake in ready:
                    return
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

    def _handle(self, frame: bytes) -> None:
        self._tally("frames")
        try:
            kind, payload = decode_frame(frame)
        except ValueError as exc:
            self._problem("malformed", f"malformed engine-event frame ({len(frame)} bytes): {exc}")
            return
        if kind != READY:
            if self._tally("ignored") == 1:
                log.info(
                    "%s: ignoring engine events other than 'ready' (first: %r)",
                    self.engine_id,
                    kind,
                )
            return
        try:
            endpoint, role = endpoint_from_ready(payload)
            record = EngineRecord(self.engine_id, endpoint, self._labels_with(role))
            encode(record)  # the size limit, before anything is written
        except InvalidRecordError as exc:
            self._problem("rejected", f"ready message rejected, nothing registered: {exc}")
            return
        self._tally("ready")
        if self._state is ReceiverState.WAITING:
            self._register(record)
        elif self._state is ReceiverState.REGISTERED:
            self._update(record)

    def _tally(self, outcome: str) -> int:
        with self._lock:
            self._counts[outcome] += 1
            count = self._counts[outcome]
        if outcome != "frames":
            self._count(outcome)
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

    def _labels_with(self, role: str | None) -> dict[str, str]:
        labels = self._labels
        if role is None or labels.get("role") == role:
            return labels
        if "role" in labels:
            log.warning(
                "%s: the engine says role %r; it replaces the role label %r",
                self.engine_id,
                role,
                labels["role"],
            )
        return {**labels, "role": role}

    def _register(self, record: EngineRecord) -> None:
        try:
            registration = register_engine(
                record.endpoint,
                engine_id=self.engine_id,
                ttl=self._ttl,
                labels=record.labels,
                weight_version=self._weight_version,
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
        log.info(
            "%s: ready; registered %s at %s (lease %016x, ttl %d s)",
            self.engine_id,
            record.endpoint.coordinator_address,
            registration.key,
            registration.lease_id or 0,
            registration.ttl,
        )
        self._set_state(ReceiverState.REGISTERED)

    def _update(self, record: EngineRecord) -> None:
        registration = self._registration
        assert registration is not None  # REGISTERED
        current = registration.record
        if current.endpoint == record.endpoint and dict(current.labels) == dict(record.labels):
            return
        try:
            registration.update(endpoint=record.endpoint, labels=record.labels)
        except DiscoveryError as exc:
            # Kept by the registration and published as soon as etcd answers.
            log.warning("%s: publishing the new ready message is delayed: %s", self.engine_id, exc)
            return
        log.info(
            "%s: a new ready message; record updated (%s)",
            self.engine_id,
            record.endpoint.coordinator_address,
        )

    def _set_state(self, state: ReceiverState) -> None:
        with self._lock:
            if self._state is ReceiverState.CLOSED or self._state is state:
                return
            self._state = state
            self._changed.notify_all()
        for listener in self._listeners:
            self._dispatcher.submit(listener, state)
