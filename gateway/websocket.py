"""The Responses API over a WebSocket at `/v1/responses` (Open Responses 2026-04-24, "WebSocket Transport").

A client sends `{"type": "response.create", ...}` (the create body without `stream`, `stream_options` or
`background`) and receives the same events a streamed HTTP response carries, as text frames; responses run one at
a time per connection, in the order asked. The connection remembers its latest turn, stored or not, so a
`store: false` conversation continues by `previous_response_id` on the same socket; a stored one continues from
the store on any socket. A continuation that fails (an error before the response, or `response.failed`) forgets
the turn it named. Failures are `{"type": "error", "status", "error": {"type", "code", "message", "param"}}`; the
connection stays open, except after `websocket_max_s` (`websocket_connection_limit_reached`) or a refused key.
Auth, size limits and admission are the HTTP path's (the same `Gateway.open`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from gateway.affinity import session_of
from gateway.errors import GatewayError, Kind
from gateway.response_store import Turn
from gateway.service import Gateway, presented_key, request_id
from mesh.logging import get_logger

POLICY_VIOLATION = 1008
TRANSPORT_FIELDS = ("stream", "stream_options", "background")

log = get_logger("gateway")


def error_event(error: GatewayError) -> str:
    """The WebSocket error envelope of a GatewayError (`code` is the error type when there is no finer one)."""
    body = error.body("responses")["error"]
    body["code"] = body["code"] or body["type"]
    return msgspec.json.encode({"type": "error", "status": error.kind.status, "error": body}).decode()


def create_body(message: str) -> tuple[bytes, str | None]:
    """The HTTP create body of a `response.create` message (streamed) and the previous response it names; 400 for
    another message type or an HTTP transport field."""
    try:
        event = msgspec.json.decode(message)
    except msgspec.DecodeError as exc:
        raise GatewayError(Kind.BAD_REQUEST, f"Invalid JSON message: {exc}") from None
    if not isinstance(event, dict) or event.get("type") != "response.create":
        kind = event.get("type") if isinstance(event, dict) else None
        why = f"Unsupported message type {kind!r}: send 'response.create'."
        raise GatewayError(Kind.BAD_REQUEST, why, param="type")
    for field in TRANSPORT_FIELDS:
        if field in event:
            raise GatewayError(Kind.BAD_REQUEST, f"'{field}' is not allowed on a WebSocket.", param=field)
    body: dict[str, Any] = {key: value for key, value in event.items() if key != "type"}
    previous = body.get("previous_response_id")
    return msgspec.json.encode({**body, "stream": True}), previous if isinstance(previous, str) else None


class ResponsesSocket:
    """One Responses WebSocket connection: authorised once, then its `response.create` messages in turn."""

    def __init__(self, gateway: Gateway, socket: WebSocket, max_s: float) -> None:
        self.gateway = gateway
        self.socket = socket
        self.key = presented_key(socket.headers)
        self.session = session_of(socket.headers)
        self.closes_at = time.monotonic() + max_s
        self.latest: dict[str, Turn] = {}

    async def serve(self) -> None:
        await self.socket.accept()
        try:
            self.gateway.authorize(self.key)
        except GatewayError as error:
            await self.socket.send_text(error_event(error))
            await self.socket.close(POLICY_VIOLATION)
            return
        while True:
            try:
                async with asyncio.timeout(self.closes_at - time.monotonic()):
                    message = await self.socket.receive_text()
            except TimeoutError:
                await self._limit_reached()
                return
            except WebSocketDisconnect:
                return
            try:
                await self.turn(message)
            except (WebSocketDisconnect, OSError):  # gone mid-response: closing the reply stopped its decode
                return

    async def turn(self, message: str) -> None:
        """One response: its events, or an error envelope; a failed continuation forgets its previous turn."""
        rid = request_id(None)
        previous = None
        try:
            body, previous = await self.gateway.workers.run(len(message), create_body, message)
            reply, ticket = await self.gateway.open(
                "responses", body, api_key=self.key, request_id=rid, session=self.session, local=self.latest
            )
        except GatewayError as error:
            self._forget(previous)
            await self.socket.send_text(error_event(error))
            return
        failed = False
        try:
            async for event in reply.events():
                failed = failed or event.name == "response.failed"
                await self.socket.send_text(event.data.decode())
        finally:
            self.gateway.close(reply, ticket)
        if failed:
            self._forget(previous)

    def _forget(self, previous: str | None) -> None:
        if previous is not None and self.latest.pop(previous, None) is not None:
            log.info("websocket_turn_forgotten", previous=previous)

    async def _limit_reached(self) -> None:
        error = GatewayError(
            Kind.BAD_REQUEST,
            "The WebSocket connection reached its time limit; open a new one.",
            code="websocket_connection_limit_reached",
        )
        if self.socket.client_state is WebSocketState.CONNECTED:
            await self.socket.send_text(error_event(error))
            await self.socket.close()
