"""Megatron-Core compatible engine records.

Field names, order, defaults, validation and exception types follow
``megatron.core.inference.engine_endpoint`` exactly, so a value written by either
side loads on the other. This module knows nothing about etcd.

One deliberate difference: a ``prefix_caching_coordinator_policy`` this version does not
know is kept (an ``UnknownValue``, written back unchanged) where Megatron's ``from_dict``
raises ValueError. Megatron's enum differs between its versions (``round_robin`` in
0.17/0.18/dev, ``load_balanced`` on main, perhaps another in the next), and each version's
``from_dict`` reads the values it writes: a record must not be refused because this
package is older or newer than the engine. Types and ranges stay as strict as Megatron's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from operator import attrgetter
from typing import Any, Protocol

from discovery._records.unknown import UnknownValue, name_schema, tolerant_reader

__all__ = [
    "InferenceEngineCapabilities",
    "InferenceEngineEndpoint",
    "PrefixCachingCoordinatorPolicy",
]


class PrefixCachingCoordinatorPolicy(enum.StrEnum):
    """How a router should place requests on the ranks of a prefix-caching engine.

    Megatron's ``megatron.core.inference.config.PrefixCachingCoordinatorPolicy`` of every
    version named here: main (d98e8a64) has ``longest_prefix``, ``first_prefix_block``
    and ``load_balanced``, default ``load_balanced`` (since bcf4c8fb, which replaced
    ``round_robin``); core_r0.17.0 (432585d5), core_r0.18.0 (dc0ee41a) and dev (d48bd6be)
    have ``longest_prefix``, ``first_prefix_block`` and ``round_robin``, default
    ``first_prefix_block``; open PR 6668 (457d3b0a) keeps main's values and moves the default
    to ``longest_prefix``. A value outside this enum (a later version's) is read as an
    ``UnknownValue`` and kept.
    """

    LONGEST_PREFIX = "longest_prefix"
    """Route to the rank with the longest consecutive prefix match."""
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    """Route to the rank that has the first block hash cached (the default of 0.17/0.18/dev)."""
    LOAD_BALANCED = "load_balanced"
    """Route to the rank with the fewest in-flight requests, ignoring prefix affinity (the
    default on main since bcf4c8fb)."""
    ROUND_ROBIN = "round_robin"
    """Route to the ranks in turn (0.17/0.18/dev; main replaced it by ``load_balanced``)."""


class DynamicEngineLike(Protocol):
    """The attributes of Megatron's ``DynamicInferenceEngine`` that ``from_engine`` reads."""

    context: Any
    controller: Any


_INTEGER_FIELDS = (
    "context_length",
    "kv_cache_block_size",
    "total_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "bos_token_id",
    "logical_data_parallel_size",
)
_POSITIVE_FIELDS = (
    "context_length",
    "kv_cache_block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "logical_data_parallel_size",
)
_BOS_ATTRIBUTES = ("bos", "bos_token_id", "eod")

MAX_CAPACITY = 2**40
"""The most a record may claim of each capacity below: about 10**12 tokens, KV blocks,
sequences or ranks, beyond any real engine. Megatron's constructor (and ours) has no upper
bound; the codec refuses a stored value over it, on read and on write, so that a record that
lies (a buggy or hostile writer's) is skipped like a malformed one instead of taking the
traffic of every router that believes it."""
_BOUNDED_FIELDS = (*_POSITIVE_FIELDS, "total_kv_blocks")


def _require_mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping, not {type(value).__name__}")
    return value


@dataclass(frozen=True)
class InferenceEngineCapabilities:
    """Static capabilities needed by an external inference control plane."""

    context_length: int
    kv_cache_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    bos_token_id: int
    enable_prefix_caching: bool
    logical_data_parallel_size: int = 1
    prefix_caching_coordinator_policy: PrefixCachingCoordinatorPolicy | str | None = None
    """Routing policy for client-side hashing; None supports older endpoint records. A
    value this version does not know, read from a mapping or an engine, is an
    ``UnknownValue`` (a ``str``)."""

    def __post_init__(self) -> None:
        """Validate types first, then ranges, with Megatron's exception types."""
        # Plain comparisons for the common case; the loops below only run to name the
        # first offending field, in Megatron's order.
        context_length = self.context_length
        kv_cache_block_size = self.kv_cache_block_size
        total_kv_blocks = self.total_kv_blocks
        max_num_seqs = self.max_num_seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        logical_data_parallel_size = self.logical_data_parallel_size
        if not (
            type(context_length) is int
            and type(kv_cache_block_size) is int
            and type(total_kv_blocks) is int
            and type(max_num_seqs) is int
            and type(max_num_batched_tokens) is int
            and type(self.bos_token_id) is int
            and type(logical_data_parallel_size) is int
        ):
            for name in _INTEGER_FIELDS:
                value = getattr(self, name)
                # bool is an int subclass; Megatron rejects it, and so do we.
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{name} must be an integer")
        if type(self.enable_prefix_caching) is not bool:
            raise TypeError("enable_prefix_caching must be a boolean")
        policy = self.prefix_caching_coordinator_policy
        if (
            policy is not None
            and type(policy) is not PrefixCachingCoordinatorPolicy
            and type(policy) is not UnknownValue
        ):
            raise TypeError("prefix_caching_coordinator_policy must be a routing policy")
        if not (
            context_length > 0
            and kv_cache_block_size > 0
            and max_num_seqs > 0
            and max_num_batched_tokens > 0
            and logical_data_parallel_size > 0
        ):
            for name in _POSITIVE_FIELDS:
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive")
        if total_kv_blocks < 0:
            raise ValueError("total_kv_blocks must be non-negative")

    @classmethod
    def from_engine(
        cls, engine: DynamicEngineLike, *, logical_data_parallel_size: int = 1
    ) -> InferenceEngineCapabilities:
        """Inspect a constructed dynamic engine once at registration time."""
        context = engine.context
        tokenizer = engine.controller.tokenizer
        bos_token_id = 0
        for name in _BOS_ATTRIBUTES:
            value = getattr(tokenizer, name, None)
            if value is not None:
                bos_token_id = int(value)
                break
        return cls(
            context_length=int(context.max_sequence_length),
            kv_cache_block_size=int(context.block_size_tokens),
            # Block zero is the allocator's root and holds no request KV.
            total_kv_blocks=max(0, int(context.kv_block_allocator.pool_size) - 1),
            max_num_seqs=int(context.max_requests),
            max_num_batched_tokens=int(context.max_tokens),
            bos_token_id=bos_token_id,
            enable_prefix_caching=bool(context.enable_prefix_caching),
            logical_data_parallel_size=int(logical_data_parallel_size),
            prefix_caching_coordinator_policy=_engine_policy(context),
        )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> InferenceEngineCapabilities:
        """Deserialize a capabilities mapping received across a process boundary.

        A policy string this version does not know is kept as an ``UnknownValue`` (module
        docs); any other problem raises what Megatron's ``from_dict`` raises.
        """
        value = _require_mapping(value, "capabilities")
        policy = value.get("prefix_caching_coordinator_policy")
        return cls(
            context_length=value["context_length"],
            kv_cache_block_size=value["kv_cache_block_size"],
            total_kv_blocks=value["total_kv_blocks"],
            max_num_seqs=value["max_num_seqs"],
            max_num_batched_tokens=value["max_num_batched_tokens"],
            bos_token_id=value["bos_token_id"],
            enable_prefix_caching=value["enable_prefix_caching"],
            logical_data_parallel_size=value.get("logical_data_parallel_size", 1),
            prefix_caching_coordinator_policy=read_policy(policy),
        )

    def to_dict(self) -> dict[str, int | bool | str | None]:
        """Return a serialization-friendly representation."""
        return dict(zip(_FIELD_NAMES, _field_values(self), strict=True))


_FIELD_NAMES = tuple(f.name for f in fields(InferenceEngineCapabilities))
_field_values = attrgetter(*_FIELD_NAMES)
_POLICY = "prefix_caching_coordinator_policy"
_read_policy, _ = tolerant_reader(PrefixCachingCoordinatorPolicy, _POLICY)


def capabilities_schema() -> dict[str, Any]:
    """The JSON Schema of ``to_dict()``, from the fields and Megatron's checks above.

    Keys it does not name are allowed (a newer Megatron's): readers keep them.
    """
    properties: dict[str, Any] = {}
    for field in fields(InferenceEngineCapabilities):
        if field.name == _POLICY:
            properties[_POLICY] = {
                **name_schema(PrefixCachingCoordinatorPolicy),
                "type": ["string", "null"],
            }
        elif field.name in _INTEGER_FIELDS:
            least = 1 if field.name in _POSITIVE_FIELDS else _LEAST.get(field.name)
            properties[field.name] = (
                {"type": "integer"}
                | ({} if least is None else {"minimum": least})
                | ({"maximum": MAX_CAPACITY} if field.name in _BOUNDED_FIELDS else {})
            )
        else:
            properties[field.name] = {"type": "boolean"}
    required = [f.name for f in fields(InferenceEngineCapabilities) if f.default is MISSING]
    return {"type": "object", "required": required, "properties": properties}


_LEAST = {"total_kv_blocks": 0}  # bos_token_id: no range check


def check_bounds(capabilities: InferenceEngineCapabilities) -> None:
    """Raise ValueError naming the first capacity over ``MAX_CAPACITY``, its value and the bound."""
    for name in _BOUNDED_FIELDS:
        value = getattr(capabilities, name)
        if value > MAX_CAPACITY:
            shown = value if value < 10**30 else f"about 10**{len(str(value)) - 1}"
            raise ValueError(
                f"capabilities {name} is {shown}, over the bound of 2**40 "
                f"({MAX_CAPACITY}) no real engine exceeds"
            )


def read_policy(policy: object) -> PrefixCachingCoordinatorPolicy | str | None:
    """A policy read from a mapping or an engine: a member, an ``UnknownValue``, or None.

    A string this version does not know is kept (1 to 64 printable characters); any other
    type, or an unprintable string, raises ValueError as Megatron's enum lookup does.
    """
    if policy is None:
        return None
    if isinstance(policy, enum.Enum) and type(policy) is not PrefixCachingCoordinatorPolicy:
        policy = policy.value  # Megatron's own member: its value, whatever its version
    return _read_policy(policy)


def _engine_policy(context: Any) -> PrefixCachingCoordinatorPolicy | str | None:
    # Megatron's inference config has the field since March 2026; before, no policy.
    return read_policy(
        getattr(getattr(context, "config", None), "prefix_caching_coordinator_policy", None)
    )


@dataclass(frozen=True)
class InferenceEngineEndpoint:
    """Address and capabilities of an already-running inference engine."""

    coordinator_address: str
    capabilities: InferenceEngineCapabilities

    def __post_init__(self) -> None:
        """Validate with Megatron's exception types."""
        _check_endpoint(self.coordinator_address, self.capabilities)

    @classmethod
    def from_engine(
        cls,
        coordinator_address: str,
        engine: DynamicEngineLike,
        *,
        logical_data_parallel_size: int = 1,
    ) -> InferenceEngineEndpoint:
        """Describe a running engine without transferring ownership of it."""
        return cls(
            coordinator_address=coordinator_address,
            capabilities=InferenceEngineCapabilities.from_engine(
                engine, logical_data_parallel_size=logical_data_parallel_size
            ),
        )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> InferenceEngineEndpoint:
        """Deserialize an endpoint received across a process boundary."""
        value = _require_mapping(value, "endpoint")
        capabilities = value["capabilities"]
        if not isinstance(capabilities, Mapping):
            raise TypeError("capabilities must be a mapping")
        return cls(
            coordinator_address=value["coordinator_address"],
            capabilities=InferenceEngineCapabilities.from_dict(capabilities),
        )

    @classmethod
    def _checked(
        cls, coordinator_address: str, capabilities: InferenceEngineCapabilities
    ) -> InferenceEngineEndpoint:
        """The same validation as the constructor, without its generic set-up (codec)."""
        _check_endpoint(coordinator_address, capabilities)
        endpoint = object.__new__(cls)
        _set(endpoint, "coordinator_address", coordinator_address)
        _set(endpoint, "capabilities", capabilities)
        return endpoint

    def to_dict(self) -> dict[str, Any]:
        """Return a serialization-friendly representation."""
        return {
            "coordinator_address": self.coordinator_address,
            "capabilities": self.capabilities.to_dict(),
        }


_set = object.__setattr__  # how a frozen dataclass sets its own fields


def _check_endpoint(address: object, capabilities: object) -> None:
    if not isinstance(address, str):
        raise TypeError("coordinator_address must be a string")
    if not address:
        raise ValueError("coordinator_address must be non-empty")
    if not isinstance(capabilities, InferenceEngineCapabilities):
        raise TypeError("capabilities must be InferenceEngineCapabilities")
