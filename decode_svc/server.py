"""One decode replica: the full model and DSpark, the engine thread, the write-back to the cache, the gRPC service
with health and reflection, Prometheus metrics, and a graceful stop (NOT_SERVING, running streams get the grace
period, then whatever is left ends with FINISH_REASON_ABORT and the write-backs in flight are awaited)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from decode_svc import masking
from decode_svc.config import DecodeConfig
from decode_svc.engine import Engine, EngineSettings
from decode_svc.grammar import Grammars, default_tokenizer, vocabulary
from decode_svc.metrics import DecodeMetrics
from decode_svc.service import DecodeService
from decode_svc.step_times import StepTimes
from decode_svc.writeback import WriteBack
from mesh.grpc_server import Registrar, StartError
from model import Transformer
from model_service.errors import RequestError
from model_service.kvstore import KVStore
from model_service.runtime import ModelServer, model_info
from proto.decode.v1 import decode_pb2, decode_pb2_grpc

FAILED_STOP_S = 5.0


class DecodeServer(ModelServer):
    package = "decode_svc"
    part = "full"
    service = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
    engine: Engine | None = None
    writeback: WriteBack | None = None

    def __init__(self, cfg: DecodeConfig, *, model: Transformer | None = None, times: StepTimes | None = None) -> None:
        """`times`: the step times DSpark's scheduler starts from (default: measured at start, then as it runs)."""
        super().__init__(cfg, model=model)
        self.times = times

    def build(self) -> tuple[Any, Registrar]:
        cfg, model = self.cfg, self.model
        assert model is not None
        if self.cache is None:
            self.log.warning("no_cache", detail="no prefix reuse, no write-back; only token_ids prompts are served")
        store = KVStore(self.cache, model) if self.cache is not None else None
        metrics = DecodeMetrics(self.registry)
        self.writeback = WriteBack(store, asyncio.get_running_loop(), metrics, self.log)
        settings = EngineSettings(
            max_batch=cfg.max_batch,
            max_queue=cfg.max_queue,
            speculation=cfg.speculation,
            max_draft=cfg.max_draft,
            draft_policy=cfg.draft_policy,
            chunk_size=cfg.chunk_size,
        )
        masking.set_fill_threads(cfg.mask_threads)
        self.engine = Engine(model, settings, metrics, self.log, self.writeback, self.times, self.calls)
        self.engine.start()
        tokenizer = Path(cfg.tokenizer) if cfg.tokenizer else default_tokenizer()
        grammars = Grammars(vocabulary(tokenizer, model.args.vocab_size), metrics.grammar_compile, cfg.grammar_cache)
        info = model_info(model, cfg.model)
        servicer = DecodeService(model, info, store, self.engine, grammars, metrics, self.log)
        return servicer, decode_pb2_grpc.add_DecodeServicer_to_server

    async def ready(self) -> None:
        """The engine's start-up: its step graphs captured and its step times profiled (minutes on a large model:
        a replica is not SERVING before it can serve at speed)."""
        assert self.engine is not None
        await asyncio.to_thread(self.engine.warmed.wait)
        if self.engine.start_error is not None:
            raise StartError(f"decode cannot start: {self.engine.start_error}")

    def fail_all(self, error: RequestError) -> None:
        if self.engine is not None:
            self.engine.fail_all(error)

    async def release(self) -> None:
        if self.engine is not None:  # a failed group's engine may be stuck in a collective: not waited for long
            await asyncio.to_thread(self.engine.stop, FAILED_STOP_S if self.exit_status else None)
        if self.writeback is not None:
            await self.writeback.drain()
