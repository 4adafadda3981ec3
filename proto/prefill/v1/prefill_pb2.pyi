from proto.mesh.v1 import model_info_pb2 as _model_info_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "cache_salt", "handoff_lease_s", "handoffs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    handoff_lease_s: float
    handoffs: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., handoff_lease_s: _Optional[float] = ..., handoffs: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "prompt_tokens", "cached_tokens", "swa_restored", "bounded_replay", "prefill_seconds", "handles")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_REPLAY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    prompt_tokens: int
    cached_tokens: int
    swa_restored: bool
    bounded_replay: bool
    prefill_seconds: float
    handles: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, handle: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., swa_restored: _Optional[bool] = ..., bounded_replay: _Optional[bool] = ..., prefill_seconds: _Optional[float] = ..., handles: _Optional[_Iterable[bytes]] = ...) -> None: ...

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
