"""Model state in cache_svc: global KV blocks, end-of-sequence SWA records, and the prefill → decode handoff record.

Both model services use it: decode reads what prefill writes, and writes back what the next prefill reads.

    block i        key h_i = mesh.block_keys over the token ids (model fingerprint, cache salt)   GlobalKVBlock bytes
    SWA record     key = mesh.block_keys.sequence_key of the tokens it ends                     EncoderState bytes
    handoff        key = a random handle, with a lease                                           prefill.v1.Handoff

The SWA record of a prefix is looked for where a previous turn can have ended inside the first uncached block: a
record at position P needs the blocks before P, so with h leading blocks cached it can only be at P in
[h·Bt, (h+1)·Bt). Every such P not beyond the prompt is probed (one small Lookup each, concurrently) and the
furthest record found wins. A record that does not fit the tokens (look-back ids differ) is dropped and the encoder
rings are bounded-replayed instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError

from cache_svc.client import AsyncCacheClient, CacheError
from mesh.block_keys import block_keys, sequence_key
from model import EncoderState, GlobalKVBlock, Past, PrefillOutput, PrefillRun, Transformer
from proto.prefill.v1 import prefill_pb2

HANDLE_PREFIX = b"handoff:"
# A handoff write failing with these may succeed under other handles (records are sharded by key).
_RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class KVStore:
    """Typed access to cache_svc for one model (its fingerprint and block size are part of every key)."""

    def __init__(self, cache: AsyncCacheClient, model: Transformer) -> None:
        self.cache = cache
        self.args = model.args
        self.fingerprint = model.fingerprint
        self.block_tokens = model.args.kv_block_tokens

    # ----------------------------------------------------------------------------------------------- keys
    def keys(self, token_ids: Sequence[int], salt: bytes) -> list[bytes]:
        return block_keys(token_ids, block_tokens=self.block_tokens, fingerprint=self.fingerprint, salt=salt)

    def sequence_key(self, token_ids: Sequence[int], salt: bytes, prefix_keys: Sequence[bytes] | None = None) -> bytes:
        return sequence_key(
            token_ids, block_tokens=self.block_tokens, fingerprint=self.fingerprint, salt=salt, prefix_keys=prefix_keys
        )

    # ---------------------------------------------------------------------------------------------- reads
    async def find_past(self, token_ids: Sequence[int], salt: bytes, keys: Sequence[bytes]) -> Past | None:
        """The longest cached prefix of `token_ids`: its blocks and, when one is pooled, its SWA record."""
        hit = await self.cache.lookup(keys)
        blocks, record = await asyncio.gather(
            self.get_blocks(keys[:hit]), self._find_record(token_ids, salt, keys[:hit])
        )
        if not blocks and record is None:
            return None
        if record is not None and record.position // self.block_tokens != len(blocks):
            record = None  # a block before it went missing between lookup and fetch
        return Past(blocks, record)

    async def get_blocks(self, keys: Sequence[bytes]) -> list[GlobalKVBlock]:
        """Blocks 0..k−1 for the leading k keys that are present and intact (stops at the first that is not)."""
        payloads = await self.cache.get_blocks(keys)
        return await asyncio.to_thread(self._parse_blocks, payloads)

    def _parse_blocks(self, payloads: Sequence[bytes | None]) -> list[GlobalKVBlock]:
        blocks: list[GlobalKVBlock] = []
        for index, payload in enumerate(payloads):
            if payload is None:
                break
            try:
                block = GlobalKVBlock.from_bytes(payload, self.args, self.fingerprint)
            except ValueError:
                break
            if block.index != index:
                break
            blocks.append(block)
        return blocks

    async def _find_record(
        self, token_ids: Sequence[int], salt: bytes, hit_keys: Sequence[bytes]
    ) -> EncoderState | None:
        first = len(hit_keys) * self.block_tokens
        ends = range(min(len(token_ids), first + self.block_tokens - 1), max(first, 1) - 1, -1)
        keys = [self.sequence_key(token_ids[:end], salt, hit_keys) for end in ends]
        found = await self.cache.has_records(keys)  # every possible end of the previous turn, in one call per shard
        for key, present in zip(keys, found, strict=True):
            if present:
                payload = await self.cache.get_record(key)
                state = self._parse_state(payload) if payload is not None else None
                if state is not None:
                    return state
        return None

    def _parse_state(self, payload: bytes) -> EncoderState | None:
        try:
            return EncoderState.from_bytes(payload, self.args, self.fingerprint)
        except ValueError:
            return None

    # --------------------------------------------------------------------------------------------- writes
    async def put_blocks(self, keys: Sequence[bytes], blocks: Sequence[GlobalKVBlock]) -> list[bytes]:
        """Commit blocks under their keys; returns the committed keys. CacheError if a replica refused."""
        if not blocks:
            return []
        payloads = await asyncio.to_thread(lambda: [block.to_bytes() for block in blocks])
        return await self.cache.put_blocks(zip(keys, payloads, strict=True))

    async def put_swa_record(self, token_ids: Sequence[int], salt: bytes, state: EncoderState) -> float:
        """Pool the SWA record of a sequence end (the cache's default TTL); returns the lifetime granted."""
        payload = await asyncio.to_thread(state.to_bytes)
        return await self.cache.put_record(self.sequence_key(token_ids, salt), payload, ttl_s=0.0)

    # -------------------------------------------------------------------------------------------- handoff
    async def put_handoffs(self, handoff: prefill_pb2.Handoff, lease_s: float, count: int = 1) -> list[bytes]:
        """Store `count` records of a handoff (one per decode that will consume one), each under a fresh handle,
        pinned for `lease_s`; returns the handles. The handoff is serialised once and sent once to each cache replica
        owning any of the handles, which stores it once for all of them (`put_records_shared`).

        A replica that is down (UNAVAILABLE, DEADLINE_EXCEEDED) costs its handles: fresh ones are drawn on the other
        replicas, once per replica at most. All or none: when the handles cannot all be stored, every handle tried is
        deleted (`delete_records`: idempotent, so a put whose answer was lost in a timeout is covered too; best effort)
        and the error that ended the batch is raised as CacheError. (When the batch outlives a timeout, records the slow
        replica may still have stored end with their lease.)"""
        payload = handoff.SerializeToString()
        stored: list[bytes] = []
        tried: list[bytes] = []
        down: set[str] = set()
        handles = [self._new_handle(down) for _ in range(count)]
        while True:
            tried += handles
            try:
                await self.cache.put_records_shared(handles, payload, ttl_s=lease_s, lease_s=lease_s)
            except CacheError as exc:
                stored += exc.committed
                down.add(exc.address)
                if exc.code not in _RETRY_ELSEWHERE or down.issuperset(self.cache.ring.nodes):
                    with contextlib.suppress(CacheError):
                        await self.cache.delete_records(tried)
                    raise
                handles = [self._new_handle(down) for _ in range(count - len(stored))]
            else:
                return stored + handles

    def _new_handle(self, down: set[str]) -> bytes:
        """A fresh random handoff handle owned by a cache replica not in `down` (which is not all of them)."""
        while True:
            handle = HANDLE_PREFIX + secrets.token_bytes(16)
            if self.cache.ring.node(handle) not in down:
                return handle

    async def take_handoff(self, handle: bytes) -> prefill_pb2.Handoff | None:
        """Consume a handoff (exactly one decode picks it up); None if absent, expired, consumed, or unreachable.

        ValueError if the record is not a handoff."""
        payload = await self.cache.get_record(handle, consume=True)
        if payload is None:
            return None
        try:
            return prefill_pb2.Handoff.FromString(payload)
        except DecodeError:
            raise ValueError(f"the record under handle {handle!r} is not a prefill handoff") from None

    def handoff_state(self, handoff: prefill_pb2.Handoff) -> EncoderState:
        """The encoder state of a handoff; ValueError if it belongs to another model or does not fit its tokens."""
        state = EncoderState.from_bytes(handoff.encoder_state, self.args, self.fingerprint)
        if state.position != len(handoff.token_ids):
            raise ValueError(f"handoff state is at position {state.position} but has {len(handoff.token_ids)} tokens")
        return state


def start_prefill(model: Transformer, token_ids: Sequence[int], past: Past | None, chunk_tokens: int) -> PrefillRun:
    """The encoder pass over the prompt on top of a cached prefix, ready for its first chunk. A record that does not
    belong to these tokens (look-back ids differ) is dropped: the encoder rings are then bounded-replayed from the
    blocks."""
    try:
        return PrefillRun(model, token_ids, past, chunk_tokens)
    except ValueError:
        if past is None or past.encoder_state is None:
            raise
    return PrefillRun(model, token_ids, Past(past.blocks), chunk_tokens)


def encode_with_past(
    model: Transformer, token_ids: Sequence[int], past: Past | None, chunk_tokens: int
) -> PrefillOutput:
    """The whole encoder pass of `start_prefill`."""
    return start_prefill(model, token_ids, past, chunk_tokens).finish()
