"""cache.v1.KvCache over gRPC: request validation, staging of two-phase puts, and the status codes.

Every failure is a `StatusError` carrying its status code; `_rpc` turns it into an abort with the message,
so bad input is always a precise INVALID_ARGUMENT (or RESOURCE_EXHAUSTED, NOT_FOUND, DEADLINE_EXCEEDED)
and never a traceback. Staged bytes of puts in flight are counted against `max_staged_bytes` and released
however the stream ends (commit, bad input, lease expiry, client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cache_svc import frames
from cache_svc.blocks import BlockStore
from cache_svc.config import CacheConfig
from cache_svc.errors import InvalidArgumentError, LeaseExpiredError, NotFoundError, ResourceExhaustedError, StatusError
from cache_svc.records import RecordPool
from cache_svc.segment import KEY_BYTES
from cache_svc.slices import Assembler, SliceError, pack
from cache_svc.stats import Counters, Histograms, tier_stats
from mesh.grpc_server import CHUNK_BYTES
from mesh.logging import bind_request
from proto.cache.v1 import cache_pb2 as pb
from proto.cache.v1 import cache_pb2_grpc

MAX_KEYS = 1 << 16  # keys per request: a 4 M-token context in 64-token blocks
MAX_RECORD_KEY_BYTES = 64
MAX_SHARED_KEYS = 256  # keys of one PutRecord: a request's n choices (OpenAI's n goes to 128), 16 KiB of keys at most
GET_WINDOW = 32  # blocks read from the store at a time while streaming a GetBlocks answer


class KvCacheService(cache_pb2_grpc.KvCacheServicer):
    def __init__(
        self,
        cfg: CacheConfig,
        store: BlockStore,
        records: RecordPool,
        counters: Counters,
        histograms: Histograms,
        logger: Any,
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._records = records
        self._counters = counters
        self._histograms = histograms
        self._logger = logger
        self._staging = _Staging(cfg.max_staged_bytes, counters)

    # --- RPCs -------------------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:  # noqa: N802
        async with self._rpc("Lookup", context):
            keys = _block_keys(request.keys)
            found = [_record_key(key) in self._records for key in _bounded(request.record_keys, "record keys")]
            return pb.LookupResponse(hit_count=self._store.lookup(keys), records_found=found)

    async def PutBlocks(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.PutBlocksRequest], context: grpc.aio.ServicerContext
    ) -> pb.PutBlocksResponse:
        async with self._rpc("PutBlocks", context), self._put() as stage:
            staged: Assembler[bytes] = Assembler(self._cfg.max_block_bytes)
            committed = False
            async for message in self._within_lease(request_iterator):
                if committed:
                    raise InvalidArgumentError("message after commit: commit must be set on the last message only")
                slices = [(s.key, s.total_bytes, s.offset, s.data) for s in message.slices]  # `.data` copies: once
                stage(sum(len(data) for *_, data in slices))
                for key, total, offset, data in slices:
                    _add(staged, _block_key(key), total, offset, data)
                committed = message.commit
            if not committed:
                raise InvalidArgumentError("stream ended without commit; its staged blocks were discarded")
            if incomplete := staged.incomplete():
                raise InvalidArgumentError("incomplete at commit: " + "; ".join(incomplete[:3]))
            blocks = staged.complete()
            await self._store.put(blocks)
            stage.done()
            return pb.PutBlocksResponse(committed=[key for key, _ in blocks])

    async def GetBlocks(  # noqa: N802
        self, request: pb.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:  # encoded GetBlocksResponses
        async with self._rpc("GetBlocks", context):
            keys = _block_keys(request.keys)
            for start in range(0, len(keys), GET_WINDOW):
                payloads = await self._store.get(keys[start : start + GET_WINDOW])
                found = [(start + i, p) for i, p in enumerate(payloads) if p is not None]
                for batch in pack(found, CHUNK_BYTES):
                    yield frames.get_blocks_response(batch)

    async def PutRecord(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.PutRecordRequest], context: grpc.aio.ServicerContext
    ) -> pb.PutRecordResponse:
        async with self._rpc("PutRecord", context), self._put() as stage:
            staged: Assembler[bytes] = Assembler(self._records.capacity, name="record")
            header: pb.PutRecordRequest | None = None
            received = 0
            async for message in self._within_lease(request_iterator):
                if header is None:
                    header = _record_header(message)
                elif message.keys or message.total_bytes or message.ttl_s or message.lease_s:
                    raise InvalidArgumentError("keys, total_bytes, ttl_s and lease_s belong on the first message only")
                stage(len(message.data))
                _add(staged, header.keys[0], header.total_bytes, received, message.data)
                received += len(message.data)
            if header is None:
                raise InvalidArgumentError("empty stream: the first message must carry keys and total_bytes")
            if incomplete := staged.incomplete():
                raise InvalidArgumentError(f"stream ended early: {incomplete[0]}")
            ((_, payload),) = staged.complete()
            lifetime = self._records.put(header.keys, payload, header.ttl_s, header.lease_s)
            self._counters.record_put_bytes += len(payload)
            stage.done()
            return pb.PutRecordResponse(expires_in_s=lifetime)

    async def GetRecord(  # noqa: N802
        self, request: pb.GetRecordRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:  # encoded GetRecordResponses
        async with self._rpc("GetRecord", context):
            key = _record_key(request.key)
            payload = self._records.get(key, consume=request.consume)
            if payload is None:
                raise NotFoundError(f"no record {key.hex()}: never put, expired, evicted or already consumed")
            for offset in range(0, len(payload), CHUNK_BYTES):
                total = len(payload) if offset == 0 else 0
                yield frames.get_record_response(total, payload[offset : offset + CHUNK_BYTES])

    async def DeleteRecords(  # noqa: N802
        self, request: pb.DeleteRecordsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteRecordsResponse:
        async with self._rpc("DeleteRecords", context):
            keys = _record_keys(request.keys, MAX_KEYS)
            return pb.DeleteRecordsResponse(deleted=self._records.delete(keys))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:  # noqa: N802
        async with self._rpc("Stats", context):
            self._records.expire_due()
            return self.snapshot()

    def snapshot(self) -> pb.StatsResponse:
        c, store, records = self._counters, self._store, self._records
        segments, dead = store.segment_stats()
        return pb.StatsResponse(
            dram=tier_stats(c, "dram", entries=len(store.dram), held=store.dram.bytes, capacity=self._cfg.dram_bytes),
            ssd=tier_stats(c, "ssd", entries=len(store), held=store.ssd_bytes, capacity=store.ssd_capacity),
            records=tier_stats(c, "record", entries=len(records), held=records.bytes, capacity=records.capacity),
            segments=segments,
            dead_bytes=dead,
            staged_bytes=self._staging.held,
            refusals=c.refusals_ssd + c.refusals_records + c.refusals_staging,
            corrupt_blocks=c.corrupt_blocks,
            record_expiries=c.record_expiries,
            record_deletions=c.record_deletions,
            record_put_bytes=c.record_put_bytes,
            compactions=c.compactions,
            aborted_puts=c.aborted_puts,
            retention_hours=self._cfg.retention_hours,
        )

    # --- plumbing ---------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _rpc(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Tag logs with the caller's request id, time the RPC, and report faults as status codes."""
        metadata = dict(context.invocation_metadata() or ())
        start = time.perf_counter()
        with bind_request(request_id=metadata.get("x-request-id", ""), rpc=method):
            try:
                yield
            except StatusError as fault:
                self._logger.info("rpc_failed", code=fault.code.name, detail=str(fault))
                await context.abort(fault.code, str(fault))
            except grpc.aio.AbortError:
                raise
            except Exception:
                self._logger.exception("rpc_crashed")
                await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the server; see its log")
            finally:
                self._histograms.rpc_seconds.labels(method).observe(time.perf_counter() - start)

    @contextlib.asynccontextmanager
    async def _put(self) -> AsyncIterator[_Put]:
        """Account the bytes a put holds before commit; a put that does not reach `done()` counts as aborted."""
        put = _Put(self._staging)
        try:
            yield put
        finally:
            self._staging.held -= put.bytes
            if not put.finished:
                self._counters.aborted_puts += 1

    async def _within_lease(self, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The stream's messages, until the put lease (counted from the first message) runs out."""
        try:
            async with asyncio.timeout(self._cfg.put_lease_s):
                async for message in messages:
                    yield message
        except TimeoutError:
            raise LeaseExpiredError(
                f"put not committed within its {self._cfg.put_lease_s:g} s lease; staged data was discarded"
            ) from None


class _Staging:
    """Bytes held by puts not yet committed, bounded by --max-staged-bytes."""

    def __init__(self, limit: int, counters: Counters) -> None:
        self.limit = limit
        self.held = 0
        self._counters = counters

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            self._counters.refusals_staging += 1
            raise ResourceExhaustedError(
                f"staging full: {self.held} bytes of uncommitted puts are held (--max-staged-bytes {self.limit})"
            )
        self.held += n


class _Put:
    """One put stream's share of the staging budget, and whether it got as far as storing its data."""

    def __init__(self, staging: _Staging) -> None:
        self._staging = staging
        self.bytes = 0
        self.finished = False

    def __call__(self, n: int) -> None:
        self._staging.take(n)
        self.bytes += n

    def done(self) -> None:
        self.finished = True


def _add(staged: Assembler[bytes], key: bytes, total: int, offset: int, data: bytes) -> None:
    try:
        staged.add(key, total, offset, data)
    except SliceError as exc:
        raise InvalidArgumentError(str(exc)) from None


def _block_key(key: bytes, position: int | None = None) -> bytes:
    if len(key) != KEY_BYTES:
        where = "" if position is None else f" #{position}"
        raise InvalidArgumentError(f"block key{where} is {len(key)} bytes; block keys are {KEY_BYTES} bytes")
    return key


def _block_keys(keys: Sequence[bytes]) -> Sequence[bytes]:
    for i, key in enumerate(_bounded(keys, "keys")):
        _block_key(key, i)
    return keys


def _bounded(keys: Sequence[bytes], what: str) -> Sequence[bytes]:
    if len(keys) > MAX_KEYS:
        raise InvalidArgumentError(f"{len(keys)} {what} in one request; the limit is {MAX_KEYS}")
    return keys


def _record_key(key: bytes, position: int | None = None) -> bytes:
    if not 0 < len(key) <= MAX_RECORD_KEY_BYTES:
        where = "" if position is None else f" #{position}"
        raise InvalidArgumentError(
            f"record key{where} is {len(key)} bytes; it must be 1 to {MAX_RECORD_KEY_BYTES} bytes"
        )
    return key


def _record_keys(keys: Sequence[bytes], limit: int) -> Sequence[bytes]:
    """`keys` of a PutRecord or DeleteRecords: 1 to `limit` distinct record keys."""
    if not keys:
        raise InvalidArgumentError("keys is empty: name at least one record key")
    if len(keys) > limit:
        raise InvalidArgumentError(f"{len(keys)} keys in one request; the limit is {limit}")
    for i, key in enumerate(keys):
        _record_key(key, i if len(keys) > 1 else None)
    if len(set(keys)) != len(keys):
        repeated = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise InvalidArgumentError(f"keys repeat {repeated.hex()}: each key names one record")
    return keys


def _record_header(message: pb.PutRecordRequest) -> pb.PutRecordRequest:
    _record_keys(message.keys, MAX_SHARED_KEYS)
    for name in ("ttl_s", "lease_s"):
        value = getattr(message, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"{name} must be a finite number ≥ 0, got {value}")
    return message
