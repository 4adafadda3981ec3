"""Our events and responses through the real `openai` and `anthropic` SDKs: their type models parse every
event and complete response we emit, and their stream accumulators rebuild our complete response. Every Responses
event and response also validates against the vendored Open Responses schema (tests/open_responses)."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from recipe_strategies import cuts, examples, outputs, parse_requests

from recipe import APIS, DONE, Event, StreamProcessor, Tokenizer, convert, pyjson
from tests.open_responses.schema import check, check_event


def _by_type(union: Any) -> dict[str, Any]:
    """The models of a discriminated event union, by their `type` literal."""
    models = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(model.model_fields["type"].annotation)[0]: model for model in models}


class _Events:
    """Validates an event with the SDK model its `type` names (missing or wrong fields fail)."""

    def __init__(self, union: Any) -> None:
        self.models = _by_type(union)

    def validate_python(self, data: dict[str, Any]) -> Any:
        return self.models[data["type"]].model_validate(data)


RESPONSES_EVENT = _Events(ResponseStreamEvent)
MESSAGES_EVENT = _Events(RawMessageStreamEvent)


def stream(api: str, body: dict[str, Any], chunks: list[str], finish: str | None) -> tuple[list[Event], dict[str, Any]]:
    processor = StreamProcessor(convert(api, body), stream=True)
    events = processor.start(12, 4, "fp_test")
    for chunk in chunks:
        events += processor.push_text(chunk, 1)
    events += processor.finish(finish)
    return events, processor.response()


def check_chat(events: list[Event], response: dict[str, Any]) -> None:
    assert events[-1].data == DONE
    state = ChatCompletionStreamState()
    for event in events[:-1]:
        assert event.name is None
        state.handle_chunk(ChatCompletionChunk.model_validate(event.json()))
    final = state.current_completion_snapshot
    completion = ChatCompletion.model_validate(response)
    ours = completion.choices[0]
    assert final.choices[0].finish_reason == ours.finish_reason
    assert (final.choices[0].message.content or "") == (ours.message.content or "")
    rebuilt = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or ()]
    assert rebuilt == [(c.function.name, c.function.arguments) for c in ours.message.tool_calls or ()]
    assert final.usage == completion.usage


def check_responses(events: list[Event], response: dict[str, Any]) -> None:
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for number, event in enumerate(events):
        check_event(event.json())
        parsed = RESPONSES_EVENT.validate_python(event.json())
        assert event.name == parsed.type
        assert parsed.sequence_number == number
        state.handle_event(parsed)
    snapshot = state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]
    check("ResponseResource", response)
    ours = Response.model_validate(response)

    def content(item: Any) -> Any:
        if item.type == "message":
            return [part.text for part in item.content]
        if item.type == "reasoning":
            return "reasoning"  # the SDK snapshot does not apply reasoning_text deltas
        if item.type == "custom_tool_call":
            return (item.name, item.call_id, item.input)
        return (item.name, item.call_id, item.arguments)

    assert [content(item) for item in snapshot.output] == [content(item) for item in ours.output]
    assert events[-1].json()["response"] == response  # the terminal event carries the complete response


def check_messages(events: list[Event], response: dict[str, Any]) -> None:
    snapshot = None
    buffers: dict[int, bytes] = {}
    for event in events:
        data = event.json()
        assert event.name == data["type"]
        if event.name == "ping":
            continue
        snapshot = accumulate_event(
            event=MESSAGES_EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=buffers
        )
    ours = Message.model_validate(response)
    assert snapshot is not None
    assert [rebuilt(block) for block in snapshot.content] == [block.model_dump() for block in ours.content]
    assert (snapshot.stop_reason, snapshot.stop_sequence) == (ours.stop_reason, ours.stop_sequence)
    assert snapshot.usage == ours.usage


def rebuilt(block: Any) -> dict[str, Any]:
    """A content block the SDK rebuilt from the stream, as the complete response holds it: a tool call's integers
    outside 64 bits as floats. The SDK reads the streamed digits exactly, and the complete response's `input` holds
    what the reference's JSON reader gives — the reference's own stream and response differ there
    (test_parse_conformance::test_wide_integer_arguments_match_reference)."""
    fields = block.model_dump()
    if block.type == "tool_use":
        fields["input"] = pyjson.narrow_integers(fields["input"])
    return fields


CHECKS = {"chat.completions": check_chat, "responses": check_responses, "messages": check_messages}


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(60)
def test_sdk_parses_events_and_rebuilds_our_response(api: str, data: st.DataObject) -> None:
    body = data.draw(parse_requests(api))
    parsing = convert(api, body).parsing
    output = data.draw(outputs(stops=parsing.stop_sequences, json_mode=parsing.parse_json_output))
    events, response = stream(api, body, data.draw(cuts(output)), data.draw(st.sampled_from(["stop", "length", None])))
    CHECKS[api](events, response)


@pytest.mark.parametrize("value", ["-9223372036854775809", "[1, 100000000000000000000]"])
def test_sdk_rebuilds_a_tool_call_with_integers_outside_64_bits(value: str) -> None:
    """The Messages stream of a call whose arguments hold an integer outside 64 bits: the SDK rebuilds the response,
    the integer read exactly from the stream where the response holds it as a float."""
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"name": "a", "input_schema": {"type": "object"}}],
    }
    output = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n'
        f'<｜DSML｜parameter name="a" string="false">{value}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    events, response = stream("messages", body, list(output), "stop")
    assert response["content"][-1]["input"]["a"] == pyjson.narrow_integers(json.loads(value))
    check_messages(events, response)


def test_chat_logprobs_and_usage_parse(tokenizer: Tokenizer) -> None:
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "q"}],
        "logprobs": True,
        "top_logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    processor = StreamProcessor(convert("chat.completions", body), tokenizer=tokenizer)
    ids = tokenizer.hf.encode("Think 😀</think>Hello 日本", add_special_tokens=False).ids
    events = processor.start(5, 2)
    for token_id in ids:
        events += processor.push_tokens([token_id], [(-0.25, [(token_id, -0.25)])])
    events += processor.finish("stop")
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    content = [
        lp.token for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content or ()
    ]
    assert "".join(content) == "Hello 日本"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    completion = ChatCompletion.model_validate(processor.response())
    assert completion.choices[0].logprobs is not None
    assert [lp.token for lp in completion.choices[0].logprobs.content or ()] == content


@pytest.mark.parametrize("api", APIS)
def test_failure_mid_stream_is_an_api_error_event(api: str) -> None:
    body = parse_requests_plain(api)
    processor = StreamProcessor(convert(api, body), stream=True)
    events = processor.start() + processor.push_text("partial") + processor.fail("decode backend unavailable")
    assert processor.finished
    assert processor.push_text("more") == []
    if api == "chat.completions":
        error = events[-2].json()
        assert error["error"]["message"] == "decode backend unavailable"
        assert events[-1].data == DONE
    elif api == "responses":
        check_event(events[-1].json())
        failed = RESPONSES_EVENT.validate_python(events[-1].json())
        assert failed.type == "response.failed"
        assert failed.response.error.message == "decode backend unavailable"
    else:
        assert events[-1].name == "error"
        assert events[-1].json()["error"] == {"type": "api_error", "message": "decode backend unavailable"}
    assert b"\ndata: " in events[-1].sse() or events[-1].sse().startswith(b"data: ")


def parse_requests_plain(api: str) -> dict[str, Any]:
    if api == "responses":
        return {"model": "DeepSeek-V4.1-Flash", "input": "hi", "stream": True}
    body: dict[str, Any] = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    if api == "messages":
        body["max_tokens"] = 10
    return body


def test_sse_framing() -> None:
    assert Event(None, b'{"a":1}').sse() == b'data: {"a":1}\n\n'
    assert Event("ping", b'{"type":"ping"}').sse() == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert Event(None, DONE).sse() == b"data: [DONE]\n\n"
    assert json.loads(Event("x", b'{"k": "v"}').data) == {"k": "v"}
