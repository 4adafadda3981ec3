"""Hypothesis strategies: random conversations in the three request formats, and random model outputs."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"
ALPHABET = st.characters(
    codec="utf-8",
    categories=("L", "N", "P", "S", "Zs"),
    include_characters="\n\t<>/\"'{}[]｜▁日本😀é",
)
TRICKY = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "</think>",
    "<think>",
    "<｜DSML｜ calls>",
    "｜DSML｜",
    "<tool_result>",
    "<｜end▁of▁sentence｜>",
    "<｜deepseek_image｜>",
    "\n\n",
    "json",
    "日本語",
    "😀",
    " ",
    "1e-05",
]
text = st.lists(st.one_of(st.text(ALPHABET, max_size=12), st.sampled_from(TRICKY)), max_size=4).map("".join)
nonempty_text = text.filter(bool)
names = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(ALPHABET, max_size=6), inner, max_size=3),
    max_leaves=6,
)
IMAGE_URLS = st.sampled_from(
    ["https://example.com/cat.png", "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()]
)


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    properties = draw(
        st.dictionaries(
            names,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["string", "integer", "number", "boolean"])},
                optional={"description": text, "enum": st.lists(json_scalars, max_size=3), "default": json_scalars},
            ),
            max_size=3,
        )
    )
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if properties and draw(st.booleans()):
        schema["required"] = sorted(properties)[: draw(st.integers(0, len(properties)))]
    return schema


@st.composite
def tools(draw: st.DrawFn) -> list[dict[str, Any]]:
    tool_names = draw(st.lists(names, max_size=3, unique=True))
    return [{"name": name, "description": draw(st.none() | text), "parameters": draw(schemas())} for name in tool_names]


@st.composite
def arguments(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["not json", "[1, 2]", "", '"s"']))
    value = draw(st.dictionaries(st.text(ALPHABET, max_size=6), json_values, max_size=3))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from([(",", ":"), None])))


@st.composite
def turns(draw: st.DrawFn, *, images: bool = True, system_anywhere: bool = True) -> list[dict[str, Any]]:
    """A neutral conversation: system / user / assistant (with tool calls) / tool turns, ending on a user
    or tool turn. Tool results answer the preceding calls, in a random order."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "text": draw(text)})
    call_number = 0
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["user", "assistant", "system"] if system_anywhere else ["user", "assistant"]))
        if kind == "system":
            out.append({"role": "system", "text": draw(text)})
        elif kind == "user":
            out.append(draw(user_turn(images)))
        else:
            calls = []
            for _ in range(draw(st.integers(0, 2))):
                call_number += 1
                calls.append({"id": f"call{call_number}", "name": draw(names), "arguments": draw(arguments())})
            reasoning = draw(st.none() | text)
            out.append({"role": "assistant", "content": draw(text), "reasoning": reasoning, "calls": calls})
            if calls:
                for call in draw(st.permutations(calls)):
                    out.append({"role": "tool", "id": call["id"], "text": draw(text)})
    if not out or out[-1]["role"] not in ("user", "tool"):
        out.append(draw(user_turn(images)))
    return out


@st.composite
def user_turn(draw: st.DrawFn, images: bool) -> dict[str, Any]:
    parts = draw(st.lists(st.one_of(text, IMAGE_URLS.map(lambda u: {"image": u})) if images else text, max_size=3))
    if not parts or (all(isinstance(p, str) for p in parts) and draw(st.booleans())):
        return {"role": "user", "text": "".join(p for p in parts if isinstance(p, str))}
    return {"role": "user", "parts": parts}


def _chat_message(turn: dict[str, Any]) -> dict[str, Any]:
    if turn["role"] == "system":
        return {"role": "system", "content": turn["text"]}
    if turn["role"] == "tool":
        return {"role": "tool", "tool_call_id": turn["id"], "content": turn["text"]}
    if turn["role"] == "user":
        if "text" in turn:
            return {"role": "user", "content": turn["text"]}
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": p}
                if isinstance(p, str)
                else {"type": "image_url", "image_url": {"url": p["image"]}}
                for p in turn["parts"]
            ],
        }
    message: dict[str, Any] = {"role": "assistant", "content": turn["content"]}
    if turn["reasoning"] is not None:
        message["reasoning_content"] = turn["reasoning"]
    if turn["calls"]:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in turn["calls"]
        ]
    return message


@st.composite
def chat_requests(draw: st.DrawFn) -> dict[str, Any]:
    conversation = draw(turns())
    declared = draw(tools())
    body: dict[str, Any] = {
        "model": draw(st.sampled_from([V41, V4])),
        "messages": [_chat_message(t) for t in conversation],
    }
    thinking = draw(st.sampled_from([None, "enabled", "disabled"]))
    if thinking:
        body["thinking"] = {"type": thinking}
    effort = draw(st.sampled_from([None, "low", "medium", "high", "xhigh", "max", "minimal", "none"]))
    if effort:
        body["reasoning_effort"] = effort
    if declared:
        body["tools"] = [{"type": "function", "function": t} for t in declared]
        choices = ["auto", "none"]
        if thinking == "disabled" and effort != "none":
            choices += ["required", {"type": "function", "function": {"name": declared[0]["name"]}}]
        body["tool_choice"] = draw(st.sampled_from(choices))
    fmt = draw(st.sampled_from([None, "json_object", "json_schema"]))
    if fmt == "json_object":
        body["messages"].append({"role": "user", "content": "Reply in JSON."})
        body["response_format"] = {"type": "json_object"}
    elif fmt == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": draw(schemas())}}
    return body


def _responses_content(turn: dict[str, Any]) -> Any:
    if "text" in turn:
        return turn["text"]
    return [
        {"type": "input_text", "text": p} if isinstance(p, str) else {"type": "input_image", "image_url": p["image"]}
        for p in turn["parts"]
    ]


@st.composite
def responses_requests(draw: st.DrawFn) -> dict[str, Any]:
    conversation = draw(turns())
    items: list[dict[str, Any]] = []
    for turn in conversation:
        if turn["role"] == "system":
            items.append({"role": draw(st.sampled_from(["system", "developer"])), "content": turn["text"]})
        elif turn["role"] == "user":
            items.append({"role": "user", "content": _responses_content(turn)})
        elif turn["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": turn["id"], "output": turn["text"]})
        else:
            if turn["reasoning"] is not None:
                items.append(
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": turn["reasoning"]}],
                    }
                )
            if turn["content"] or not turn["calls"]:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": turn["content"]}],
                    }
                )
            for call in turn["calls"]:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["name"],
                        "arguments": call["arguments"],
                    }
                )
    body: dict[str, Any] = {"model": draw(st.sampled_from([V41, V4])), "input": items}
    if draw(st.booleans()):
        body["instructions"] = draw(text)
    effort = draw(st.sampled_from([None, "none", "minimal", "low", "medium", "high", "xhigh", "max"]))
    if effort:
        body["reasoning"] = {"effort": effort}
    declared = draw(tools())
    if declared:
        body["tools"] = [{"type": "function", **t} for t in declared]
        if draw(st.booleans()):
            body["tools"].append(
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": draw(text),
                    "tools": [{"type": "function", **declared[0]}],
                }
            )
        choices = ["auto", "none"]
        if effort == "none":
            choices += ["required", {"type": "function", "name": declared[0]["name"]}]
        body["tool_choice"] = draw(st.sampled_from(choices))
    if draw(st.booleans()):
        items.append({"role": "user", "content": "answer in json"})
        body["text"] = {"format": {"type": "json_object"}}
    return body


def _messages_blocks(turn: dict[str, Any]) -> Any:
    if "text" in turn:
        return turn["text"]
    return [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "image", "source": {"type": "url", "url": p["image"]}}
        for p in turn["parts"]
        if isinstance(p, str) or p["image"].startswith("http")
    ]


@st.composite
def messages_requests(draw: st.DrawFn) -> dict[str, Any]:
    conversation = draw(turns(system_anywhere=False))
    system = None
    if conversation[0]["role"] == "system":
        system = conversation.pop(0)["text"]
    messages: list[dict[str, Any]] = []
    for turn in conversation:
        if turn["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": turn["id"], "content": turn["text"]}
            if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                messages[-1]["content"].append(result)
            else:
                messages.append({"role": "user", "content": [result]})
        elif turn["role"] == "user":
            blocks = _messages_blocks(turn)
            previous = messages[-1] if messages else None
            if (
                previous
                and previous["role"] == "user"
                and isinstance(previous["content"], list)
                and previous["content"]
            ):
                previous["content"] += [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks
            else:
                messages.append({"role": "user", "content": blocks})
        else:
            blocks = []
            if turn["reasoning"] is not None:
                blocks.append({"type": "thinking", "thinking": turn["reasoning"], "signature": "sig"})
            if turn["content"]:
                blocks.append({"type": "text", "text": turn["content"]})
            for call in turn["calls"]:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["name"],
                        "input": draw(st.dictionaries(names, json_values, max_size=2)),
                    }
                )
            messages.append({"role": "assistant", "content": blocks or turn["content"]})
    body: dict[str, Any] = {"model": draw(st.sampled_from([V41, V4])), "max_tokens": 1000, "messages": messages}
    if system is not None:
        body["system"] = system
    thinking = draw(st.sampled_from([None, "enabled", "disabled"]))
    if thinking:
        body["thinking"] = {"type": thinking}
    effort = draw(st.sampled_from([None, "low", "medium", "high", "max"]))
    if effort:
        body["output_config"] = {"effort": effort}
    declared = draw(tools())
    if declared:
        body["tools"] = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in declared
        ]
        choices = [{"type": "auto"}, {"type": "any"}, {"type": "none"}]
        if thinking == "disabled":
            choices.append({"type": "tool", "name": declared[0]["name"]})
        body["tool_choice"] = draw(st.sampled_from(choices))
    return body


REQUESTS = {"chat.completions": chat_requests, "responses": responses_requests, "messages": messages_requests}


# -- model outputs --------------------------------------------------------------------------------------

# deepseek-recipe 0.2.0 drops what follows a space in a parameter name (`{"shipping: ...`) and copies
# names unescaped (a newline breaks the JSON); such names are checked in test_vectors.py instead.
PARAM_NAMES = st.one_of(names, st.sampled_from(["", "日本", "x=y", "q'"]))


@st.composite
def dsml_block(draw: st.DrawFn) -> str:
    v41 = draw(st.booleans())
    block, invoke, parameter = (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke", "parameter")
    calls = []
    for _ in range(draw(st.integers(1, 2))):
        params = []
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                value, flag = draw(text), "true"
            else:
                value, flag = json.dumps(draw(json_values), ensure_ascii=False), "false"
            name = draw(PARAM_NAMES)
            params.append(f'<｜DSML｜{parameter} name="{name}" string="{flag}">{value}</｜DSML｜{parameter}>')
        body = "\n".join(params)
        calls.append(f'<｜DSML｜{invoke} name="{draw(names)}">\n{body}\n</｜DSML｜{invoke}>')
    newlines = draw(st.sampled_from(["", "\n", "\n\n"]))
    return f"{newlines}<｜DSML｜{block}>\n" + "\n".join(calls) + f"\n</｜DSML｜{block}>"


@st.composite
def outputs(draw: st.DrawFn, *, stops: tuple[str, ...] = (), json_mode: bool = False) -> str:
    """A model output: reasoning, `</think>`, an answer (maybe with a stop string or JSON), tool calls, junk."""
    out = ""
    if draw(st.booleans()):
        out += draw(text) + draw(st.sampled_from(["</think>", "\n\n</think>", "\n</think>\n\n"]))
    answer = draw(text)
    if json_mode and draw(st.booleans()):
        fence = draw(st.sampled_from(["```json\n", "```\n", ""]))
        answer += fence + json.dumps(draw(json_values), ensure_ascii=False) + ("\n```" if fence else "") + draw(text)
    if stops and draw(st.booleans()):
        answer += draw(st.sampled_from(stops)) + draw(text)
    out += answer
    if draw(st.booleans()):
        out += draw(dsml_block())
    if draw(st.booleans()):
        out += draw(text)
    return out


@st.composite
def cuts(draw: st.DrawFn, value: str) -> list[str]:
    """`value` cut at random points (possibly everywhere)."""
    if value and draw(st.integers(0, 5)) == 0:
        return list(value)
    points = sorted(draw(st.sets(st.integers(1, max(1, len(value) - 1)), max_size=8)))
    pieces, last = [], 0
    for point in points:
        if point < len(value):
            pieces.append(value[last:point])
            last = point
    pieces.append(value[last:])
    return [p for p in pieces if p]


# -- requests for output parsing --------------------------------------------------------------------------

PARSE_TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object"}},
    {"name": "apply", "parameters": {"type": "object"}},
]
STOPS = ["STOP", "\n\n", "ab", "</think>", "<｜DSML｜"]


@st.composite
def parse_requests(draw: st.DrawFn, api: str) -> dict[str, Any]:
    """A one-turn request with the settings that steer parsing: thinking, tools, stops, JSON mode."""
    thinking = draw(st.booleans())
    tools = draw(st.booleans())
    required = tools and not thinking and draw(st.integers(0, 3)) == 0
    stops = draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True)) if api != "responses" else []
    json_mode = api != "messages" and not tools and draw(st.integers(0, 3)) == 0
    model = draw(st.sampled_from([V41, V4]))
    if api == "chat.completions":
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "q json"}]}
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        if tools:
            body["tools"] = [{"type": "function", "function": t} for t in PARSE_TOOLS]
            body["tool_choice"] = "required" if required else "auto"
        if stops:
            body["stop"] = stops
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        if draw(st.booleans()):
            body["logprobs"] = True
    elif api == "responses":
        body = {"model": model, "input": "q json", "reasoning": {"effort": "high" if thinking else "none"}}
        if tools:
            body["tools"] = [{"type": "function", **t} for t in PARSE_TOOLS]
            body["tool_choice"] = "required" if required else "auto"
        if json_mode:
            body["text"] = {"format": {"type": "json_object"}}
        if draw(st.booleans()):
            body["top_logprobs"] = 2
    else:
        body = {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": "q"}]}
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        if tools:
            body["tools"] = [{"name": t["name"], "input_schema": t["parameters"]} for t in PARSE_TOOLS]
            body["tool_choice"] = {"type": "tool", "name": "get_weather"} if required else {"type": "auto"}
        if stops:
            body["stop_sequences"] = stops
    return body


def examples(count: int) -> settings:
    """Settings of a recipe property test: `count` examples (ten times more with RECIPE_DEEP=1), no deadline.

    Set per test rather than as a global profile, so the other packages' hypothesis tests keep theirs."""
    count *= 10 if os.environ.get("RECIPE_DEEP") == "1" else 1
    return settings(
        max_examples=count, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )
