"""OpenAI Responses request → ConvertedRequest.

Input items are grouped into turns: reasoning items, assistant messages and function calls that follow
each other form one assistant turn (a reasoning item after content or calls, or a message after calls,
starts the next one). Namespaced functions are declared to the model as `namespace::name`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import msgspec

from recipe.apply_patch import APPLY_PATCH_DESCRIPTION, APPLY_PATCH_PARAMETERS
from recipe.conversation import (
    Assistant,
    Content,
    Conversation,
    Image,
    Message,
    ResponseFormat,
    System,
    Tool,
    ToolCall,
    ToolResult,
    User,
    text_of,
)
from recipe.errors import RecipeError
from recipe.options import ConversionOptions, ConvertedRequest
from recipe.request import common
from recipe.request.chat import EFFORTS, Effort
from recipe.tokens import ModelVersion

UNSUPPORTED_DOCUMENT = "[Unsupported Document]"
COMPACTION_PREFIX = "v41c1:"  # the encoding of a compaction item's `encrypted_content`: this, then base64 UTF-8
COMPACTION_LEAD = "A summary of the conversation so far, which replaces its earlier turns:\n\n"
WEB_SEARCH_TYPES = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")


class InputText(msgspec.Struct, tag="input_text", tag_field="type", gc=False):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", gc=False):
    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", gc=False):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] = "auto"


class InputFile(msgspec.Struct, tag="input_file", tag_field="type", gc=False):
    pass


Part = InputText | OutputText | InputImage | InputFile


class MessageItem(msgspec.Struct, gc=False):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class ReasoningText(msgspec.Struct, gc=False):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, gc=False):
    content: list[ReasoningText] | None = None


class FunctionCallItem(msgspec.Struct, gc=False):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class CustomToolCallItem(msgspec.Struct, gc=False):
    call_id: str
    name: str
    input: str


class CompactionItem(msgspec.Struct, gc=False):
    encrypted_content: str


class OutputItem(msgspec.Struct, gc=False):
    call_id: str
    output: str | list[Part]


class FunctionTool(msgspec.Struct, gc=False):
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, gc=False):
    name: str
    tools: list[FunctionTool]
    description: str | None = None


class CustomTool(msgspec.Struct, gc=False):
    name: str


class Reasoning(msgspec.Struct, gc=False):
    effort: Effort | int | None = None
    summary: str | None = None


class TextFormat(msgspec.Struct, omit_defaults=True, gc=False):
    type: Literal["text", "json_object", "json_schema"]
    schema: Any = None
    name: str | None = None
    strict: bool | None = None


class Text(msgspec.Struct, gc=False):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class NamedToolChoice(msgspec.Struct, gc=False):
    type: Literal["function", "custom"]
    name: str


class ResponsesRequest(msgspec.Struct, gc=False):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    reasoning: Reasoning | None = None
    text: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None


def _item(item: dict[str, Any], schema: type[Any], param: str) -> Any:
    try:
        return msgspec.convert(item, schema)
    except msgspec.ValidationError as error:
        field = common.field_of(str(error))
        raise RecipeError(f"Invalid '{param}': {error}", param=f"{param}.{field}" if field else param) from None


def _parts(content: str | list[Part], param: str) -> Content:
    if isinstance(content, str):
        return content
    parts: list[str | Image] = []
    for index, part in enumerate(content):
        if isinstance(part, InputText | OutputText):
            parts.append(part.text)
        elif isinstance(part, InputFile):
            parts.append(UNSUPPORTED_DOCUMENT)
        elif part.image_url is None:
            raise RecipeError(
                f"{param}[{index}]: file_id is not supported. Pass the image as a base64 data url instead.",
                param=f"{param}[{index}]",
            )
        else:
            parts.append(common.image(part.image_url, part.detail, f"{param}[{index}]"))
    if all(isinstance(part, str) for part in parts):
        return "\n\n".join(parts)  # type: ignore[arg-type]
    return parts


class _Turns:
    """Builds the message list, folding consecutive assistant-side items into one Assistant turn."""

    def __init__(self, version: ModelVersion) -> None:
        self.version = version
        self.messages: list[Message] = []
        self.turn: Assistant | None = None

    def close(self) -> None:
        self.turn = None

    def assistant(self, *, new_if: bool) -> Assistant:
        if self.turn is None or new_if:
            self.turn = Assistant()
            self.messages.append(self.turn)
        return self.turn

    def add(self, item: dict[str, Any], index: int) -> None:
        kind = item.get("type", "message")
        param = f"input[{index}]"
        if kind == "message":
            message = _item(item, MessageItem, param)
            if message.role == "assistant":
                turn = self.assistant(new_if=self.turn is not None and bool(self.turn.tool_calls))
                text = text_of(_parts(message.content, f"{param}.content"))
                if text:
                    turn.content = f"{turn.content}\n\n{text}" if turn.content else text
                return
            self.close()
            content = _parts(message.content, f"{param}.content")
            # deepseek-recipe reads a developer message as a system message for V4.1, a user one for V4.
            as_user = message.role == "user" or (message.role == "developer" and self.version is ModelVersion.V4)
            self.messages.append(User(content) if as_user else System(content))
        elif kind == "reasoning":
            reasoning = _item(item, ReasoningItem, param)
            text = "\n".join(part.text for part in reasoning.content or ())
            if not text and self.turn is not None:
                return  # an empty reasoning item neither starts a turn nor adds to one
            turn = self.assistant(new_if=self.turn is not None and bool(self.turn.content or self.turn.tool_calls))
            # joined as deepseek-recipe joins them: after a turn's reasoning so far, unless that is still empty
            turn.reasoning = f"{turn.reasoning}\n{text}" if turn.reasoning else text
        elif kind == "function_call":
            call = _item(item, FunctionCallItem, param)
            name = namespaced(call.namespace, call.name, self.version) if call.namespace else call.name
            self.assistant(new_if=False).tool_calls.append(ToolCall(call.call_id, name, call.arguments))
        elif kind == "custom_tool_call":
            custom = _item(item, CustomToolCallItem, param)
            arguments = msgspec.json.encode({"input": custom.input}).decode()
            self.assistant(new_if=False).tool_calls.append(ToolCall(custom.call_id, custom.name, arguments))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self.close()
            output = _item(item, OutputItem, param)
            self.messages.append(ToolResult(_parts(output.output, f"{param}.output"), output.call_id))
        elif kind == "compaction":
            self.close()
            compaction = _item(item, CompactionItem, param)
            self.messages.append(User(COMPACTION_LEAD + compaction_summary(compaction.encrypted_content, param)))
        elif kind != "item_reference":
            raise RecipeError(f"Unsupported input item type '{kind}'", param=f"{param}.type")


def compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    """The compaction item of a conversation summarised as `summary` (`/v1/responses/compact`): its content is
    not encrypted, only encoded, so any replica, and the recipe itself, can read it back."""
    content = COMPACTION_PREFIX + base64.b64encode(summary.encode()).decode()
    return {"type": "compaction", "id": item_id, "encrypted_content": content}


def compaction_summary(content: str, param: str) -> str:
    """The summary a compaction item's `encrypted_content` carries; a 400 for content another server made."""
    try:
        if content.startswith(COMPACTION_PREFIX):
            return base64.b64decode(content.removeprefix(COMPACTION_PREFIX), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        pass
    raise RecipeError(
        f"{param}.encrypted_content: not a compaction item of this server", param=f"{param}.encrypted_content"
    )


def _check_outputs(messages: list[Message]) -> None:
    """Every function call is answered right after its turn, and every output answers a call."""
    pending: list[str] = []
    for message in messages:
        if isinstance(message, ToolResult):
            if message.tool_call_id not in pending:
                raise RecipeError(
                    f"No tool call found for tool output with call_id {message.tool_call_id}.", param="input"
                )
            pending.remove(message.tool_call_id)
            continue
        if pending:
            raise RecipeError(f"No tool output found for tool call {pending[0]}.", param="input")
        if isinstance(message, Assistant):
            pending = [call.id for call in message.tool_calls]
    if pending:
        raise RecipeError(f"No tool output found for tool call {pending[0]}.", param="input")


class _Tools(msgspec.Struct, gc=False):
    tools: list[Tool] = msgspec.field(default_factory=list)
    echo: list[dict[str, Any]] = msgspec.field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = msgspec.field(default_factory=dict)
    custom: set[str] = msgspec.field(default_factory=set)


def _function_echo(function: FunctionTool) -> dict[str, Any]:
    return {
        "type": "function",
        "name": function.name,
        "description": function.description,
        "parameters": function.parameters,
        "strict": function.strict,
    }


def namespaced(namespace: str, name: str, version: ModelVersion) -> str:
    """The name a namespaced function has in the prompt (`ns::f` for V4.1, `ns__f` for V4)."""
    return f"{namespace}{'::' if version is ModelVersion.V41 else '__'}{name}"


def _tools(declared: list[dict[str, Any]], options: ConversionOptions, version: ModelVersion) -> _Tools:
    out = _Tools()
    for index, entry in enumerate(declared):
        kind, param = entry.get("type"), f"tools[{index}]"
        if kind == "function":
            function = _item(entry, FunctionTool, param)
            out.tools.append(common.tool(*msgspec.structs.astuple(function), param))
            out.echo.append(_function_echo(function))
        elif kind == "namespace":
            namespace = _item(entry, NamespaceTool, param)
            for function in namespace.tools:
                name = namespaced(namespace.name, function.name, version)
                description = function.description or ""
                if namespace.description and version is ModelVersion.V41:
                    description = f"{namespace.description}\n{description}"
                inner = common.tool(function.name, description, function.parameters, function.strict, param)
                out.tools.append(Tool(name, inner.description, inner.parameters, inner.strict))
                out.namespaces[name] = (namespace.name, function.name)
            out.echo.append(
                {
                    "type": "namespace",
                    "name": namespace.name,
                    "description": namespace.description,
                    "tools": [_function_echo(f) for f in namespace.tools],
                }
            )
        elif kind == "custom":
            custom = _item(entry, CustomTool, param)
            if custom.name != "apply_patch":
                raise RecipeError(
                    f"Unsupported custom tool: '{custom.name}'. Only 'apply_patch' is supported.", param=param
                )
            out.tools.append(Tool("apply_patch", APPLY_PATCH_DESCRIPTION, APPLY_PATCH_PARAMETERS))
            out.custom.add("apply_patch")
            out.echo.append({"type": "custom", "name": "apply_patch"})
        elif kind in WEB_SEARCH_TYPES:
            if options.responses_web_search == "reject":
                raise RecipeError(f"{param}: web search is not supported", param=param)
            out.echo.append({"type": kind, "search_context_size": None, "user_location": None})
        else:
            raise RecipeError(f"{param}: unsupported tool type '{kind}'", param=f"{param}.type")
    return out


def _text_echo(fmt: TextFormat | None, verbosity: str | None) -> dict[str, Any]:
    """The response's `text`: the format asked for (plain text by default) and the verbosity, absent unless asked
    (the schema allows `low`, `medium` or `high`, never null)."""
    text: dict[str, Any] = {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}}
    if verbosity is not None:
        text["verbosity"] = verbosity
    return text


def convert(body: bytes | str | dict, options: ConversionOptions) -> ConvertedRequest:
    request = common.decode(body, ResponsesRequest)
    version = options.model_version(request.model)
    if request.previous_response_id is not None and options.responses_chain == "reject":
        raise RecipeError(
            "previous_response_id is not supported: responses are not stored; send the whole conversation in 'input'",
            param="previous_response_id",
        )
    if not request.input and request.instructions is None:
        raise RecipeError("Either input or instructions must be provided", param="input")
    turns = _Turns(version)
    if request.instructions:
        turns.messages.append(System(request.instructions))
    if isinstance(request.input, str):
        turns.messages.append(User(request.input))
    else:
        for index, item in enumerate(request.input or ()):
            turns.add(item, index)
    messages = turns.messages
    _check_outputs(messages)

    effort = request.reasoning.effort if request.reasoning else None
    # Responses has no thinking switch of its own: an effort turns thinking on, "none" turns it off.
    thinking = options.default_thinking if effort is None else effort != "none"
    if isinstance(effort, int) and not 1 <= effort <= 100:
        raise RecipeError("Invalid reasoning.effort value, the valid range is [1, 100]", param="reasoning.effort")
    tools = _tools(request.tools or [], options, version)
    fmt = request.text.format if request.text else None
    response_format = None
    if fmt is not None and fmt.type == "json_object":
        response_format = ResponseFormat("json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema is None:
            raise RecipeError("Missing 'text.format.schema'", param="text.format.schema")
        response_format = ResponseFormat("json_schema", schema=fmt.schema, strict=bool(fmt.strict))
    conversation = Conversation(
        messages,
        thinking=thinking,
        tools=common.unique_tools(tools.tools),
        reasoning_effort=effort if isinstance(effort, int) else EFFORTS.get(effort or ""),
        response_format=response_format,
    )
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        common.tool_choice_named(conversation, choice.name, "tool_choice")
    elif choice is not None:
        conversation.tool_choice = choice
    common.check_conversation(conversation, options)

    common.check_range(request.temperature, 0, 2, "temperature")
    common.check_range(request.top_p, 0, 1.0, "top_p", open_low=True)
    common.check_max_tokens(request.max_output_tokens, thinking, options, "max_output_tokens")
    common.check_range(request.top_logprobs, 0, 20, "top_logprobs")
    echo = {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "reasoning": {
            "effort": effort,
            "summary": request.reasoning.summary if request.reasoning else None,
        },
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": _text_echo(fmt, request.text.verbosity if request.text else None),
        "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
        "tools": tools.echo,
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "user": request.user,
        "store": request.store is not False,
        "previous_response_id": request.previous_response_id,
    }
    sampling = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "logprobs": bool(request.top_logprobs),
        "top_logprobs": request.top_logprobs or 0,
    }
    return common.converted(
        "responses",
        request.model,
        version,
        conversation,
        sampling,
        stream=request.stream,
        echo=echo,
        namespaces=tools.namespaces,
        custom_tools=frozenset(tools.custom),
    )
