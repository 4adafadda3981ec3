"""The interface between the stream processor and an API's events and complete response."""

from __future__ import annotations

from typing import Any

from recipe.options import ConvertedRequest
from recipe.response.events import Event, Finish, Meta, Usage


class Writer:
    """Turns parsed output into one API's stream events (when `stream`) and its complete response.

    The processor calls `start` once, then `reasoning` / `content` / `tool_start` / `tool_args` /
    `tool_end` in output order, then `finish` (or `fail`); `response()` is the complete body.
    """

    def __init__(self, request: ConvertedRequest, meta: Meta, *, stream: bool) -> None:
        self.request = request
        self.meta = meta
        self.stream = stream
        self.thinking = request.parsing.thinking_stage is not None
        self.usage = Usage()

    def start(self, usage: Usage) -> list[Event]:
        raise NotImplementedError

    def reasoning(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        raise NotImplementedError

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        raise NotImplementedError

    def tool_start(self, index: int, call_id: str, name: str) -> list[Event]:
        raise NotImplementedError

    def tool_args(self, fragment: str) -> list[Event]:
        raise NotImplementedError

    def tool_end(self) -> list[Event]:
        raise NotImplementedError

    def finish(self, reason: Finish, stop_sequence: str | None, usage: Usage) -> list[Event]:
        raise NotImplementedError

    def fail(self, message: str) -> list[Event]:
        raise NotImplementedError

    def response(self) -> dict[str, Any]:
        raise NotImplementedError
