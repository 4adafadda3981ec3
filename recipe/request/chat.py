"""OpenAI Chat Completions request → ConvertedRequest."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from recipe.conversation import (
    Assistant,
    Content,
    Conversation,
    Image,
    LatestReminder,
    Message,
    ResponseFormat,
    System,
    ToolCall,
    ToolResult,
    User,
)
from recipe.errors import RecipeError
from recipe.options import ConversionOptions, ConvertedRequest
from recipe.request import common

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]
EFFORTS: dict[str, Any] = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "ultra": "max",
    "max": "max",
}


class TextPart(msgspec.Struct, tag="text", tag_field="type", gc=False):
    text: str


class ImageUrl(msgspec.Struct, gc=False):
    url: str
    detail: Literal["low", "high", "auto", "original"] = "auto"


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type", gc=False):
    image_url: ImageUrl


Parts = str | list[TextPart | ImagePart]


class SystemMessage(msgspec.Struct, tag="system", tag_field="role", gc=False):
    content: Parts


class DeveloperMessage(msgspec.Struct, tag="developer", tag_field="role", gc=False):
    content: Parts


class UserMessage(msgspec.Struct, tag="user", tag_field="role", gc=False):
    content: Parts


class Function(msgspec.Struct, gc=False):
    name: str
    arguments: str


class ChatToolCall(msgspec.Struct, gc=False):
    id: str
    function: Function
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct, tag="assistant", tag_field="role", gc=False):
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    prefix: bool = False


class ToolMessage(msgspec.Struct, tag="tool", tag_field="role", gc=False):
    content: Parts
    tool_call_id: str


class ReminderMessage(msgspec.Struct, tag="latest_reminder", tag_field="role", gc=False):
    content: str


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | ReminderMessage


class FunctionDefinition(msgspec.Struct, gc=False):
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, gc=False):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, gc=False):
    name: str


class NamedToolChoice(msgspec.Struct, gc=False):
    function: NamedFunction
    type: Literal["function"] = "function"


class Thinking(msgspec.Struct, gc=False):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JsonSchema(msgspec.Struct, gc=False):
    schema: Any
    name: str = ""
    description: str | None = None
    strict: bool | None = None


class ChatResponseFormat(msgspec.Struct, gc=False):
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchema | None = None
    regex: str | None = None


class StreamOptions(msgspec.Struct, gc=False):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, gc=False):
    model: str
    messages: list[ChatMessage]
    thinking: Thinking | None = None
    reasoning_effort: Effort | int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ChatResponseFormat | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def _parts(content: Parts, message: int) -> Content:
    if type(content) is str:
        return content
    parts: list[str | Image] = []
    for index, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
        else:
            param = f"messages[{message}].content[{index}]"
            parts.append(common.image(part.image_url.url, part.image_url.detail, param))
    if all(isinstance(part, str) for part in parts):
        return "\n\n".join(parts)  # type: ignore[arg-type]
    return parts


def _message(message: ChatMessage, index: int) -> Message:
    kind = type(message)
    if kind is UserMessage:
        return User(_parts(message.content, index))
    if kind is AssistantMessage:
        if message.tool_calls is not None and not message.tool_calls:
            raise RecipeError(
                f"Invalid 'messages[{index}].tool_calls': empty array. Expected an array with minimum length 1.",
                param=f"messages[{index}].tool_calls",
            )
        if message.content is None and not message.tool_calls:
            raise RecipeError(
                "Invalid assistant message: content or tool_calls must be set", param=f"messages[{index}].content"
            )
        content = message.content or ""
        if not isinstance(content, str):
            content = "\n\n".join(part.text for part in content)
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        return Assistant(content, message.reasoning_content, calls, message.prefix)
    if kind is ToolMessage:
        return ToolResult(_parts(message.content, index), message.tool_call_id)
    if kind is ReminderMessage:
        return LatestReminder(message.content)
    return System(_parts(message.content, index))


def _response_format(fmt: ChatResponseFormat | None) -> ResponseFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RecipeError("Missing 'response_format.json_schema'", param="response_format.json_schema")
        return ResponseFormat("json_schema", schema=fmt.json_schema.schema, strict=bool(fmt.json_schema.strict))
    if fmt.type == "regex":
        if fmt.regex is None:
            raise RecipeError("Missing 'response_format.regex'", param="response_format.regex")
        return ResponseFormat("regex", regex=fmt.regex)
    return ResponseFormat("json_object")


def convert(body: bytes | str | dict, options: ConversionOptions) -> ConvertedRequest:
    request = common.decode(body, ChatRequest)
    version = options.model_version(request.model)
    if not request.messages:
        raise RecipeError("Empty input messages", param="messages")
    messages = [_message(m, i) for i, m in enumerate(request.messages)]
    # Chat Completions drops empty system messages (deepseek-recipe does; they say nothing).
    messages = [m for m in messages if not (isinstance(m, System) and m.content == "")]
    common.check_prefix(messages)
    common.check_tool_results(messages)

    # An explicit thinking switch wins over `reasoning_effort: "none"`.
    effort = request.reasoning_effort
    if request.thinking is not None:
        thinking = request.thinking.type != "disabled"
    else:
        thinking = options.default_thinking and effort != "none"
    if isinstance(effort, int) and not 1 <= effort <= 100:
        raise RecipeError("Invalid reasoning_effort value, the valid range is [1, 100]", param="reasoning_effort")
    tools = [
        common.tool(t.function.name, t.function.description, t.function.parameters, t.function.strict, f"tools[{i}]")
        for i, t in enumerate(request.tools or ())
    ]
    conversation = Conversation(
        messages,
        thinking=thinking,
        tools=common.unique_tools(tools),
        reasoning_effort=effort if isinstance(effort, int) else EFFORTS.get(effort or ""),
        response_format=_response_format(request.response_format),
    )
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        common.tool_choice_named(conversation, choice.function.name, "tool_choice")
    elif choice is not None:
        conversation.tool_choice = choice
    common.check_conversation(conversation, options)

    max_tokens = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
    common.check_range(request.temperature, 0, 2, "temperature")
    common.check_range(request.top_p, 0, 1.0, "top_p", open_low=True)
    common.check_range(request.presence_penalty, -2, 2, "presence_penalty")
    common.check_range(request.frequency_penalty, -2, 2, "frequency_penalty")
    common.check_max_tokens(max_tokens, thinking, options, "max_tokens")
    common.check_seed(request.seed)
    n = 1 if request.n is None else request.n
    if not 1 <= n <= options.max_n:
        raise RecipeError(f"Invalid n value, the valid range of n is [1, {options.max_n}]", param="n")
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise RecipeError(
                "Invalid top_logprobs and logprobs value, logprobs must be set to true if top_logprobs is used.",
                param="top_logprobs",
            )
        common.check_range(request.top_logprobs, 0, 20, "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise RecipeError("stream_options should be set along with stream = true", param="stream_options")
    sampling = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "max_tokens": max_tokens,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "n": n,
        "logprobs": bool(request.logprobs),
        "top_logprobs": request.top_logprobs or 0,
    }
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return common.converted(
        "chat.completions",
        request.model,
        version,
        conversation,
        sampling,
        stops=common.stop_sequences(request.stop, "stop"),
        stream=request.stream,
        include_usage=include_usage,
    )
