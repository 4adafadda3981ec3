"""Client of cache.v1.KvCache: the contract prefill, decode, the gateway and outside checks use.

    from cache_svc.client import CacheClient

    with CacheClient(["cache-0:7001", "cache-1:7001", "cache-2:7001"]) as cache:
        committed = cache.put_blocks([(key, payload), ...])    # -> list[bytes], keys now readable
        payloads = cache.get_blocks(keys)                       # -> list[bytes | None]
        hit = cache.lookup(keys)                                # -> leading keys present
        cache.put_record(seq_key, swa_state, ttl_s=300)         # volatile, DRAM only
        cache.put_record(handoff_key, handoff, ttl_s=60, lease_s=30)
        cache.put_records_shared(handles, handoff, ttl_s=60, lease_s=30)  # one payload, a record per key
        cache.get_record(handoff_key, consume=True)             # -> bytes | None
        cache.delete_records(handles)                           # -> how many existed
        cache.stats()                                           # -> {address: {...}}

`AsyncCacheClient` has the same methods as coroutines (create it inside the event loop that uses it).

Blocks are sharded over the replicas by consistent hashing of their key, records by theirs: a payload stored under
several record keys travels once to each replica that owns any of them (and is stored once there). A replica
that is down or too slow only costs its own keys: they read as misses (get → None, lookup stops at the
first of them) while writes to it raise `CacheError` with code UNAVAILABLE or DEADLINE_EXCEEDED. Every
RPC carries a deadline (`timeout_s`); nothing waits longer. Payloads travel in slices of ≤ 1 MiB.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from cache_svc import frames
from cache_svc.heap import keep_freed_memory
from cache_svc.ring import HashRing
from cache_svc.slices import Assembler, SliceError, pack
from mesh.grpc_server import CHUNK_BYTES, PEER_CHANNEL_OPTIONS
from proto.cache.v1 import cache_pb2 as pb

DEFAULT_TIMEOUT_S = 5.0
# The sync stub otherwise starts a thread per server-streaming call (GetBlocks, GetRecord): 3-4x slower.
SYNC_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)
# Codes meaning "this replica cannot answer now": reads treat its keys as misses.
DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

Block = tuple[bytes, bytes]
log = structlog.get_logger(service="cache_client")


class CacheError(Exception):
    """A cache RPC failed. `code` is the gRPC status, `address` the replica; for a put, `committed` lists the
    keys that other replicas did commit."""

    def __init__(self, message: str, *, code: grpc.StatusCode, address: str, committed: Sequence[bytes] = ()) -> None:
        super().__init__(f"{address}: {code.name}: {message}")
        self.code = code
        self.address = address
        self.details = message
        self.committed = list(committed)


def _error(exc: grpc.RpcError, address: str, committed: Sequence[bytes] = ()) -> CacheError:
    return CacheError(exc.details() or "", code=exc.code(), address=address, committed=committed)


def _put_requests(blocks: Sequence[Block], chunk_bytes: int) -> Iterator[bytes]:
    """Encoded PutBlocksRequests: slices of every block, `commit` set on the last message."""
    batches = pack(blocks, chunk_bytes)
    held = next(batches, [])
    for batch in batches:
        yield frames.put_blocks_request(held, commit=False)
        held = batch
    yield frames.put_blocks_request(held, commit=True)


def _record_requests(
    keys: Sequence[bytes], payload: bytes, ttl_s: float, lease_s: float | None, chunk_bytes: int
) -> Iterator[bytes]:
    """Encoded PutRecordRequests: the header on the first, then consecutive slices of the payload."""
    header = {"keys": keys, "total_bytes": len(payload), "ttl_s": ttl_s, "lease_s": lease_s or 0.0}
    yield frames.put_record_request(payload[:chunk_bytes], **header)
    for offset in range(chunk_bytes, len(payload), chunk_bytes):
        yield frames.put_record_request(payload[offset : offset + chunk_bytes])


class _Gather:
    """Puts the answers of several replicas back in request order."""

    def __init__(self, n: int) -> None:
        self.found: list[bytes | None] = [None] * n

    def add(self, positions: Sequence[int], messages: Iterable[pb.GetBlocksResponse], address: str) -> None:
        assembler: Assembler[int] = Assembler(sys.maxsize)
        try:
            for message in messages:
                for s in message.slices:
                    assembler.add(s.index, s.total_bytes, s.offset, s.data)
        except SliceError as exc:
            raise CacheError(
                f"malformed GetBlocks answer: {exc}", code=grpc.StatusCode.INTERNAL, address=address
            ) from None
        finally:  # blocks completed before a replica failed mid-stream are still good
            for index, payload in assembler.complete():
                if index < len(positions):
                    self.found[positions[index]] = payload


def _first_missing(positions: Sequence[int], hit_count: int, n: int) -> int:
    return positions[hit_count] if hit_count < len(positions) else n


def _record_lookup(keys: Sequence[bytes], positions: Sequence[int]) -> pb.LookupRequest:
    return pb.LookupRequest(record_keys=[keys[i] for i in positions])


def _mark_found(found: list[bool], positions: Sequence[int], answer: pb.LookupResponse) -> None:
    for i, present in zip(positions, answer.records_found, strict=True):
        found[i] = present


def _record(payloads: Iterable[pb.GetRecordResponse]) -> bytes:
    parts = [m.data for m in payloads]
    return parts[0] if len(parts) == 1 else b"".join(parts)


def as_dict(message: Message) -> dict[str, Any]:
    """A Stats answer as plain Python numbers (json_format would turn uint64 into strings)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        out[field.name] = as_dict(value) if field.message_type is not None else value
    return out


def _ordered(blocks: Sequence[Block], committed: set[bytes]) -> list[bytes]:
    return [key for key, _ in blocks if key in committed]


def _record_shards(ring: HashRing, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
    """The record keys each replica owns; a payload under several keys is sent once per replica in here."""
    if not keys:
        raise ValueError("no record keys given")
    return {address: [keys[i] for i in positions] for address, positions in ring.split(keys).items()}


Failure = tuple[str, grpc.RpcError]


def _shared_put(
    shards: dict[str, list[bytes]], answers: dict[str, pb.PutRecordResponse], failure: Failure | None
) -> float:
    """The lifetime every replica granted; CacheError (`.committed`: the keys stored elsewhere) if one failed."""
    if failure is not None:
        raise _error(failure[1], failure[0], [key for address in answers for key in shards[address]])
    return min(answer.expires_in_s for answer in answers.values())


def _deleted(answers: dict[str, pb.DeleteRecordsResponse], failure: Failure | None) -> int:
    if failure is not None:
        raise _error(failure[1], failure[0])
    return sum(answer.deleted for answer in answers.values())


def _down(exc: grpc.RpcError, address: str, method: str) -> bool:
    """Whether a read failure means 'replica down' (its keys miss); logs it if so."""
    if exc.code() in DOWN:
        log.warning("replica_down", address=address, rpc=method, code=exc.code().name, detail=exc.details())
        return True
    return False


class _Replicas:
    """The replica ring and one channel per replica, shared by the blocking and the asyncio client."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        channel: Callable[[str], Any],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        keep_freed_memory()
        self.ring = HashRing([addresses] if isinstance(addresses, str) else list(addresses))
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._channels = {address: channel(address) for address in self.ring.nodes}
        self._stubs = {address: frames.stub(c) for address, c in self._channels.items()}


class CacheClient(_Replicas):
    """Blocking client; safe to share between threads."""

    def __init__(
        self, addresses: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        options = PEER_CHANNEL_OPTIONS + SYNC_OPTIONS
        channel = functools.partial(grpc.insecure_channel, options=options)
        super().__init__(addresses, channel, timeout_s=timeout_s, chunk_bytes=chunk_bytes)

    def put_blocks(self, blocks: Iterable[Block]) -> list[bytes]:
        """Commit blocks on their replicas; returns the committed keys in input order.

        Raises CacheError (with `.committed`) if any replica refused or could not be reached."""
        blocks = list(blocks)
        shards = self.ring.split([k for k, _ in blocks])
        answers, failure = self._fan_out(
            "PutBlocks", {a: _put_requests([blocks[i] for i in p], self.chunk_bytes) for a, p in shards.items()}
        )
        committed = {key for answer in answers.values() for key in answer.committed}
        if failure is not None:
            raise _error(failure[1], failure[0], _ordered(blocks, committed))
        return _ordered(blocks, committed)

    def _fan_out(self, method: str, requests: dict[str, Any]) -> tuple[dict[str, Any], Failure | None]:
        """Call `method` on each replica with its request (stream), all at once; the answers of those that
        succeeded and the first failure. One replica: a plain blocking call (cheaper than a future)."""
        if len(requests) == 1:
            ((address, request),) = requests.items()
            waits = {address: functools.partial(getattr(self._stubs[address], method), request, timeout=self.timeout_s)}
        else:
            waits = {
                address: getattr(self._stubs[address], method).future(request, timeout=self.timeout_s).result
                for address, request in requests.items()
            }
        answers: dict[str, Any] = {}
        failure: Failure | None = None
        for address, wait in waits.items():
            try:
                answers[address] = wait()
            except grpc.RpcError as exc:
                failure = failure or (address, exc)
        return answers, failure

    def get_blocks(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Payloads in key order; None for a key that is missing, corrupt, or on a replica that is down."""
        gather = _Gather(len(keys))
        streams = [
            (
                address,
                positions,
                self._stubs[address].GetBlocks(
                    pb.GetBlocksRequest(keys=[keys[i] for i in positions]), timeout=self.timeout_s
                ),
            )
            for address, positions in self.ring.split(keys).items()
        ]
        for address, positions, stream in streams:
            try:
                gather.add(positions, stream, address)
            except grpc.RpcError as exc:
                if not _down(exc, address, "GetBlocks"):
                    raise _error(exc, address) from None
        return gather.found

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present on their replicas (a replica that is down counts as missing)."""
        calls = [
            (
                address,
                positions,
                self._stubs[address].Lookup.future(
                    pb.LookupRequest(keys=[keys[i] for i in positions]), timeout=self.timeout_s
                ),
            )
            for address, positions in self.ring.split(keys).items()
        ]
        hit = len(keys)
        for address, positions, call in calls:
            try:
                count = call.result().hit_count
            except grpc.RpcError as exc:
                if not _down(exc, address, "Lookup"):
                    raise _error(exc, address) from None
                count = 0
            hit = min(hit, _first_missing(positions, count, len(keys)))
        return hit

    def put_record(self, key: bytes, payload: bytes, ttl_s: float, lease_s: float | None = None) -> float:
        """Store a volatile record; with a lease it is pinned until consumed or the lease ends.
        Returns the lifetime granted (the server caps it at its --record-ttl-s)."""
        return self.put_records_shared([key], payload, ttl_s, lease_s)

    def put_records_shared(
        self, keys: Sequence[bytes], payload: bytes, ttl_s: float, lease_s: float | None = None
    ) -> float:
        """Store `payload` under each of `keys` (distinct): a record per key, consumed once and ended on its own,
        the bytes sent once to each replica owning any of the keys and stored once there. Returns the lifetime
        granted. Raises CacheError if a replica refused or could not be reached; `.committed` lists the keys
        the other replicas stored (the failed replica's keys were not, unless its answer was lost in a timeout)."""
        shards = _record_shards(self.ring, keys)
        requests = {a: _record_requests(k, payload, ttl_s, lease_s, self.chunk_bytes) for a, k in shards.items()}
        return _shared_put(shards, *self._fan_out("PutRecord", requests))

    def delete_records(self, keys: Sequence[bytes]) -> int:
        """Remove these records (distinct keys), one DeleteRecords per replica owning any; returns how many existed.
        A missing key is no error. CacheError if a replica could not answer (the others' deletes are done)."""
        if not keys:
            return 0
        shards = _record_shards(self.ring, keys)
        return _deleted(
            *self._fan_out("DeleteRecords", {a: pb.DeleteRecordsRequest(keys=k) for a, k in shards.items()})
        )

    def get_record(self, key: bytes, consume: bool = False) -> bytes | None:
        """The record, or None if absent, expired, already consumed, or its replica is down."""
        address = self.ring.node(key)
        try:
            return _record(
                self._stubs[address].GetRecord(pb.GetRecordRequest(key=key, consume=consume), timeout=self.timeout_s)
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND or _down(exc, address, "GetRecord"):
                return None
            raise _error(exc, address) from None

    def has_records(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each record is present: one Lookup per replica holding any of them (one that is down: absent)."""
        found = [False] * len(keys)
        shards = self.ring.split(keys)
        calls = {
            address: self._stubs[address].Lookup.future(_record_lookup(keys, positions), timeout=self.timeout_s)
            for address, positions in shards.items()
        }
        for address, call in calls.items():
            try:
                _mark_found(found, shards[address], call.result())
            except grpc.RpcError as exc:
                if not _down(exc, address, "Lookup"):
                    raise _error(exc, address) from None
        return found

    def has_record(self, key: bytes) -> bool:
        return self.has_records([key])[0]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per replica address: its Stats answer as a dict, or {"error": ...} if it cannot answer."""
        calls = {a: stub.Stats.future(pb.StatsRequest(), timeout=self.timeout_s) for a, stub in self._stubs.items()}
        out: dict[str, dict[str, Any]] = {}
        for address, call in calls.items():
            try:
                out[address] = as_dict(call.result())
            except grpc.RpcError as exc:
                out[address] = {"error": f"{exc.code().name}: {exc.details()}"}
        return out

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCacheClient(_Replicas):
    """asyncio client with the same methods as `CacheClient`, as coroutines."""

    def __init__(
        self, addresses: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        channel = functools.partial(grpc.aio.insecure_channel, options=PEER_CHANNEL_OPTIONS)
        super().__init__(addresses, channel, timeout_s=timeout_s, chunk_bytes=chunk_bytes)

    async def put_blocks(self, blocks: Iterable[Block]) -> list[bytes]:
        blocks = list(blocks)
        shards = self.ring.split([k for k, _ in blocks])
        answers, failure = await self._fan_out(
            "PutBlocks", {a: _put_requests([blocks[i] for i in p], self.chunk_bytes) for a, p in shards.items()}
        )
        committed = {key for answer in answers.values() for key in answer.committed}
        if failure is not None:
            raise _error(failure[1], failure[0], _ordered(blocks, committed))
        return _ordered(blocks, committed)

    async def _fan_out(self, method: str, requests: dict[str, Any]) -> tuple[dict[str, Any], Failure | None]:
        """Call `method` on each replica with its request (stream), concurrently; the answers of those that
        succeeded and the first failure (in request order). Any other exception propagates."""
        results = await asyncio.gather(
            *(getattr(self._stubs[a], method)(r, timeout=self.timeout_s) for a, r in requests.items()),
            return_exceptions=True,
        )
        answers: dict[str, Any] = {}
        failure: Failure | None = None
        for address, result in zip(requests, results, strict=True):
            if isinstance(result, grpc.RpcError):
                failure = failure or (address, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                answers[address] = result
        return answers, failure

    async def get_blocks(self, keys: Sequence[bytes]) -> list[bytes | None]:
        gather = _Gather(len(keys))

        async def one(address: str, positions: list[int]) -> None:
            call = self._stubs[address].GetBlocks(
                pb.GetBlocksRequest(keys=[keys[i] for i in positions]), timeout=self.timeout_s
            )
            try:
                gather.add(positions, [m async for m in call], address)
            except grpc.RpcError as exc:
                if not _down(exc, address, "GetBlocks"):
                    raise _error(exc, address) from None

        await asyncio.gather(*(one(a, p) for a, p in self.ring.split(keys).items()))
        return gather.found

    async def lookup(self, keys: Sequence[bytes]) -> int:
        async def one(address: str, positions: list[int]) -> int:
            try:
                answer = await self._stubs[address].Lookup(
                    pb.LookupRequest(keys=[keys[i] for i in positions]), timeout=self.timeout_s
                )
            except grpc.RpcError as exc:
                if not _down(exc, address, "Lookup"):
                    raise _error(exc, address) from None
                return _first_missing(positions, 0, len(keys))
            return _first_missing(positions, answer.hit_count, len(keys))

        firsts = await asyncio.gather(*(one(a, p) for a, p in self.ring.split(keys).items()))
        return min(firsts, default=len(keys))

    async def put_record(self, key: bytes, payload: bytes, ttl_s: float, lease_s: float | None = None) -> float:
        return await self.put_records_shared([key], payload, ttl_s, lease_s)

    async def put_records_shared(
        self, keys: Sequence[bytes], payload: bytes, ttl_s: float, lease_s: float | None = None
    ) -> float:
        shards = _record_shards(self.ring, keys)
        requests = {a: _record_requests(k, payload, ttl_s, lease_s, self.chunk_bytes) for a, k in shards.items()}
        return _shared_put(shards, *await self._fan_out("PutRecord", requests))

    async def delete_records(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        shards = _record_shards(self.ring, keys)
        requests = {a: pb.DeleteRecordsRequest(keys=k) for a, k in shards.items()}
        return _deleted(*await self._fan_out("DeleteRecords", requests))

    async def get_record(self, key: bytes, consume: bool = False) -> bytes | None:
        address = self.ring.node(key)
        call = self._stubs[address].GetRecord(pb.GetRecordRequest(key=key, consume=consume), timeout=self.timeout_s)
        try:
            return _record([m async for m in call])
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND or _down(exc, address, "GetRecord"):
                return None
            raise _error(exc, address) from None

    async def has_records(self, keys: Sequence[bytes]) -> list[bool]:
        found = [False] * len(keys)

        async def one(address: str, positions: list[int]) -> None:
            try:
                answer = await self._stubs[address].Lookup(_record_lookup(keys, positions), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if not _down(exc, address, "Lookup"):
                    raise _error(exc, address) from None
                return
            _mark_found(found, positions, answer)

        await asyncio.gather(*(one(a, p) for a, p in self.ring.split(keys).items()))
        return found

    async def has_record(self, key: bytes) -> bool:
        return (await self.has_records([key]))[0]

    async def stats(self) -> dict[str, dict[str, Any]]:
        async def one(stub: Any) -> dict[str, Any]:
            try:
                return as_dict(await stub.Stats(pb.StatsRequest(), timeout=self.timeout_s))
            except grpc.RpcError as exc:
                return {"error": f"{exc.code().name}: {exc.details()}"}

        answers = await asyncio.gather(*(one(s) for s in self._stubs.values()))
        return dict(zip(self._stubs, answers, strict=True))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
