"""OpenAI Chat Completions: `chat.completion.chunk` events and the `chat.completion` body.

Deltas are spliced into a pre-encoded chunk prefix: the hot path encodes only the new text.
Reasoning travels in `reasoning_content` (DeepSeek's field) and its logprobs under
`logprobs.reasoning_content`. The stream ends with `data: [DONE]`.
"""

from __future__ import annotations

from typing import Any

from recipe.options import ConvertedRequest
from recipe.response.events import DONE, Event, Finish, Meta, Usage, encode
from recipe.response.writer import Writer

FINISH_REASONS = {
    Finish.STOP: "stop",
    Finish.LENGTH: "length",
    Finish.CONTENT_FILTER: "content_filter",
    Finish.TOOL_CALLS: "tool_calls",
    Finish.STOP_SEQUENCE: "stop",
    Finish.END_OF_STREAM: "stop",
}


def usage_body(usage: Usage, thinking: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if thinking:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    body["prompt_cache_hit_tokens"] = usage.cached_tokens
    body["prompt_cache_miss_tokens"] = usage.prompt_tokens - usage.cached_tokens
    return body


class ChatWriter(Writer):
    """One choice of a Chat Completions response (`index`); `final_usage=False` leaves the usage chunk and
    `[DONE]` to a multi-choice stream."""

    def __init__(
        self, request: ConvertedRequest, meta: Meta, *, stream: bool, index: int = 0, final_usage: bool = True
    ) -> None:
        super().__init__(request, meta, stream=stream)
        self.index = index
        self.final_usage = final_usage
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.calls: list[tuple[str, str, list[str]]] = []
        self.reasoning_logprobs: list[dict[str, Any]] = []
        self.content_logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self._head = self._tail = b""
        # Pre-encoded chunk pieces around a delta's text: the hot path only encodes the text.
        self._reasoning_head = self._content_head = self._reasoning_tail = self._content_tail = b""
        self._args_head = self._args_tail = b""  # around the open call's argument text
        self._args: list[str] = []  # the open call's argument pieces

    def chunk_head(self) -> bytes:
        meta = self.meta
        return (
            b'{"id":' + encode(meta.id) + b',"object":"chat.completion.chunk","created":' + str(meta.created).encode()
            + b',"model":' + encode(meta.model) + b',"system_fingerprint":' + encode(meta.system_fingerprint)
            + b',"choices":['
        )  # fmt: skip

    def _chunk(self, delta: bytes, logprobs: bytes = b"null", finish: bytes = b"null") -> Event:
        return Event(
            None,
            self._head + b'{"index":' + str(self.index).encode() + b',"delta":' + delta + b',"logprobs":' + logprobs
            + b',"finish_reason":' + finish + b"}]" + self._tail,
        )  # fmt: skip

    def start(self, usage: Usage) -> list[Event]:
        self.usage = usage
        if not self.stream:
            return []
        self._head = self.chunk_head()
        self._tail = b',"usage":null}' if self.request.include_usage else b"}"
        delta = self._head + b'{"index":' + str(self.index).encode() + b',"delta":'
        self._reasoning_head = delta + b'{"content":null,"reasoning_content":'
        self._content_head = delta + b'{"content":'
        tail = b',"logprobs":null,"finish_reason":null}]' + self._tail
        self._reasoning_tail = b"}" + tail
        self._content_tail = (b',"reasoning_content":null}' if self.thinking else b"}") + tail
        if self.thinking:
            return [self._chunk(b'{"role":"assistant","content":null,"reasoning_content":""}')]
        return [self._chunk(b'{"role":"assistant","content":""}')]

    def reasoning(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        self.reasoning_parts.append(text)
        if logprobs:
            self.reasoning_logprobs += logprobs
        if not self.stream:
            return []
        if not logprobs:
            return [Event(None, self._reasoning_head + encode(text) + self._reasoning_tail)]
        lp = encode({"reasoning_content": logprobs})
        return [self._chunk(b'{"content":null,"reasoning_content":' + encode(text) + b"}", lp)]

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        self.content_parts.append(text)
        if logprobs:
            self.content_logprobs += logprobs
        if not self.stream:
            return []
        if not logprobs:
            return [Event(None, self._content_head + encode(text) + self._content_tail)]
        lp = encode({"content": logprobs})
        if self.thinking:
            return [self._chunk(b'{"content":' + encode(text) + b',"reasoning_content":null}', lp)]
        return [self._chunk(b'{"content":' + encode(text) + b"}", lp)]

    def tool_start(self, index: int, call_id: str, name: str) -> list[Event]:
        self._args = []
        self.calls.append((call_id, name, self._args))
        if not self.stream:
            return []
        self._args_head = (
            self._head + b'{"index":' + str(self.index).encode() + b',"delta":{"tool_calls":[{"index":'
            + str(len(self.calls) - 1).encode() + b',"function":{"arguments":'
        )  # fmt: skip
        self._args_tail = b'}}]},"logprobs":null,"finish_reason":null}]' + self._tail
        call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        return [self._chunk(encode({"tool_calls": [call]}))]

    def tool_args(self, fragment: str) -> list[Event]:
        self._args.append(fragment)
        return [Event(None, self._args_head + encode(fragment) + self._args_tail)] if self.stream else []

    def tool_end(self) -> list[Event]:
        return []

    def finish(self, reason: Finish, stop_sequence: str | None, usage: Usage) -> list[Event]:
        self.finish_reason = FINISH_REASONS[reason]
        self.usage = usage
        if not self.stream:
            return []
        delta = b'{"content":"","reasoning_content":null}' if self.thinking else b'{"content":""}'
        event = self._chunk(delta, finish=encode(self.finish_reason))
        if not self.final_usage:
            return [event]
        usage_bytes = encode(usage_body(usage, self.thinking))
        event = Event(None, event.data[: -len(self._tail)] + b',"usage":' + usage_bytes + b"}")
        return [event, Event(None, DONE)]

    def fail(self, message: str) -> list[Event]:
        error = {"error": {"message": message, "type": "internal_error", "param": None, "code": None}}
        return [Event(None, encode(error)), Event(None, DONE)] if self.stream else []

    def choice(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content_parts)}
        if self.thinking:
            message["reasoning_content"] = "".join(self.reasoning_parts)
        if self.calls:
            message["tool_calls"] = [
                {"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": "".join(args)}}
                for i, (call_id, name, args) in enumerate(self.calls)
            ]
        logprobs = None
        if self.content_logprobs or self.reasoning_logprobs:
            logprobs = {}
            if self.content_logprobs:
                logprobs["content"] = self.content_logprobs
            if self.reasoning_logprobs:
                logprobs["reasoning_content"] = self.reasoning_logprobs
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def response(self) -> dict[str, Any]:
        meta = self.meta
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [self.choice()],
            "usage": usage_body(self.usage, self.thinking),
            "system_fingerprint": meta.system_fingerprint,
        }
