"""Key layout and value codec. No I/O.

Layout: one key per engine, ``{root}/{namespace}/engines/{engine_id}``, default root
``/inference/v1``, default namespace ``default``. The value is compact UTF-8 JSON:
exactly ``InferenceEngineEndpoint.to_dict()`` plus the top-level metadata that
``EngineRecord`` declares (``_records/record.py``), which Megatron's ``from_dict`` ignores. A value
without ``status`` is ``ready``. Encode and both decode paths below are derived from that
declaration; keys this version does not know are kept (``extra``, ``extra_capabilities``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Any

import msgspec

from discovery._errors import InvalidRecordError, RecordDecodeError
from discovery._records.endpoint import _FIELD_NAMES as CAPABILITY_FIELDS
from discovery._records.endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    check_bounds,
    read_policy,
)
from discovery._records.record import (
    KNOWN_KEYS,
    SETTERS,
    STORED,
    EngineRecord,
    _check_name,
    validate_engine_id,
    validate_namespace,
)
from discovery._records.unknown import UnknownValue

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_ROOT",
    "MAX_VALUE_BYTES",
    "KeySpace",
]

DEFAULT_ROOT = "/inference/v1"
DEFAULT_NAMESPACE = "default"
MAX_VALUE_BYTES = 16 * 1024
"""Largest encoded value we write, and read: a larger one is refused before it is parsed.
A full record with a dozen labels is under 1 KiB."""

_SHARED = 4096
"""How many distinct capability records (and label sets) decoding shares an instance of."""
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def validate_root(root: object) -> str:
    """Return ``root`` if it is '/' followed by key-safe segments, else raise."""
    if not isinstance(root, str) or not root.startswith("/") or root.endswith("/"):
        raise InvalidRecordError(
            f"root {root!r} must start with '/' and not end with '/', e.g. {DEFAULT_ROOT!r}"
        )
    for segment in root[1:].split("/"):
        _check_name(segment, f"root segment of {root!r}")
    return root


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


def _plain(value: object) -> str:
    """An ``UnknownValue`` (a str subclass, which msgspec does not take) as its text."""
    if type(value) is UnknownValue:
        return str(value)
    raise NotImplementedError  # msgspec's TypeError naming the type


_encoder = msgspec.json.Encoder(enc_hook=_plain)


def encode(record: EngineRecord) -> bytes:
    """Encode ``record`` as compact UTF-8 JSON, refusing values over MAX_VALUE_BYTES."""
    value = record.to_value()
    try:
        if record.extra or record.extra_capabilities:
            # Keys we do not know go back as json.loads read them (NaN, lone surrogates).
            data = json.dumps(value, separators=(",", ":")).encode()
        else:
            # Byte for byte json.dumps(separators=(",", ":"), ensure_ascii=False), 10x faster.
            data = _encoder.encode(value)
    except (TypeError, ValueError) as exc:  # an extra key's value given in Python, say
        raise InvalidRecordError(f"record for {record.engine_id!r} is not JSON: {exc}") from None
    try:
        check_bounds(record.endpoint.capabilities)  # readers would skip it
    except ValueError as exc:
        raise InvalidRecordError(f"record for {record.engine_id!r}: {exc}") from None
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidRecordError(
            f"encoded record for {record.engine_id!r} is {len(data)} bytes, over the "
            f"{MAX_VALUE_BYTES}-byte limit; shorten its labels"
        )
    return data


def _wire_struct(cls: type, **wire: Any) -> type[msgspec.Struct]:
    """A msgspec Struct with the fields, types and defaults of dataclass ``cls``.

    ``wire`` gives a field the JSON type msgspec checks instead of its Python type.
    Unknown fields are refused: such a value takes the exact path, which keeps them.
    """
    hints = {**typing.get_type_hints(cls), **wire}
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
        forbid_unknown_fields=True,
    )


# The policy is any string on the wire: one this version does not know is kept (read_policy).
_WireCapabilities = _wire_struct(
    InferenceEngineCapabilities, prefix_caching_coordinator_policy=str | None
)
_capabilities_decoder = msgspec.json.Decoder(_WireCapabilities)
_NULL = msgspec.Raw(b"null")

_WireValue = msgspec.defstruct(
    "_WireValue",
    [
        ("coordinator_address", str),
        # Raw: its bytes are the key under which engines share one validated instance.
        ("capabilities", msgspec.Raw),
        ("engine_id", str | msgspec.UnsetType, msgspec.UNSET),  # null is a mismatch
        *(
            (name, msgspec.Raw, _NULL) if stored.form.shared else (name, stored.form.wire, None)
            for name, stored in STORED
        ),
    ],
    gc=False,
    forbid_unknown_fields=True,
)
"""A stored value as msgspec checks it: the JSON type of every field this version knows."""
_wire_decoder = msgspec.json.Decoder(_WireValue)
_wire_metadata = attrgetter(*(name for name, _ in STORED))
_shared_capabilities: dict[bytes, InferenceEngineCapabilities] = {}


def _capabilities_of(raw: bytes) -> InferenceEngineCapabilities:
    wire: Any = _capabilities_decoder.decode(raw)  # types; the dataclass checks the ranges
    policy = read_policy(wire.prefix_caching_coordinator_policy)  # an unknown one is kept
    values = msgspec.structs.replace(wire, prefix_caching_coordinator_policy=policy)
    capabilities = InferenceEngineCapabilities(*msgspec.structs.astuple(values))
    check_bounds(capabilities)
    return capabilities


def _shared(cache: dict[bytes, Any], build: Callable[[bytes], Any], raw: msgspec.Raw) -> Any:
    """The instance built from JSON ``raw``, shared by every value with the same bytes."""
    key = bytes(raw)
    found = cache.get(key)
    if found is None:
        found = build(key)  # raises for a bad value: nothing is cached
        if len(cache) >= _SHARED:
            cache.clear()
        cache[key] = found
    return found


def _fast_loader(load: Callable[[Any], Any], shared: bool) -> Callable[[Any], Any]:
    if not shared:
        return load
    cache: dict[bytes, Any] = {}
    build = lambda raw: load(msgspec.json.decode(raw))  # noqa: E731
    return functools.partial(_shared, cache, build)


_fast_loaders = tuple(_fast_loader(s.form.load, s.form.shared) for _, s in STORED)
_absent = tuple(s.form.load(None) for _, s in STORED)  # each field's value when not stored
_stored_setters = tuple(SETTERS[name] for name, _ in STORED)
_set_engine_id, _set_endpoint, _set_extra, _set_extra_capabilities = (
    SETTERS[name] for name in ("engine_id", "endpoint", "extra", "extra_capabilities")
)


def decode(key: str, value: bytes, engine_id: str) -> EngineRecord:
    """Decode the value stored at ``key``, or raise RecordDecodeError.

    ``engine_id`` is the id the key names, already validated (``KeySpace.engine_id``).
    One pass: msgspec parses and checks the JSON type of every field (an int is never a
    bool or a float, as Megatron requires), then each field's own check runs, once per
    distinct capability record and label set, which engines then share. Any value msgspec
    refuses (a key this version does not know included) takes the exact path (``json.loads``
    and Megatron's ``from_dict``), which accepts what Megatron accepts, keeps unknown keys
    and names any problem: the hot path never decides that a value is bad. A value over
    MAX_VALUE_BYTES is refused unread, and capacities over their bound (``MAX_CAPACITY``)
    on either path.
    """
    if len(value) > MAX_VALUE_BYTES:
        raise RecordDecodeError(
            key, f"{len(value)} bytes, over the {MAX_VALUE_BYTES}-byte limit of a record"
        )
    try:
        if not value.isascii():  # ASCII, the usual value, is UTF-8 as it stands
            value.decode("utf-8")  # msgspec does not check UTF-8 in the fields it skips
        return _fast_record(_wire_decoder.decode(value), engine_id)
    except (msgspec.MsgspecError, ValueError, TypeError):  # UnicodeDecodeError is a ValueError
        pass  # the exact path names the problem
    return _exact_record(key, _loads_exactly(key, value), engine_id)


def _fast_record(wire: Any, engine_id: str) -> EngineRecord:
    """The record of a value msgspec has type-checked; raises on any other problem."""
    if wire.engine_id is not msgspec.UNSET and wire.engine_id != engine_id:
        raise ValueError("engine_id does not match the key")
    capabilities = _shared(_shared_capabilities, _capabilities_of, wire.capabilities)
    record = object.__new__(EngineRecord)  # every field set below, each checked once
    _set_engine_id(record, engine_id)
    _set_endpoint(record, InferenceEngineEndpoint._checked(wire.coordinator_address, capabilities))
    for set_field, load, absent, raw in zip(
        _stored_setters, _fast_loaders, _absent, _wire_metadata(wire), strict=False
    ):
        # _NULL: a shared field the value leaves out (most records), without its cache lookup.
        set_field(record, absent if raw is None or raw is _NULL else load(raw))
    _set_extra(record, _EMPTY)  # the Struct refuses unknown keys: there are none
    _set_extra_capabilities(record, _EMPTY)
    record._check_together()
    return record


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
        check_bounds(endpoint.capabilities)
    except KeyError as exc:
        raise RecordDecodeError(key, f"missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise RecordDecodeError(key, str(exc)) from exc
    stored_id = obj.get("engine_id", engine_id)
    if stored_id != engine_id:
        raise RecordDecodeError(key, f"engine_id {stored_id!r} does not match the key")
    try:
        values = [stored.form.load(obj.get(name)) for name, stored in STORED]
    except ValueError as exc:  # InvalidRecordError is one
        raise RecordDecodeError(key, str(exc)) from exc
    try:
        return EngineRecord._decoded(
            (
                engine_id,
                endpoint,
                *values,
                unknown_keys(obj, KNOWN_KEYS),
                unknown_keys(obj["capabilities"], CAPABILITY_FIELDS),
            )
        )
    except ValueError as exc:
        raise RecordDecodeError(key, str(exc)) from exc


def unknown_keys(obj: Mapping[str, Any], known: tuple[str, ...]) -> Mapping[str, Any]:
    """The keys of ``obj`` not in ``known``, read-only (the shared empty one when none)."""
    extra = {k: v for k, v in obj.items() if k not in known}
    return MappingProxyType(extra) if extra else _EMPTY
