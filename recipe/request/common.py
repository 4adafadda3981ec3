"""What the three request converters share: body decoding, value checks, tools, images, settings."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any, TypeVar

import msgspec

from recipe import pyjson
from recipe.conversation import Assistant, Conversation, Image, Message, Tool, ToolResult, User, text_of
from recipe.errors import Api, RecipeError
from recipe.options import (
    ConversionOptions,
    ConvertedRequest,
    OutputConstraint,
    ParsingOptions,
    Sampling,
    ThinkingStage,
)
from recipe.tokens import ModelVersion

T = TypeVar("T")

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_JSON_WORD = re.compile("json", re.IGNORECASE)
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)
MAX_STOP_SEQUENCES = 16


def decode(body: bytes | str | dict, schema: type[T]) -> T:
    """Decode and validate a request body against its API schema (a dict goes through JSON text, so it
    obeys the same rules: no NaN or infinities, string keys)."""
    if isinstance(body, dict):
        try:
            body = json.dumps(body, allow_nan=False)
        except (ValueError, TypeError) as error:
            raise RecipeError(f"Invalid JSON body: {error}", param=_json_fault(body)) from None
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as error:
        message = str(error)
        raise RecipeError(f"Invalid request: {message}", param=field_of(message)) from None
    except msgspec.DecodeError as error:
        raise RecipeError(f"Invalid JSON body: {error}") from None


def _json_fault(value: Any, path: str = "") -> str | None:
    """The path of the first value in `value` that JSON cannot hold (NaN, infinity, a non-string key...)."""
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            fault = inner if not isinstance(key, str) else _json_fault(item, inner)
            if fault:
                return fault
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            fault = _json_fault(item, f"{path}[{index}]")
            if fault:
                return fault
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return path
    return None if value is None or isinstance(value, str | int | float) else path


def field_of(message: str) -> str | None:
    """The request field a msgspec validation message is about (`messages[0].content`)."""
    path = _PATH.search(message)
    where = path.group(1) if path else ""
    missing = _MISSING.search(message)
    if missing:
        where = f"{where}.{missing.group(1)}" if where else missing.group(1)
    return where or None


def check_range(value: float | None, low: float, high: float, name: str, *, open_low: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (open_low and value == low):
        bounds = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise RecipeError(f"Invalid {name} value, the valid range of {name} is {bounds}", param=name)


def check_max_tokens(value: int | None, thinking: bool, options: ConversionOptions, name: str) -> None:
    bound = options.thinking_max_tokens if thinking else options.non_thinking_max_tokens
    if value is not None and not 1 <= value <= bound:
        raise RecipeError(f"Invalid {name} value, the valid range of {name} is [1, {bound}]", param=name)


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 2**63:
        raise RecipeError("Invalid seed value, the valid range of seed is [0, 2^63)", param="seed")


def stop_sequences(stop: str | list[str] | None, param: str) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RecipeError(f"Stop string array too long: {len(stops)}", param=param)
    for index, text in enumerate(stops):
        if not text:
            raise RecipeError(
                f"Invalid '{param}[{index}]': empty string. Expected a string with minimum length 1.",
                param=f"{param}[{index}]",
            )
    return tuple(stops)


def tool(name: str, description: str | None, parameters: Any, strict: bool | None, param: str) -> Tool:
    """A validated function tool (strict tools get the strict-mode form of their schema)."""
    if not name:
        raise RecipeError(f"Invalid '{param}.name': empty string.", param=f"{param}.name")
    if not _TOOL_NAME.fullmatch(name):
        raise RecipeError(
            f"Invalid '{param}.name': string does not match pattern. Expected a string that matches the "
            "pattern '^[a-zA-Z0-9_-]+$'.",
            param=f"{param}.name",
        )
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise RecipeError(f"Invalid schema for function '{name}': schema must be a JSON object.", param=param)
    elif parameters:
        kind = parameters.get("type")
        if kind != "object":
            got = "null" if kind is None else pyjson.dumps(kind)
            raise RecipeError(
                f"Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"', "
                f"got 'type: {got}'.",
                param=f"{param}.parameters",
            )
        if strict:
            parameters = strict_schema(parameters, f"{param}.parameters")
    return Tool(name, description, parameters, strict)


def unique_tools(tools: list[Tool]) -> list[Tool]:
    if len({t.name for t in tools}) != len(tools):
        raise RecipeError("Tool names must be unique.", param="tools")
    return tools


def strict_schema(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """The strict-mode form of a schema: every object closed, with every property required."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    if "type" in schema:
        out["type"] = schema["type"]
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object:
        properties = schema.get("properties", {})
        required = schema.get("required")
        if required is not None and sorted(required) != sorted(properties):
            raise RecipeError("Required properties must match all properties in the object", param=param)
        if schema.get("additionalProperties") not in (None, False):
            raise RecipeError("additionalProperties must be false for strict tools", param=param)
        out["properties"] = {key: strict_schema(value, f"{param}.{key}") for key, value in properties.items()}
        out["additionalProperties"] = False
        out["required"] = list(properties)
    for key, value in schema.items():
        if key in out or key == "required":
            continue
        if key == "items":
            out[key] = strict_schema(value, f"{param}.items")
        elif key in ("anyOf", "allOf", "oneOf") and isinstance(value, list):
            out[key] = [strict_schema(item, f"{param}.{key}") for item in value]
        elif key in ("$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: strict_schema(item, f"{param}.{key}.{name}") for name, item in value.items()}
        else:
            out[key] = value
    return out


def image(url: str, detail: str, param: str) -> Image:
    """A validated image: an http(s) URL or a `data:image/...;base64,` URL with valid base64."""
    if url.startswith(("http://", "https://")):
        return Image(url, detail)  # type: ignore[arg-type]
    data = _DATA_URL.fullmatch(url)
    if data is None:
        raise RecipeError(f"{param}: Unsupported image_url format", param=param)
    try:
        base64.b64decode(data.group(1), validate=True)
    except (binascii.Error, ValueError):
        raise RecipeError(f"{param}: Invalid base64 data", param=param) from None
    return Image(url, detail)  # type: ignore[arg-type]


def require_json_word(conversation: Conversation) -> None:
    """OpenAI's rule for `json_object`: the prompt must mention JSON."""
    for message in conversation.messages:
        text = message.content if isinstance(message, Assistant) else text_of(message.content)
        if _JSON_WORD.search(text):
            return
    raise RecipeError(
        "Prompt must contain the word 'json' in some form to use 'response_format' of type 'json_object'.",
        param="response_format",
    )


def check_reasoning_passed_back(messages: list[Message], options: ConversionOptions) -> None:
    """With `reasoning_content="reject"`: tool-call turns of the current turn must carry their reasoning."""
    if options.reasoning_content != "reject":
        return
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, User)), default=-1)
    for message in messages[last_user + 1 :]:
        if isinstance(message, Assistant) and message.tool_calls and message.reasoning is None:
            raise RecipeError(
                "The `reasoning_content` in the thinking mode must be passed back to the API.", param="messages"
            )


def sampling(
    version: ModelVersion,
    conversation: Conversation,
    *,
    temperature: float | None,
    top_p: float | None,
    **settings: Any,
) -> Sampling:
    """Sampling settings under DeepSeek's policy: thinking mode samples at temperature 1.0 and keeps top_p
    at 0.95 or above (V4-Pro with tools: exactly 0.95); outside thinking mode the request decides."""
    if conversation.thinking:
        temperature = 1.0
        if version is ModelVersion.V4:
            top_p = 0.95 if conversation.uses_tools else 1.0
        else:
            top_p = 1.0 if top_p is None else max(top_p, 0.95)
    return Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        **settings,
    )


def tool_choice_named(conversation: Conversation, name: str, param: str) -> None:
    """A named tool choice keeps only that tool and makes calling it required."""
    chosen = [t for t in conversation.tools if t.name == name]
    if not chosen:
        raise RecipeError(
            f"Invalid value for 'tool_choice': no function named '{name}' was specified in the 'tools' parameter.",
            param=param,
        )
    conversation.tools = chosen
    conversation.tool_choice = "required"


def check_conversation(conversation: Conversation, options: ConversionOptions) -> None:
    """The checks every API makes once its request is a Conversation."""
    if conversation.thinking and conversation.tool_choice == "required" and conversation.tools:
        raise RecipeError("Thinking mode does not support this tool_choice", param="tool_choice")
    fmt = conversation.response_format
    if fmt is not None and fmt.type == "json_object":
        require_json_word(conversation)
    if conversation.thinking:
        check_reasoning_passed_back(conversation.messages, options)


def converted(
    api: Api,
    model: str,
    version: ModelVersion,
    conversation: Conversation,
    sampling_settings: dict[str, Any],
    *,
    stops: tuple[str, ...] = (),
    stream: bool | None = False,
    **fields: Any,
) -> ConvertedRequest:
    """The ConvertedRequest of a conversation: sampling under DeepSeek's policy, parsing options and the
    output constraint follow from it; `fields` are the API's own (include_usage, echo, ...)."""
    return ConvertedRequest(
        api=api,
        model=model,
        version=version,
        conversation=conversation,
        sampling=sampling(version, conversation, **sampling_settings),
        parsing=parsing(conversation, stops),
        output_constraint=output_constraint(conversation),
        stream=bool(stream),
        **fields,
    )


def output_constraint(conversation: Conversation) -> OutputConstraint | None:
    """The constraint the backend may enforce: a required tool call, the response format, or any tool call."""
    if conversation.uses_tools:
        declared = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": t.strict,
                },
            }
            for t in conversation.tools
        ]
        kind = "tool_call_required" if conversation.tool_choice == "required" else "tool_call"
        if kind == "tool_call_required" or conversation.response_format is None:
            return OutputConstraint(kind, msgspec.json.encode(declared).decode())
    fmt = conversation.response_format
    if fmt is None:
        return None
    if fmt.type == "regex":
        return OutputConstraint("regex", fmt.regex or "")
    if fmt.type == "json_schema":
        return OutputConstraint("json", msgspec.json.encode(fmt.schema).decode(), strict=fmt.strict)
    return OutputConstraint("json", "")


def parsing(conversation: Conversation, stops: tuple[str, ...]) -> ParsingOptions:
    """How to read the output of a prompt rendered from `conversation`."""
    stage: ThinkingStage | None = None
    last = conversation.messages[-1] if conversation.messages else None
    if conversation.thinking:
        stage = "reasoning_start"
        if isinstance(last, Assistant) and last.prefix:
            stage = "content_continuation" if last.content else "reasoning_continuation"
    fmt = conversation.response_format
    return ParsingOptions(
        parse_tool_calls=conversation.uses_tools,
        starts_in_tool_calls=conversation.tool_choice == "required" and bool(conversation.tools),
        parse_json_output=fmt is not None and fmt.type == "json_object",
        thinking_stage=stage,
        stop_sequences=stops,
    )


def check_prefix(messages: list[Message]) -> None:
    """Only the last message may be a partial assistant answer."""
    for index, message in enumerate(messages):
        if isinstance(message, Assistant) and message.prefix and index != len(messages) - 1:
            raise RecipeError(
                "Invalid completion message: prefix set true with message which is not final message or message "
                "role is not assistant",
                param=f"messages[{index}].prefix",
            )


def check_tool_results(messages: list[Message]) -> None:
    """Every tool call is answered by the tool results right after it, and every result answers a call."""
    pending: list[str] = []
    for index, message in enumerate(messages):
        kind = type(message)
        if kind is ToolResult:
            if message.tool_call_id not in pending:
                raise RecipeError(
                    "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'",
                    param=f"messages[{index}]",
                )
            pending.remove(message.tool_call_id)
            continue
        if pending:
            raise RecipeError(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id', The following tool_call_ids did not have response messages: {', '.join(pending)}",
                param=f"messages[{index}]",
            )
        if kind is Assistant and message.tool_calls:  # type: ignore[union-attr]
            pending = [call.id for call in message.tool_calls]  # type: ignore[union-attr]
            if len(set(pending)) != len(pending):
                raise RecipeError(
                    f"Duplicate value for 'tool_call_id' in message[{index}]", param=f"messages[{index}].tool_calls"
                )
    if pending:
        raise RecipeError(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            "'tool_call_id'. (insufficient tool messages following tool_calls message)",
            param="messages",
        )
