from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MANAGED: _ClassVar[DeviceTier]
    ENGINE_MANAGED: _ClassVar[DeviceTier]

class SessionRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE: _ClassVar[SessionRole]
    SCHEDULER: _ClassVar[SessionRole]
MANAGED: DeviceTier
ENGINE_MANAGED: DeviceTier
ENGINE: SessionRole
SCHEDULER: SessionRole

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "kv_format")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    kv_format: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., kv_format: _Optional[str] = ...) -> None: ...

class DeviceBuffer(_message.Message):
    __slots__ = ("handle", "offset", "size", "page_stride", "page_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    size: int
    page_stride: int
    page_bytes: int
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., page_stride: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("namespace", "layout", "backend", "device", "buffers", "num_device_pages", "write_policy", "host_pool_pages", "replace_existing", "engine", "model", "device_uuid", "device_tier", "role", "tp_rank", "tp_size", "instance", "wait_for_ranks_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TIER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_RANKS_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KvLayout
    backend: str
    device: int
    buffers: _containers.RepeatedCompositeFieldContainer[DeviceBuffer]
    num_device_pages: int
    write_policy: str
    host_pool_pages: int
    replace_existing: bool
    engine: str
    model: str
    device_uuid: str
    device_tier: DeviceTier
    role: SessionRole
    tp_rank: int
    tp_size: int
    instance: str
    wait_for_ranks_ms: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., backend: _Optional[str] = ..., device: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[DeviceBuffer, _Mapping]]] = ..., num_device_pages: _Optional[int] = ..., write_policy: _Optional[str] = ..., host_pool_pages: _Optional[int] = ..., replace_existing: bool = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., device_uuid: _Optional[str] = ..., device_tier: _Optional[_Union[DeviceTier, str]] = ..., role: _Optional[_Union[SessionRole, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., instance: _Optional[str] = ..., wait_for_ranks_ms: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session", "host_pool_pages", "write_policy", "warm", "dropped_device_tokens", "daemon_instance", "storage", "max_prompts_per_match", "lease_timeout_ms", "ack_timeout_ms", "idle_session_timeout_ms", "ranks_missing", "max_message_bytes", "max_leases_per_session", "device_uuid")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    DROPPED_DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPTS_PER_MATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ACK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASES_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    session: str
    host_pool_pages: int
    write_policy: str
    warm: bool
    dropped_device_tokens: int
    daemon_instance: str
    storage: str
    max_prompts_per_match: int
    lease_timeout_ms: int
    ack_timeout_ms: int
    idle_session_timeout_ms: int
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    max_message_bytes: int
    max_leases_per_session: int
    device_uuid: str
    def __init__(self, session: _Optional[str] = ..., host_pool_pages: _Optional[int] = ..., write_policy: _Optional[str] = ..., warm: bool = ..., dropped_device_tokens: _Optional[int] = ..., daemon_instance: _Optional[str] = ..., storage: _Optional[str] = ..., max_prompts_per_match: _Optional[int] = ..., lease_timeout_ms: _Optional[int] = ..., ack_timeout_ms: _Optional[int] = ..., idle_session_timeout_ms: _Optional[int] = ..., ranks_missing: _Optional[_Iterable[int]] = ..., max_message_bytes: _Optional[int] = ..., max_leases_per_session: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("tokens", "extra_key")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    extra_key: bytes
    def __init__(self, tokens: _Optional[bytes] = ..., extra_key: _Optional[bytes] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session", "prompts", "lease", "include_storage")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STORAGE_FIELD_NUMBER: _ClassVar[int]
    session: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    lease: bool
    include_storage: bool
    def __init__(self, session: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., lease: bool = ..., include_storage: bool = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("device_pages", "device_tokens", "host_tokens", "device_node", "host_node", "depends_on", "lease", "storage_tokens", "complete_tokens")
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_NODE_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    device_pages: bytes
    device_tokens: int
    host_tokens: int
    device_node: int
    host_node: int
    depends_on: _containers.RepeatedScalarFieldContainer[int]
    lease: int
    storage_tokens: int
    complete_tokens: int
    def __init__(self, device_pages: _Optional[bytes] = ..., device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., device_node: _Optional[int] = ..., host_node: _Optional[int] = ..., depends_on: _Optional[_Iterable[int]] = ..., lease: _Optional[int] = ..., storage_tokens: _Optional[int] = ..., complete_tokens: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[MatchResult, _Mapping]]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("session", "tokens", "device_pages", "extra_key", "chunked", "release_lease", "lease", "engine_event")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EVENT_FIELD_NUMBER: _ClassVar[int]
    session: str
    tokens: bytes
    device_pages: bytes
    extra_key: bytes
    chunked: bool
    release_lease: int
    lease: bool
    engine_event: bytes
    def __init__(self, session: _Optional[str] = ..., tokens: _Optional[bytes] = ..., device_pages: _Optional[bytes] = ..., extra_key: _Optional[bytes] = ..., chunked: bool = ..., release_lease: _Optional[int] = ..., lease: bool = ..., engine_event: _Optional[bytes] = ..., **kwargs) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("cached_tokens", "redundant_pages", "node", "lease", "transfer")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_PAGES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    redundant_pages: bytes
    node: int
    lease: int
    transfer: int
    def __init__(self, cached_tokens: _Optional[int] = ..., redundant_pages: _Optional[bytes] = ..., node: _Optional[int] = ..., lease: _Optional[int] = ..., transfer: _Optional[int] = ...) -> None: ...

class LoadBackRequest(_message.Message):
    __slots__ = ("session", "node", "device_pages", "lease", "start_page", "wait", "engine_event")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    START_PAGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EVENT_FIELD_NUMBER: _ClassVar[int]
    session: str
    node: int
    device_pages: bytes
    lease: int
    start_page: int
    wait: bool
    engine_event: bytes
    def __init__(self, session: _Optional[str] = ..., node: _Optional[int] = ..., device_pages: _Optional[bytes] = ..., lease: _Optional[int] = ..., start_page: _Optional[int] = ..., wait: bool = ..., engine_event: _Optional[bytes] = ...) -> None: ...

class LoadBackResponse(_message.Message):
    __slots__ = ("transfer", "device_pages", "device_tokens", "loaded_tokens", "depends_on", "unused_pages", "layer_events")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    UNUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    transfer: int
    device_pages: bytes
    device_tokens: int
    loaded_tokens: int
    depends_on: _containers.RepeatedScalarFieldContainer[int]
    unused_pages: bytes
    layer_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, transfer: _Optional[int] = ..., device_pages: _Optional[bytes] = ..., device_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., depends_on: _Optional[_Iterable[int]] = ..., unused_pages: _Optional[bytes] = ..., layer_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("session", "transfer")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    session: str
    transfer: int
    def __init__(self, session: _Optional[str] = ..., transfer: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("transfer", "code", "message", "load_failed", "failed_pages", "expired", "unsolicited")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    UNSOLICITED_FIELD_NUMBER: _ClassVar[int]
    transfer: int
    code: int
    message: str
    load_failed: bool
    failed_pages: bytes
    expired: bool
    unsolicited: bool
    def __init__(self, transfer: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., load_failed: bool = ..., failed_pages: _Optional[bytes] = ..., expired: bool = ..., unsolicited: bool = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "leases")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    session: str
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[str] = ..., leases: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("session", "num_pages", "engine_event")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EVENT_FIELD_NUMBER: _ClassVar[int]
    session: str
    num_pages: int
    engine_event: bytes
    def __init__(self, session: _Optional[str] = ..., num_pages: _Optional[int] = ..., engine_event: _Optional[bytes] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("freed_pages", "written_back_pages")
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: bytes
    written_back_pages: int
    def __init__(self, freed_pages: _Optional[bytes] = ..., written_back_pages: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session", "tokens", "extra_key", "policy", "timeout_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    session: str
    tokens: bytes
    extra_key: bytes
    policy: str
    timeout_ms: int
    def __init__(self, session: _Optional[str] = ..., tokens: _Optional[bytes] = ..., extra_key: _Optional[bytes] = ..., policy: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PrefetchProgress(_message.Message):
    __slots__ = ("state", "transfer", "storage_tokens", "fetched_tokens", "host_tokens_added")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[PrefetchProgress.State]
        STARTED: _ClassVar[PrefetchProgress.State]
        DONE: _ClassVar[PrefetchProgress.State]
        NOTHING: _ClassVar[PrefetchProgress.State]
        WAITING_ENDED: _ClassVar[PrefetchProgress.State]
    STATE_UNSPECIFIED: PrefetchProgress.State
    STARTED: PrefetchProgress.State
    DONE: PrefetchProgress.State
    NOTHING: PrefetchProgress.State
    WAITING_ENDED: PrefetchProgress.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_ADDED_FIELD_NUMBER: _ClassVar[int]
    state: PrefetchProgress.State
    transfer: int
    storage_tokens: int
    fetched_tokens: int
    host_tokens_added: int
    def __init__(self, state: _Optional[_Union[PrefetchProgress.State, str]] = ..., transfer: _Optional[int] = ..., storage_tokens: _Optional[int] = ..., fetched_tokens: _Optional[int] = ..., host_tokens_added: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "layout", "write_policy", "eviction_policy", "attached", "nodes", "device_pages", "device_pages_held", "device_pages_evictable", "device_pages_protected", "host_pages_used", "host_pages_capacity", "host_page_bytes", "transfers_in_flight", "pinned_nodes", "tracked_duplicates", "counters", "leases", "oldest_lease_seconds", "load_backs_unacked", "sessions", "tp_size", "ranks_missing", "detached_seconds", "tenant")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PINNED_NODES_FIELD_NUMBER: _ClassVar[int]
    TRACKED_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACKS_UNACKED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    DETACHED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KvLayout
    write_policy: str
    eviction_policy: str
    attached: bool
    nodes: int
    device_pages: int
    device_pages_held: int
    device_pages_evictable: int
    device_pages_protected: int
    host_pages_used: int
    host_pages_capacity: int
    host_page_bytes: int
    transfers_in_flight: int
    pinned_nodes: int
    tracked_duplicates: int
    counters: _containers.ScalarMap[str, int]
    leases: int
    oldest_lease_seconds: float
    load_backs_unacked: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    tp_size: int
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    detached_seconds: float
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., write_policy: _Optional[str] = ..., eviction_policy: _Optional[str] = ..., attached: bool = ..., nodes: _Optional[int] = ..., device_pages: _Optional[int] = ..., device_pages_held: _Optional[int] = ..., device_pages_evictable: _Optional[int] = ..., device_pages_protected: _Optional[int] = ..., host_pages_used: _Optional[int] = ..., host_pages_capacity: _Optional[int] = ..., host_page_bytes: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., pinned_nodes: _Optional[int] = ..., tracked_duplicates: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., leases: _Optional[int] = ..., oldest_lease_seconds: _Optional[float] = ..., load_backs_unacked: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., tp_size: _Optional[int] = ..., ranks_missing: _Optional[_Iterable[int]] = ..., detached_seconds: _Optional[float] = ..., tenant: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session", "engine", "role", "tp_rank", "instance", "age_seconds", "streams_open", "leases", "load_backs_unacked", "tenant")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_OPEN_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACKS_UNACKED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session: str
    engine: str
    role: str
    tp_rank: int
    instance: str
    age_seconds: float
    streams_open: bool
    leases: int
    load_backs_unacked: int
    tenant: str
    def __init__(self, session: _Optional[str] = ..., engine: _Optional[str] = ..., role: _Optional[str] = ..., tp_rank: _Optional[int] = ..., instance: _Optional[str] = ..., age_seconds: _Optional[float] = ..., streams_open: bool = ..., leases: _Optional[int] = ..., load_backs_unacked: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("namespaces", "sessions", "version", "uptime_seconds", "daemon_instance")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    sessions: int
    version: str
    uptime_seconds: float
    daemon_instance: str
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., daemon_instance: _Optional[str] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("namespace", "max_nodes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    max_nodes: int
    def __init__(self, namespace: _Optional[str] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("id", "parent", "depth", "tokens", "on_device", "on_host", "lock_ref", "host_lock", "pins", "backup", "evicting", "hit_count", "extra_key")
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ON_HOST_FIELD_NUMBER: _ClassVar[int]
    LOCK_REF_FIELD_NUMBER: _ClassVar[int]
    HOST_LOCK_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    EVICTING_FIELD_NUMBER: _ClassVar[int]
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    id: int
    parent: int
    depth: int
    tokens: int
    on_device: bool
    on_host: bool
    lock_ref: int
    host_lock: int
    pins: _containers.RepeatedScalarFieldContainer[int]
    backup: int
    evicting: bool
    hit_count: int
    extra_key: bytes
    def __init__(self, id: _Optional[int] = ..., parent: _Optional[int] = ..., depth: _Optional[int] = ..., tokens: _Optional[int] = ..., on_device: bool = ..., on_host: bool = ..., lock_ref: _Optional[int] = ..., host_lock: _Optional[int] = ..., pins: _Optional[_Iterable[int]] = ..., backup: _Optional[int] = ..., evicting: bool = ..., hit_count: _Optional[int] = ..., extra_key: _Optional[bytes] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("total_nodes", "max_depth", "device_nodes", "host_nodes", "duplicate_nodes", "nodes", "truncated", "digest")
    TOTAL_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NODES_FIELD_NUMBER: _ClassVar[int]
    HOST_NODES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    total_nodes: int
    max_depth: int
    device_nodes: int
    host_nodes: int
    duplicate_nodes: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    truncated: bool
    digest: str
    def __init__(self, total_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ..., device_nodes: _Optional[int] = ..., host_nodes: _Optional[int] = ..., duplicate_nodes: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., truncated: bool = ..., digest: _Optional[str] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("namespace", "message")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    message: str
    def __init__(self, namespace: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("violations", "namespaces_checked")
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    namespaces_checked: int
    def __init__(self, violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., namespaces_checked: _Optional[int] = ...) -> None: ...

class DropNamespaceRequest(_message.Message):
    __slots__ = ("namespace", "store")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    store: bool
    def __init__(self, namespace: _Optional[str] = ..., store: bool = ...) -> None: ...

class DropNamespaceResponse(_message.Message):
    __slots__ = ("host_tokens", "freed_host_bytes", "stored_tokens")
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREED_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    host_tokens: int
    freed_host_bytes: int
    stored_tokens: int
    def __init__(self, host_tokens: _Optional[int] = ..., freed_host_bytes: _Optional[int] = ..., stored_tokens: _Optional[int] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "namespace", "snapshot")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    namespace: str
    snapshot: bool
    def __init__(self, from_seq: _Optional[int] = ..., namespace: _Optional[str] = ..., snapshot: bool = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "tier", "medium", "block_hashes", "parent_block_hash", "token_ids", "block_size", "extra_key", "lora_name")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KvEvent.Kind]
        BLOCK_STORED: _ClassVar[KvEvent.Kind]
        BLOCK_REMOVED: _ClassVar[KvEvent.Kind]
        ALL_BLOCKS_CLEARED: _ClassVar[KvEvent.Kind]
    KIND_UNSPECIFIED: KvEvent.Kind
    BLOCK_STORED: KvEvent.Kind
    BLOCK_REMOVED: KvEvent.Kind
    ALL_BLOCKS_CLEARED: KvEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    kind: KvEvent.Kind
    tier: str
    medium: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    extra_key: bytes
    lora_name: str
    def __init__(self, kind: _Optional[_Union[KvEvent.Kind, str]] = ..., tier: _Optional[str] = ..., medium: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., extra_key: _Optional[bytes] = ..., lora_name: _Optional[str] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "namespace", "ts", "events", "daemon_instance", "snapshot")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    namespace: str
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    daemon_instance: str
    snapshot: bool
    def __init__(self, seq: _Optional[int] = ..., namespace: _Optional[str] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., daemon_instance: _Optional[str] = ..., snapshot: bool = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("id", "match", "load_back", "insert", "evict", "release", "echo")
    ID_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACK_FIELD_NUMBER: _ClassVar[int]
    INSERT_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    id: int
    match: MatchRequest
    load_back: LoadBackRequest
    insert: InsertRequest
    evict: EvictRequest
    release: ReleaseRequest
    echo: EchoRequest
    def __init__(self, id: _Optional[int] = ..., match: _Optional[_Union[MatchRequest, _Mapping]] = ..., load_back: _Optional[_Union[LoadBackRequest, _Mapping]] = ..., insert: _Optional[_Union[InsertRequest, _Mapping]] = ..., evict: _Optional[_Union[EvictRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., echo: _Optional[_Union[EchoRequest, _Mapping]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "message", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("id", "match", "load_back", "insert", "evict", "release", "echo", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACK_FIELD_NUMBER: _ClassVar[int]
    INSERT_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    match: MatchResponse
    load_back: LoadBackResponse
    insert: InsertResponse
    evict: EvictResponse
    release: ReleaseResponse
    echo: EchoResponse
    error: CallStatus
    def __init__(self, id: _Optional[int] = ..., match: _Optional[_Union[MatchResponse, _Mapping]] = ..., load_back: _Optional[_Union[LoadBackResponse, _Mapping]] = ..., insert: _Optional[_Union[InsertResponse, _Mapping]] = ..., evict: _Optional[_Union[EvictResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., echo: _Optional[_Union[EchoResponse, _Mapping]] = ..., error: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...
