"""A real gateway (HTTP + gRPC servers) on a background event loop, for the tests of tests/gateway."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import ExitStack
from typing import Any

from gateway.config import GatewayConfig
from gateway.server import GatewayServer

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


def refusing_address(held: ExitStack) -> str:
    """A loopback address that refuses connections: a port held bound without listening until `held` closes (a port
    merely found free once could be taken, and then answered, by a server of another test worker)."""
    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    sock.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{sock.getsockname()[1]}"
