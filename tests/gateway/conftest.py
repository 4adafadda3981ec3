"""The gateway under test with no model behind it (the fixtures; the harness is in gateway_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from gateway_helpers import API_KEY, InProcessGateway, refusing_address

from gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def lone_gateway() -> Iterator[InProcessGateway]:
    """A gateway whose prefill, decode and cache addresses refuse connections, with an API key."""
    with ExitStack() as held:
        nowhere = [refusing_address(held) for _ in range(3)]
        yield from _lone_gateway(nowhere)


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
