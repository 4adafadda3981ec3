"""cache_svc.frames writes payload messages by hand: the bytes must be exactly protobuf's own."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_svc import frames
from proto.cache.v1 import cache_pb2 as pb

sizes = st.integers(min_value=0, max_value=(1 << 40))
data = st.binary(max_size=300)  # > 127 bytes: two-byte length varints too
put_slices = st.lists(st.tuples(st.binary(min_size=16, max_size=16), sizes, sizes, data), max_size=5)
get_slices = st.lists(st.tuples(st.integers(min_value=0, max_value=(1 << 32) - 1), sizes, sizes, data), max_size=5)


@settings(max_examples=200, deadline=None)
@given(put_slices, st.booleans())
def test_put_blocks_request_is_protobufs_encoding(batch: list, commit: bool) -> None:
    expected = pb.PutBlocksRequest(
        slices=[pb.PutSlice(key=k, total_bytes=t, offset=o, data=d) for k, t, o, d in batch], commit=commit
    )
    assert frames.put_blocks_request(batch, commit=commit) == expected.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(get_slices)
def test_get_blocks_response_is_protobufs_encoding(batch: list) -> None:
    expected = pb.GetBlocksResponse(
        slices=[pb.GetSlice(index=i, total_bytes=t, offset=o, data=d) for i, t, o, d in batch]
    )
    assert frames.get_blocks_response(batch) == expected.SerializeToString()


@settings(max_examples=100, deadline=None)
@given(
    data, st.binary(max_size=64), sizes, st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6)
)
def test_record_messages_are_protobufs_encoding(
    payload: bytes, key: bytes, total: int, ttl_s: float, lease_s: float
) -> None:
    header = {"keys": [key], "total_bytes": total, "ttl_s": ttl_s, "lease_s": lease_s}
    assert (
        frames.put_record_request(payload, **header) == pb.PutRecordRequest(data=payload, **header).SerializeToString()
    )
    assert frames.put_record_request(payload) == pb.PutRecordRequest(data=payload).SerializeToString()
    response = pb.GetRecordResponse(total_bytes=total, data=payload)
    assert frames.get_record_response(total, payload) == response.SerializeToString()


def test_a_full_size_slice_parses_back() -> None:
    """A 1 MiB slice: a three-byte length, and protobuf reads the payload back unchanged."""
    payload = bytes(range(256)) * 4096
    message = pb.GetBlocksResponse.FromString(frames.get_blocks_response([(7, 3 << 20, 1 << 20, payload)]))
    (s,) = message.slices
    assert (s.index, s.total_bytes, s.offset, s.data) == (7, 3 << 20, 1 << 20, payload)


def test_data_is_the_last_field_of_every_payload_message() -> None:
    """What makes frames' encoding protobuf's own: a field added after `data` would be written before it."""
    for message in (pb.PutSlice, pb.GetSlice, pb.PutRecordRequest, pb.GetRecordResponse):
        numbers = [f.number for f in message.DESCRIPTOR.fields]
        assert message.DESCRIPTOR.fields_by_name["data"].number == max(numbers), message.DESCRIPTOR.name


def test_one_key_from_a_client_of_the_singular_field_reads_as_a_list_of_one() -> None:
    """`PutRecordRequest.keys` was `bytes key = 1`: a sender of the old message still names one record."""
    key = b"handoff:old-client"
    old_wire = bytes([1 << 3 | 2, len(key)]) + key + pb.PutRecordRequest(total_bytes=3, data=b"abc").SerializeToString()
    assert list(pb.PutRecordRequest.FromString(old_wire).keys) == [key]
