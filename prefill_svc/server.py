"""One prefill replica: the encoder half of the model, its cache client, the gRPC service with health and reflection,
Prometheus metrics, and a graceful stop (NOT_SERVING, in-flight prefills finish, then exit)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cache_svc.client import AsyncCacheClient
from mesh.grpc_server import GrpcServer
from mesh.logging import get_logger
from mesh.metrics import new_registry, serve_metrics
from model import Transformer
from prefill_svc.config import PrefillConfig
from prefill_svc.kvstore import KVStore
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.runtime import load_model, model_summary, warm_up
from prefill_svc.service import PrefillService
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServer:
    """`start()` loads the model (unless one is given) before serving, so health turns SERVING only when ready."""

    def __init__(self, cfg: PrefillConfig, *, model: Transformer | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.log: Any = get_logger("prefill_svc")
        self.registry = new_registry()
        self.port = 0
        self.metrics_port = 0
        self.service: PrefillService | None = None
        self._cache: AsyncCacheClient | None = None
        self._grpc: GrpcServer | None = None

    async def start(self) -> None:
        cfg = self.cfg
        if self.model is None:
            started = time.monotonic()
            self.model = await asyncio.to_thread(
                load_model, cfg.model, "encoder", device=cfg.device, dtype=cfg.dtype, seed=cfg.seed
            )
            await asyncio.to_thread(warm_up, self.model)
            self.log.info("model_loaded", seconds=round(time.monotonic() - started, 3), **model_summary(self.model))
        self._cache = AsyncCacheClient(cfg.cache, timeout_s=cfg.cache_timeout_s)
        store = KVStore(self._cache, self.model)
        self.service = PrefillService(cfg, self.model, store, PrefillMetrics(self.registry), self.log)
        self._grpc = GrpcServer(
            [(prefill_pb2_grpc.add_PrefillServicer_to_server, self.service, SERVICE_NAME)], cfg.host, cfg.port
        )
        self.port = self._grpc.port
        await self._grpc.start()
        self.metrics_port = serve_metrics(self.registry, cfg.metrics_host, cfg.metrics_port)
        self.log.info("serving", host=cfg.host, port=self.port, metrics_port=self.metrics_port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new prompts (health NOT_SERVING, GetLoad draining), let in-flight ones finish, release everything."""
        grace = self.cfg.grace_s if grace_s is None else grace_s
        if self.service is not None:
            self.service.draining = True
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.service is not None:
            await asyncio.to_thread(self.service.queue.close)
        if self._cache is not None:
            await self._cache.close()
        self.log.info("stopped")
