"""Key layout and value codec. No I/O.

Layout: one key per engine, ``{root}/{namespace}/engines/{engine_id}``, default root
``/inference/v1``, default namespace ``default``. The value is compact UTF-8 JSON:
exactly ``InferenceEngineEndpoint.to_dict()`` plus optional top-level metadata
(``engine_id``, ``labels``, ``registered_at``, ``status``, ``drain_deadline``) that
Megatron's ``from_dict`` ignores. A value without ``status`` is ``ready``.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from ._endpoint import InferenceEngineEndpoint
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
        return MappingProxyType({})
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

    @property
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

    def decode(self, key: bytes, value: bytes) -> EngineRecord:
        """Decode one key/value pair read from etcd, or raise RecordDecodeError."""
        text_key = key.decode("utf-8", "backslashreplace")
        return decode(text_key, value, self.engine_id(text_key))


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


@dataclass(frozen=True)
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
        object.__setattr__(self, "status", validate_status(self.status))
        deadline = self.drain_deadline
        if deadline is not None:
            if not isinstance(deadline, datetime) or deadline.tzinfo is None:
                raise InvalidRecordError("drain_deadline must be a timezone-aware datetime")
            if self.status is not EngineStatus.DRAINING:
                raise InvalidRecordError(
                    f"drain_deadline is only allowed on a draining record, not {self.status}"
                )
            object.__setattr__(self, "drain_deadline", deadline.astimezone(UTC))

    @property
    def ready(self) -> bool:
        """Whether routers pick this engine by default (status ``ready``)."""
        return self.status is EngineStatus.READY

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


def encode(record: EngineRecord) -> bytes:
    """Encode ``record`` as compact UTF-8 JSON, refusing values over MAX_VALUE_BYTES."""
    data = json.dumps(record.to_value(), separators=(",", ":"), ensure_ascii=False).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidRecordError(
            f"encoded record for {record.engine_id!r} is {len(data)} bytes, over the "
            f"{MAX_VALUE_BYTES}-byte limit; shorten its labels"
        )
    return data


def decode(key: str, value: bytes, engine_id: str) -> EngineRecord:
    """Decode the value stored at ``key`` for ``engine_id``, or raise RecordDecodeError."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordDecodeError(key, f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise RecordDecodeError(key, f"not JSON ({exc})") from exc
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
    labels = obj.get("labels")  # null means none; false, [] or "" are bad labels
    status = obj.get("status")  # absent (every older value, bare Megatron values): ready
    try:
        return EngineRecord(
            engine_id=engine_id,
            endpoint=endpoint,
            labels=MappingProxyType({}) if labels is None else labels,
            registered_at=_parse_time(obj.get("registered_at"), "registered_at"),
            status=EngineStatus.READY if status is None else validate_status(status),
            drain_deadline=_parse_time(obj.get("drain_deadline"), "drain_deadline"),
        )
    except (InvalidRecordError, ValueError, TypeError) as exc:
        raise RecordDecodeError(key, str(exc)) from exc


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(text: object, name: str) -> datetime | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{name} must be an ISO 8601 string, not {type(text).__name__}")
    return datetime.fromisoformat(text)
