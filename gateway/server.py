"""One gateway process: the HTTP server (uvicorn) and the gRPC server on one event loop, the replica and cache
pollers, and a graceful stop.

Stop (SIGTERM): gRPC health NOT_SERVING, the listeners close (in Kubernetes the preStop sleep has already taken the
pod out of its Service), requests on open connections get 503, in-flight responses get `grace_s` to finish; what is
still running then is cancelled, which aborts its decode sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from gateway.admission import Admission
from gateway.affinity import AffinityTable
from gateway.app import create_app
from gateway.backends import Backends, Settings
from gateway.config import GatewayConfig
from gateway.discovery import ROLES, Discovery, make_discovery
from gateway.errors import GatewayError
from gateway.grpc_api import SERVICE_NAME, GatewayService
from gateway.job import Codec
from gateway.metrics import GatewayMetrics
from gateway.replicas import CacheHealth, ReplicaPool
from gateway.response_store import ResponseStore
from gateway.router import Router
from gateway.service import Gateway
from gateway.workers import Workers
from mesh.grpc_server import GrpcServer
from mesh.logging import get_logger
from mesh.metrics import new_registry
from proto.gateway.v1 import gateway_pb2_grpc
from recipe import load_tokenizer

log = get_logger("gateway")


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway stops both servers together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class GatewayServer:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.registry = new_registry()
        self.metrics = GatewayMetrics(self.registry)
        self.port = 0
        self.grpc_port = 0
        self.gateway: Gateway | None = None
        self._poller: asyncio.Task[None] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._discovery: Discovery | None = None
        self._pools: dict[str, ReplicaPool] = {}
        self._cache: CacheHealth | None = None
        self._http: _HttpServer | None = None
        self._grpc: GrpcServer | None = None
        self._grpc_serving = True  # what gRPC health reports: GrpcServer.start() sets SERVING
        self._health_lock = asyncio.Lock()  # the start and the poller's readiness updates, one at a time

    async def start(self) -> None:
        cfg = self.cfg
        self._discovery = make_discovery(cfg.discovery, prefill=cfg.prefill, decode=cfg.decode, namespace=cfg.namespace)
        self._discovery.start()
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer or None)
        self._pools = {role: ReplicaPool(role, self._discovery, self.metrics, cfg.inhibit_s) for role in ROLES}
        affinity = AffinityTable(cfg.affinity_entries)
        router = Router(self._pools, affinity, cfg.affinity_slack, self.metrics)  # type: ignore[arg-type]
        self._cache = CacheHealth(list(cfg.cache), self.metrics)
        settings = Settings(
            retries=cfg.retries,
            prefill_fallback=cfg.prefill_fallback,
            prefill_timeout_s=cfg.prefill_timeout_s,
            stall_timeout_s=cfg.stall_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            handoff_lease_s=cfg.handoff_lease_s,
            writeback_wait_s=cfg.writeback_wait_s,
        )
        admission = Admission(
            cfg.max_inflight,
            cfg.max_queue,
            cfg.queue_timeout_s,
            cfg.max_queue_wait_s,
            on_change=self._admission_changed,
            on_refused=lambda reason: self.metrics.admission_refusals.labels(reason).inc(),
        )
        self.metrics.expected_wait.set_function(admission.expected_wait_s)
        codec = Codec(
            tokenizer, model_name=cfg.model_name, max_output_tokens=cfg.max_output_tokens, prefix_reuse=cfg.prefix_reuse
        )
        self.gateway = Gateway(
            codec,
            Backends(settings, router, self._cache, self.metrics),
            admission,
            Workers(cfg.prepare_threads),
            self.metrics,
            ResponseStore(cfg.response_store, cfg.response_retention_h * 3600),
            api_key=cfg.api_key,
            max_body_bytes=cfg.max_body_bytes,
        )
        self._poller = asyncio.get_running_loop().create_task(self._poll())

        sock = _listen(cfg.host, cfg.port)
        self.port = sock.getsockname()[1]
        app = create_app(self.gateway, self.registry, self.readiness, cfg)
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=int(cfg.grace_s)
        )
        self._http = _HttpServer(config)
        self._serving = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            await asyncio.sleep(0.01)

        self._grpc = GrpcServer(
            [(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayService(self.gateway), SERVICE_NAME)],
            cfg.host,
            cfg.grpc_port,
        )
        self.grpc_port = self._grpc.port
        async with self._health_lock:  # the poller, running already, must not set a status the start then overwrites
            await self._grpc.start()
            self._grpc_serving = True
        await self._follow_readiness()
        log.info("serving", host=cfg.host, port=self.port, grpc_port=self.grpc_port)

    def readiness(self) -> dict[str, Any]:
        """/health: ready while the model is known (a replica described it), a decode replica answers, and draining
        has not started."""
        gateway = self.gateway
        assert gateway is not None
        up = {role: sum(1 for s in pool.states() if s.up) for role, pool in self._pools.items()}
        if gateway.draining:
            status = "draining"
        elif not gateway.model_known:
            status = "waiting for a replica to describe the model"
        elif not up["decode"]:
            status = "no decode replica answers"
        else:
            status = "ok"
        return {
            "ready": status == "ok",
            "status": status,
            "replicas_up": up,
            "cache_shards_up": self._cache.shards_up if self._cache else None,
            "queued": gateway.admission.queued,
            "inflight": gateway.admission.inflight,
        }

    async def stop(self, grace_s: float) -> None:
        gateway = self.gateway
        if gateway is not None:
            gateway.admission.draining = True
        log.info("draining", grace_s=grace_s)
        if self._http is not None:
            self._http.config.timeout_graceful_shutdown = int(grace_s)
            self._http.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._serving is not None:
            await self._serving  # uvicorn lets open responses finish, then cancels what is left
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if gateway is not None:
            await gateway.backends.drain()
            gateway.store.close()
        await asyncio.gather(*(pool.close() for pool in self._pools.values()))
        if self._cache is not None:
            await self._cache.close()
        if self._discovery is not None:
            self._discovery.close()
        log.info("stopped")

    async def _poll(self) -> None:
        """Replica loads, cache health and (until known) the model, every `load_interval_s`."""
        assert self._cache is not None
        while True:
            polls = [pool.poll() for pool in self._pools.values()]
            await asyncio.gather(*polls, self._cache.poll(), self._learn_model())
            self._observe_decode()
            await self._follow_readiness()
            await asyncio.sleep(self.cfg.load_interval_s)

    async def _follow_readiness(self) -> None:
        """gRPC health says what /health says: SERVING only while ready."""
        async with self._health_lock:
            ready = self.readiness()["ready"]
            if self._grpc is not None and ready != self._grpc_serving and not self.gateway.draining:  # type: ignore[union-attr]
                self._grpc_serving = ready
                await self._grpc.set_serving(ready)

    def _observe_decode(self) -> None:
        """Admission's view of the mesh: the batch slots and the sequences of the decode replicas that answer."""
        assert self.gateway is not None
        up = [state for state in self._pools["decode"].states() if state.up]
        load = sum(state.reported + state.sent_since_poll for state in up)
        self.gateway.admission.observe(sum(state.capacity for state in up), load)

    async def _learn_model(self) -> None:
        assert self.gateway is not None
        if not self.gateway.model_known:
            with contextlib.suppress(GatewayError):
                await self.gateway.model()

    def _admission_changed(self, queued: int, inflight: int) -> None:
        self.metrics.queue_depth.set(queued)
        self.metrics.inflight.set(inflight)
