"""discovery: find running Megatron-Core inference engines through etcd.

Engines register an ``InferenceEngineEndpoint`` under a lease; routers watch the prefix
into a live ``RoutingTable``. See README.md for the key layout and the guarantees.
"""

from ._codec import DEFAULT_NAMESPACE, DEFAULT_ROOT, MAX_VALUE_BYTES, EngineRecord, KeySpace
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
    NoEngineAvailableError,
    PermissionDeniedError,
    RecordDecodeError,
)
from ._metrics import Metrics
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
)
from ._registration import (
    Registration,
    RegistrationHealth,
    RegistrationState,
    aregister_engine,
    default_engine_id,
    register_dynamic_engine,
    register_engine,
)
from ._router import PickHandle, Router, RouterHealth
from ._routing import RoutingSnapshot, RoutingTable
from ._settings import Settings
from ._signals import deregister_on_signals
from ._watcher import EndpointEvent, EndpointWatcher, EventType, WatcherHealth, WatcherState

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
    "DiscoveryError",
    "EndpointEvent",
    "EndpointWatcher",
    "EngineConflictError",
    "EngineRecord",
    "EtcdError",
    "EtcdUnavailableError",
    "EventType",
    "FirstPrefixBlockPolicy",
    "InferenceEngineCapabilities",
    "InferenceEngineEndpoint",
    "InvalidRecordError",
    "KeySpace",
    "LoadBalancedPolicy",
    "LongestPrefixPolicy",
    "Metrics",
    "NoEngineAvailableError",
    "PermissionDeniedError",
    "PickHandle",
    "PickRequest",
    "Policy",
    "PrefixCachingCoordinatorPolicy",
    "RecordDecodeError",
    "Registration",
    "RegistrationHealth",
    "RegistrationState",
    "RoundRobinPolicy",
    "Router",
    "RouterHealth",
    "RoutingPolicy",
    "RoutingSnapshot",
    "RoutingTable",
    "Settings",
    "WatcherHealth",
    "WatcherState",
    "__version__",
    "aregister_engine",
    "default_engine_id",
    "deregister_on_signals",
    "register_dynamic_engine",
    "register_engine",
]
