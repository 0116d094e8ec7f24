from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleWorkersRequest(_message.Message):
    __slots__ = ("prefill", "decode", "colocated")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    colocated: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., colocated: _Optional[int] = ...) -> None: ...

class ScaleWorkersResponse(_message.Message):
    __slots__ = ("previous", "desired")
    class PreviousEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DesiredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    previous: _containers.ScalarMap[str, int]
    desired: _containers.ScalarMap[str, int]
    def __init__(self, previous: _Optional[_Mapping[str, int]] = ..., desired: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DrainWorkersRequest(_message.Message):
    __slots__ = ("worker_ids", "host", "timeout_s")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    host: str
    timeout_s: float
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., host: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WorkerDrain(_message.Message):
    __slots__ = ("id", "address", "drained", "error", "held", "finished", "moved", "kv_blocks_held", "kv_blocks_left", "seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    drained: bool
    error: str
    held: int
    finished: int
    moved: int
    kv_blocks_held: int
    kv_blocks_left: int
    seconds: float
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., drained: _Optional[bool] = ..., error: _Optional[str] = ..., held: _Optional[int] = ..., finished: _Optional[int] = ..., moved: _Optional[int] = ..., kv_blocks_held: _Optional[int] = ..., kv_blocks_left: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DrainWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerDrain]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerDrain, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("id", "role", "address", "health", "running", "waiting", "queued_prefill_tokens", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "metrics_address", "state_age_s", "pid", "draining", "build", "features", "kv_wire_version", "tokenizer", "speed_factor")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    KV_WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SPEED_FACTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    address: str
    health: str
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    metrics_address: str
    state_age_s: float
    pid: int
    draining: bool
    build: str
    features: _containers.RepeatedScalarFieldContainer[str]
    kv_wire_version: int
    tokenizer: str
    speed_factor: float
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., health: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., tpot_p50_ms: _Optional[float] = ..., tpot_p99_ms: _Optional[float] = ..., metrics_address: _Optional[str] = ..., state_age_s: _Optional[float] = ..., pid: _Optional[int] = ..., draining: _Optional[bool] = ..., build: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., kv_wire_version: _Optional[int] = ..., tokenizer: _Optional[str] = ..., speed_factor: _Optional[float] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "in_flight", "draining", "desired", "admitted_requests", "admitted_prompt_tokens", "admitted_max_tokens", "finished_requests", "completion_tokens", "admitted_local_only", "shed_requests", "shed_prompt_tokens", "model", "tokenizer")
    class DesiredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    in_flight: int
    draining: bool
    desired: _containers.ScalarMap[str, int]
    admitted_requests: int
    admitted_prompt_tokens: int
    admitted_max_tokens: int
    finished_requests: int
    completion_tokens: int
    admitted_local_only: bool
    shed_requests: int
    shed_prompt_tokens: int
    model: str
    tokenizer: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., desired: _Optional[_Mapping[str, int]] = ..., admitted_requests: _Optional[int] = ..., admitted_prompt_tokens: _Optional[int] = ..., admitted_max_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., admitted_local_only: _Optional[bool] = ..., shed_requests: _Optional[int] = ..., shed_prompt_tokens: _Optional[int] = ..., model: _Optional[str] = ..., tokenizer: _Optional[str] = ...) -> None: ...
