"""A real gateway (HTTP + gRPC servers) on a background event loop, for the tests that need no model behind it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from mesh.processes import free_port

API_KEY = "test-key"


class InProcessGateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = GatewayServer(cfg)
        self.call(self.server.start())
        self.base_url = f"http://127.0.0.1:{self.server.port}"
        self.grpc_address = f"127.0.0.1:{self.server.grpc_port}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        self.call(self.server.stop(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def lone_gateway() -> Iterator[InProcessGateway]:
    """A gateway whose prefill and decode addresses answer nothing (ports nobody listens on), with an API key."""
    nowhere = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    cfg = GatewayConfig(
        port=0,
        grpc_port=0,
        prefill=[nowhere[0]],
        decode=[nowhere[1]],
        cache=[nowhere[2]],
        api_key=API_KEY,
        max_body_bytes=4096,
    )
    gateway = InProcessGateway(cfg)
    yield gateway
    gateway.stop()
