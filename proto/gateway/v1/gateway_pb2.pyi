from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Api(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    API_UNSPECIFIED: _ClassVar[Api]
    API_CHAT_COMPLETIONS: _ClassVar[Api]
    API_RESPONSES: _ClassVar[Api]
    API_MESSAGES: _ClassVar[Api]
API_UNSPECIFIED: Api
API_CHAT_COMPLETIONS: Api
API_RESPONSES: Api
API_MESSAGES: Api

class GenerateRequest(_message.Message):
    __slots__ = ("api", "body", "api_key")
    API_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    api: Api
    body: bytes
    api_key: str
    def __init__(self, api: _Optional[_Union[Api, str]] = ..., body: _Optional[bytes] = ..., api_key: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("event", "data")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    event: str
    data: bytes
    def __init__(self, event: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
