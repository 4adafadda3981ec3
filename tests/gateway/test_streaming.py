"""gateway.streaming: a complete response's work and the client-disconnect watch beside it."""

from __future__ import annotations

import anyio
import pytest
from starlette.requests import ClientDisconnect

from gateway.errors import GatewayError, Kind
from gateway.streaming import cancel_on_disconnect


async def _connected() -> dict:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def _gone() -> dict:
    return {"type": "http.disconnect"}


def test_the_works_error_comes_out_as_itself() -> None:
    """A decode replica that fails a complete (non-streamed) response is the GatewayError's status (503), not an
    ExceptionGroup the app answers with a 500."""

    async def failing() -> str:
        raise GatewayError(Kind.UNAVAILABLE, "The decode replica sent nothing for 60 s.")

    with pytest.raises(GatewayError) as raised:
        anyio.run(cancel_on_disconnect, _connected, failing())
    assert raised.value.kind.status == 503


def test_result_and_disconnect() -> None:
    async def answer() -> str:
        return "done"

    async def slow() -> str:
        await anyio.sleep_forever()
        return "never"

    assert anyio.run(cancel_on_disconnect, _connected, answer()) == "done"
    with pytest.raises(ClientDisconnect):
        anyio.run(cancel_on_disconnect, _gone, slow())
