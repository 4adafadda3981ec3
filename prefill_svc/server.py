"""One prefill replica: the encoder half of the model, its cache client, the gRPC service with health and reflection,
Prometheus metrics, and a graceful stop (NOT_SERVING, in-flight prefills finish, then exit)."""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.grpc_server import Registrar
from model_service.kvstore import KVStore
from model_service.runtime import ModelServer
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.service import PrefillService
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc


class PrefillServer(ModelServer):
    package = "prefill_svc"
    part = "encoder"
    service = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

    def build(self) -> tuple[Any, Registrar]:
        assert self.model is not None
        assert self.cache is not None  # the configuration requires one
        store = KVStore(self.cache, self.model)
        servicer = PrefillService(
            self.cfg, self.model, store, PrefillMetrics(self.registry), self.log, calls=self.calls
        )
        return servicer, prefill_pb2_grpc.add_PrefillServicer_to_server

    async def release(self) -> None:
        if self.servicer is not None:
            await asyncio.to_thread(self.servicer.queue.close)
