"""Bad input through a raw gRPC stub: each case gets its precise status code, nothing leaks, nothing is stored."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from cache_helpers import key_of

from cache_svc.client import CacheClient
from mesh.grpc_server import CHANNEL_OPTIONS
from proto.cache.v1 import cache_pb2 as pb
from proto.cache.v1 import cache_pb2_grpc

KEY = key_of(1)
RPC_TIMEOUT_S = 60  # generous: a loaded CI machine must not turn a precise code into DEADLINE_EXCEEDED
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def cache(start_server: Any) -> Iterator[tuple[cache_pb2_grpc.KvCacheStub, CacheClient]]:
    server = start_server(max_block_bytes=1 << 20, record_bytes=1 << 20, put_lease_s=0.2, max_staged_bytes=8 << 20)
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    with server.client() as client:
        yield cache_pb2_grpc.KvCacheStub(channel), client
    channel.close()


def _put(*messages: pb.PutBlocksRequest) -> Iterator[pb.PutBlocksRequest]:
    yield from messages


def _slice(key: bytes = KEY, total: int = 4, offset: int = 0, data: bytes = b"abcd") -> pb.PutSlice:
    return pb.PutSlice(key=key, total_bytes=total, offset=offset, data=data)


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as failure:
        call()
    return failure.value.code(), failure.value.details()


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10) -> bool:
    """Poll server state through its Stats RPC until the predicate holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
    return False


def _stats(client: CacheClient) -> dict[str, Any]:
    (only,) = client.stats().values()
    return only


PUT_CASES = {
    "short key": ([pb.PutBlocksRequest(slices=[_slice(key=b"short")], commit=True)], "block key is 5 bytes"),
    "empty key": ([pb.PutBlocksRequest(slices=[_slice(key=b"")], commit=True)], "block key is 0 bytes"),
    "empty block": ([pb.PutBlocksRequest(slices=[_slice(total=0, data=b"")], commit=True)], "is empty"),
    "block over the limit": (
        [pb.PutBlocksRequest(slices=[_slice(total=(1 << 20) + 1)], commit=True)],
        "the limit is 1048576",
    ),
    "more data than declared": ([pb.PutBlocksRequest(slices=[_slice(total=2)], commit=True)], "exceed the declared"),
    "gap between slices": (
        [pb.PutBlocksRequest(slices=[_slice(total=8), _slice(total=8, offset=6)], commit=True)],
        "offset 6, expected 4",
    ),
    "continuation before start": (
        [pb.PutBlocksRequest(slices=[_slice(total=8, offset=4)], commit=True)],
        "before its first slice",
    ),
    "block twice": ([pb.PutBlocksRequest(slices=[_slice(), _slice()], commit=True)], "appears twice"),
    "incomplete at commit": ([pb.PutBlocksRequest(slices=[_slice(total=8)], commit=True)], "4 of 8 bytes"),
    "no commit": ([pb.PutBlocksRequest(slices=[_slice()])], "without commit"),
    "message after commit": (
        [pb.PutBlocksRequest(slices=[_slice()], commit=True), pb.PutBlocksRequest(commit=True)],
        "after commit",
    ),
}


@pytest.mark.parametrize("case", PUT_CASES, ids=list(PUT_CASES))
def test_bad_puts_are_invalid_argument_and_store_nothing(cache: Any, case: str) -> None:
    stub, client = cache
    messages, detail = PUT_CASES[case]
    code, details = _code(lambda: stub.PutBlocks(_put(*messages), timeout=RPC_TIMEOUT_S))
    assert code == INVALID
    assert detail in details
    stats = _stats(client)
    assert stats["ssd"]["entries"] == 0
    assert stats["staged_bytes"] == 0
    assert stats["aborted_puts"] == 1


def test_bad_reads_and_lookups(cache: Any) -> None:
    stub, _ = cache
    code, details = _code(lambda: stub.Lookup(pb.LookupRequest(keys=[KEY, b"x" * 17]), timeout=RPC_TIMEOUT_S))
    assert (code, "block key #1 is 17 bytes") == (INVALID, details[: len("block key #1 is 17 bytes")])
    code, details = _code(lambda: list(stub.GetBlocks(pb.GetBlocksRequest(keys=[b""]), timeout=RPC_TIMEOUT_S)))
    assert code == INVALID
    assert "block key #0 is 0 bytes" in details
    code, details = _code(lambda: stub.Lookup(pb.LookupRequest(keys=[KEY] * 65537), timeout=RPC_TIMEOUT_S))
    assert code == INVALID
    assert "65537 keys" in details
    code, details = _code(lambda: stub.Lookup(pb.LookupRequest(record_keys=[b"k", b"k" * 65]), timeout=RPC_TIMEOUT_S))
    assert code == INVALID
    assert "record key is 65 bytes" in details


def test_unknown_keys(cache: Any) -> None:
    stub, _ = cache
    assert list(stub.GetBlocks(pb.GetBlocksRequest(keys=[KEY]), timeout=RPC_TIMEOUT_S)) == []  # a miss, not an error
    assert stub.Lookup(pb.LookupRequest(keys=[KEY]), timeout=RPC_TIMEOUT_S).hit_count == 0
    code, details = _code(lambda: list(stub.GetRecord(pb.GetRecordRequest(key=b"nobody"), timeout=RPC_TIMEOUT_S)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "6e6f626f6479" in details


def test_oversized_message_is_refused_by_the_server(cache: Any) -> None:
    _, client = cache
    (address,) = client.stats()
    # A sender without our limits: the server's own receive limit must stop it.
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = cache_pb2_grpc.KvCacheStub(channel)
        huge = pb.PutBlocksRequest(slices=[_slice(total=5 << 20, data=b"x" * (5 << 20))], commit=True)
        code, details = _code(lambda: stub.PutBlocks(_put(huge), timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in details
    assert _stats(client)["ssd"]["entries"] == 0


RECORD_CASES = {
    "no keys": (pb.PutRecordRequest(total_bytes=1, data=b"x"), INVALID, "keys is empty"),
    "empty key": (pb.PutRecordRequest(keys=[b""], total_bytes=1, data=b"x"), INVALID, "record key is 0 bytes"),
    "long key": (pb.PutRecordRequest(keys=[b"k" * 65], total_bytes=1, data=b"x"), INVALID, "record key is 65"),
    "long second key": (pb.PutRecordRequest(keys=[b"k", b"k" * 65], total_bytes=1, data=b"x"), INVALID, "key #1"),
    "repeated key": (pb.PutRecordRequest(keys=[b"a", b"b", b"a"], total_bytes=1, data=b"x"), INVALID, "repeat 61"),
    "too many keys": (
        pb.PutRecordRequest(keys=[b"%d" % i for i in range(257)], total_bytes=1, data=b"x"),
        INVALID,
        "257 keys in one request; the limit is 256",
    ),
    "negative ttl": (pb.PutRecordRequest(keys=[b"k"], total_bytes=1, ttl_s=-1, data=b"x"), INVALID, "ttl_s"),
    "nan lease": (pb.PutRecordRequest(keys=[b"k"], total_bytes=1, lease_s=math.nan, data=b"x"), INVALID, "lease_s"),
    "empty record": (pb.PutRecordRequest(keys=[b"k"], total_bytes=0), INVALID, "is empty"),
    "short record": (pb.PutRecordRequest(keys=[b"k"], total_bytes=9, data=b"x"), INVALID, "1 of 9 bytes"),
    "larger than the pool": (pb.PutRecordRequest(keys=[b"k"], total_bytes=2 << 20), INVALID, "the limit is 1048576"),
}


@pytest.mark.parametrize("case", RECORD_CASES, ids=list(RECORD_CASES))
def test_bad_records(cache: Any, case: str) -> None:
    stub, client = cache
    message, want, detail = RECORD_CASES[case]
    code, details = _code(lambda: stub.PutRecord(iter([message]), timeout=RPC_TIMEOUT_S))
    assert code == want
    assert detail in details
    assert _stats(client)["records"]["entries"] == 0


def test_record_header_fields_only_on_the_first_message(cache: Any) -> None:
    stub, _ = cache
    messages = [pb.PutRecordRequest(keys=[b"k"], total_bytes=2, data=b"x"), pb.PutRecordRequest(keys=[b"k"], data=b"y")]
    code, details = _code(lambda: stub.PutRecord(iter(messages), timeout=RPC_TIMEOUT_S))
    assert code == INVALID
    assert "first message only" in details
    code, details = _code(lambda: stub.PutRecord(iter([]), timeout=RPC_TIMEOUT_S))
    assert code == INVALID
    assert "empty stream" in details


DELETE_CASES = {
    "no keys": ([], "keys is empty"),
    "empty key": ([b"a", b""], "record key #1 is 0 bytes"),
    "repeated key": ([b"a", b"a"], "keys repeat 61"),
    "too many keys": ([b"%d" % i for i in range(65537)], "65537 keys in one request; the limit is 65536"),
}


@pytest.mark.parametrize("case", DELETE_CASES, ids=list(DELETE_CASES))
def test_bad_deletes_are_invalid_argument_and_delete_nothing(cache: Any, case: str) -> None:
    stub, client = cache
    client.put_record(b"a", b"kept", ttl_s=60, lease_s=30)
    keys, detail = DELETE_CASES[case]
    code, details = _code(lambda: stub.DeleteRecords(pb.DeleteRecordsRequest(keys=keys), timeout=RPC_TIMEOUT_S))
    assert (code, detail in details) == (INVALID, True), details
    assert client.get_record(b"a") == b"kept"
    assert _stats(client)["record_deletions"] == 0


def _open_put(stub: cache_pb2_grpc.KvCacheStub) -> tuple[Any, Callable[[], None]]:
    """A put stream that sends one staged block and then waits, uncommitted, until released."""
    release = False

    def messages() -> Iterator[pb.PutBlocksRequest]:
        yield pb.PutBlocksRequest(slices=[_slice(total=4096, data=b"s" * 4096)])
        while not release:
            time.sleep(0.01)

    def let_go() -> None:
        nonlocal release
        release = True

    return stub.PutBlocks.future(messages(), timeout=30), let_go


def test_a_put_never_committed_expires_with_its_lease(cache: Any) -> None:
    stub, client = cache
    call, let_go = _open_put(stub)
    try:
        with pytest.raises(grpc.RpcError) as failure:
            call.result()
    finally:
        let_go()
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "0.2 s lease" in failure.value.details()
    stats = _stats(client)
    assert (stats["staged_bytes"], stats["aborted_puts"], stats["ssd"]["entries"]) == (0, 1, 0)


def test_a_client_that_disconnects_mid_stream_leaves_nothing(cache: Any) -> None:
    stub, client = cache
    call, let_go = _open_put(stub)
    assert _wait_for(lambda: _stats(client)["staged_bytes"] == 4096)
    call.cancel()
    let_go()
    assert _wait_for(lambda: _stats(client)["aborted_puts"] == 1)
    stats = _stats(client)
    assert (stats["staged_bytes"], stats["ssd"]["entries"]) == (0, 0)
    assert client.lookup([KEY]) == 0


def test_staging_is_bounded(cache: Any) -> None:
    stub, client = cache
    block = b"z" * (1 << 20)
    slices = [pb.PutBlocksRequest(slices=[_slice(key=key_of(n), total=len(block), data=block)]) for n in range(9)]
    code, details = _code(lambda: stub.PutBlocks(_put(*slices), timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "staging full" in details
    assert _stats(client)["staged_bytes"] == 0
