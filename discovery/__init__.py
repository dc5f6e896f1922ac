"""discovery: find running Megatron-Core inference engines through etcd.

Engines register an ``InferenceEngineEndpoint`` under a lease; routers watch the prefix
into a live ``RoutingTable``. See the documentation (docs/, ``./dev docs``) for the
key layout and the guarantees.
"""

from ._blockhash import block_hashes
from ._codec import DEFAULT_NAMESPACE, DEFAULT_ROOT, MAX_VALUE_BYTES, KeySpace
from ._connection import Connection
from ._endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
)
from ._errors import (
    ClosedError,
    ConfigurationError,
    DiscoveryError,
    EngineConflictError,
    EtcdError,
    EtcdUnavailableError,
    InvalidRecordError,
    InvalidSelectorError,
    NoEngineAvailableError,
    NotACandidateError,
    OverloadedError,
    PermissionDeniedError,
    RecordDecodeError,
)
from ._events import EngineEventReceiver, ReceiverHealth, ReceiverState
from ._fleet import ControlResult, FleetClient, RequestLostError
from ._follower import EngineState, EngineStates, EngineStatesHealth
from ._handoff import (
    EngineRole,
    HandoffKey,
    KvLayout,
    KvTransferBackend,
    handoff_key,
    handoff_problem,
)
from ._launch import launch
from ._metrics import Metrics, MetricsHooks
from ._operators import deregister, drain, pause, resume, undrain
from ._policies import (
    Candidate,
    Choice,
    FirstPrefixBlockPolicy,
    LoadBalancedPolicy,
    LongestPrefixPolicy,
    PickRequest,
    Policy,
    RoundRobinPolicy,
    RoutingPolicy,
    SessionPolicy,
)
from ._port import EtcdPort
from ._record import EngineRecord, EngineStatus, record_schema
from ._registration import (
    Registration,
    RegistrationHealth,
    RegistrationState,
    aregister_engine,
    default_engine_id,
    register_dynamic_engine,
    register_engine,
)
from ._router import Explanation, PickHandle, PickPair, Router, RouterHealth
from ._routing import RoutingTable, watch_table
from ._selector import Selector
from ._session import Session
from ._settings import Settings
from ._signals import StopSignals, deregister_on_signals, drain_and_close
from ._split import Split
from ._store import EndpointEvent, EventType, RoutingSnapshot
from ._unknown import UnknownValue
from ._watcher import (
    EndpointWatcher,
    EngineListing,
    ListedEngine,
    WatcherHealth,
    WatcherState,
    list_engines,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_ROOT",
    "MAX_VALUE_BYTES",
    "Candidate",
    "Choice",
    "ClosedError",
    "ConfigurationError",
    "Connection",
    "ControlResult",
    "DiscoveryError",
    "EndpointEvent",
    "EndpointWatcher",
    "EngineConflictError",
    "EngineEventReceiver",
    "EngineListing",
    "EngineRecord",
    "EngineRole",
    "EngineState",
    "EngineStates",
    "EngineStatesHealth",
    "EngineStatus",
    "EtcdError",
    "EtcdPort",
    "EtcdUnavailableError",
    "EventType",
    "Explanation",
    "FirstPrefixBlockPolicy",
    "FleetClient",
    "HandoffKey",
    "InferenceEngineCapabilities",
    "InferenceEngineEndpoint",
    "InvalidRecordError",
    "InvalidSelectorError",
    "KeySpace",
    "KvLayout",
    "KvTransferBackend",
    "ListedEngine",
    "LoadBalancedPolicy",
    "LongestPrefixPolicy",
    "Metrics",
    "MetricsHooks",
    "NoEngineAvailableError",
    "NotACandidateError",
    "OverloadedError",
    "PermissionDeniedError",
    "PickHandle",
    "PickPair",
    "PickRequest",
    "Policy",
    "PrefixCachingCoordinatorPolicy",
    "ReceiverHealth",
    "ReceiverState",
    "RecordDecodeError",
    "Registration",
    "RegistrationHealth",
    "RegistrationState",
    "RequestLostError",
    "RoundRobinPolicy",
    "Router",
    "RouterHealth",
    "RoutingPolicy",
    "RoutingSnapshot",
    "RoutingTable",
    "Selector",
    "Session",
    "SessionPolicy",
    "Settings",
    "Split",
    "StopSignals",
    "UnknownValue",
    "WatcherHealth",
    "WatcherState",
    "__version__",
    "aregister_engine",
    "block_hashes",
    "default_engine_id",
    "deregister",
    "deregister_on_signals",
    "drain",
    "drain_and_close",
    "handoff_key",
    "handoff_problem",
    "launch",
    "list_engines",
    "pause",
    "record_schema",
    "register_dynamic_engine",
    "register_engine",
    "resume",
    "undrain",
    "watch_table",
]
