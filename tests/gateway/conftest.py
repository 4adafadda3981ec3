"""The gateway under test with no model behind it (the fixtures; the harness is in gateway_helpers.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from gateway_helpers import API_KEY, InProcessGateway

from gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def lone_gateway() -> Iterator[InProcessGateway]:
    """A gateway whose prefill and decode addresses answer nothing, with an API key.

    Each address is a port this fixture holds bound without listening: a connection is refused, and no server of
    another test worker can take the port meanwhile (a port merely found free once could be, and then answered)."""
    with ExitStack() as held:
        nowhere = [_refusing_address(held) for _ in range(3)]
        yield from _lone_gateway(nowhere)


def _refusing_address(held: ExitStack) -> str:
    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    sock.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{sock.getsockname()[1]}"


def _lone_gateway(nowhere: list[str]) -> Iterator[InProcessGateway]:
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
