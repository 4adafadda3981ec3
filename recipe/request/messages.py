"""Anthropic Messages request → ConvertedRequest.

A user message's `tool_result` blocks (which come first) become tool results, its other blocks one user
message; an assistant message's thinking blocks become the turn's reasoning, text blocks its answer and
`tool_use` blocks (which come last) its tool calls.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from recipe.conversation import (
    Assistant,
    Content,
    Conversation,
    Image,
    Message,
    System,
    ToolCall,
    ToolResult,
    User,
)
from recipe.errors import RecipeError
from recipe.options import ConversionOptions, ConvertedRequest
from recipe.request import common
from recipe.request.chat import EFFORTS


class TextBlock(msgspec.Struct, tag="text", tag_field="type", gc=False):
    text: str


class ImageSource(msgspec.Struct, gc=False):
    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", gc=False):
    source: ImageSource


class DocumentSource(msgspec.Struct, gc=False):
    media_type: str | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type", gc=False):
    source: DocumentSource | None = None

    def placeholder(self) -> str:
        media_type = self.source.media_type if self.source is not None else None
        return f"[Unsupported document type: {media_type or 'unknown'}]"


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", gc=False):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type", gc=False):
    data: str = ""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", gc=False):
    id: str
    name: str
    input: Any


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", gc=False):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None


class ServerToolUseBlock(msgspec.Struct, tag="server_tool_use", tag_field="type", gc=False):
    pass


class WebSearchResultBlock(msgspec.Struct, tag="web_search_tool_result", tag_field="type", gc=False):
    pass


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolUseBlock
    | ToolResultBlock
    | ServerToolUseBlock
    | WebSearchResultBlock
)


class InputMessage(msgspec.Struct, gc=False):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDefinition(msgspec.Struct, gc=False):
    name: str
    description: str | None = None
    input_schema: Any = None
    type: str | None = None


class ToolChoice(msgspec.Struct, gc=False):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(msgspec.Struct, gc=False):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(msgspec.Struct, gc=False):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | int | None = None


class MessagesRequest(msgspec.Struct, gc=False):
    model: str
    messages: list[InputMessage]
    max_tokens: int | None = None
    system: str | list[TextBlock] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None


def _image(source: ImageSource, param: str) -> Image:
    if source.type == "file":
        raise RecipeError(
            f"{param}: file_id is not supported. Pass the image as a base64 data url instead.", param=param
        )
    if source.type == "url":
        return common.image(source.url or "", "auto", param)
    return common.image(f"data:{source.media_type or 'image/png'};base64,{source.data or ''}", "auto", param)


def _parts(blocks: list[Any], param: str) -> Content:
    parts: list[str | Image] = []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ImageBlock):
            parts.append(_image(block.source, f"{param}[{index}]"))
        elif isinstance(block, DocumentBlock):
            parts.append(block.placeholder())
        else:
            kind = block.__struct_config__.tag
            raise RecipeError(f"{param}.{index}: a `{kind}` block cannot appear here", param=f"{param}.{index}")
    if all(isinstance(part, str) for part in parts):
        return "\n\n".join(parts)  # type: ignore[arg-type]
    return parts


def _server_tool(block: Any, options: ConversionOptions, param: str) -> bool:
    """Whether `block` is a server-tool block to drop (rejected unless web search is set to "drop")."""
    if not isinstance(block, ServerToolUseBlock | WebSearchResultBlock):
        return False
    if options.messages_web_search == "reject":
        raise RecipeError(f"{param}: server tools are not supported", param=param)
    return True


def _user(message: InputMessage, index: int, options: ConversionOptions) -> list[Message]:
    param = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [User(message.content)]
    out: list[Message] = []
    rest: list[Any] = []
    for number, block in enumerate(message.content):
        if _server_tool(block, options, f"{param}.{number}"):
            continue
        if isinstance(block, ToolResultBlock):
            if rest:
                raise RecipeError(
                    f"{param}.{number}: `tool_result` blocks must come before any other content in a user message",
                    param=f"{param}.{number}",
                )
            content = block.content if isinstance(block.content, str) else _parts(block.content, param)
            out.append(ToolResult(content, block.tool_use_id))
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock | ToolUseBlock):
            raise RecipeError(f"{param}.{number}: a user message cannot hold this block", param=f"{param}.{number}")
        else:
            rest.append(block)
    # Each block is a user message of its own (V4 then joins only the non-empty ones).
    out += [User(_parts([block], param)) for block in rest]
    if not out:
        out.append(User(""))
    return out


def _assistant(message: InputMessage, index: int, options: ConversionOptions) -> Assistant:
    param = f"messages.{index}.content"
    if isinstance(message.content, str):
        return Assistant(message.content)
    turn = Assistant()
    texts: list[str] = []
    thoughts: list[str] = []
    for number, block in enumerate(message.content):
        if _server_tool(block, options, f"{param}.{number}") or isinstance(block, RedactedThinkingBlock):
            continue
        if isinstance(block, ToolUseBlock):
            turn.tool_calls.append(ToolCall(block.id, block.name, msgspec.json.encode(block.input).decode()))
            continue
        if turn.tool_calls:
            raise RecipeError(
                f"messages.{index}.{number}: `tool_use` ids were found without `tool_result` blocks immediately "
                "after. `tool_use` blocks must come last in an assistant message.",
                param=f"{param}.{number}",
            )
        if isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise RecipeError(f"{param}.{number}: an assistant message cannot hold this block", param=param)
    turn.content = "\n\n".join(text for text in texts if text)
    turn.reasoning = "\n\n".join(thought for thought in thoughts if thought) if thoughts else None
    return turn


def _check_tool_results(messages: list[Message]) -> None:
    pending: list[str] = []
    for index, message in enumerate(messages):
        if isinstance(message, ToolResult):
            if message.tool_call_id not in pending:
                raise RecipeError(
                    f"unexpected `tool_use_id` found in `tool_result` blocks: {message.tool_call_id}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
                    param=f"messages.{index}",
                )
            pending.remove(message.tool_call_id)
            continue
        if pending:
            raise RecipeError(
                f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(pending)}. "
                "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                param=f"messages.{index}",
            )
        if isinstance(message, Assistant):
            pending = [call.id for call in message.tool_calls]
    if pending:
        raise RecipeError(
            f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(pending)}. "
            "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
            param="messages",
        )


def convert(body: bytes | str | dict, options: ConversionOptions) -> ConvertedRequest:
    request = common.decode(body, MessagesRequest)
    version = options.model_version(request.model)
    messages: list[Message] = []
    if request.system is not None:
        system = request.system
        messages.append(System(system if isinstance(system, str) else "\n\n".join(b.text for b in system)))
    for index, message in enumerate(request.messages):
        if isinstance(message.content, list) and not message.content:
            raise RecipeError(f"messages.{index}: all messages must have non-empty content", param=f"messages.{index}")
        if message.role == "user":
            messages += _user(message, index, options)
        elif message.role == "assistant":
            messages.append(_assistant(message, index, options))
        else:
            content = message.content
            if not isinstance(content, str):
                content = _parts(content, f"messages.{index}.content")
            messages.append(System(content))
    if not request.messages:
        raise RecipeError("messages: at least one message is required", param="messages")
    _check_tool_results(messages)

    thinking = options.default_thinking
    if request.thinking is not None:
        thinking = request.thinking.type != "disabled"
    effort = request.output_config.effort if request.output_config else None
    if isinstance(effort, int) and not 1 <= effort <= 100:
        raise RecipeError("Invalid output_config.effort value, the valid range is [1, 100]", param="output_config")
    tools = []
    for index, declared in enumerate(request.tools or ()):
        if declared.type is not None and declared.type != "custom":
            if options.messages_web_search == "reject" or not declared.type.startswith("web_search"):
                raise RecipeError(f"tools[{index}]: server tools are not supported", param=f"tools[{index}]")
            continue
        tools.append(common.tool(declared.name, declared.description, declared.input_schema, None, f"tools[{index}]"))
    conversation = Conversation(
        messages,
        thinking=thinking,
        tools=common.unique_tools(tools),
        reasoning_effort=effort if isinstance(effort, int) else EFFORTS.get(effort or ""),
    )
    choice = request.tool_choice
    if choice is not None and choice.type == "tool":
        common.tool_choice_named(conversation, choice.name or "", "tool_choice.name")
    elif choice is not None and choice.type == "none":
        conversation.tool_choice = "none"
    common.check_conversation(conversation, options)

    if request.max_tokens is not None and request.max_tokens < 1:
        raise RecipeError("Invalid max_tokens value, the valid range of max_tokens is [1, ...]", param="max_tokens")
    bound = options.thinking_max_tokens if thinking else options.non_thinking_max_tokens
    max_tokens = None if request.max_tokens is None else min(request.max_tokens, bound)
    common.check_range(request.temperature, 0, 2, "temperature")
    common.check_range(request.top_p, 0, 1.0, "top_p", open_low=True)
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else None
    sampling = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": None if thinking else top_k,
        "max_tokens": max_tokens,
    }
    stops = common.stop_sequences(request.stop_sequences, "stop_sequences")
    converted = common.converted(
        "messages", request.model, version, conversation, sampling, stops=stops, stream=request.stream
    )
    constraint = converted.output_constraint
    if choice is not None and choice.type == "any" and constraint is not None and constraint.kind == "tool_call":
        # `any` renders as auto (as the reference does); the constraint still asks for a call
        converted.output_constraint = msgspec.structs.replace(constraint, kind="tool_call_required")
    return converted
