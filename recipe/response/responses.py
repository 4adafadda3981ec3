"""OpenAI Responses: the `response.*` event stream and the `response` object.

Output items come in order: a reasoning item, a message item, then one item per tool call. An item is
opened (`output_item.added`, with its content part) when its first output arrives and closed
(`*.done`, `output_item.done`) when the next one opens or the response ends. Every event carries a
`sequence_number`. Calls of the `apply_patch` custom tool are reported as `custom_tool_call` items with
the patch text as `input`; namespaced functions carry their `namespace`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from recipe.options import ConvertedRequest
from recipe.response.events import Event, Finish, Meta, Usage, encode
from recipe.response.writer import Writer

INCOMPLETE_REASONS = {Finish.LENGTH: "max_output_tokens", Finish.CONTENT_FILTER: "content_filter"}
_DELTAS = {
    "reasoning": "response.reasoning_text.delta",
    "message": "response.output_text.delta",
    "function_call": "response.function_call_arguments.delta",
}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # The SDK requires `cache_write_tokens`; how much of the prompt the cache stored is not known here.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Item:
    """An output item being written: its kind, ids and accumulated text."""

    __slots__ = (
        "call_id",
        "delta",
        "index",
        "item_id",
        "kind",
        "logprobs",
        "name",
        "namespace",
        "parts",
        "phase",
        "response",
    )

    def __init__(self, kind: str, prefix: str, response: str, index: int, call: tuple[str, str, str | None]) -> None:
        self.kind = kind
        self.response = response
        self.item_id = f"{prefix}_{response}_{index}"
        self.index = index
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.phase = "final_answer"
        self.call_id, self.name, self.namespace = call
        # The item's delta event around its text, pre-encoded: (name, head, tail up to the sequence number).
        kind_name = _DELTAS.get(kind, "")
        content_index = b'"content_index":0,' if kind in ("reasoning", "message") else b""
        logprobs = b',"logprobs":[]' if kind == "message" else b""
        self.delta = (
            kind_name,
            b'{"type":"' + kind_name.encode() + b'",' + content_index + b'"delta":',
            b',"item_id":"' + self.item_id.encode() + b'"' + logprobs + b',"output_index":' + str(index).encode()
            + b',"sequence_number":',
        )  # fmt: skip

    def body(self, status: str) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
            return {
                "type": "reasoning",
                "id": self.item_id,
                "status": status,
                "content": content,
                "summary": [],
                "encrypted_content": f"{self.response}-{self.index}",
            }
        if self.kind == "message":
            content = [self.part(text)] if status != "in_progress" else []
            return {
                "type": "message",
                "id": self.item_id,
                "status": status,
                "role": "assistant",
                "phase": self.phase if status != "in_progress" else "final_answer",
                "content": content,
            }
        if self.kind == "custom_tool_call":
            text = _patch_input(text) if status != "in_progress" else ""
            return {
                "type": "custom_tool_call",
                "id": self.item_id,
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "input": text,
            }
        body = {"type": "function_call", "id": self.item_id, "status": status, "call_id": self.call_id}
        body["name"] = self.name
        if self.namespace is not None:
            body["namespace"] = self.namespace
        body["arguments"] = text if status != "in_progress" else ""
        return body

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "annotations": [], "logprobs": self.logprobs, "text": text}


def _patch_input(arguments: str) -> str:
    """The `input` string of an apply_patch call's JSON arguments (the raw text if they do not parse)."""
    try:
        decoded = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    value = decoded.get("input") if isinstance(decoded, dict) else None
    return value if isinstance(value, str) else arguments


class ResponsesWriter(Writer):
    def __init__(self, request: ConvertedRequest, meta: Meta, *, stream: bool) -> None:
        super().__init__(request, meta, stream=stream)
        self.items: list[_Item] = []
        self.done: list[dict[str, Any]] = []
        self.open: _Item | None = None
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete: str | None = None
        self.error: dict[str, Any] | None = None
        self.completed_at: int | None = None

    # -- events ----------------------------------------------------------------------------------------

    def _event(self, kind: str, fields: dict[str, Any]) -> Event:
        body = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return Event(kind, encode(body))

    def _delta(self, item: _Item, text: str) -> Event:
        """The item's delta event, spliced from its pre-encoded pieces."""
        name, head, tail = item.delta
        sequence = self.sequence
        self.sequence = sequence + 1
        return Event(name, b"%b%b%b%d}" % (head, encode(text), tail, sequence))

    def _open(self, kind: str, prefix: str, call: tuple[str, str, str | None] = ("", "", None)) -> list[Event]:
        events = self._close("completed")
        index = len(self.items)
        item = _Item(kind, prefix, self.meta.id, index, call)
        self.items.append(item)
        self.open = item
        if not self.stream:
            return events
        events.append(
            self._event("response.output_item.added", {"item": item.body("in_progress"), "output_index": index})
        )
        if kind in ("reasoning", "message"):
            events.append(
                self._event(
                    "response.content_part.added",
                    {"content_index": 0, "item_id": item.item_id, "output_index": index, "part": item.part("")},
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        body = item.body(status)
        self.done.append(body)
        if not self.stream:
            return []
        text = "".join(item.parts)
        ids = {"item_id": item.item_id, "output_index": item.index}
        events = []
        if item.kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", {"content_index": 0, **ids, "text": text}))
        elif item.kind == "message":
            events.append(
                self._event(
                    "response.output_text.done", {"content_index": 0, **ids, "logprobs": item.logprobs, "text": text}
                )
            )
        elif item.kind == "custom_tool_call":
            events.append(self._event("response.custom_tool_call_input.delta", {"delta": body["input"], **ids}))
            events.append(self._event("response.custom_tool_call_input.done", {"input": body["input"], **ids}))
        else:
            events.append(self._event("response.function_call_arguments.done", {"arguments": text, **ids}))
        if item.kind in ("reasoning", "message"):
            events.append(
                self._event("response.content_part.done", {"content_index": 0, **ids, "part": item.part(text)})
            )
        events.append(self._event("response.output_item.done", {"item": body, "output_index": item.index}))
        return events

    # -- writer ----------------------------------------------------------------------------------------

    def start(self, usage: Usage) -> list[Event]:
        self.usage = usage
        if not self.stream:
            return []
        return [
            self._event("response.created", {"response": self.response()}),
            self._event("response.in_progress", {"response": self.response()}),
        ]

    def reasoning(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        item = self.open
        if item is None or item.kind != "reasoning":
            return self._open("reasoning", "rs") + self.reasoning(text, logprobs)
        item.parts.append(text)
        return [self._delta(item, text)] if self.stream else []

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        item = self.open
        if item is None or item.kind != "message":
            return self._open("message", "msg") + self.content(text, logprobs)
        item.parts.append(text)
        if not logprobs:
            return [self._delta(item, text)] if self.stream else []
        item.logprobs += logprobs
        if not self.stream:
            return []
        fields = {"content_index": 0, "delta": text, "item_id": item.item_id, "logprobs": logprobs}
        return [self._event("response.output_text.delta", {**fields, "output_index": item.index})]

    def tool_start(self, index: int, call_id: str, name: str) -> list[Event]:
        if self.open is not None and self.open.kind == "message":
            self.open.phase = "commentary"
        namespace = self.request.namespaces.get(name)
        call = (call_id, namespace[1], namespace[0]) if namespace else (call_id, name, None)
        if name in self.request.custom_tools:
            return self._open("custom_tool_call", "ctc", call)
        return self._open("function_call", "fc", call)

    def tool_args(self, fragment: str) -> list[Event]:
        item = self.open
        assert item is not None
        item.parts.append(fragment)
        if self.stream and item.kind == "function_call":
            return [self._delta(item, fragment)]
        return []

    def tool_end(self) -> list[Event]:
        # The call stays open until the next item or the end: a truncated response marks it incomplete.
        return []

    def finish(self, reason: Finish, stop_sequence: str | None, usage: Usage) -> list[Event]:
        self.usage = usage
        self.incomplete = INCOMPLETE_REASONS.get(reason)
        self.status = "incomplete" if self.incomplete else "completed"
        events = self._close(self.status)
        self.completed_at = int(time.time())
        if self.stream:
            events.append(self._event(f"response.{self.status}", {"response": self.response()}))
        return events

    def fail(self, message: str) -> list[Event]:
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        events = self._close("incomplete")
        if self.stream:
            events.append(self._event("response.failed", {"response": self.response()}))
        return events

    def response(self) -> dict[str, Any]:
        echo = self.request.echo or {}
        meta = self.meta
        return {
            "id": meta.id,
            "object": "response",
            "created_at": meta.created,
            "status": self.status,
            "background": False,
            "completed_at": self.completed_at,
            "content_filters": None,
            "error": self.error,
            "frequency_penalty": 0.0,
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "max_tool_calls": None,
            "model": meta.model,
            "moderation": None,
            "output": list(self.done),
            "parallel_tool_calls": True,
            "presence_penalty": 0.0,
            "previous_response_id": echo.get("previous_response_id"),
            "prompt_cache_key": None,
            "prompt_cache_retention": None,
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "safety_identifier": None,
            "service_tier": "default",
            "store": echo.get("store", False),
            "temperature": echo.get("temperature", 1.0),
            "text": echo.get("text", {"format": {"type": "text"}}),
            "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools", []),
            "top_logprobs": echo.get("top_logprobs", 0),
            "top_p": echo.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": usage_body(self.usage) if self.status != "in_progress" else None,
            "user": echo.get("user"),
            "metadata": {},
        }
