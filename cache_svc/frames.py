"""cache.v1 messages that carry payload bytes, encoded without passing the bytes through protobuf.

Building a `PutSlice`/`GetSlice` copies its data into protobuf's arena and serialising copies it again, into a
buffer that grows by doubling: 0.5 ms of CPU for 16 blocks of 56,960 B, more than the rest of a get on the
server. Here protobuf serialises only the small fields; the payload follows as its length-delimited `data`
field, which is the last field of its message, so the bytes are exactly what protobuf itself would write
(tests/cache_svc/test_frames.py holds them against `SerializeToString`) and one join is the only copy.
Receivers parse with protobuf as usual.

The sender of such a message gets a handler or stub whose serializer passes these bytes through: `stub` for
clients and `add_servicer` for the server, both built from the service's descriptor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import grpc
from google.protobuf.message import Message

from cache_svc.slices import Slice
from proto.cache.v1 import cache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KvCache"]
PRE_ENCODED_REQUESTS = frozenset({"PutBlocks", "PutRecord"})  # clients send bytes from this module
PRE_ENCODED_RESPONSES = frozenset({"GetBlocks", "GetRecord"})  # the server sends bytes from this module
WIRE_LENGTH_DELIMITED = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_number(message: type[Message], name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


def _prefix(field: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return _varint(field << 3 | WIRE_LENGTH_DELIMITED) + _varint(length)


def _with_data(meta: Message, data: bytes) -> list[bytes]:
    """`meta` (whose `data` is unset) serialised by protobuf, then `data` as its last field."""
    head = meta.SerializeToString()
    if not data:  # proto3 writes no empty field
        return [head]
    return [head, _prefix(_field_number(type(meta), "data"), len(data)), data]


def _embedded(field: int, parts: list[bytes]) -> list[bytes]:
    return [_prefix(field, sum(map(len, parts))), *parts]


_PUT_SLICES = _field_number(pb.PutBlocksRequest, "slices")
_GET_SLICES = _field_number(pb.GetBlocksResponse, "slices")
_COMMIT = pb.PutBlocksRequest(commit=True).SerializeToString()


def put_blocks_request(batch: Sequence[Slice[bytes]], commit: bool) -> bytes:
    """A `PutBlocksRequest` with these slices (key, total_bytes, offset, data)."""
    parts: list[bytes] = []
    for key, total, offset, data in batch:
        parts += _embedded(_PUT_SLICES, _with_data(pb.PutSlice(key=key, total_bytes=total, offset=offset), data))
    if commit:
        parts.append(_COMMIT)
    return b"".join(parts)


def get_blocks_response(batch: Sequence[Slice[int]]) -> bytes:
    """A `GetBlocksResponse` with these slices (index, total_bytes, offset, data)."""
    parts: list[bytes] = []
    for index, total, offset, data in batch:
        parts += _embedded(_GET_SLICES, _with_data(pb.GetSlice(index=index, total_bytes=total, offset=offset), data))
    return b"".join(parts)


def put_record_request(data: bytes, **header: Any) -> bytes:
    """A `PutRecordRequest`: `header` (key, total_bytes, ttl_s, lease_s) on the first message only."""
    return b"".join(_with_data(pb.PutRecordRequest(**header), data))


def get_record_response(total_bytes: int, data: bytes) -> bytes:
    return b"".join(_with_data(pb.GetRecordResponse(total_bytes=total_bytes), data))


# --- gRPC plumbing ----------------------------------------------------------------------------------------

_KINDS = {  # (client streaming, server streaming) → (channel method, handler factory)
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _methods() -> Iterable[tuple[str, Any, type[Message], type[Message]]]:
    for method in SERVICE.methods:
        kind = (method.client_streaming, method.server_streaming)
        yield method.name, kind, getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)


Encoder = Callable[[Any], bytes]


def _pass_through(encode: Encoder, name: str, pre_encoded: frozenset[str]) -> Encoder | None:
    return None if name in pre_encoded else encode  # None: gRPC sends the bytes as they are


def stub(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """A KvCache stub (blocking or asyncio, after the channel) whose PutBlocks and PutRecord take bytes."""
    calls = {}
    for name, kind, request, response in _methods():
        make = getattr(channel, _KINDS[kind][0])
        calls[name] = make(
            f"/{SERVICE.full_name}/{name}",
            request_serializer=_pass_through(request.SerializeToString, name, PRE_ENCODED_REQUESTS),
            response_deserializer=response.FromString,
        )
    return SimpleNamespace(**calls)


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register a KvCache servicer whose GetBlocks and GetRecord yield bytes."""
    handlers = {
        name: _KINDS[kind][1](
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=_pass_through(response.SerializeToString, name, PRE_ENCODED_RESPONSES),
        )
        for name, kind, request, response in _methods()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
