from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "cache_salt", "handoff_lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    handoff_lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., handoff_lease_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "prompt_tokens", "cached_tokens", "swa_restored", "bounded_replay", "prefill_seconds")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_REPLAY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    prompt_tokens: int
    cached_tokens: int
    swa_restored: bool
    bounded_replay: bool
    prefill_seconds: float
    def __init__(self, handle: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., swa_restored: _Optional[bool] = ..., bounded_replay: _Optional[bool] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "encoder_state", "cached_tokens", "swa_restored", "bounded_replay")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ENCODER_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_REPLAY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    encoder_state: bytes
    cached_tokens: int
    swa_restored: bool
    bounded_replay: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., encoder_state: _Optional[bytes] = ..., cached_tokens: _Optional[int] = ..., swa_restored: _Optional[bool] = ..., bounded_replay: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("queue_depth", "running", "pending_tokens", "draining")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    running: int
    pending_tokens: int
    draining: bool
    def __init__(self, queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., pending_tokens: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "fingerprint", "kv_block_tokens", "layout_version", "vocab_size", "max_context", "sliding_window")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: bytes
    kv_block_tokens: int
    layout_version: int
    vocab_size: int
    max_context: int
    sliding_window: int
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., kv_block_tokens: _Optional[int] = ..., layout_version: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., sliding_window: _Optional[int] = ...) -> None: ...
