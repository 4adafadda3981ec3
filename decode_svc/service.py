"""decode.v1.Decode: Generate streams a generation; Abort ends one; GetLoad feeds the gateway's router; GetModelInfo
describes the model (as prefill's does: the gateway learns it from whichever replica answers).

    Generate: validate, compile its output constraint (grammar.py) → a queue slot (RESOURCE_EXHAUSTED when full)
              → the prompt:
                handle     → consume the handoff record (NOT_FOUND if its lease expired or it was taken) + fetch the
                             global blocks it needs; a block missing or a state unusable here → prefill locally
                token_ids  → prefill locally on top of whatever prefix the cache holds
              → the engine (continuous batching) → token deltas (several per message under DSpark) → final message
              with finish_reason and usage.

A stream whose client goes away (cancelled RPC) is aborted at once, like an Abort: its sequence leaves the batch at
the next step boundary. A finished stream closes after its final message only once the sequence's write-back is done
(writeback.py): the close tells a caller that the conversation's next turn will find this turn's SWA record.
Failure semantics and flags: docs/services.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cache_svc.client import CacheError
from decode_svc.engine import Engine
from decode_svc.grammar import Grammars
from decode_svc.guide import Guide
from decode_svc.metrics import DecodeMetrics
from decode_svc.sequence import Delta, End, Failure, Outbox, Params, Prompt, Sampling, Sequence
from mesh.logging import bind_request
from model import Past, Transformer
from model_service.kvstore import KVStore
from model_service.runtime import RequestError, check_common, invalid, max_context, prompt_error, request_id_of
from proto.decode.v1 import decode_pb2, decode_pb2_grpc
from proto.mesh.v1 import model_info_pb2

MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_HANDLE_BYTES = 64


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        model: Transformer,
        info: model_info_pb2.ModelInfo,
        store: KVStore | None,
        engine: Engine,
        grammars: Grammars,
        metrics: DecodeMetrics,
        logger: Any,
    ) -> None:
        self.model = model
        self.info = info
        self.store = store
        self.engine = engine
        self.grammars = grammars
        self.metrics = metrics
        self.log = logger
        self.draining = False

    # ------------------------------------------------------------------------------------------------ RPCs
    async def Generate(  # noqa: N802
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        request_id = request_id_of(request.request_id, context)
        with bind_request(request_id=request_id):
            arrived = time.monotonic()
            seq: Sequence | None = None
            try:
                params = self._params(request, request_id)
                if self.draining:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, "this decode replica is draining", "draining")
                guide = await self._guide(request, params) if request.HasField("constraint") else None
                seq = Sequence(params, Outbox(asyncio.get_running_loop()), guide=guide)
                self.engine.register(seq)
                await self._prepare(seq, request)
                self.engine.submit(seq)
                async for message in self._stream(seq, arrived):
                    yield message
            except RequestError as error:
                self.metrics.requests.labels(error.outcome).inc()
                self.log.info("generate_refused", code=error.code.name, error=error.message)
                await context.abort(error.code, error.message)
            finally:
                if seq is not None:
                    self.engine.release(seq, "client_gone")

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        with bind_request(request_id=request.request_id):
            found = bool(request.request_id) and self.engine.abort(request.request_id, "abort_rpc")
            self.log.info("abort", found=found)
            return decode_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: decode_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return decode_pb2.Load(
            queue_depth=self.engine.waiting,
            running=self.engine.running,
            max_batch=self.engine.capacity,
            draining=self.draining,
        )

    async def GetModelInfo(  # noqa: N802
        self, request: model_info_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> model_info_pb2.ModelInfo:
        return self.info

    # ------------------------------------------------------------------------------------------- validation
    def _params(self, request: decode_pb2.GenerateRequest, request_id: str) -> Params:
        check_common(request_id, request.cache_salt)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("set either handle (from prefill) or token_ids")
        if kind == "handle" and not 0 < len(request.handle) <= MAX_HANDLE_BYTES:
            raise invalid(f"handle must be 1 to {MAX_HANDLE_BYTES} bytes, got {len(request.handle)}")
        if kind == "token_ids":
            error = prompt_error(request.token_ids.ids, self.model)
            if error is not None:
                raise invalid(error)
        vocab = self.model.args.vocab_size
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"{len(request.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        for i, token in enumerate(request.stop_token_ids):
            if token >= vocab:
                raise invalid(f"stop_token_ids[{i}] = {token} is outside the vocabulary [0, {vocab})")
        if not -1 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be -1 (none) to {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        return Params(
            request_id=request_id,
            sampling=self._sampling(request.sampling),
            stop_token_ids=frozenset(request.stop_token_ids),
            max_tokens=request.max_tokens,
            logprobs=(request.logprobs or request.top_logprobs > 0) and request.top_logprobs >= 0,
            top_logprobs=max(request.top_logprobs, 0),
            speculate=not request.disable_speculation,
            salt=bytes(request.cache_salt),
        )

    def _sampling(self, s: decode_pb2.SamplingParams) -> Sampling:
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise invalid(f"sampling.temperature must be a finite number ≥ 0, got {s.temperature}")
        if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
            raise invalid(f"sampling.top_p must be in [0, 1] (0 or 1 = off), got {s.top_p}")
        return Sampling(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=min(s.top_k, self.model.args.vocab_size),
            seed=s.seed if s.HasField("seed") else None,
        )

    async def _guide(self, request: decode_pb2.GenerateRequest, params: Params) -> Guide:
        """The request's output constraint, compiled (INVALID_ARGUMENT naming what does not compile)."""
        c, vocab = request.constraint, self.model.args.vocab_size
        for i, token in enumerate(c.banned_token_ids):
            if token >= vocab:
                raise invalid(f"constraint.banned_token_ids[{i}] = {token} is outside the vocabulary [0, {vocab})")
        reasoning_end = c.reasoning_end_token_id if c.HasField("reasoning_end_token_id") else None
        if reasoning_end is not None and reasoning_end >= vocab:
            raise invalid(f"constraint.reasoning_end_token_id = {reasoning_end} is outside the vocabulary")
        if reasoning_end is not None and c.answer_prefix:
            raise invalid("constraint.answer_prefix: an output that starts in reasoning has no answer prefix")
        grammar = await self.grammars.compile(c)
        self.metrics.constrained.labels(c.WhichOneof("grammar") or "banned_tokens").inc()
        try:
            return Guide(
                grammar,
                banned=c.banned_token_ids,
                reasoning_end=reasoning_end,
                answer_prefix=c.answer_prefix,
                stop_ids=params.stop_token_ids,
            )
        except ValueError as error:
            raise invalid(f"constraint.answer_prefix: {error}") from None

    def _limit(self, max_tokens: int, prompt_tokens: int) -> int:
        """The output budget: max_tokens, or (0) everything the context leaves after the prompt."""
        room = max_context(self.model) - prompt_tokens
        if max_tokens > room:
            raise invalid(
                f"max_tokens {max_tokens} does not fit: the {prompt_tokens}-token prompt leaves {room} of the "
                f"model's {max_context(self.model)}-token context"
            )
        return max_tokens or room

    # ---------------------------------------------------------------------------------------------- prompt
    async def _prepare(self, seq: Sequence, request: decode_pb2.GenerateRequest) -> None:
        if request.WhichOneof("prompt") == "token_ids":
            tokens = list(request.token_ids.ids)
            seq.prompt = Prompt(tokens, past=await self._past(tokens, seq.params.salt), local_prefill="token_ids")
        else:
            seq.prompt = await self._from_handoff(seq, bytes(request.handle))
        seq.limit = self._limit(request.max_tokens, len(seq.prompt.token_ids))

    async def _from_handoff(self, seq: Sequence, handle: bytes) -> Prompt:
        if self.store is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, "this decode replica has no cache: send token_ids", "no_cache"
            )
        try:
            handoff = await self.store.take_handoff(handle)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        except CacheError as exc:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"cannot read the handoff: {exc}", "cache_error") from None
        if handoff is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"no handoff record under handle {handle.hex()}: its lease expired, another decode took it, or the "
                "cache is unreachable; send the prompt's token_ids instead",
                "handoff_lost",
            )
        tokens, salt = list(handoff.token_ids), bytes(handoff.cache_salt)
        seq.params = dataclasses.replace(seq.params, salt=salt)  # the salt its blocks are keyed with
        try:
            state = self.store.handoff_state(handoff)
        except ValueError as exc:
            self.log.warning("handoff_unusable", error=str(exc))
            return Prompt(tokens, past=await self._past(tokens, salt), local_prefill="handoff_unusable")
        need = state.position // self.model.args.kv_block_tokens
        blocks = await self.store.get_blocks(self.store.keys(tokens, salt)[:need])
        if len(blocks) < need:
            self.log.warning("handoff_blocks_missing", found=len(blocks), needed=need)
            return Prompt(tokens, past=Past(blocks) if blocks else None, local_prefill="blocks_missing")
        if handoff.bounded_replay:
            self.metrics.bounded_replays.inc()
        return Prompt(tokens, blocks, state, cached_tokens=handoff.cached_tokens, bounded_replay=handoff.bounded_replay)

    async def _past(self, tokens: list[int], salt: bytes) -> Past | None:
        if self.store is None:
            return None
        return await self.store.find_past(tokens, salt, self.store.keys(tokens, salt))

    # ---------------------------------------------------------------------------------------------- stream
    async def _stream(self, seq: Sequence, arrived: float) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """The engine's outputs as messages: everything queued since the last message goes out in one."""
        last_sent: float | None = None
        while True:
            message = decode_pb2.GenerateResponse()
            for item in await seq.outbox.get():
                if isinstance(item, Failure):
                    raise RequestError(item.code, item.message, "failed")
                if isinstance(item, Delta):
                    message.token_ids.extend(item.tokens)
                    message.logprobs.extend(_logprobs(item))
                elif isinstance(item, End):
                    message.finish_reason = item.reason
                    message.usage.CopyFrom(item.usage)
            now = time.monotonic()
            if message.token_ids:
                histogram = self.metrics.ttft if last_sent is None else self.metrics.itl
                histogram.observe(now - (arrived if last_sent is None else last_sent))
                last_sent = now
            yield message
            if message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED:
                aborted = message.finish_reason == decode_pb2.FINISH_REASON_ABORT
                self.metrics.requests.labels("aborted" if aborted else "ok").inc()
                if seq.writebacks:  # close the stream once what the next turn needs is in the cache (or failed)
                    await asyncio.wait(seq.writebacks)
                return


def _logprobs(delta: Delta) -> list[decode_pb2.TokenLogprob]:
    return [
        decode_pb2.TokenLogprob(logprob=lp, top=[decode_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top])
        for lp, top in delta.logprobs or ()
    ]
