"""gRPC server bootstrap shared by the services: explicit message-size limits, the standard health
service (per service name and overall), server reflection, and graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh.config import config_dict, load_config
from mesh.logging import configure_logging

# Large payloads are streamed in chunks of at most 1 MiB; the limit leaves room for framing fields.
CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
# For channels to mesh peers: a restarted peer is reached again within a second or two, not after gRPC's default
# 2-minute reconnect backoff; and each channel owns its connections, so a new client of a peer that just came back
# connects at once instead of inheriting the backoff of a process-wide shared subchannel.
PEER_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
)

FAILED_GRACE_S = 2.0  # a failed server's in-flight RPCs have been ended: this only lets their last messages out

Registrar = Callable[[Any, grpc.aio.Server], None]


class GrpcServer:
    """An asyncio gRPC server with health + reflection for the given services."""

    def __init__(self, services: Iterable[tuple[Registrar, Any, str]], host: str, port: int) -> None:
        self._services = list(services)
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._health = health.aio.HealthServicer()
        for register, servicer, _name in self._services:
            register(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [name for _, _, name in self._services]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server,
        )
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")

    async def start(self) -> None:
        await self._server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        for _, _, name in self._services:
            await self._health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING first (routers stop sending), then let in-flight RPCs finish."""
        await self.set_serving(False)
        await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


class StartError(RuntimeError):
    """A server's start-up work failed in a way it cannot serve past (its message says what and why)."""


class Servable(Protocol):
    """Anything `run_until_signal` can run: a `GrpcServer`, or a service object that wraps one."""

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


async def run_until_signal(server: Servable, *, grace_s: float, on_stop: Callable[[], Any] | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain for up to `grace_s` seconds and run `on_stop`; 0.

    A server that can fail as a whole (a model service whose rank group lost a rank) has a `failed` event and an
    `exit_status`: once it is set the server stops at once (its in-flight work has already been ended) and its status
    is returned, non-zero, for the supervisor to restart it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    failed: asyncio.Event | None = getattr(server, "failed", None)
    waits = [asyncio.ensure_future(stop.wait())]
    if failed is not None:
        waits.append(asyncio.ensure_future(failed.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    status = int(getattr(server, "exit_status", 0) or 0) if failed is not None and failed.is_set() else 0
    await server.stop(FAILED_GRACE_S if status else grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    return status


C = TypeVar("C", bound=msgspec.Struct)


def serve_main(
    argv: Sequence[str] | None,
    *,
    service: str,
    config: type[C],
    env_prefix: str,
    make_server: Callable[[C], Servable],
    resolve: Callable[[C], C] | None = None,
) -> int:
    """The `python -m <service> serve [flags]` command every service shares.

    Builds the typed configuration from flags and `<env_prefix>_*` variables (`resolve` may fill in automatic
    values), logs it, serves until SIGTERM/SIGINT and drains for `cfg.grace_s`. Exit status: 0 after a
    graceful stop, 2 for a usage or configuration error, 1 when the server cannot start (address in use, data
    directory locked, a bad value found only at start) or when it failed as a whole while serving."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "serve":
        print(f"usage: python -m {service} serve [options]   (serve --help lists them)", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    cfg = load_config(config, args[1:], env_prefix=env_prefix, prog=f"python -m {service} serve")
    if resolve is not None:
        cfg = resolve(cfg)
    logger = configure_logging(service, level=getattr(cfg, "log_level", "info"))
    logger.info("config", **config_dict(cfg))
    try:
        status = asyncio.run(run_until_signal(make_server(cfg), grace_s=getattr(cfg, "grace_s", 30.0)))
    except (OSError, ValueError, StartError) as exc:
        logger.error("cannot_start", error=str(exc))
        return 1
    return status
