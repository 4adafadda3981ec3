"""Protocol events as they go on the wire, and the pieces every API's writer shares."""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

encode = msgspec.json.encode
_decode = msgspec.json.decode

DONE = b"[DONE]"


class Event(msgspec.Struct, frozen=True, gc=False):
    """One server-sent event: `name` (the `event:` line; None for a bare `data:` event) and JSON `data`.

    Untracked by the garbage collector (it holds only a str and bytes): one per streamed chunk, made faster."""

    name: str | None
    data: bytes

    def sse(self) -> bytes:
        """The event framed for SSE."""
        if self.name is None:
            return b"data: " + self.data + b"\n\n"
        return b"event: " + self.name.encode() + b"\ndata: " + self.data + b"\n\n"

    def json(self) -> Any:
        """The decoded data (`None` for Chat's `[DONE]`)."""
        return None if self.data == DONE else _decode(self.data)


class Finish(enum.Enum):
    """Why generation ended, after parsing: the backend's reason, or what the output itself said."""

    STOP = "stop"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    TOOL_CALLS = "tool_calls"
    STOP_SEQUENCE = "stop_sequence"
    END_OF_STREAM = "end_of_stream"


class Usage(msgspec.Struct):
    """Token counts of one generation. `cached_tokens` are prompt tokens served from the prefix cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


class Meta(msgspec.Struct):
    """What every response of one request reports: id, creation time, model, backend fingerprint."""

    id: str
    model: str
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None


def logprob_entry(token: bytes, logprob: float, top: list[tuple[bytes, float]] | None) -> dict[str, Any]:
    """One OpenAI logprob object; a token that is not valid UTF-8 on its own is spelled as `\\xNN` bytes."""

    def spelled(raw: bytes) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" for b in raw)

    return {
        "token": spelled(token),
        "logprob": logprob,
        "bytes": list(token),
        "top_logprobs": [{"token": spelled(t), "logprob": lp, "bytes": list(t)} for t, lp in top or ()],
    }
