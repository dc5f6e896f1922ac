"""Exceptions raised by discovery, grouped by cause.

    DiscoveryError
    ├── ConfigurationError (ValueError)     bad settings: URL, TLS files, timeouts
    ├── InvalidRecordError (ValueError)     bad endpoint, engine id, namespace, labels, size
    │   ├── RecordDecodeError               a stored value that cannot be decoded (names the key)
    │   └── InvalidSelectorError            a label selector that does not parse (names the term)
    ├── EtcdError                           etcd answered with, or failed by, a runtime error
    │   ├── EtcdUnavailableError            no member reachable / timed out after retries
    │   ├── EtcdNoSpaceError                etcd's space quota is full (NOSPACE): writes refused
    │   ├── RequestTooLargeError            a request over etcd's --max-request-bytes
    │   ├── PermissionDeniedError           authentication failed or the role lacks permission
    │   └── EngineConflictError             the engine id is held by another live lease
    ├── NoEngineAvailableError              no engine in the routing table can serve a request
    │   ├── OverloadedError                 engines pass the filters, none has room in time
    │   └── NotACandidateError              a pick pinned to an engine that is no candidate
    └── ClosedError (RuntimeError)          misuse: an object used after close()/stop()

Record validation itself keeps Megatron-Core's types (``TypeError``/``ValueError``/
``KeyError``) so code written against Megatron's module behaves the same here.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "ConfigurationError",
    "DiscoveryError",
    "EngineConflictError",
    "EtcdError",
    "EtcdNoSpaceError",
    "EtcdUnavailableError",
    "InvalidRecordError",
    "InvalidSelectorError",
    "NoEngineAvailableError",
    "NotACandidateError",
    "OverloadedError",
    "PermissionDeniedError",
    "RecordDecodeError",
    "RequestTooLargeError",
]


class DiscoveryError(Exception):
    """Root of every exception raised by discovery itself."""


class ConfigurationError(DiscoveryError, ValueError):
    """A setting is missing, malformed or points at a file that does not exist."""


class InvalidRecordError(DiscoveryError, ValueError):
    """An endpoint, engine id, namespace, label or value is not acceptable."""


def shown_key(text: str) -> str:
    r"""``text`` quoted as etcdctl shows a key: a byte that is not UTF-8 escaped once.

    Keys read from etcd are decoded with ``backslashreplace`` (byte 0xff is the four
    characters ``ÿ``); ``repr`` would escape those backslashes a second time.
    """
    return repr(text).replace("\\\\", "\\")


class RecordDecodeError(InvalidRecordError):
    """A value stored in etcd could not be decoded into an engine record."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"cannot decode value at {shown_key(key)}: {reason}")
        self.key = key
        self.reason = reason


class InvalidSelectorError(InvalidRecordError):
    """A label selector's text is malformed, or a key or value in it is not allowed.

    ``selector`` is the text, ``column`` where the problem is (1-based), ``term`` the
    requirement it is in, ``problem`` what is wrong there.
    """

    def __init__(self, selector: str, column: int, term: str, problem: str) -> None:
        where = f"column {column}" + (
            f" (term {term!r})" if term and term != selector.strip() else ""
        )
        super().__init__(f"invalid selector {selector!r}, {where}: {problem}")
        self.selector = selector
        self.column = column
        self.term = term
        self.problem = problem


class EtcdError(DiscoveryError):
    """etcd refused a request or could not be reached."""


class EtcdUnavailableError(EtcdError):
    """No etcd member answered in time, after retries: a transient failure.

    ``reason`` is the short cause as the client reported it (for health and logs).
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class EtcdNoSpaceError(EtcdError):
    """etcd's backend reached its space quota (the NOSPACE alarm): it refuses every write.

    Not transient: etcd answers at once and goes on refusing until an operator frees space
    and disarms the alarm; the message says how. Reads, watches and keepalives still work,
    so registrations keep their leases and records meanwhile.
    """

    RUNBOOK = (
        "free space, then disarm the alarm: `etcdctl endpoint status -w json` (the revision), "
        "`etcdctl compact <revision>`, `etcdctl defrag`, `etcdctl alarm disarm` "
        '(docs/operations/etcd.md, "Space quota exceeded")'
    )

    def __init__(self, details: str) -> None:
        super().__init__(
            f"etcd refused the write: its space quota is full, the NOSPACE alarm ({details}); "
            f"{self.RUNBOOK}"
        )
        self.details = details


class RequestTooLargeError(EtcdError):
    """etcd refused a request larger than its ``--max-request-bytes``.

    ``size`` is what the request carried (keys and values, in bytes), ``limit`` the
    members' limit as the settings know it (``Settings.max_request_bytes``, etcd's default
    1,572,864 bytes unless set).
    """

    def __init__(self, size: int, limit: int, shorten: str, details: str) -> None:
        if size > limit:
            why = f"over the members' --max-request-bytes, {limit:,} bytes"
        else:  # etcd's own limit is lower than the settings say
            why = (
                f"the members' --max-request-bytes is below the {limit:,} bytes the settings "
                "say: set theirs there"
            )
        super().__init__(
            f"a request of {size:,} bytes is too large for etcd ({details}); {why} "
            f"(Settings.max_request_bytes, DISCOVERY_ETCD_MAX_REQUEST_BYTES): {shorten}"
        )
        self.size = size
        self.limit = limit


class PermissionDeniedError(EtcdError):
    """Authentication failed, or the user's role does not allow the request."""


class EngineConflictError(EtcdError):
    """Another live lease holds the engine id."""

    def __init__(self, engine_id: str, key: str, lease_id: int, remaining_ttl: int) -> None:
        super().__init__(
            f"engine id {engine_id!r} is already registered at {key!r} by lease "
            f"{lease_id:016x} (remaining TTL {remaining_ttl} s); choose another id, or "
            "pass replace=True to take it over"
        )
        self.engine_id = engine_id
        self.key = key
        self.lease_id = lease_id
        self.remaining_ttl = remaining_ttl


class NoEngineAvailableError(DiscoveryError):
    """No engine passes a pick's filters; the message names the filter that emptied the set."""


class OverloadedError(NoEngineAvailableError):
    """Engines pass a pick's filters but none had room within its wait (admission).

    ``capacity`` and ``load`` are the candidates' total slots and requests in flight (this
    router's and, where relayed, the others'), ``waited`` the seconds the pick waited,
    ``queued`` the picks waiting when it gave up (or was refused a place).
    """

    def __init__(
        self, message: str, *, capacity: int, load: int, waited: float, queued: int
    ) -> None:
        super().__init__(message)
        self.capacity = capacity
        self.load = load
        self.waited = waited
        self.queued = queued


class NotACandidateError(NoEngineAvailableError):
    """A pick pinned to an engine (``engine_id=``) that is no candidate now.

    ``explanation`` is ``Router.explain``'s answer for it: why, filter by filter.
    """

    def __init__(self, message: str, explanation: object) -> None:
        super().__init__(message)
        self.explanation = explanation


class ClosedError(DiscoveryError, RuntimeError):
    """The object was used after it was closed or stopped."""
