"""One decode replica: the full model and DSpark, the engine thread, the write-back to the cache, the gRPC service
with health and reflection, Prometheus metrics, and a graceful stop (NOT_SERVING, running streams get the grace
period, then whatever is left ends with FINISH_REASON_ABORT and the write-backs in flight are awaited)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cache_svc.client import AsyncCacheClient
from decode_svc.config import DecodeConfig
from decode_svc.engine import Engine, EngineSettings
from decode_svc.metrics import DecodeMetrics
from decode_svc.service import DecodeService
from decode_svc.writeback import WriteBack
from mesh.grpc_server import GrpcServer
from mesh.logging import get_logger
from mesh.metrics import new_registry, serve_metrics
from model import Transformer
from prefill_svc.kvstore import KVStore
from prefill_svc.runtime import load_model, model_summary, warm_up
from proto.decode.v1 import decode_pb2, decode_pb2_grpc

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


class DecodeServer:
    """`start()` loads the model (unless one is given) before serving, so health turns SERVING only when ready."""

    def __init__(self, cfg: DecodeConfig, *, model: Transformer | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.log: Any = get_logger("decode_svc")
        self.registry = new_registry()
        self.port = 0
        self.metrics_port = 0
        self.engine: Engine | None = None
        self.service: DecodeService | None = None
        self._cache: AsyncCacheClient | None = None
        self._writeback: WriteBack | None = None
        self._grpc: GrpcServer | None = None

    async def start(self) -> None:
        cfg = self.cfg
        if self.model is None:
            started = time.monotonic()
            self.model = await asyncio.to_thread(
                load_model, cfg.model, "full", device=cfg.device, dtype=cfg.dtype, seed=cfg.seed
            )
            await asyncio.to_thread(warm_up, self.model)
            self.log.info("model_loaded", seconds=round(time.monotonic() - started, 3), **model_summary(self.model))
        if not cfg.cache:
            self.log.warning("no_cache", detail="no prefix reuse, no write-back; only token_ids prompts are served")
        self._cache = AsyncCacheClient(cfg.cache, timeout_s=cfg.cache_timeout_s) if cfg.cache else None
        store = KVStore(self._cache, self.model) if self._cache is not None else None
        metrics = DecodeMetrics(self.registry)
        self._writeback = WriteBack(store, asyncio.get_running_loop(), metrics, self.log)
        settings = EngineSettings(
            max_batch=cfg.max_batch,
            max_queue=cfg.max_queue,
            speculation=cfg.speculation,
            max_draft=cfg.max_draft,
            draft_threshold=cfg.draft_threshold,
            chunk_size=cfg.chunk_size,
        )
        self.engine = Engine(self.model, settings, metrics, self.log, self._writeback)
        self.service = DecodeService(self.model, store, self.engine, metrics, self.log)
        self._grpc = GrpcServer(
            [(decode_pb2_grpc.add_DecodeServicer_to_server, self.service, SERVICE_NAME)], cfg.host, cfg.port
        )
        self.port = self._grpc.port
        self.engine.start()
        await self._grpc.start()
        self.metrics_port = serve_metrics(self.registry, cfg.metrics_host, cfg.metrics_port)
        self.log.info("serving", host=cfg.host, port=self.port, metrics_port=self.metrics_port)

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.cfg.grace_s if grace_s is None else grace_s
        if self.service is not None:
            self.service.draining = True
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self._writeback is not None:
            await self._writeback.drain()
        if self._cache is not None:
            await self._cache.close()
        self.log.info("stopped")
