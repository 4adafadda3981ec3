"""Anthropic Messages: the `message_start` … `message_stop` event stream and the `message` body.

In thinking mode the thinking block opens at once (it closes with a `signature_delta`, by default the
response id); then a text block and one `tool_use` block per call follow. A `ping` follows the first
`content_block_start`. Usage reports uncached prompt tokens as `input_tokens` and cached ones as
`cache_read_input_tokens`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from recipe import pyjson
from recipe.options import ConvertedRequest
from recipe.response.events import Event, Finish, Meta, Usage, encode
from recipe.response.writer import Writer

STOP_REASONS = {
    Finish.STOP: "end_turn",
    Finish.LENGTH: "max_tokens",
    Finish.CONTENT_FILTER: "refusal",
    Finish.TOOL_CALLS: "tool_use",
    Finish.STOP_SEQUENCE: "stop_sequence",
    Finish.END_OF_STREAM: "end_turn",
}
PING = Event("ping", b'{"type":"ping"}')
_BLOCK_DELTA = "content_block_delta"
_DELTA_FIELDS = {
    "thinking": (b"thinking_delta", b"thinking"),
    "text": (b"text_delta", b"text"),
    "tool_use": (b"input_json_delta", b"partial_json"),
}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "service_tier": "standard",
    }


def _tool_input(arguments: str) -> Any:
    """The decoded arguments of a call (`{}` when they are not a complete JSON object)."""
    try:
        value = pyjson.loads(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesWriter(Writer):
    def __init__(self, request: ConvertedRequest, meta: Meta, *, stream: bool, signature: str | None = None) -> None:
        super().__init__(request, meta, stream=stream)
        self.signature = meta.id if signature is None else signature
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_type: str | None = None  # the open block's type, checked on every delta
        self.parts: list[str] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._delta_head = b""

    def _event(self, kind: str, fields: dict[str, Any]) -> Event:
        return Event(kind, encode({"type": kind, **fields}))

    def _delta(self, kind: bytes, field: bytes, text: str) -> Event:
        index = str(len(self.blocks) - 1).encode()
        return Event(
            "content_block_delta",
            b'{"type":"content_block_delta","index":' + index + b',"delta":{"type":"' + kind + b'","' + field
            + b'":' + encode(text) + b"}}",
        )  # fmt: skip

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.open, self.open_type = block, block["type"]
        self.parts = []
        self.blocks.append(block)
        kind, field = _DELTA_FIELDS[block["type"]]
        index = str(len(self.blocks) - 1).encode()
        self._delta_head = (
            b'{"type":"content_block_delta","index":' + index + b',"delta":{"type":"' + kind + b'","' + field + b'":'
        )
        if not self.stream:
            return events
        start = {"index": len(self.blocks) - 1, "content_block": block}
        events.append(self._event("content_block_start", start))
        if len(self.blocks) == 1:
            events.append(PING)
        return events

    def _close(self) -> list[Event]:
        block, self.open, self.open_type = self.open, None, None
        if block is None:
            return []
        text = "".join(self.parts)
        index = len(self.blocks) - 1
        events = []
        if block["type"] == "thinking":
            self.blocks[index] = {"type": "thinking", "thinking": text, "signature": self.signature}
            if self.stream:
                events.append(self._delta(b"signature_delta", b"signature", self.signature))
        elif block["type"] == "text":
            self.blocks[index] = {"type": "text", "text": text}
        else:
            self.blocks[index] = {**block, "input": _tool_input(text)}
        if self.stream:
            events.append(Event("content_block_stop", b'{"type":"content_block_stop","index":%d}' % index))
        return events

    def start(self, usage: Usage) -> list[Event]:
        self.usage = usage
        events = []
        if self.stream:
            events.append(self._event("message_start", {"message": self._body(content=[])}))
        if self.thinking:
            events += self._open({"type": "thinking", "thinking": "", "signature": ""})
        return events

    # Text goes into the open block as a delta spliced onto its pre-encoded head (written out in each
    # method: one call less per streamed chunk).

    def reasoning(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        if self.open_type != "thinking":
            return self._open({"type": "thinking", "thinking": "", "signature": ""}) + self.reasoning(text)
        self.parts.append(text)
        return [Event(_BLOCK_DELTA, self._delta_head + encode(text) + b"}}")] if self.stream else []

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        if self.open_type != "text":
            return self._open({"type": "text", "text": ""}) + self.content(text)
        self.parts.append(text)
        return [Event(_BLOCK_DELTA, self._delta_head + encode(text) + b"}}")] if self.stream else []

    def tool_start(self, index: int, call_id: str, name: str) -> list[Event]:
        return self._open({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_args(self, fragment: str) -> list[Event]:
        self.parts.append(fragment)
        return [Event(_BLOCK_DELTA, self._delta_head + encode(fragment) + b"}}")] if self.stream else []

    def tool_end(self) -> list[Event]:
        return self._close()

    def finish(self, reason: Finish, stop_sequence: str | None, usage: Usage) -> list[Event]:
        self.usage = usage
        self.stop_reason = STOP_REASONS[reason]
        self.stop_sequence = stop_sequence if reason is Finish.STOP_SEQUENCE else None
        events = self._close()
        if self.stream:
            delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
            events.append(self._event("message_delta", {"delta": delta, "usage": usage_body(usage)}))
            events.append(self._event("message_stop", {}))
        return events

    def fail(self, message: str) -> list[Event]:
        return [self._event("error", {"error": {"type": "api_error", "message": message}})] if self.stream else []

    def _body(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "model": self.meta.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": usage_body(self.usage),
        }

    def response(self) -> dict[str, Any]:
        return self._body(self.blocks)
