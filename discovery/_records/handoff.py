"""Prefill/decode hand-off: an engine's role, KV transfer backend and KV layout, and the rule.

Megatron-Core hands a request's KV (and, for hybrid models, SSM) state from a prefill
engine to a decode engine (``megatron/core/inference/disaggregation/``; every fact below
is cited with its file and commit in docs/prefill-decode.md). The record says
what a router needs to know which pairs can hand off: ``role``, ``kv_transfer_backend``
and ``kv_layout`` (declared in ``_records/record.py``). ``handoff_problem(prefill, decode)`` is
Megatron's rule: None when the pair can hand off, else the reason.

Every part of the rule is a condition on one engine or the equality of a value on both,
so compatibility is an equivalence: ``handoff_key(record)`` is None for an engine that
can hand off with no one, else a key, and a prefill and a decode engine can hand off
exactly when their keys are equal. A router can group engines by key instead of checking
every pair. Values this version does not know (a role, a backend, a dtype, a layout key)
are kept as read; an unknown role or backend is never offered, an unknown layout key must
be equal on both sides.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from discovery._errors import InvalidRecordError
from discovery._records.endpoint import InferenceEngineEndpoint
from discovery._records.unknown import UnknownValue, name_schema, read_unknown, tolerant_reader

__all__ = [
    "EngineRole",
    "HandoffKey",
    "KvLayout",
    "KvTransferBackend",
    "handoff_key",
    "handoff_problem",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class EngineRole(enum.StrEnum):
    """What an engine does with a request (Megatron's ``--role``); absent means aggregated."""

    AGGREGATED = "aggregated"
    """Serves whole requests; takes part in no hand-off."""
    PREFILL = "prefill"
    """Computes prompts and hands their KV to a decode engine."""
    DECODE = "decode"
    """Generates from a prefill engine's KV; cannot compute a prompt itself."""


class KvTransferBackend(enum.StrEnum):
    """How KV moves between a prefill and a decode engine (chosen by the launcher)."""

    NIXL = "nixl"
    """One-sided reads: the decode engine pulls the prefill engine's blocks (Megatron's default)."""
    NCCL = "nccl"
    """Two-sided sends and receives inside one torch.distributed process group."""


def _normal_backend(value: str) -> str:
    return value.lower().replace("_", "-")  # as Megatron's backend registry reads a name


read_role, validate_role = tolerant_reader(EngineRole, "role")
read_backend, validate_backend = tolerant_reader(
    KvTransferBackend, "kv_transfer_backend", _normal_backend
)

KV_DTYPES = ("bfloat16", "float16", "float32")
"""The KV cache's dtypes: Megatron allocates it in the model's ``params_dtype``."""


@dataclass(frozen=True)
class KvLayout:
    """An engine's KV-cache layout: what a hand-off must match, or can reshard (TP, PP).

    The names are those of the metadata Megatron's transfer backends exchange
    (``export_geometry_meta``): the engine's tensor- and pipeline-parallel sizes, the
    model's attention layers and KV heads (GQA: its query groups) in all, the head
    dimension, and the cache's dtype; its SSM layers in all (0: no hybrid state) and the
    MTP proposals it samples with the first token (``num_speculative_tokens``). ``extra``
    holds keys this version does not know (read from etcd, kept and written back).
    """

    tp_size: int
    pp_size: int
    num_layers_global: int
    num_kv_heads_global: int
    head_dim: int
    dtype: str
    num_ssm_layers_global: int = 0
    num_speculative_tokens: int = 0
    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        """Check every value; ``dtype`` is one of ``KV_DTYPES`` unless read from etcd."""
        for name in _INTEGERS:
            value = getattr(self, name)
            least = 0 if name in _MAY_BE_ZERO else 1
            if type(value) is not int or value < least:
                raise InvalidRecordError(
                    f"kv_layout {name} must be an integer >= {least}, not {value!r}"
                )
        if type(self.dtype) is not UnknownValue and self.dtype not in KV_DTYPES:
            raise InvalidRecordError(
                f"kv_layout dtype {self.dtype!r} is not one of {', '.join(KV_DTYPES)}"
            )
        if not isinstance(self.extra, Mapping):
            raise InvalidRecordError("kv_layout extra must be a mapping")
        taken = sorted(k for k in self.extra if not isinstance(k, str) or k in _NAMES)
        if taken:
            raise InvalidRecordError(f"kv_layout extra: {taken} are known keys, not unknown ones")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)) or _EMPTY)

    @classmethod
    def from_dict(cls, value: object) -> KvLayout:
        """The layout as stored (etcd): unknown keys and an unknown dtype are kept."""
        if not isinstance(value, Mapping):
            raise InvalidRecordError(f"kv_layout must be an object, not {type(value).__name__}")
        missing = [name for name in _REQUIRED if name not in value]
        if missing:
            raise InvalidRecordError(f"kv_layout is missing {', '.join(missing)}")
        known = {name: value[name] for name in _NAMES if name in value}
        dtype = known["dtype"]
        if isinstance(dtype, str) and dtype not in KV_DTYPES:
            known["dtype"] = read_unknown(dtype, "kv_layout dtype")
        return cls(**known, extra={k: v for k, v in value.items() if k not in _NAMES})

    @classmethod
    def parse(cls, text: str) -> KvLayout:
        """The layout given as ``key=value,...`` (``--kv-layout``): every key known."""
        values: dict[str, Any] = {}
        for pair in text.split(","):
            key, sep, raw = pair.strip().partition("=")
            if not sep or key not in _NAMES:
                raise InvalidRecordError(
                    f"kv_layout {pair.strip()!r} must be KEY=VALUE with KEY one of "
                    f"{', '.join(_NAMES)}"
                )
            try:
                values[key] = raw if key == "dtype" else int(raw)
            except ValueError:
                raise InvalidRecordError(
                    f"kv_layout {key} must be an integer, not {raw!r}"
                ) from None
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise InvalidRecordError(f"kv_layout is missing {', '.join(missing)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored in etcd (the unknown keys last)."""
        value: dict[str, Any] = {name: getattr(self, name) for name in _NAMES}
        value["dtype"] = str(self.dtype)
        return {**value, **self.extra}


_NAMES = tuple(f.name for f in fields(KvLayout) if f.name != "extra")
_REQUIRED = tuple(
    f.name for f in fields(KvLayout) if f.default is MISSING and f.default_factory is MISSING
)
_INTEGERS = tuple(name for name in _NAMES if name != "dtype")
_MAY_BE_ZERO = ("num_ssm_layers_global", "num_speculative_tokens")
LAYOUT_SCHEMA = {
    "type": "object",
    "required": list(_REQUIRED),
    "properties": {
        name: name_schema(KV_DTYPES)
        if name == "dtype"
        else {"type": "integer", "minimum": 0 if name in _MAY_BE_ZERO else 1}
        for name in _NAMES
    },
}
"""The JSON Schema of a stored ``kv_layout`` (other keys are kept, and must match)."""


def validate_layout(value: object) -> KvLayout | None:
    """``value`` if it is None or a ``KvLayout``, else InvalidRecordError."""
    if value is None or isinstance(value, KvLayout):
        return value
    raise InvalidRecordError(f"kv_layout must be a KvLayout, not {type(value).__name__}")


# -- the rule ----------------------------------------------------------------------------


class HandoffSide(Protocol):
    """What the rule reads of an engine: an ``EngineRecord``."""

    @property
    def engine_id(self) -> str:
        """The engine's id."""
        ...

    @property
    def endpoint(self) -> InferenceEngineEndpoint:
        """Its block size and prefix caching."""
        ...

    @property
    def role(self) -> EngineRole | str:
        """Its role."""
        ...

    @property
    def kv_transfer_backend(self) -> KvTransferBackend | str | None:
        """Its KV transfer backend, if declared."""
        ...

    @property
    def kv_layout(self) -> KvLayout | None:
        """Its KV layout, if declared."""
        ...


class HandoffKey(NamedTuple):
    """What a prefill and a decode engine must have equal to hand off (``handoff_key``)."""

    kv_transfer_backend: str
    kv_cache_block_size: int
    num_layers_global: int
    num_kv_heads_global: int
    head_dim: int
    dtype: str
    num_ssm_layers_global: int
    num_speculative_tokens: int
    extra: str
    """The layout's unknown keys, as canonical JSON."""


# Why each part of the key must be equal (docs/prefill-decode.md cites the file and commit).
_EQUAL_BECAUSE = {
    "kv_transfer_backend": "both engines must run the same transfer backend",
    "kv_cache_block_size": "the decode engine counts the prompt's blocks in its own block size",
    "num_layers_global": "Megatron reshards layers and heads between layouts of one model only",
    "num_kv_heads_global": "Megatron reshards layers and heads between layouts of one model only",
    "head_dim": "KV bytes are copied as they are: head size and element size must match",
    "dtype": "KV bytes are copied as they are: head size and element size must match",
    "num_ssm_layers_global": "hybrid SSM state is handed over with the KV: the same model on both",
    "num_speculative_tokens": "the decode engine resumes from one sampled token plus its own "
    "number of MTP proposals",
    "extra": "layout keys this version does not know must be equal on both engines",
}


def _cannot(record: HandoffSide) -> str | None:
    """Why ``record`` can hand off with no engine at all (its role aside), or None."""
    backend = record.kv_transfer_backend
    if backend is None:
        return "declares no kv_transfer_backend"
    if type(backend) is not KvTransferBackend:
        return f"kv_transfer_backend {backend!r} is unknown to this version"
    if backend is KvTransferBackend.NCCL:
        return (
            "nccl hands off only inside one torch.distributed process group (one "
            "coordinator-native deployment), which two registered engines are not"
        )
    if not record.endpoint.capabilities.enable_prefix_caching:
        return "has prefix caching off: a hand-off needs it on both engines"
    layout = record.kv_layout
    if layout is None:
        return "declares no kv_layout"
    if layout.num_kv_heads_global % layout.tp_size:
        return (
            f"tp_size {layout.tp_size} does not divide its {layout.num_kv_heads_global} KV "
            "heads: Megatron reshards whole KV heads only"
        )
    return None


def handoff_key(record: HandoffSide) -> HandoffKey | None:
    """The key a hand-off partner of ``record`` must share, or None if it can have none.

    The role is not part of it: a prefill and a decode engine with equal keys can hand
    off (``handoff_problem``). None also for an aggregated or unknown role.
    """
    if type(record.role) is not EngineRole or record.role is EngineRole.AGGREGATED:
        return None
    if _cannot(record) is not None:
        return None
    layout = record.kv_layout
    assert layout is not None  # _cannot checked
    return HandoffKey(
        str(record.kv_transfer_backend),
        record.endpoint.capabilities.kv_cache_block_size,
        layout.num_layers_global,
        layout.num_kv_heads_global,
        layout.head_dim,
        str(layout.dtype),
        layout.num_ssm_layers_global,
        layout.num_speculative_tokens,
        json.dumps(dict(layout.extra), sort_keys=True, default=repr),
    )


def handoff_problem(prefill: HandoffSide, decode: HandoffSide) -> str | None:
    """None when ``prefill`` can hand a request's KV to ``decode``, else the reason.

    Megatron's rules: the roles prefill and decode; the same known backend (nixl across
    engines); prefix caching on both; a declared layout each, whose tensor-parallel size
    divides its KV heads; the same block size, model (layers, KV heads, head size, dtype,
    SSM layers) and MTP proposals. Tensor- and pipeline-parallel sizes may differ: Megatron
    reshards between them.
    """
    for record, role in ((prefill, EngineRole.PREFILL), (decode, EngineRole.DECODE)):
        if record.role is not role:
            return f"{record.engine_id} has role {str(record.role)!r}, not {role.value!r}"
        reason = _cannot(record)
        if reason is not None:
            return f"{record.engine_id} {reason}"
    ours, theirs = handoff_key(prefill), handoff_key(decode)
    assert ours is not None and theirs is not None  # both passed the checks above
    for name, mine, other in zip(HandoffKey._fields, ours, theirs, strict=True):
        if mine != other:
            return (
                f"{name} differs: {mine} on {prefill.engine_id}, {other} on "
                f"{decode.engine_id} ({_EQUAL_BECAUSE[name]})"
            )
    return None
