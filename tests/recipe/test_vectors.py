"""The conformance vectors of reference/recipe-format.md §6, one test (or parameter set) per vector."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recipe import (
    Assistant,
    Conversation,
    RecipeError,
    StreamProcessor,
    System,
    Tokenizer,
    ToolCall,
    User,
    convert,
    render,
    render_history,
)
from recipe.templates import V4_EFFORT_HIGH, V4_EFFORT_MAX
from recipe.tokens import RECIPE_IMAGE_TOKEN, SpecialTokens

V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"
BOS, SYS, USER, ASSIST, EOS = (
    "<｜begin▁of▁sentence｜>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
)


def effort(level: int) -> str:
    return f"Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def prompt(body: dict[str, Any], api: str = "chat.completions", **kwargs: Any) -> str:
    converted = convert(api, body)
    return render(converted.conversation, converted.version, **kwargs).text


def chat(messages: list[dict[str, Any]], model: str = V41, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **fields}


HELLO = [{"role": "user", "content": "Hello"}]
OFF = {"thinking": {"type": "disabled"}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("model", [V41, V4])
def test_1_non_thinking_hello(model: str) -> None:
    assert prompt(chat(HELLO, model, **OFF)) == f"{BOS}{USER}Hello{ASSIST}</think>"


@pytest.mark.parametrize(
    ("setting", "level"),
    [(None, 75), ("low", 50), ("max", 100), ("medium", 75), ("xhigh", 75), ("minimal", 50), (42, 42)],
)
def test_2_v41_effort_line(setting: str | int | None, level: int) -> None:
    fields = {"reasoning_effort": setting} if setting is not None else {}
    assert prompt(chat(HELLO, **fields)) == f"{BOS}{SYS}{effort(level)}{USER}Hello{ASSIST}<think>"


@pytest.mark.parametrize(
    ("setting", "text"), [(None, V4_EFFORT_HIGH), ("high", V4_EFFORT_HIGH), ("low", ""), ("max", V4_EFFORT_MAX)]
)
def test_3_v4_effort_text(setting: str | None, text: str) -> None:
    fields = {"reasoning_effort": setting} if setting else {}
    assert prompt(chat(HELLO, V4, **fields)) == f"{BOS}{text}{USER}Hello{ASSIST}<think>"


def test_4_system_message() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert prompt(chat(messages, **OFF)) == f"{BOS}{SYS}S{USER}U{ASSIST}</think>"
    assert prompt(chat(messages, V4, **OFF)) == f"{BOS}S{USER}U{ASSIST}</think>"
    assert prompt(chat(messages)) == f"{BOS}{SYS}{effort(75)}S{USER}U{ASSIST}<think>"


def test_5_history_reasoning_dropped() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    text = prompt(chat(messages))
    assert text.endswith(f"{USER}q1{ASSIST}</think>a1{EOS}{USER}q2{ASSIST}<think>")
    assert "r1" not in text


def test_6_official_golden_history_rendering() -> None:
    conversation = Conversation(
        [
            System("You are a helpful assistant."),
            User("Hello"),
            Assistant("Hi there! How can I help you?", reasoning="The user said hello, I should greet back."),
            User("What is the capital of France?"),
            Assistant(
                "The capital of France is Paris.", reasoning="The user asks about the capital of France. It is Paris."
            ),
        ],
        reasoning_effort="low",
    )
    assert render_history(conversation, V4).text == (
        f"{BOS}You are a helpful assistant.{USER}Hello{ASSIST}</think>Hi there! How can I help you?{EOS}"
        f"{USER}What is the capital of France?{ASSIST}<think>The user asks about the capital of France. It is Paris."
        f"</think>The capital of France is Paris.{EOS}"
    )


def test_7_mid_conversation_system() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "mid"},
        {"role": "user", "content": "q2"},
    ]
    tail = f"{USER}q1{ASSIST}</think>a1{EOS}"
    assert prompt(chat(messages, **OFF)) == f"{BOS}{SYS}S{tail}{SYS}mid{USER}q2{ASSIST}</think>"
    assert prompt(chat(messages, V4, **OFF)) == f"{BOS}S\n\nmid{tail}{USER}q2{ASSIST}</think>"
    official = Conversation(
        [System("sys"), User("q1"), Assistant("a1"), System("mid sys")], reasoning_effort=88
    )  # ends in the system message: it takes the generation header
    assert render(official).text == f"{BOS}{SYS}{effort(88)}sys{tail}{SYS}mid sys{ASSIST}<think>"


def test_8_later_system_counts_as_user() -> None:
    messages = [
        {"role": "user", "content": "first"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer", "reasoning_content": "prior reasoning"},
        {"role": "system", "content": "new instruction"},
    ]
    expected = (
        f"{BOS}{SYS}{effort(50)}{USER}first\n\nsecond{ASSIST}</think>answer{EOS}{SYS}new instruction{ASSIST}<think>"
    )
    assert prompt(chat(messages, reasoning_effort="low")) == expected
    assert prompt(chat(messages, reasoning_effort="minimal")) == expected


WEATHER_CALLS = [
    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "A", "days": 3}'}},
    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "B"}'}},
]
TOOL_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": WEATHER_CALLS},
    {"role": "tool", "tool_call_id": "b", "content": "rB"},
    {"role": "tool", "tool_call_id": "a", "content": "rA"},
]


@pytest.mark.parametrize("model", [V41, V4])
def test_9_tool_history_in_call_order(model: str) -> None:
    block, invoke, param = ("calls", "invoke", "parameter") if model == V4 else (" calls", " invoke", " parameter")
    block = "tool_calls" if model == V4 else block
    dsml = "｜DSML｜"
    calls = (
        f'<{dsml}{block}>\n<{dsml}{invoke} name="get_weather">\n'
        f'<{dsml}{param} name="city" string="true">A</{dsml}{param}>\n'
        f'<{dsml}{param} name="days" string="false">3</{dsml}{param}>\n</{dsml}{invoke}>\n'
        f'<{dsml}{invoke} name="get_weather">\n<{dsml}{param} name="city" string="true">B</{dsml}{param}>\n'
        f"</{dsml}{invoke}>\n</{dsml}{block}>"
    )
    text = prompt(chat(TOOL_HISTORY, model, tools=[WEATHER_TOOL]))
    assert text.endswith(
        f"{USER}Weather?{ASSIST}<think>need tool</think>\n\n{calls}{EOS}"
        f"{USER}<tool_result>rA</tool_result>\n\n<tool_result>rB</tool_result>{ASSIST}<think>"
    )
    if model == V41:
        assert text.startswith(f"{BOS}{SYS}{effort(75)}\n\n## Tools\n\n")


def test_10_official_assistant_turn_and_parse_back() -> None:
    conversation = Conversation(
        [
            User("q"),
            Assistant(
                "summary", reasoning="  reason  ", tool_calls=[ToolCall("c", "lookup", '{"query":"value","limit":2}')]
            ),
        ]
    )
    text = render_history(conversation).text
    block = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    completion = f"  reason  </think>summary\n\n{block}{EOS}"
    assert text.endswith(f"{ASSIST}<think>{completion}")
    body = chat([{"role": "user", "content": "q"}], tools=[WEATHER_TOOL])
    processor = StreamProcessor(convert("chat.completions", body))
    processor.push_text(completion.removesuffix(EOS))
    processor.finish("stop")
    message = processor.response()["choices"][0]["message"]
    assert message["reasoning_content"] == "  reason  "
    assert message["content"] == "summary"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"query": "value", "limit": 2}


def test_11_messages_history() -> None:
    body = {
        "model": V41,
        "max_tokens": 100,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need tool", "signature": "s"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    }
    text = prompt(body, "messages")
    assert f"{ASSIST}<think>need tool</think>Let me check.\n\n<｜DSML｜ calls>\n" in text
    assert text.endswith(f"</｜DSML｜ calls>{EOS}{USER}<tool_result>sunny</tool_result>\n\nthanks{ASSIST}<think>")


@pytest.mark.parametrize(("model", "block"), [(V41, " calls"), (V4, "tool_calls")])
def test_12_required_tool_choice(model: str, block: str) -> None:
    body = chat([{"role": "user", "content": "Weather?"}], model, tools=[WEATHER_TOOL], tool_choice="required")
    assert prompt({**body, **OFF}).endswith(f"{USER}Weather?{ASSIST}</think>\n\n<｜DSML｜{block}>\n")
    with pytest.raises(RecipeError, match="Thinking mode does not support this tool_choice"):
        convert("chat.completions", body)


def test_13_json_mode() -> None:
    body = chat([{"role": "user", "content": "Return JSON"}], response_format={"type": "json_object"}, **OFF)
    assert prompt(body) == (
        f"{BOS}{SYS}\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        f'{{"type": "json_object"}}{USER}Return JSON{ASSIST}</think>'
    )
    assert prompt({**body, "model": V4}) == (
        f"{BOS}\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
        f"Reply with JSON object ONLY.{USER}Return JSON{ASSIST}</think>"
    )


IMAGE_MESSAGE = {
    "role": "user",
    "content": [
        {"type": "text", "text": "before"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "text", "text": "after"},
    ],
}


def test_14_images() -> None:
    body = chat([IMAGE_MESSAGE], **OFF)
    assert prompt(body) == f"{BOS}{USER}before\n\n<｜deepseek_image｜>\n\nafter{ASSIST}</think>"
    recipe_spelling = prompt(body, tokens=SpecialTokens(image=RECIPE_IMAGE_TOKEN))
    assert recipe_spelling == f"{BOS}{USER}before\n\n<｜image｜>\n\nafter{ASSIST}</think>"
    assert prompt({**body, "model": V4}) == f"{BOS}{USER}before\n\n[Unsupported Image]\n\nafter{ASSIST}</think>"
    assert [i.url for i in render(convert("chat.completions", body).conversation).images] == [
        "https://example.com/a.png"
    ]


def test_15_responses_instructions_and_effort() -> None:
    body = {"model": V41, "instructions": "I", "input": "hi", "reasoning": {"effort": "low"}}
    assert prompt(body, "responses") == f"{BOS}{SYS}{effort(50)}I{USER}hi{ASSIST}<think>"
    body = {"model": V41, "input": [{"role": "developer", "content": "D"}, {"role": "user", "content": "hi"}]}
    assert prompt({**body, "reasoning": {"effort": "none"}}, "responses") == f"{BOS}{SYS}D{USER}hi{ASSIST}</think>"


def test_16_responses_namespace() -> None:
    lookup = {"type": "function", "name": "lookup", "description": "Look up", "parameters": {"type": "object"}}
    body = {
        "model": V41,
        "input": "hi",
        "tools": [{"type": "namespace", "name": "search", "description": "Search tools.", "tools": [lookup]}],
    }
    line = '{"name": "search::lookup", "description": "Search tools.\\nLook up", "parameters": {"type": "object"}}'
    assert line in prompt(body, "responses")


def test_17_float_spelling_and_strict() -> None:
    enum = [0.0, -0.0, 0.0001, 1e-5, 1e-6, 1e-9, 1e16, 1e20]
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "strict": False,
            "parameters": {"type": "object", "properties": {"a": {"enum": enum}}},
        },
    }
    text = prompt(chat(HELLO, tools=[tool]))
    assert '"enum": [0.0, -0.0, 0.0001, 1e-05, 1e-06, 1e-09, 1e+16, 1e+20]' in text
    assert '"strict"' not in text
    with pytest.raises(RecipeError) as rejected:
        convert("chat.completions", b'{"model": "DeepSeek-V4.1-Flash", "messages": [], "temperature": NaN}')
    assert rejected.value.status == 400


def dsml(calls: list[tuple[str, list[tuple[str, str, str]]]], v41: bool = True) -> str:
    """A DSML tool-calls block: calls of (name, [(parameter, "true"|"false", value)])."""
    block, tag = (" calls", " ") if v41 else ("tool_calls", "")
    invokes = []
    for name, params in calls:
        lines = [f'<｜DSML｜{tag}parameter name="{k}" string="{f}">{v}</｜DSML｜{tag}parameter>' for k, f, v in params]
        invokes.append(f'<｜DSML｜{tag}invoke name="{name}">\n' + "\n".join(lines) + f"\n</｜DSML｜{tag}invoke>")
    return f"<｜DSML｜{block}>\n" + "\n".join(invokes) + f"\n</｜DSML｜{block}>"


def parse(
    body: dict[str, Any], chunks: list[str], finish: str = "stop", api: str = "chat.completions"
) -> dict[str, Any]:
    processor = StreamProcessor(convert(api, body))
    for chunk in chunks:
        processor.push_text(chunk)
    processor.finish(finish)
    return processor.response()


TOOLS_BODY = chat([{"role": "user", "content": "q"}], tools=[WEATHER_TOOL])


def cut_after(text: str, marker: str) -> list[str]:
    at = text.index(marker) + len(marker)
    return [text[:at], text[at:]]


def test_18_parsing_vectors() -> None:
    message = parse(
        TOOLS_BODY,
        [
            "The user wants ",
            "weather.</think>",
            *cut_after(
                "Checking.\n\n" + dsml([("get_weather", [("city", "true", "Paris"), ("days", "false", "3")])]), "Par"
            ),
        ],
    )["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["reasoning_content"] == "The user wants weather."
    assert message["message"]["content"] == "Checking."
    assert message["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("v41", [False, True])
def test_18_awkward_parameter_names_at_every_split(v41: bool) -> None:
    params = [
        ("shipping address", "true", "Paris\n日本"),
        (" string= mode ", "false", '{"enabled":true}'),
        ("count", "false", "2"),
        ("", "true", "empty key"),
    ]
    output = dsml([("submit", params)], v41=v41)
    expected = {"shipping address": "Paris\n日本", " string= mode ": {"enabled": True}, "count": 2, "": "empty key"}
    converted = convert("chat.completions", {**TOOLS_BODY, **OFF})
    for chunks in [[output], list(output), *([output[:i], output[i:]] for i in range(1, len(output)))]:
        processor = StreamProcessor(converted)
        for chunk in chunks:
            processor.push_text(chunk)
        processor.finish("stop")
        choice = processor.response()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == expected


def test_18_edge_cases() -> None:
    v4_tags = "</think>" + dsml([("x", [("a", "false", '{"k": [1, 2]}')])], v41=False)
    assert (
        parse(TOOLS_BODY, [v4_tags])["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        == '{"a": {"k": [1, 2]}}'
    )
    no_tools = chat([{"role": "user", "content": "q"}])
    assert parse(no_tools, [v4_tags])["choices"][0]["message"]["content"] == v4_tags.removeprefix("</think>")
    truncated = parse(
        TOOLS_BODY,
        ['</think><｜DSML｜ calls><｜DSML｜ invoke name="f"><｜DSML｜ parameter name="a" string="true">unfin'],
        "length",
    )
    assert truncated["choices"][0]["finish_reason"] == "length"
    assert truncated["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": "unfin'
    escaped = parse(
        TOOLS_BODY,
        ["</think>" + dsml([("f", [("a", "true", 'say "hi"\\n\nline2')])])],
    )
    assert (
        escaped["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        == '{"a": "say \\"hi\\"\\\\n\\nline2"}'
    )
    non_thinking = chat([{"role": "user", "content": "q"}], **OFF)
    assert parse(non_thinking, ["a</think>b"])["choices"][0]["message"]["content"] == "ab"
    assert parse(non_thinking, ["\n\nHi\n"])["choices"][0]["message"]["content"] == "Hi\n"
    reasoning_only = parse(chat([{"role": "user", "content": "q"}]), ["thinking on"], "length")["choices"][0]
    assert reasoning_only["message"] == {"role": "assistant", "content": "", "reasoning_content": "thinking on"}


def test_18_stop_sequence_per_api() -> None:
    chunks = ["</think>Hello ST", "OP world"]
    chat_body = chat([{"role": "user", "content": "q"}], stop=["STOP"])
    choice = parse(chat_body, chunks)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Hello ", "stop")
    messages_body = {
        "model": V41,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "q"}],
        "stop_sequences": ["STOP"],
    }
    message = parse(messages_body, chunks, api="messages")
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP")
    assert message["content"][-1] == {"type": "text", "text": "Hello "}


def test_18_json_mode_output() -> None:
    body = chat([{"role": "user", "content": "json"}], response_format={"type": "json_object"}, **OFF)
    for chunks in (['Sure: ```json\n{"a": 1}\n``` done'], ["Sure: ```json\n{", '"a": ', "1}\n``` done"]):
        assert parse(body, chunks)["choices"][0]["message"]["content"] == ' {"a": 1} '


def test_18_v4_tags_with_cjk() -> None:
    calls = dsml([("get_weather", [("city", "true", "東京"), ("days", "false", "3")])], v41=False)
    output = f"Checking</think>Done\n\n{calls}"
    message = parse({**TOOLS_BODY, "model": V4}, [output])["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Done", "Checking")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "東京", "days": 3}


def test_19_token_counts(tokenizer: Tokenizer) -> None:
    def ids(content: str) -> list[int]:
        converted = convert("chat.completions", chat([{"role": "user", "content": content}], **OFF))
        return render(converted.conversation, converted.version, tokenizer).token_ids or []

    empty = ids("")
    assert len(empty) == 4
    assert len(ids("x")) == 5
    spelled = ids("<｜User｜>")
    assert spelled[2:7] == [30, 28217, 6756, 28217, 32]
    assert spelled[:2] + spelled[7:] == empty
    assert len(ids("<think>")) == 7


def test_parameter_names_are_escaped_into_valid_json() -> None:
    """Beyond deepseek-recipe, which copies names raw: a newline or backslash in a name keeps the JSON valid."""
    output = "</think>" + dsml([("f", [("a\nb\\c", "false", "1")])])
    arguments = parse(TOOLS_BODY, [output])["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"a\nb\\c": 1}


def test_tokens_pushed_after_a_stop_sequence_end_the_stream_once(tokenizer: Tokenizer) -> None:
    body = chat([{"role": "user", "content": "q"}], stop=["STOP"], stream=True, **OFF)
    processor = StreamProcessor(convert("chat.completions", body), tokenizer=tokenizer)
    events = processor.push_tokens(tokenizer.encode_plain("Hello STOP more"))
    assert processor.finished
    assert processor.push_tokens(tokenizer.encode_plain(" and more")) == []
    assert [event.json() for event in events].count(None) == 1  # one `[DONE]`
    assert processor.response()["choices"][0]["finish_reason"] == "stop"


def test_template_token_in_a_stage_without_markers_is_text(tokenizer: Tokenizer) -> None:
    """A `｜DSML｜` token after the JSON answer of a request without tools: plain text, as the same text is."""
    body = chat([{"role": "user", "content": "json"}], response_format={"type": "json_object"}, **OFF)
    output = '```json\n{"a": 1}\n```<｜DSML｜tool_calls> x'
    processor = StreamProcessor(convert("chat.completions", body), tokenizer=tokenizer)
    ids = tokenizer.hf.encode(output, add_special_tokens=False).ids
    assert tokenizer.special_id(tokenizer.tokens.dsml) in ids
    for token_id in ids:
        processor.push_tokens([token_id])
    processor.finish("stop")
    assert processor.response()["choices"][0]["message"] == parse(body, [output])["choices"][0]["message"]
