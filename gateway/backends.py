"""What every request's prefill and generations share: the settings they follow, the router, the cache's health,
metrics and background calls; and the prompt they start from."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc
import msgspec

from gateway.affinity import AffinityKey
from gateway.metrics import GatewayMetrics
from gateway.replicas import CacheHealth
from gateway.router import Router
from gateway.writebacks import WriteBacks
from mesh.logging import get_logger

# Codes after which a replica is routed around for a while: it is gone, frozen or failing.
DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL})

log = get_logger("gateway")


class Settings(msgspec.Struct, frozen=True):
    """The part of the gateway's configuration a request's prefill and generations follow."""

    retries: int
    prefill_fallback: bool
    prefill_timeout_s: float
    stall_timeout_s: float
    request_timeout_s: float
    handoff_lease_s: float
    writeback_wait_s: float


class Prompt(msgspec.Struct, frozen=True):
    """What a prefill or a generation starts from (each choice's generation has its own request id)."""

    request_id: str
    token_ids: list[int]
    salt: bytes
    affinity: AffinityKey


class Backends:
    """What every request shares: the router, the cache's health, metrics, and background aborts."""

    def __init__(self, settings: Settings, router: Router, cache: CacheHealth, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.metrics = metrics
        self.writebacks = WriteBacks()
        self._background: set[asyncio.Task[Any]] = set()

    def fall_back(self, request_id: str, reason: str, why: str, choices: int = 1) -> None:
        """Count `choices` decodes that must prefill from the token ids (no handoff record for them), and say why."""
        self.metrics.fallbacks.labels(reason).inc(choices)
        log.warning("prefill_fallback", request_id=request_id, reason=reason, why=why, choices=choices)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` detached from the request (it must outlive a cancelled one); failures are logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background_call_failed", error=repr(task.exception()))

    async def drain(self) -> None:
        """Wait for the aborts already sent and the finished streams still closing."""
        await asyncio.gather(*self._background, return_exceptions=True)


def describe(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"
