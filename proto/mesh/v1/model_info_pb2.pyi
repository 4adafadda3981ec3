from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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
