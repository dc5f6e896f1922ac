"""Key layout and value codec. No I/O.

Layout: one key per engine, ``{root}/{namespace}/engines/{engine_id}``, default root
``/inference/v1``, default namespace ``default``. The value is compact UTF-8 JSON:
exactly ``InferenceEngineEndpoint.to_dict()`` plus optional top-level metadata
(``engine_id``, ``labels``, ``registered_at``, ``status``, ``drain_deadline``) that
Megatron's ``from_dict`` ignores. A value without ``status`` is ``ready``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

import msgspec

from ._endpoint import InferenceEngineCapabilities, InferenceEngineEndpoint, _set
from ._errors import InvalidRecordError, RecordDecodeError

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_ROOT",
    "MAX_VALUE_BYTES",
    "EngineRecord",
    "EngineStatus",
    "KeySpace",
]

DEFAULT_ROOT = "/inference/v1"
DEFAULT_NAMESPACE = "default"
MAX_VALUE_BYTES = 16 * 1024
"""Largest encoded value we write; a full record with a dozen labels is under 1 KiB."""

_NAME = re.compile(r"(?!\.+$)[A-Za-z0-9._-]{1,128}")  # and not only dots
_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]{1,63}")
_MAX_LABEL_VALUE = 256
_MAX_LABELS = 64
_NO_LABELS: Mapping[str, str] = MappingProxyType({})
_SHARED = 4096
"""How many distinct capability records (and label sets) decoding shares an instance of."""


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidRecordError(f"{what} must be a string, not {type(value).__name__}")
    if not _NAME.fullmatch(value):
        raise InvalidRecordError(
            f"{what} {value!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-' "
            "(and not only dots)"
        )
    return value


def validate_engine_id(engine_id: object) -> str:
    """Return ``engine_id`` if it is key-safe, else raise InvalidRecordError."""
    return _check_name(engine_id, "engine id")


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is key-safe, else raise InvalidRecordError."""
    return _check_name(namespace, "namespace")


def validate_root(root: object) -> str:
    """Return ``root`` if it is '/' followed by key-safe segments, else raise."""
    if not isinstance(root, str) or not root.startswith("/") or root.endswith("/"):
        raise InvalidRecordError(
            f"root {root!r} must start with '/' and not end with '/', e.g. {DEFAULT_ROOT!r}"
        )
    for segment in root[1:].split("/"):
        _check_name(segment, f"root segment of {root!r}")
    return root


def validate_labels(labels: Mapping[str, str] | None) -> Mapping[str, str]:
    """Return a read-only copy of ``labels`` after checking keys, values and count."""
    if labels is None:
        return _NO_LABELS
    if not isinstance(labels, Mapping):
        raise InvalidRecordError(f"labels must be a mapping, not {type(labels).__name__}")
    if len(labels) > _MAX_LABELS:
        raise InvalidRecordError(f"at most {_MAX_LABELS} labels are allowed, got {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise InvalidRecordError(
                f"label key {key!r} is not allowed: use 1-63 letters, digits, '.', '_', '/' or '-'"
            )
        if not isinstance(value, str):
            raise InvalidRecordError(f"label {key!r} must be a string, not {type(value).__name__}")
        if len(value) > _MAX_LABEL_VALUE or not value.isprintable():
            raise InvalidRecordError(
                f"label {key!r} must be printable and at most {_MAX_LABEL_VALUE} characters"
            )
    return MappingProxyType(dict(labels))


@dataclass(frozen=True)
class KeySpace:
    """The keys of one namespace: ``{root}/{namespace}/engines/{engine_id}``."""

    root: str = DEFAULT_ROOT
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        """Validate root and namespace."""
        validate_root(self.root)
        validate_namespace(self.namespace)

    @functools.cached_property
    def prefix(self) -> str:
        """The prefix every engine key of this namespace starts with."""
        return f"{self.root}/{self.namespace}/engines/"

    def key(self, engine_id: str) -> str:
        """Return the key of ``engine_id``."""
        return self.prefix + validate_engine_id(engine_id)

    def engine_id(self, key: str) -> str:
        """Return the engine id a key names, or raise RecordDecodeError."""
        prefix = self.prefix
        if not key.startswith(prefix):
            raise RecordDecodeError(key, f"not under {prefix!r}")
        try:
            return validate_engine_id(key[len(prefix) :])
        except InvalidRecordError as exc:
            raise RecordDecodeError(key, str(exc)) from exc

    def decode(self, key: bytes | str, value: bytes) -> EngineRecord:
        """Decode one key/value pair read from etcd, or raise RecordDecodeError."""
        if isinstance(key, bytes):
            key = key.decode("utf-8", "backslashreplace")
        return decode(key, value, self.engine_id(key))


class EngineStatus(enum.StrEnum):
    """What routers may do with an engine (the ``status`` of its record).

    Routers pick only ``ready`` engines by default. A value without ``status`` is ``ready``.
    """

    STARTING = "starting"
    """Registered (visible to operators) but not taking requests yet."""
    READY = "ready"
    """Taking new requests."""
    DRAINING = "draining"
    """Finishing the requests it has, taking no new ones; leaves at ``drain_deadline``."""


def validate_status(status: object) -> EngineStatus:
    """Return ``status`` as an EngineStatus, or raise InvalidRecordError naming it."""
    try:
        return EngineStatus(status)  # type: ignore[arg-type]  # anything: refused below
    except ValueError:
        names = ", ".join(s.value for s in EngineStatus)
        raise InvalidRecordError(f"status {status!r} is not one of {names}") from None


def drain_deadline_after(timeout: object) -> datetime:
    """The drain deadline ``timeout`` seconds from now, or InvalidRecordError naming it."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidRecordError(f"drain timeout must be >= 0 seconds, got {timeout!r}")
    return datetime.now(UTC) + timedelta(seconds=timeout)


def _checked_status(status: object, deadline: object) -> tuple[EngineStatus, datetime | None]:
    """A record's status (None: ready) and drain deadline (UTC), checked together."""
    checked = EngineStatus.READY if status is None else validate_status(status)
    if deadline is None:
        return checked, None
    if not isinstance(deadline, datetime) or deadline.tzinfo is None:
        raise InvalidRecordError("drain_deadline must be a timezone-aware datetime")
    if checked is not EngineStatus.DRAINING:
        raise InvalidRecordError(
            f"drain_deadline is only allowed on a draining record, not {checked}"
        )
    return checked, deadline.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One engine as stored in etcd: id, endpoint, labels, registration time and status.

    ``drain_deadline`` (UTC) is when a ``draining`` engine leaves; None means it drains
    until someone undrains or removes it. Only a draining record may carry one.
    """

    engine_id: str
    endpoint: InferenceEngineEndpoint
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    registered_at: datetime | None = None
    status: EngineStatus = EngineStatus.READY
    drain_deadline: datetime | None = None

    def __post_init__(self) -> None:
        """Validate the metadata; the endpoint validates itself."""
        validate_engine_id(self.engine_id)
        if not isinstance(self.endpoint, InferenceEngineEndpoint):
            raise InvalidRecordError("endpoint must be an InferenceEngineEndpoint")
        object.__setattr__(self, "labels", validate_labels(self.labels))
        if self.registered_at is not None and not isinstance(self.registered_at, datetime):
            raise InvalidRecordError("registered_at must be a datetime")
        status, deadline = _checked_status(self.status, self.drain_deadline)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "drain_deadline", deadline)

    @property
    def ready(self) -> bool:
        """Whether routers pick this engine by default (status ``ready``)."""
        return self.status is EngineStatus.READY

    @classmethod
    def _decoded(
        cls,
        engine_id: str,
        endpoint: InferenceEngineEndpoint,
        labels: Mapping[str, str],
        registered_at: datetime | None,
        status: tuple[EngineStatus, datetime | None],
    ) -> EngineRecord:
        """A record from parts the decoder has already validated: nothing is checked twice."""
        record = object.__new__(cls)
        _set(record, "engine_id", engine_id)
        _set(record, "endpoint", endpoint)
        _set(record, "labels", labels)
        _set(record, "registered_at", registered_at)
        _set(record, "status", status[0])
        _set(record, "drain_deadline", status[1])
        return record

    def matches(self, selector: Mapping[str, str] | None) -> bool:
        """Whether every ``key: value`` of ``selector`` is among this record's labels."""
        return not selector or all(self.labels.get(k) == v for k, v in selector.items())

    def to_value(self) -> dict[str, Any]:
        """Return the JSON object stored in etcd: Megatron's ``to_dict()`` plus metadata."""
        value = self.endpoint.to_dict()
        value["engine_id"] = self.engine_id
        if self.labels:
            value["labels"] = dict(self.labels)
        if self.registered_at is not None:
            value["registered_at"] = _format_time(self.registered_at)
        value["status"] = self.status.value
        if self.drain_deadline is not None:
            value["drain_deadline"] = _format_time(self.drain_deadline)
        return value


class RecordView:
    """Shortcuts to the ``record`` an object carries (events, pick handles)."""

    __slots__ = ()
    record: EngineRecord

    @property
    def engine_id(self) -> str:
        """The engine's id."""
        return self.record.engine_id

    @property
    def endpoint(self) -> InferenceEngineEndpoint:
        """The engine's endpoint: coordinator address and capabilities."""
        return self.record.endpoint

    @property
    def labels(self) -> Mapping[str, str]:
        """The engine's labels."""
        return self.record.labels

    @property
    def status(self) -> EngineStatus:
        """The engine's status: starting, ready or draining."""
        return self.record.status


_encoder = msgspec.json.Encoder()


def encode(record: EngineRecord) -> bytes:
    """Encode ``record`` as compact UTF-8 JSON, refusing values over MAX_VALUE_BYTES."""
    # Byte for byte json.dumps(separators=(",", ":"), ensure_ascii=False), 10x faster.
    data = _encoder.encode(record.to_value())
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidRecordError(
            f"encoded record for {record.engine_id!r} is {len(data)} bytes, over the "
            f"{MAX_VALUE_BYTES}-byte limit; shorten its labels"
        )
    return data


def _wire_struct(cls: type) -> type[msgspec.Struct]:
    """A msgspec Struct with the fields, types and defaults of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return msgspec.defstruct(
        f"_Wire{cls.__name__}",
        [
            (f.name, hints[f.name])
            if f.default is dataclasses.MISSING
            else (f.name, hints[f.name], f.default)
            for f in dataclasses.fields(cls)
        ],
        frozen=True,  # hashable: the key that shares equal capabilities
        gc=False,
    )


_capabilities_decoder = msgspec.json.Decoder(_wire_struct(InferenceEngineCapabilities))
_labels_decoder = msgspec.json.Decoder(dict[str, str] | None)
_NULL = msgspec.Raw(b"null")


class _WireValue(msgspec.Struct, gc=False):
    """A stored value as msgspec checks it: the JSON types of the fields read each time.

    Capabilities and labels stay raw JSON: their bytes are the key under which engines
    share one validated instance, so a repeated set costs one bytes object, not a parse.
    """

    coordinator_address: str
    capabilities: msgspec.Raw
    engine_id: str | msgspec.UnsetType = msgspec.UNSET  # null is a mismatch, not "absent"
    labels: msgspec.Raw = _NULL
    registered_at: str | None = None
    status: str | None = None  # absent (older values, bare Megatron ones): ready
    drain_deadline: str | None = None


_wire_decoder = msgspec.json.Decoder(_WireValue)
_shared_capabilities: dict[bytes, InferenceEngineCapabilities] = {}
_shared_labels: dict[bytes, Mapping[str, str]] = {}


def _capabilities_of(raw: bytes) -> InferenceEngineCapabilities:
    wire = _capabilities_decoder.decode(raw)  # types; the dataclass checks the ranges
    return InferenceEngineCapabilities(*msgspec.structs.astuple(wire))


def _labels_of(raw: bytes) -> Mapping[str, str]:
    return validate_labels(_labels_decoder.decode(raw))


def _shared(cache: dict[bytes, Any], raw: msgspec.Raw, build: Callable[[bytes], Any]) -> Any:
    """The instance built from JSON ``raw``, shared by every value with the same bytes."""
    key = bytes(raw)
    found = cache.get(key)
    if found is None:
        found = build(key)  # raises for a bad value: nothing is cached
        if len(cache) >= _SHARED:
            cache.clear()
        cache[key] = found
    return found


def decode(key: str, value: bytes, engine_id: str) -> EngineRecord:
    """Decode the value stored at ``key``, or raise RecordDecodeError.

    ``engine_id`` is the id the key names, already validated (``KeySpace.engine_id``).
    One pass: msgspec parses and checks the JSON type of every field we read (an int is
    never a bool or a float, as Megatron requires), then ranges and label rules are
    checked once per distinct capability record and label set, and engines that share
    them share one instance. Any value msgspec refuses takes the exact path (``json.loads``
    and Megatron's ``from_dict``), which accepts what Megatron accepts and names the
    problem: the hot path never decides that a value is bad.
    """
    try:
        if not value.isascii():  # ASCII, the usual value, is UTF-8 as it stands
            value.decode("utf-8")  # msgspec does not check UTF-8 in the fields it skips
        return _fast_record(_wire_decoder.decode(value), engine_id)
    except (msgspec.MsgspecError, ValueError, TypeError):  # UnicodeDecodeError is a ValueError
        pass  # the exact path names the problem
    return _exact_record(key, _loads_exactly(key, value), engine_id)


def _fast_record(wire: _WireValue, engine_id: str) -> EngineRecord:
    """The record of a value msgspec has type-checked; raises on any other problem."""
    if wire.engine_id is not msgspec.UNSET and wire.engine_id != engine_id:
        raise ValueError("engine_id does not match the key")
    capabilities = _shared(_shared_capabilities, wire.capabilities, _capabilities_of)
    return EngineRecord._decoded(
        engine_id,
        InferenceEngineEndpoint._checked(wire.coordinator_address, capabilities),
        _shared(_shared_labels, wire.labels, _labels_of),
        _parse_time(wire.registered_at, "registered_at"),
        _checked_status(wire.status, _parse_time(wire.drain_deadline, "drain_deadline")),
    )


def _loads_exactly(key: str, value: bytes) -> Any:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordDecodeError(key, f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise RecordDecodeError(key, f"not JSON ({exc})") from exc


def _exact_record(key: str, obj: Any, engine_id: str) -> EngineRecord:
    """What json.loads parsed, validated by Megatron's rules (every problem named)."""
    if not isinstance(obj, dict):
        raise RecordDecodeError(key, f"a JSON {type(obj).__name__}, not an object")
    try:
        endpoint = InferenceEngineEndpoint.from_dict(obj)
    except KeyError as exc:
        raise RecordDecodeError(key, f"missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise RecordDecodeError(key, str(exc)) from exc
    stored_id = obj.get("engine_id", engine_id)
    if stored_id != engine_id:
        raise RecordDecodeError(key, f"engine_id {stored_id!r} does not match the key")
    try:
        return EngineRecord._decoded(
            engine_id,
            endpoint,
            validate_labels(obj.get("labels")),  # null: none; false, [] or "" are bad
            _parse_time(obj.get("registered_at"), "registered_at"),
            _checked_status(
                obj.get("status"),
                _parse_time(obj.get("drain_deadline"), "drain_deadline"),
            ),
        )
    except ValueError as exc:  # InvalidRecordError is one
        raise RecordDecodeError(key, str(exc)) from exc


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(text: object, name: str) -> datetime | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{name} must be an ISO 8601 string, not {type(text).__name__}")
    return datetime.fromisoformat(text)
