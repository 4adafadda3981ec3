"""One cache replica: the block store and the record pool behind cache.v1.KvCache, with health,
reflection, Prometheus metrics and a graceful stop (in-flight commits finish and are fsynced)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from cache_svc import frames
from cache_svc.blocks import BlockStore
from cache_svc.config import CacheConfig
from cache_svc.heap import keep_freed_memory
from cache_svc.records import RecordPool
from cache_svc.service import KvCacheService
from cache_svc.stats import Counters, Histograms, StatsCollector
from mesh.grpc_server import GrpcServer
from mesh.logging import get_logger
from mesh.metrics import new_registry, serve_metrics

SERVICE_NAME = frames.SERVICE.full_name
SWEEP_INTERVAL_S = 1.0  # how often expired records are dropped when nobody touches the pool


class CacheServer:
    def __init__(self, cfg: CacheConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self._clock = clock
        self.logger: Any = get_logger("cache_svc")
        self.registry = new_registry()
        self.port = 0
        self.metrics_port = 0
        self._store: BlockStore | None = None
        self._grpc: GrpcServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Recover the data directory, then start serving."""
        keep_freed_memory()
        counters = Counters()
        histograms = Histograms(self.registry)
        self._store = await BlockStore.open(
            self.cfg, clock=self._clock, counters=counters, histograms=histograms, logger=self.logger
        )
        records = RecordPool(self.cfg.record_bytes, self.cfg.record_ttl_s, self._clock, counters)
        service = KvCacheService(self.cfg, self._store, records, counters, histograms, self.logger)
        self.registry.register(StatsCollector(service.snapshot, counters))
        try:
            self._grpc = GrpcServer([(frames.add_servicer, service, SERVICE_NAME)], self.cfg.host, self.cfg.port)
        except OSError:
            await self._store.close()
            raise
        self.port = self._grpc.port
        await self._grpc.start()
        self._sweeper = asyncio.get_running_loop().create_task(_sweep(records))
        self.metrics_port = serve_metrics(self.registry, self.cfg.metrics_host, self.cfg.metrics_port)
        self.logger.info("serving", host=self.cfg.host, port=self.port, metrics_port=self.metrics_port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop taking RPCs, let in-flight ones finish (commits included), then fsync and close the files."""
        grace = self.cfg.grace_s if grace_s is None else grace_s
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._store is not None:
            await self._store.close()
        self.logger.info("stopped")


async def _sweep(records: RecordPool) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        records.expire_due()
