"""Responses that notice a client leaving at once, not at their next write, so the decode stream behind them is
stopped (and its sequence freed) while the model is still busy: a server-sent-event stream, and a watch for
complete responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """A text/event-stream response of pre-framed events; `on_close` runs once, however the stream ends."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], None], headers: Mapping[str, str] | None = None
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await _until_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        except OSError:
            pass  # the client went away during a write
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnect once the client left (and `work` was cancelled). An error of `work`
    itself is raised as it is — the task group would wrap it in an ExceptionGroup, which the app's error mapping
    (a GatewayError's status) would not recognise."""
    done: list[T] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await _until_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            done.append(await work)
        except Exception as error:
            failed.append(error)
        group.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not done:
        raise ClientDisconnect()
    return done[0]
