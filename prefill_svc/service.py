"""prefill.v1.Prefill: the encoder half over a prompt, on top of whatever prefix the cache holds.

    validate → block keys → cache: hit blocks + the SWA record of the hit prefix → encoder over the suffix (chunked,
    one encoder thread) → cache: new full blocks + the handoff record(s) (leased) → handle(s)

A request may ask for several handoff records of its one prefill (`handoffs`): the gateway's n choices of a prompt
each restore their own, since a decode consumes the record it takes. The handoff travels once to each cache replica
holding any of the records and is stored once there (`KVStore.put_handoffs`).

Stateless between requests: any replica serves any prompt. Failure semantics (docs/services.md):
- bad input → INVALID_ARGUMENT naming the field; queue full → RESOURCE_EXHAUSTED; draining → UNAVAILABLE;
- the cache cannot take a handoff record (unreachable, or its pool full of leases) → FAILED_PRECONDITION, the
  records it did take deleted: the gateway then sends the token ids to decode, which prefills itself. After an
  unreachable cache the replica answers so at once for `cache_retry_s` instead of running the encoder for nothing;
- new blocks the cache refuses (SSD full, a shard down) are counted and logged, never fatal: decode recomputes
  what it cannot fetch.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import grpc

from cache_svc.client import DOWN, CacheError
from mesh.logging import bind_request
from model import Past, PrefillOutput, Transformer
from model_service.kvstore import KVStore
from model_service.ranks import LocalCalls, ModelCalls
from model_service.runtime import RequestError, check_common, invalid, model_info, prompt_error, request_id_of
from prefill_svc.config import PrefillConfig
from prefill_svc.encoder_queue import EncoderQueue
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.passes import encoder_pass
from proto.mesh.v1 import model_info_pb2
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

SEND_TOKENS = "send the prompt's token ids to decode instead"


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        cfg: PrefillConfig,
        model: Transformer,
        store: KVStore,
        metrics: PrefillMetrics,
        logger: Any,
        calls: ModelCalls | None = None,
    ) -> None:
        """`calls`: how the encoder is run (a rank group's rank 0 has every rank run it; default: here only)."""
        self.cfg = cfg
        self.model = model
        self.calls = calls if calls is not None else LocalCalls(model)
        self.store = store
        self.metrics = metrics
        self.log = logger
        self.queue = EncoderQueue(cfg.max_queue, metrics, *encoder_pass(self.calls, cfg.chunk_size))
        self.info = model_info(model, cfg.model)
        self.draining = False
        self._cache_down_until = 0.0

    # ------------------------------------------------------------------------------------------------ RPCs
    async def Prefill(  # noqa: N802
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        request_id = request_id_of(request.request_id, context)
        with bind_request(request_id=request_id):
            started = time.monotonic()
            try:
                response = await self._prefill(request, request_id)
            except RequestError as error:
                self.metrics.requests.labels(error.outcome).inc()
                self.log.info("prefill_refused", code=error.code.name, error=error.message)
                await context.abort(error.code, error.message)
            except asyncio.CancelledError:
                self.metrics.requests.labels("cancelled").inc()
                self.log.info("prefill_cancelled")
                raise
            except Exception as exc:
                self.metrics.requests.labels("error").inc()
                self.log.exception("prefill_failed")
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
            else:
                response.prefill_seconds = time.monotonic() - started
                self.metrics.requests.labels("ok").inc()
                return response

    async def GetLoad(self, request: prefill_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.Load:  # noqa: N802
        q = self.queue
        return prefill_pb2.Load(
            queue_depth=q.depth, running=q.running, pending_tokens=q.pending_tokens, draining=self.draining
        )

    async def GetModelInfo(  # noqa: N802
        self, request: model_info_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> model_info_pb2.ModelInfo:
        return self.info

    # ------------------------------------------------------------------------------------------ the prefill
    async def _prefill(self, request: prefill_pb2.PrefillRequest, request_id: str) -> prefill_pb2.PrefillResponse:
        tokens, salt = list(request.token_ids), bytes(request.cache_salt)
        lease = self._check(request, request_id, tokens)
        count = request.handoffs or 1
        with self.queue.place(len(tokens)) as place:
            keys = self.store.keys(tokens, salt)
            past = await self.store.find_past(tokens, salt, keys)
            out = await place.run((tokens, past))
        self._count(tokens, past, out, place.seconds)
        first = len(past.blocks) if past is not None else 0
        handoff = prefill_pb2.Handoff(
            token_ids=tokens,
            cache_salt=salt,
            encoder_state=await asyncio.to_thread(out.encoder_state.to_bytes),
            cached_tokens=out.cached_tokens,
            swa_restored=out.swa_restored,
            bounded_replay=out.bounded_replay,
        )
        _, handles = await asyncio.gather(
            self._write_blocks(keys[first : first + len(out.blocks)], out), self._write_handoffs(handoff, lease, count)
        )
        self.log.info(
            "prefill",
            prompt_tokens=len(tokens),
            cached_tokens=out.cached_tokens,
            swa_restored=out.swa_restored,
            bounded_replay=out.bounded_replay,
            new_blocks=len(out.blocks),
            handoffs=count,
        )
        return prefill_pb2.PrefillResponse(
            handle=handles[0],
            handles=handles,
            prompt_tokens=len(tokens),
            cached_tokens=out.cached_tokens,
            swa_restored=out.swa_restored,
            bounded_replay=out.bounded_replay,
        )

    def _check(self, request: prefill_pb2.PrefillRequest, request_id: str, tokens: list[int]) -> float:
        """Refuse what cannot be served (the queue's own limit is checked when the prompt takes its place)."""
        check_common(request_id, request.cache_salt)
        error = prompt_error(tokens, self.model)
        if error is not None:
            raise invalid(error)
        lease = request.handoff_lease_s
        if not math.isfinite(lease) or lease < 0:
            raise invalid(f"handoff_lease_s must be a finite number ≥ 0, got {lease}")
        if lease > self.cfg.max_handoff_lease_s:
            raise invalid(f"handoff_lease_s {lease:g} exceeds this replica's maximum {self.cfg.max_handoff_lease_s:g}")
        if request.handoffs > self.cfg.max_handoffs:
            raise invalid(f"handoffs {request.handoffs} exceeds this replica's maximum {self.cfg.max_handoffs}")
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "this prefill replica is draining", "draining")
        if time.monotonic() < self._cache_down_until:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the cache failed a handoff write less than {self.cfg.cache_retry_s:g} s ago; {SEND_TOKENS}",
                "cache_unavailable",
            )
        return lease or self.cfg.handoff_lease_s

    def _count(self, tokens: list[int], past: Past | None, out: PrefillOutput, seconds: float) -> None:
        """A prompt's encoder pass in the metrics."""
        # An SWA record resumes the encoder past the cached blocks: at the record's position.
        resumed = past.encoder_state.position if out.swa_restored and past and past.encoder_state else out.cached_tokens
        computed = len(tokens) - resumed
        m = self.metrics
        m.seconds.observe(seconds)
        m.prompt_tokens.inc(len(tokens))
        m.tokens.inc(computed)
        m.batch_tokens.observe(computed)
        m.cache_hit_tokens.inc(out.cached_tokens)
        if out.swa_restored:
            m.swa_restored.inc()
        if out.bounded_replay:
            m.bounded_replays.inc()

    async def _write_blocks(self, keys: list[bytes], out: PrefillOutput) -> None:
        try:
            await self.store.put_blocks(keys, out.blocks)
        except CacheError as exc:
            self.metrics.cache_errors.labels("put_blocks").inc()
            self.log.warning("cache_write_failed", op="put_blocks", code=exc.code.name, error=str(exc))

    async def _write_handoffs(self, handoff: prefill_pb2.Handoff, lease: float, count: int) -> list[bytes]:
        """`count` records of the handoff, each under its own handle; all or none (FAILED_PRECONDITION)."""
        try:
            return await self.store.put_handoffs(handoff, lease, count)
        except CacheError as exc:
            self.metrics.cache_errors.labels("put_handoff").inc()
            if exc.code in DOWN:
                self._cache_down_until = time.monotonic() + self.cfg.cache_retry_s
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the cache cannot take the handoff record ({exc}); {SEND_TOKENS}",
                "cache_unavailable",
            ) from None
