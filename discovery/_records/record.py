"""The stored record, declared once: ``EngineRecord`` and how each of its fields is stored.

The value in etcd is ``InferenceEngineEndpoint.to_dict()`` (Megatron's, unchanged) plus
top-level metadata Megatron's ``from_dict`` ignores. Each metadata field is one line of
``EngineRecord`` below: its Python type and default, and a ``Stored`` description (its
JSON form, its check, its one-line doc, its CLI column, whether an outside writer owns
it). Everything else is derived from that declaration: validation (``__post_init__``),
the codec's encode and both decode paths (``_records/codec.py``), the registrar's adoption of
outside changes, the CLI's columns (``discovery list`` / ``watch``), and the field table
of the documentation (``field_table()``, generated at every build of the site). Adding a field
is one line here and its tests.

Keys this package does not know (a newer writer's, Megatron's next capability) are kept:
``extra`` holds unknown top-level keys, ``extra_capabilities`` unknown keys inside
``capabilities``, and both are written back unchanged on every rewrite.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from discovery._errors import InvalidRecordError, shown_key
from discovery._records.endpoint import _FIELD_NAMES as CAPABILITY_FIELDS
from discovery._records.endpoint import InferenceEngineEndpoint, _set, capabilities_schema
from discovery._records.handoff import (
    LAYOUT_SCHEMA,
    EngineRole,
    KvLayout,
    KvTransferBackend,
    read_backend,
    read_role,
    validate_backend,
    validate_layout,
    validate_role,
)
from discovery._records.selector import LABELS_SCHEMA, SelectorLike, selector_of, validate_labels
from discovery._records.unknown import name_schema

__all__ = [
    "EndpointLike",
    "EngineRecord",
    "EngineStatus",
    "RecordView",
    "endpoint_parts",
    "record_schema",
]

_NAME = re.compile(r"(?!\.+$)[A-Za-z0-9._-]{1,128}")  # and not only dots
_EMPTY: Mapping[str, Any] = MappingProxyType({})

ENDPOINT_KEYS = ("coordinator_address", "capabilities")
"""The top-level keys of Megatron's ``InferenceEngineEndpoint.to_dict()``."""


# -- checks of single values -------------------------------------------------------------


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidRecordError(f"{what} must be a string, not {type(value).__name__}")
    if not _NAME.fullmatch(value):
        raise InvalidRecordError(
            f"{what} {shown_key(value)} is not allowed: use 1-128 letters, digits, '.', '_' "
            "or '-' "
            "(and not only dots)"
        )
    return value


def validate_engine_id(engine_id: object) -> str:
    """Return ``engine_id`` if it is key-safe, else raise InvalidRecordError."""
    return _check_name(engine_id, "engine id")


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is key-safe, else raise InvalidRecordError."""
    return _check_name(namespace, "namespace")


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
    STALLED = "stalled"
    """Silent past its launcher's stall timeout (hung, frozen): no new requests until heard."""
    PAUSED = "paused"
    """Up, keeping its lease and id, taking no new requests for now (weights being updated,
    memory suspended for training); ``ready`` again when resumed."""
    STOPPING = "stopping"
    """Going away on purpose (its engine exited, it closed, an operator deregistered it):
    the record is deleted next. Written just before a ready engine's record is removed, so
    routers tell a deliberate removal from an expired lease; never picked, never adopted."""


def validate_status(status: object) -> EngineStatus:
    """Return ``status`` as an EngineStatus, or raise InvalidRecordError naming it."""
    try:
        return EngineStatus(status)  # type: ignore[arg-type]  # anything: refused below
    except ValueError:
        names = ", ".join(s.value for s in EngineStatus)
        raise InvalidRecordError(f"status {status!r} is not one of {names}") from None


MAX_WEIGHT_VERSION = 2**63 - 1
"""The largest ``weight_version`` (a signed 64-bit integer, for readers in other languages)."""


def validate_weight_version(value: object) -> int | None:
    """Return ``value`` if it is None or an integer from 0 to 2**63 - 1, else raise."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 0 <= value <= MAX_WEIGHT_VERSION
    ):
        raise InvalidRecordError(
            f"weight_version must be an integer from 0 to 2**63 - 1, not {value!r}"
        )
    return value


def check_version_order(stored: int | None, new: int | None, *, force: bool) -> None:
    """Refuse (InvalidRecordError) a write of ``new`` over ``stored`` that lowers it.

    None counts as older than every version: removing a version lowers it too. ``force``
    allows it (a rollback).
    """
    if force or stored is None or (new is not None and new >= stored):
        return
    raise InvalidRecordError(
        f"weight_version would go backwards from {stored} (stored) to {new}: "
        "give force=True (--force) to roll back"
    )


def drain_deadline_after(timeout: object) -> datetime:
    """The drain deadline ``timeout`` seconds from now, or InvalidRecordError naming it."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidRecordError(f"drain timeout must be >= 0 seconds, got {timeout!r}")
    return datetime.now(UTC) + timedelta(seconds=timeout)


def format_time(moment: datetime) -> str:
    """ISO 8601 in UTC with milliseconds and a ``Z``, as stored."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _checked_address(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("tcp://") or len(value) > 256:
        raise InvalidRecordError(f"state_address must be tcp://HOST:PORT, not {value!r}")
    return value


# -- how a field is stored -----------------------------------------------------------------


class Form(NamedTuple):
    """How one kind of value looks in the stored JSON."""

    wire: Any
    """The JSON type msgspec checks on the fast decode path (``None`` when absent)."""
    load: Callable[[Any], Any]
    """JSON value (None when absent) -> the field's value; raises ValueError naming it."""
    dump: Callable[[Any], Any]
    """The field's value -> its JSON value."""
    check: Callable[[Any], Any]
    """A value given in Python -> the value kept; raises InvalidRecordError naming it."""
    schema: Mapping[str, Any]
    """Its JSON Schema (``record_schema``; a stored null means absent, whatever the form)."""
    shared: bool = False
    """Decoded once per distinct JSON text, the instance shared by every record using it."""


LABELS = Form(Any, validate_labels, dict, validate_labels, LABELS_SCHEMA, shared=True)
_STATUSES: dict[object, EngineStatus] = {
    None: EngineStatus.READY,
    **{s.value: s for s in EngineStatus},
}


def _load_status(value: object) -> EngineStatus:
    """A stored status: a lookup (it is the value of every record), else the named refusal."""
    try:
        return _STATUSES[value]
    except (KeyError, TypeError):  # TypeError: a JSON list or object is no key
        return validate_status(value)


STATUS = Form(
    str | None, _load_status, str, validate_status, {"enum": [s.value for s in EngineStatus]}
)


def _load_role(value: object) -> EngineRole | str:
    """A stored role: absent is aggregated; a role this version does not know is kept."""
    return EngineRole.AGGREGATED if value is None else read_role(value)


def _check_role(value: object) -> EngineRole | str:
    return EngineRole.AGGREGATED if value is None else validate_role(value)


ROLE = Form(str | None, _load_role, str, _check_role, name_schema(EngineRole))


def _optional(check: Callable[[object], Any]) -> Callable[[object], Any]:
    """``check`` of a value that may be absent (None)."""
    return lambda value: None if value is None else check(value)


BACKEND = Form(
    str | None,
    _optional(read_backend),
    str,
    _optional(validate_backend),
    name_schema(KvTransferBackend),
)


LAYOUT = Form(
    Any,
    _optional(KvLayout.from_dict),
    KvLayout.to_dict,
    validate_layout,
    LAYOUT_SCHEMA,
    shared=True,
)


WEIGHT_VERSION = Form(
    int | None,
    validate_weight_version,
    int,
    validate_weight_version,
    {"type": "integer", "minimum": 0, "maximum": MAX_WEIGHT_VERSION},
)


def _time(name: str, *, aware: bool) -> Form:
    """A moment stored as ISO 8601 text (``aware``: it must carry a zone; kept in UTC)."""

    def check(value: object) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime) or (aware and value.tzinfo is None):
            raise InvalidRecordError(f"{name} must be a {'timezone-aware ' * aware}datetime")
        return value.astimezone(UTC) if aware else value

    def load(text: object) -> datetime | None:
        if text is None:
            return None
        if not isinstance(text, str):
            raise InvalidRecordError(
                f"{name} must be an ISO 8601 string, not {type(text).__name__}"
            )
        return check(datetime.fromisoformat(text))  # its ValueError names the text

    return Form(str | None, load, format_time, check, {"type": "string"})


class Column(NamedTuple):
    """How the CLI shows a field: its header and the cell of a record."""

    header: str
    cell: Callable[[EngineRecord], str]
    lead: bool = False
    """Shown right after the engine id (what a record's state is), else after the endpoint."""


@dataclass(frozen=True)
class Stored:
    """One metadata field of the stored value (see the module docs)."""

    form: Form
    doc: str
    """What the field means: one line of the documentation's field table."""
    json: str
    """Its JSON type, in the field table's words."""
    always: bool = False
    """Written even when it has its default (else a default value is left out)."""
    adopt: bool = False
    """An outside writer's change of it (an operator) is adopted by the registrar."""
    column: Column | None = None
    """The CLI column (``discovery list`` / ``watch``) showing it, if any."""


def _stored(default: Any = None, *, factory: Any = None, **meta: Any) -> Any:
    """A dataclass field with its ``Stored`` description (``meta``)."""
    metadata = {"stored": Stored(**meta)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _status_cell(record: EngineRecord) -> str:
    deadline = record.drain_deadline
    until = "" if deadline is None else f" until {deadline.isoformat(timespec='seconds')}"
    return f"{record.status}{until}"


def _version_cell(record: EngineRecord) -> str:
    return "-" if record.weight_version is None else f"v{record.weight_version}"


def _role_cell(record: EngineRecord) -> str:
    # "-" for the absent role (aggregated), as for an absent version: the others stand out.
    return "-" if record.role is EngineRole.AGGREGATED else str(record.role)


def _labels_cell(record: EngineRecord) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(record.labels.items())) or "-"


# -- the record --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One engine as stored in etcd: id, endpoint, labels, registration time, status, version.

    ``role``, ``kv_transfer_backend`` and ``kv_layout`` say which engines it can hand a
    request's KV to or take it from (``_records/handoff.py``); values of them this version does
    not know are kept as read (``UnknownValue``).
    ``drain_deadline`` (UTC) is when a ``draining`` engine leaves; None means it drains
    until someone undrains or removes it. Only a draining record may carry one.
    ``extra`` and ``extra_capabilities`` hold keys of the stored value this version does
    not know (top level, and inside ``capabilities``); they are written back unchanged.
    """

    engine_id: str
    endpoint: InferenceEngineEndpoint
    labels: Mapping[str, str] = _stored(
        factory=lambda: _EMPTY,
        form=LABELS,
        json="object of strings",
        doc="routing labels (`model`, `zone`, ...); keys 1-63 of `A-Za-z0-9._/-`, values "
        "printable, at most 256 characters, at most 64 labels",
        column=Column("LABELS", _labels_cell),
    )
    registered_at: datetime | None = _stored(
        form=_time("registered_at", aware=False),
        json="ISO 8601 string",
        doc="when the record was last written on a new lease (UTC)",
    )
    status: EngineStatus = _stored(
        EngineStatus.READY,
        form=STATUS,
        json="string",
        doc="`starting`, `ready`, `draining`, `paused` or `stalled` (silent past its "
        "launcher's stall timeout): routers pick `ready` engines; absent means `ready`",
        always=True,
        adopt=True,
        column=Column("STATUS", _status_cell, lead=True),
    )
    drain_deadline: datetime | None = _stored(
        form=_time("drain_deadline", aware=True),
        json="ISO 8601 string",
        doc="when a `draining` engine's lease is revoked (UTC); only on a draining record",
        adopt=True,
    )
    weight_version: int | None = _stored(
        form=WEIGHT_VERSION,
        json="integer",
        doc="the version of the weights the engine serves (0 to 2**63 - 1, never lowered "
        "without `force`); absent means none was set",
        adopt=True,
        column=Column("VERSION", _version_cell, lead=True),
    )
    state_address: str | None = _stored(
        form=Form(
            str | None,
            _checked_address,
            str,
            _checked_address,
            {"type": "string", "pattern": "^tcp://", "maxLength": 256},
        ),
        json="string",
        doc="where the engine's launcher relays its live state (cached blocks, load) over "
        "ZeroMQ, `tcp://HOST:PORT`; read by routers' `EngineStates`",
    )
    role: EngineRole | str = _stored(
        EngineRole.AGGREGATED,
        form=ROLE,
        json="string",
        doc="`aggregated`, `prefill` or `decode` (Megatron's `--role`); absent means "
        "`aggregated`; a role this version does not know is kept and never paired",
        column=Column("ROLE", _role_cell, lead=True),
    )
    kv_transfer_backend: KvTransferBackend | str | None = _stored(
        form=BACKEND,
        json="string",
        doc="how KV moves between a prefill and a decode engine: `nixl` or `nccl` (the "
        "launcher's choice in Megatron); absent: not declared, never paired",
    )
    kv_layout: KvLayout | None = _stored(
        form=LAYOUT,
        json="object",
        doc="the KV layout a hand-off must match or can reshard, in Megatron's names: "
        "`tp_size`, `pp_size`, `num_layers_global`, `num_kv_heads_global`, `head_dim`, "
        "`dtype`, `num_ssm_layers_global`, `num_speculative_tokens` (docs/routing.md)",
    )
    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    extra_capabilities: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        """Check every field by its declaration; the endpoint validates itself."""
        validate_engine_id(self.engine_id)
        if not isinstance(self.endpoint, InferenceEngineEndpoint):
            raise InvalidRecordError("endpoint must be an InferenceEngineEndpoint")
        for name, stored in STORED:
            _set(self, name, stored.form.check(getattr(self, name)))
        _set(self, "extra", _unknown(self.extra, KNOWN_KEYS, "extra"))
        _set(
            self,
            "extra_capabilities",
            _unknown(self.extra_capabilities, CAPABILITY_FIELDS, "extra_capabilities"),
        )
        self._check_together()

    def _check_together(self) -> None:
        """The rules between fields (after each field passed its own check)."""
        if self.drain_deadline is not None and self.status is not EngineStatus.DRAINING:
            raise InvalidRecordError(
                f"drain_deadline is only allowed on a draining record, not {self.status}"
            )

    @property
    def ready(self) -> bool:
        """Whether routers pick this engine by default (status ``ready``)."""
        return self.status is EngineStatus.READY

    @classmethod
    def _decoded(cls, values: Iterable[Any]) -> EngineRecord:
        """A record from values the decoder has already checked, every field in order.

        Nothing is checked twice: only the rules between fields run.
        """
        record = object.__new__(cls)
        for set_field, value in zip(_SETTERS, values, strict=False):  # the caller's count
            set_field(record, value)
        record._check_together()
        return record

    def matches(self, selector: SelectorLike | None) -> bool:
        """Whether this record's labels meet ``selector`` (a Selector, its text or labels)."""
        return selector_of(selector).matches(self.labels)

    def metadata(self) -> dict[str, Any]:
        """Every metadata field as JSON values (``None`` where unset), in declared order."""
        return {
            name: None if (value := getattr(self, name)) is None else stored.form.dump(value)
            for name, stored in STORED
        }

    def to_value(self) -> dict[str, Any]:
        """Return the JSON object stored in etcd: Megatron's ``to_dict()`` plus metadata."""
        value = self.endpoint.to_dict()
        if self.extra_capabilities:
            value["capabilities"].update(self.extra_capabilities)
        value["engine_id"] = self.engine_id
        for name, stored in STORED:
            current, default = getattr(self, name), _DEFAULTS[name]
            if stored.always or (current is not default and current != default):
                value[name] = stored.form.dump(current)
        value.update(self.extra)
        return value

    @staticmethod
    def column_headers(*, lead: bool) -> list[str]:
        """Headers of the CLI's columns of the metadata (``lead``: shown after the id)."""
        return [column.header for column in COLUMNS if column.lead is lead]

    def column_cells(self, *, lead: bool) -> list[str]:
        """The record's cells in those columns (``-`` for nothing)."""
        return [column.cell(self) for column in COLUMNS if column.lead is lead]

    def adopting(self, found: EngineRecord, *, fields: bool = True) -> EngineRecord:
        """A copy with what outside writers own taken from ``found``.

        Outside writers own the keys this version does not know and (with ``fields``) the
        fields declared ``adopt``, such as the status an operator set.
        """
        # A stopping mark announces a deletion (an operator's deregister): a registrar that
        # writes its record again afterwards keeps its own status.
        fields = fields and found.status is not EngineStatus.STOPPING
        return dataclasses.replace(
            self,
            extra=found.extra,
            extra_capabilities=found.extra_capabilities,
            **{name: getattr(found, name) for name in ADOPTED if fields},
        )


def _unknown(keys: Mapping[str, Any], known: Collection[str], what: str) -> Any:
    if not isinstance(keys, Mapping):
        raise InvalidRecordError(f"{what} must be a mapping, not {type(keys).__name__}")
    if not keys:
        return _EMPTY
    taken = sorted(k for k in keys if not isinstance(k, str) or k in known)
    if taken:
        raise InvalidRecordError(f"{what}: {taken} are fields of the record, not unknown keys")
    return MappingProxyType(dict(keys))


STORED: tuple[tuple[str, Stored], ...] = tuple(
    (f.name, f.metadata["stored"]) for f in dataclasses.fields(EngineRecord) if f.metadata
)
"""Every stored metadata field of the record: (name, how it is stored), in order."""
KNOWN_KEYS = (*ENDPOINT_KEYS, "engine_id", *(name for name, _ in STORED))
"""Every top-level key this version knows."""
ADOPTED = tuple(name for name, stored in STORED if stored.adopt)
_DEFAULTS = {
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(EngineRecord)
}
# Each field's slot, set directly: decoding sets every field of thousands of records.
SETTERS: Mapping[str, Callable[[EngineRecord, Any], None]] = {
    f.name: EngineRecord.__dict__[f.name].__set__ for f in dataclasses.fields(EngineRecord)
}
_SETTERS = tuple(SETTERS.values())
COLUMNS = tuple(stored.column for _, stored in STORED if stored.column is not None)
"""The CLI's metadata columns, in declared order."""


def field_table() -> str:
    """The table of the stored metadata, rendered from the declaration (the site's page)."""
    rows = ["| key | JSON | meaning |", "|---|---|---|"]
    rows.append(f"| `engine_id` | string | {_ENGINE_ID_DOC} |")
    rows.extend(f"| `{name}` | {s.json} | {s.doc} |" for name, s in STORED)
    return "\n".join(rows)


_ENGINE_ID_DOC = "the engine id; when absent, the one the key names"


def record_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a stored value, from the record's declaration.

    Megatron's ``to_dict()`` (``capabilities_schema``), ``engine_id``, and every declared
    field by its form's schema (null allowed: a stored null means absent). Every object
    allows keys it does not name: a reader keeps them (docs/record.md).
    """
    metadata = {
        name: {"description": stored.doc, **_or_null(stored.form.schema)} for name, stored in STORED
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "discovery engine record",
        "description": "The value of {root}/{namespace}/engines/{engine_id}: Megatron-Core's "
        "InferenceEngineEndpoint.to_dict() plus top-level metadata (docs/record.md).",
        "type": "object",
        "required": list(ENDPOINT_KEYS),
        "properties": {
            "coordinator_address": {"type": "string", "minLength": 1},
            "capabilities": capabilities_schema(),
            "engine_id": {
                "description": _ENGINE_ID_DOC,
                "type": "string",
                "pattern": f"^{_NAME.pattern}$",
            },
            **metadata,
        },
    }


def _or_null(schema: Mapping[str, Any]) -> dict[str, Any]:
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    return {**schema, "type": [schema["type"], "null"]}


class EndpointLike(Protocol):
    """An endpoint record with Megatron's ``to_dict()``: ours, or Megatron-Core's own."""

    def to_dict(self) -> Mapping[str, Any]:
        """``{"coordinator_address": ..., "capabilities": {...}}``."""
        ...


def endpoint_parts(
    endpoint: object,
) -> tuple[InferenceEngineEndpoint, Mapping[str, Any], Mapping[str, Any]]:
    """Our endpoint for ``endpoint``, and the keys of its ``to_dict()`` we do not know.

    Takes our ``InferenceEngineEndpoint`` as it is, and any object with Megatron's
    ``to_dict()`` (Megatron-Core's own record, whatever its version) through that dict:
    the unknown keys (top level, then inside ``capabilities``) come back to be stored.
    """
    if isinstance(endpoint, InferenceEngineEndpoint):
        return endpoint, _EMPTY, _EMPTY
    to_dict = getattr(endpoint, "to_dict", None)
    if not callable(to_dict):
        raise InvalidRecordError(
            "endpoint must be an InferenceEngineEndpoint or have Megatron's to_dict(), "
            f"not {type(endpoint).__name__}"
        )
    return endpoint_from_dict(to_dict(), f"{type(endpoint).__name__}.to_dict()")


def endpoint_from_dict(
    value: object, what: str
) -> tuple[InferenceEngineEndpoint, Mapping[str, Any], Mapping[str, Any]]:
    """``endpoint_parts`` of a ``to_dict()`` value; ``what`` names it in errors."""
    if not isinstance(value, Mapping):
        raise InvalidRecordError(f"{what} is a {type(value).__name__}, not a mapping")
    capabilities = value.get("capabilities")
    try:
        endpoint = InferenceEngineEndpoint.from_dict(value)
    except KeyError as exc:
        raise InvalidRecordError(f"{what} is missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"{what} is invalid: {exc}") from None
    extra = {k: v for k, v in value.items() if k not in ENDPOINT_KEYS}
    assert isinstance(capabilities, Mapping)  # from_dict checked it
    extra_capabilities = {k: v for k, v in capabilities.items() if k not in CAPABILITY_FIELDS}
    return (
        endpoint,
        _unknown(extra, KNOWN_KEYS, what),
        _unknown(extra_capabilities, CAPABILITY_FIELDS, what),
    )


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
        """The engine's status (``EngineStatus``): what routers may do with it."""
        return self.record.status

    @property
    def weight_version(self) -> int | None:
        """The version of the weights the engine serves, or None when it set none."""
        return self.record.weight_version

    @property
    def role(self) -> EngineRole | str:
        """The engine's role: aggregated, prefill or decode (or one this version does not know)."""
        return self.record.role
