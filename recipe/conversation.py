"""The neutral Conversation: what every API request becomes and what the prompt renderer reads.

Messages are a tagged union on `role`, so a Conversation is plain JSON with msgspec (the training
package stores them that way). Content is a string, or a list of text and `Image` parts when a
message carries images: each image becomes one placeholder token at its position in the prompt.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ReasoningEffort = Literal["low", "high", "xhigh", "max"]
ToolChoice = Literal["auto", "none", "required"]


class Image(msgspec.Struct, frozen=True, gc=False):
    """An image given by URL (http(s) or a `data:` URL with base64 bytes)."""

    url: str
    detail: Literal["low", "high", "auto", "original"] = "auto"


Content = str | list[str | Image]


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """A tool call of an assistant turn; `arguments` is the JSON object text as the client sent it."""

    id: str
    name: str
    arguments: str


class System(msgspec.Struct, tag="system", tag_field="role", gc=False):
    content: Content


class User(msgspec.Struct, tag="user", tag_field="role", gc=False):
    content: Content


class Assistant(msgspec.Struct, tag="assistant", tag_field="role", gc=False):
    """An assistant turn. `prefix` marks the last message as a partial answer the model continues."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    prefix: bool = False


class ToolResult(msgspec.Struct, tag="tool", tag_field="role", gc=False):
    content: Content
    tool_call_id: str = ""


class LatestReminder(msgspec.Struct, tag="latest_reminder", tag_field="role", gc=False):
    content: str


Message = System | User | Assistant | ToolResult | LatestReminder


class Tool(msgspec.Struct, frozen=True, gc=False):
    """A function the model may call. `parameters` is its JSON Schema (an object schema, or `{}`)."""

    name: str
    description: str | None = None
    parameters: Any = msgspec.field(default_factory=dict)
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, gc=False):
    """A requested answer format: any JSON object, JSON matching `schema`, or text matching `regex`. `strict`: the
    schema's objects admit no property it does not name (OpenAI's strict structured outputs)."""

    type: Literal["json_object", "json_schema", "regex"]
    schema: Any = None
    regex: str | None = None
    strict: bool = False


class Conversation(msgspec.Struct, gc=False):
    """A conversation and its prompt settings.

    `reasoning_effort` is a level name or an integer 1..100 (V4.1 renders the number; `None` means high).
    """

    messages: list[Message]
    thinking: bool = True
    tools: list[Tool] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    reasoning_effort: ReasoningEffort | int | None = None
    response_format: ResponseFormat | None = None

    @property
    def uses_tools(self) -> bool:
        """Whether the prompt declares tools (and so whether the output may hold DSML tool calls)."""
        return bool(self.tools) and self.tool_choice != "none"


def text_of(content: Content) -> str:
    """The text parts of `content`, joined as the prompt joins them (images left out)."""
    if isinstance(content, str):
        return content
    return "\n\n".join(part for part in content if isinstance(part, str))
