"""The prefill and decode replicas as the router sees them: one channel each, their load, their health.

Every `load_interval_s` the gateway asks each replica GetLoad (1 s deadline). A replica's routing load is what it
reported (queued + running, over its batch capacity for decode) plus the requests this gateway sent it since that
report, so a burst between two polls spreads instead of piling onto the replica that looked idle. A replica that
does not answer, reports draining, or just failed a call (inhibited for `inhibit_s`) gets no new work.
The replica set itself comes from discovery and is re-read on every routing decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.discovery import Discovery, Replica, Role
from gateway.metrics import GatewayMetrics
from mesh.grpc_server import PEER_CHANNEL_OPTIONS
from mesh.logging import get_logger
from proto.decode.v1 import decode_pb2, decode_pb2_grpc
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

POLL_TIMEOUT_S = 1.0

log = get_logger("gateway")


class ReplicaState:
    """One replica: its stub and what the router knows about it."""

    def __init__(self, replica: Replica, role: Role) -> None:
        self.replica = replica
        self.channel = grpc.aio.insecure_channel(replica.address, options=PEER_CHANNEL_OPTIONS)
        stub_class = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        self.stub: Any = stub_class(self.channel)
        self.up: bool | None = None  # None until the first poll: routable
        self.draining = False
        self.reported = 0.0
        self.capacity = 1
        self.sent_since_poll = 0
        self.inhibited_until = 0.0

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def load(self) -> float:
        return (self.reported + self.sent_since_poll) / self.capacity

    def routable(self, now: float) -> bool:
        return self.up is not False and not self.draining and now >= self.inhibited_until


class ReplicaPool:
    """The replicas of one role."""

    def __init__(self, role: Role, discovery: Discovery, metrics: GatewayMetrics, inhibit_s: float) -> None:
        self.role = role
        self._discovery = discovery
        self._metrics = metrics
        self._inhibit_s = inhibit_s
        self._states: dict[str, ReplicaState] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.on_leave: Callable[[str], None] = lambda name: None

    def states(self) -> list[ReplicaState]:
        """The current replicas (discovery's snapshot), opening channels to new ones and closing departed ones."""
        replicas = self._discovery.replicas(self.role)
        if tuple(s.replica for s in self._states.values()) != replicas:
            current = {r.name: r for r in replicas}
            for name in [n for n in self._states if n not in current or self._states[n].replica != current[n]]:
                self._leave(self._states.pop(name))
            for name, replica in current.items():
                if name not in self._states:
                    self._states[name] = ReplicaState(replica, self.role)
            self._states = {name: self._states[name] for name in current}
        return list(self._states.values())

    def routable(self, exclude: Collection[str], ignore_health: bool = False) -> list[ReplicaState]:
        """Replicas that may take work now (with `ignore_health`: every one not draining)."""
        now = time.monotonic()
        return [
            s
            for s in self.states()
            if s.name not in exclude and (s.routable(now) or (ignore_health and not s.draining))
        ]

    def failed(self, state: ReplicaState) -> None:
        """A call to `state` failed as if it were down: route around it for a while."""
        state.inhibited_until = time.monotonic() + self._inhibit_s

    async def poll(self) -> None:
        states = self.states()
        answers = await asyncio.gather(*(self._get_load(s) for s in states), return_exceptions=True)
        for state, answer in zip(states, answers, strict=True):
            was_up = state.up
            if isinstance(answer, BaseException):
                state.up = False
                if was_up is not False:
                    log.warning("replica_down", role=self.role, replica=state.name, error=_describe(answer))
            else:
                state.up = True
                state.draining = answer.draining
                state.reported = float(answer.queue_depth + answer.running)
                state.capacity = max(1, getattr(answer, "max_batch", 1))
                state.sent_since_poll = 0
                if was_up is False:
                    log.info("replica_up", role=self.role, replica=state.name)
            self._metrics.replica_up.labels(self.role, state.name).set(1 if state.up else 0)
            self._metrics.replica_load.labels(self.role, state.name).set(state.load)

    async def _get_load(self, state: ReplicaState) -> Any:
        request = prefill_pb2.GetLoadRequest() if self.role == "prefill" else decode_pb2.GetLoadRequest()
        return await state.stub.GetLoad(request, timeout=POLL_TIMEOUT_S)

    def _leave(self, state: ReplicaState) -> None:
        log.info("replica_left", role=self.role, replica=state.name)
        self.on_leave(state.name)
        for gauge in (self._metrics.replica_up, self._metrics.replica_load):
            with contextlib.suppress(KeyError):  # never polled
                gauge.remove(self.role, state.name)
        task = asyncio.get_running_loop().create_task(state.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*(s.channel.close() for s in self._states.values()), *self._closing)
        self._states.clear()


class CacheHealth:
    """Whether the cache shards answer their gRPC health checks: with none up, prefill is skipped at once."""

    def __init__(self, addresses: list[str], metrics: GatewayMetrics) -> None:
        self._channels = [grpc.aio.insecure_channel(a, options=PEER_CHANNEL_OPTIONS) for a in addresses]
        self._stubs = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._metrics = metrics
        self.shards_up: int | None = None if addresses else 0

    @property
    def down(self) -> bool:
        """True once a poll found every shard down (a mesh without a cache counts as down)."""
        return self.shards_up == 0

    async def poll(self) -> None:
        if not self._stubs:
            return
        answers = await asyncio.gather(
            *(s.Check(health_pb2.HealthCheckRequest(), timeout=POLL_TIMEOUT_S) for s in self._stubs),
            return_exceptions=True,
        )
        serving = health_pb2.HealthCheckResponse.SERVING
        up = sum(1 for a in answers if not isinstance(a, BaseException) and a.status == serving)
        if up != self.shards_up:
            log.info("cache_shards_up", up=up, of=len(self._stubs))
        self.shards_up = up
        self._metrics.cache_up.set(1 if up == len(self._stubs) else 0)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
