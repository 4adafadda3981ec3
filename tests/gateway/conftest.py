"""The gateway under test with no model behind it (the fixtures; the harness is in gateway_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_helpers import API_KEY, InProcessGateway

from gateway.config import GatewayConfig
from mesh.processes import free_port


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
