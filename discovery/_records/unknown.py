"""Values a newer writer may use that this version does not know: kept, never refused.

A record's string enums (an engine's ``role``, its ``kv_transfer_backend``, its
``prefix_caching_coordinator_policy``) gain members over time: Megatron's next policy, a
transfer backend added later. A reader of etcd or of an engine keeps such a value as an
``UnknownValue`` (a ``str``, written back unchanged) and treats it as the safe default
its own code names; a value a user gives in Python must be a member.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from discovery._errors import InvalidRecordError

__all__ = ["UnknownValue"]

_MAX_UNKNOWN = 64  # characters of a value this version does not know


class UnknownValue(str):
    """A value this version does not know, kept as it was read (from etcd or an engine)."""

    __slots__ = ()


def name_schema(known: Iterable[str]) -> dict[str, Any]:
    """The JSON Schema of a value read tolerantly: any name, the ``known`` ones as examples."""
    return {"type": "string", "minLength": 1, "maxLength": _MAX_UNKNOWN, "examples": [*known]}


def read_unknown(value: str, what: str) -> UnknownValue:
    """``value`` kept as an ``UnknownValue``, if it is a short printable name."""
    if not 0 < len(value) <= _MAX_UNKNOWN or not value.isprintable():
        raise InvalidRecordError(
            f"{what} {value[:_MAX_UNKNOWN]!r} is not a name: 1 to {_MAX_UNKNOWN} printable "
            "characters"
        )
    return UnknownValue(value)


_Known = TypeVar("_Known", bound=enum.StrEnum)


def tolerant_reader(
    kind: type[_Known], what: str, normal: Callable[[str], str] = str
) -> tuple[Callable[[object], _Known | str], Callable[[object], _Known | str]]:
    """(read, check) for a string enum: ``read`` keeps an unknown string, ``check`` refuses it.

    Both take a member, an ``UnknownValue`` (kept) or a string naming a member; ``read``
    is for what etcd or an engine says, ``check`` for what a user gives. Both raise
    InvalidRecordError (a ValueError) naming ``what``.
    """
    members = {member.value: member for member in kind}
    names = ", ".join(members)

    def read(value: object) -> _Known | str:
        if type(value) is kind or type(value) is UnknownValue:
            return value  # a member, or a value read before and kept
        if not isinstance(value, str):
            raise InvalidRecordError(f"{what} must be a string, not {value!r}"[:200])
        known = members.get(normal(value))
        return read_unknown(value, what) if known is None else known

    def check(value: object) -> _Known | str:
        if type(value) is UnknownValue:
            return value  # read earlier, kept
        if isinstance(value, str) and normal(value) in members:
            return members[normal(value)]
        raise InvalidRecordError(f"{what} {value!r} is not one of {names}")

    return read, check
