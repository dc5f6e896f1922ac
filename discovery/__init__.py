"""discovery: find running Megatron-Core inference engines through etcd.

Engines register an ``InferenceEngineEndpoint`` under a lease; routers watch the prefix
into a live ``RoutingTable``. See the documentation (docs/, ``./dev docs``) for the
key layout and the guarantees.
"""

from discovery._engine.events import EngineEventReceiver, ReceiverHealth, ReceiverState
from discovery._engine.launch import launch
from discovery._errors import (
    ClosedError,
    ConfigurationError,
    DiscoveryError,
    EngineConflictError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    InvalidRecordError,
    InvalidSelectorError,
    NoEngineAvailableError,
    NotACandidateError,
    OverloadedError,
    PermissionDeniedError,
    RecordDecodeError,
    RequestTooLargeError,
)
from discovery._etcd.connection import Connection
from discovery._etcd.port import EtcdPort
from discovery._metrics import Metrics, MetricsHooks
from discovery._reads.store import EndpointEvent, EventType, RoutingSnapshot
from discovery._reads.table import RoutingTable, watch_table
from discovery._reads.watcher import (
    EndpointWatcher,
    EngineListing,
    ListedEngine,
    WatcherHealth,
    WatcherState,
    list_engines,
)
from discovery._records.codec import DEFAULT_NAMESPACE, DEFAULT_ROOT, MAX_VALUE_BYTES, KeySpace
from discovery._records.endpoint import (
    InferenceEngineCapabilities,
    InferenceEngineEndpoint,
    PrefixCachingCoordinatorPolicy,
)
from discovery._records.handoff import (
    EngineRole,
    HandoffKey,
    KvLayout,
    KvTransferBackend,
    handoff_key,
    handoff_problem,
)
from discovery._records.record import EngineRecord, EngineStatus, record_schema
from discovery._records.selector import Selector
from discovery._records.unknown import UnknownValue
from discovery._routing.fleet import ControlResult, FleetClient, RequestLostError
from discovery._routing.inference_client import FleetAddress, FleetInferenceClient, parse_fleet
from discovery._routing.policies import (
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
from discovery._routing.router import Explanation, PickHandle, PickPair, Router, RouterHealth
from discovery._routing.split import Split
from discovery._serving.options import ServeOptions
from discovery._serving.server import serve_fleet
from discovery._settings import Settings
from discovery._state.blockhash import block_hashes
from discovery._state.engine_states import EngineState, EngineStates, EngineStatesHealth
from discovery._writes.operators import deregister, drain, pause, resume, undrain
from discovery._writes.registration import (
    Registration,
    RegistrationHealth,
    RegistrationState,
    aregister_engine,
    default_engine_id,
    register_dynamic_engine,
    register_engine,
)
from discovery._writes.session import Session
from discovery._writes.signals import StopSignals, deregister_on_signals, drain_and_close

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
    "EtcdNoSpaceError",
    "EtcdPort",
    "EtcdUnavailableError",
    "EventType",
    "Explanation",
    "FirstPrefixBlockPolicy",
    "FleetAddress",
    "FleetClient",
    "FleetInferenceClient",
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
    "RequestTooLargeError",
    "RoundRobinPolicy",
    "Router",
    "RouterHealth",
    "RoutingPolicy",
    "RoutingSnapshot",
    "RoutingTable",
    "Selector",
    "ServeOptions",
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
    "parse_fleet",
    "pause",
    "record_schema",
    "register_dynamic_engine",
    "register_engine",
    "resume",
    "serve_fleet",
    "undrain",
    "watch_table",
]
