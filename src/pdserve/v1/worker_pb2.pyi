from pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckPeerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckPeerReply(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainReport(_message.Message):
    __slots__ = ("worker_id", "held", "finished", "moved", "kv_blocks_held", "kv_blocks_left", "seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    held: int
    finished: int
    moved: int
    kv_blocks_held: int
    kv_blocks_left: int
    seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., held: _Optional[int] = ..., finished: _Optional[int] = ..., moved: _Optional[int] = ..., kv_blocks_held: _Optional[int] = ..., kv_blocks_left: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_address", "client_request_id", "cache_salt", "prefill_grant", "resumed_output_tokens", "tenant", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GRANT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    prefill_address: str
    client_request_id: str
    cache_salt: bytes
    prefill_grant: bytes
    resumed_output_tokens: int
    tenant: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., client_request_id: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., prefill_grant: _Optional[bytes] = ..., resumed_output_tokens: _Optional[int] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("decode_worker_id", "rendezvous", "block_ids", "tag")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    rendezvous: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., rendezvous: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "block_size")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_size: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "layout", "transfer_timeout_ms", "client_request_id", "cache_salt", "resumed_output_tokens", "tenant", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    target: KVTarget
    layout: KVLayout
    transfer_timeout_ms: int
    client_request_id: str
    cache_salt: bytes
    resumed_output_tokens: int
    tenant: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transfer_timeout_ms: _Optional[int] = ..., client_request_id: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., resumed_output_tokens: _Optional[int] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbandonReply(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "kv_follows", "cached_prompt_tokens", "logprobs", "prompt_logprobs", "waited_ms", "finish_reason")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    kv_follows: bool
    cached_prompt_tokens: int
    logprobs: _generate_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprobs]
    waited_ms: int
    finish_reason: _generate_pb2.FinishReason
    def __init__(self, token_id: _Optional[int] = ..., kv_follows: _Optional[bool] = ..., cached_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[_generate_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprobs, _Mapping]]] = ..., waited_ms: _Optional[int] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
