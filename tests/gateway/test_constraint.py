"""What decode is told to enforce, per API: the response formats, the tool choices (the DSML tool-call grammar,
compiled here by decode's own compiler against the real vocabulary: it admits the calls the recipe renders and
refuses arguments outside the schema), the DSML marker banned wherever the answer may not hold a call, and the
reasoning left free."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from decode_svc.grammar import Grammars, default_tokenizer, vocabulary
from gateway.job import Codec, Model
from proto.decode.v1 import decode_pb2
from recipe import Assistant, Conversation, ModelVersion, Tokenizer, Tool, ToolCall, User, load_tokenizer, render

MODEL = Model(fingerprint=b"f" * 16, block_tokens=16, layout_version=1, max_context=8192)
NAME = "DeepSeek-V4.1-Flash"
DSML, THINK_END = 128825, 128822
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def codec(tokenizer: Tokenizer) -> Codec:
    return Codec(tokenizer, model_name=NAME, max_output_tokens=0, prefix_reuse=True)


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(vocabulary(default_tokenizer(), 129_280))


def constraint(codec: Codec, api: str, **body: object) -> decode_pb2.OutputConstraint:
    return codec.convert(api, json.dumps({"model": NAME, **body}).encode()).constraint  # type: ignore[arg-type]


def chat(codec: Codec, **fields: object) -> decode_pb2.OutputConstraint:
    messages = [{"role": "user", "content": "Answer in JSON."}]
    return constraint(codec, "chat.completions", messages=messages, thinking={"type": "disabled"}, **fields)


def test_response_formats(codec: Codec) -> None:
    strict_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    strict = chat(codec, response_format=strict_format)
    assert (json.loads(strict.json_schema), strict.strict) == (SCHEMA, True)
    assert list(strict.banned_token_ids) == [DSML]  # a JSON answer holds no tool call
    loose = chat(codec, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert (loose.WhichOneof("grammar"), loose.strict) == ("json_schema", False)
    assert chat(codec, response_format={"type": "json_object"}).json_object
    assert chat(codec, response_format={"type": "regex", "regex": "[0-9]+"}).regex == "[0-9]+"
    responses = constraint(
        codec, "responses", input="Answer in JSON.", reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    assert (json.loads(responses.json_schema), responses.strict) == (SCHEMA, True)


def test_no_tools_bans_the_dsml_marker_and_the_reasoning_is_free(codec: Codec) -> None:
    plain = chat(codec)
    assert plain.WhichOneof("grammar") is None
    assert list(plain.banned_token_ids) == [DSML]
    assert not plain.HasField("reasoning_end_token_id")
    thinking = constraint(codec, "chat.completions", messages=[{"role": "user", "content": "Hi"}])
    assert thinking.reasoning_end_token_id == THINK_END
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    assert list(chat(codec, tools=tools, tool_choice="none").banned_token_ids) == [DSML]
    messages = constraint(codec, "messages", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert list(messages.banned_token_ids) == [DSML]


def _tools(api: str) -> list[dict]:
    if api == "chat.completions":
        return [{"type": "function", "function": {"name": n, "parameters": WEATHER}} for n in ("get_weather", "other")]
    if api == "responses":
        return [{"type": "function", "name": n, "parameters": WEATHER} for n in ("get_weather", "other")]
    return [{"name": n, "input_schema": WEATHER} for n in ("get_weather", "other")]


def _required(codec: Codec, api: str, named: bool) -> decode_pb2.OutputConstraint:
    ask = [{"role": "user", "content": "Weather?"}]
    if api == "chat.completions":
        choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
        return chat(codec, tools=_tools(api), tool_choice=choice)
    if api == "responses":
        choice = {"type": "function", "name": "get_weather"} if named else "required"
        return constraint(codec, api, input="Weather?", reasoning={"effort": "none"}, tools=_tools(api),
                          tool_choice=choice)  # fmt: skip
    choice = {"type": "tool", "name": "get_weather"} if named else {"type": "any"}
    return constraint(codec, api, max_tokens=8, messages=ask, thinking={"type": "disabled"}, tools=_tools(api),
                      tool_choice=choice)  # fmt: skip


def _answer(tokenizer: Tokenizer, calls: list[ToolCall], opened: bool) -> str:
    """The text of an answer that makes `calls`, as the template renders it (from the calls block's first `invoke`
    when the prompt already opened the block)."""
    conversation = Conversation(
        [User("Weather?"), Assistant("", None, calls), User("ok")],
        thinking=False,
        tools=[Tool("get_weather", None, WEATHER), Tool("other", None, WEATHER)],
    )
    text = render(conversation, ModelVersion.V41, tokenizer).text
    end = text.rindex(tokenizer.tokens.eos)
    block = text[text.rindex("</think>", 0, end) + len("</think>") : end]
    return block.split("calls>\n", 1)[1] if opened else block


def _admits(grammars: Grammars, c: decode_pb2.OutputConstraint, answer: str) -> bool:
    """Whether the grammar takes the answer and then the stop token."""
    matcher = xgr.GrammarMatcher(grammars.compile_now(c), override_stop_tokens=[1])
    return matcher.accept_string(answer) and matcher.accept_token(1) and matcher.is_terminated()


@pytest.mark.parametrize("api", ["chat.completions", "responses", "messages"])
def test_required_and_named_tool_choice_is_the_dsml_call_grammar(
    codec: Codec, tokenizer: Tokenizer, grammars: Grammars, api: str
) -> None:
    good = ToolCall("c", "get_weather", '{"city": "Paris", "days": 3}')
    out_of_range = ToolCall("c", "get_weather", '{"city": "Paris", "days": 30}')
    missing = ToolCall("c", "get_weather", '{"city": "Paris"}')
    other = ToolCall("d", "other", '{"city": "Oslo", "days": 1}')
    for named in (False, True):
        c = _required(codec, api, named)
        opened = api != "messages" or named  # Anthropic's `any` renders as auto: the answer opens the block
        assert c.WhichOneof("grammar") == "structural_tag"
        assert not c.banned_token_ids
        assert _admits(grammars, c, _answer(tokenizer, [good], opened))
        assert not _admits(grammars, c, _answer(tokenizer, [out_of_range], opened))
        assert not _admits(grammars, c, _answer(tokenizer, [missing], opened))
        assert not _admits(grammars, c, "Just text.")
        assert _admits(grammars, c, _answer(tokenizer, [good, other], opened)) is not named  # only the named one


def test_tool_choice_auto_lets_text_through_and_holds_calls_to_their_schema(
    codec: Codec, tokenizer: Tokenizer, grammars: Grammars
) -> None:
    auto = chat(codec, tools=_tools("chat.completions"))
    assert auto.WhichOneof("grammar") == "structural_tag"
    good = _answer(tokenizer, [ToolCall("c", "get_weather", '{"city": "Paris", "days": 3}')], opened=False)
    bad = _answer(tokenizer, [ToolCall("c", "get_weather", '{"city": "Paris", "days": 30}')], opened=False)
    assert _admits(grammars, auto, "Just text.")
    assert _admits(grammars, auto, "Checking." + good)
    assert not _admits(grammars, auto, "Checking." + bad)
    matcher = xgr.GrammarMatcher(grammars.compile_now(auto), override_stop_tokens=[1])
    marker = [tokenizer.encode_plain("\n\n<")[0], DSML]  # the model's own DSML token opens the block too
    assert all(matcher.accept_token(t) for t in [*tokenizer.encode_plain("Checking."), *marker])


def test_an_argument_ends_only_at_the_marker_token_not_at_its_spelling(
    codec: Codec, tokenizer: Tokenizer, grammars: Grammars
) -> None:
    """A grammar matches text, but the parser reads markup only at the DSML marker token: under a tool-call grammar
    ordinary tokens cannot spell `｜`, so a string argument is closed by the marker token alone (and holds no `｜`),
    while a grammar of plain text still takes the character."""
    c = _required(codec, "chat.completions", named=True)
    answer = _answer(tokenizer, [ToolCall("c", "get_weather", '{"city": "Paris", "days": 3}')], opened=True)
    inside = answer[: answer.index("Paris") + len("Paris")]
    close = answer[len(inside) : answer.index(">", len(inside)) + 1]  # `</｜DSML｜parameter>`
    marker = "｜DSML｜"
    assert close.startswith("</" + marker)
    by_marker = [*tokenizer.encode_plain("</"), DSML, *tokenizer.encode_plain(close[len("</" + marker) :])]
    by_spelling = tokenizer.encode_plain(close)
    assert DSML not in by_spelling
    compiled = grammars.compile_now(c)

    def takes(tokens: list[int]) -> bool:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[1])
        return matcher.accept_string(inside) and all(matcher.accept_token(t) for t in tokens)

    assert takes(by_marker)
    assert not takes(by_spelling)
    (bar,) = tokenizer.encode_plain("｜")
    assert not takes([bar])
    text = xgr.GrammarMatcher(grammars.compile_now(decode_pb2.OutputConstraint(regex="a｜b")))
    assert text.accept_string("a")
    assert text.accept_token(bar)
