"""Structured output through the whole mesh serving the demo checkpoint, driven by the real SDKs: every answer under a
JSON Schema validates (jsonschema as the oracle) or ran out of budget; a required or named tool choice gives a call
whose arguments validate, on all three APIs; a mask changes nothing when the unconstrained answer already conforms;
a constraint decode cannot compile is the API's 400."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import grpc
import jsonschema
import openai
import pytest
from e2e_helpers import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from schemas import schemas

from mesh.processes import Mesh
from proto.decode.v1 import decode_pb2, decode_pb2_grpc
from recipe import Conversation, ModelVersion, ResponseFormat, User, load_tokenizer, render

NO_THINKING = {"thinking": {"type": "disabled"}}
SCHEMAS = 52
DSML = 128825  # the DSML marker token
MAX_TOKENS = 48
WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "minLength": 1, "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "days"],
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}}, "required": ["query"]}
TOOLS = {"get_weather": WEATHER, "search": SEARCH}


def _chat_json(oai: openai.OpenAI, schema: dict[str, Any], strict: bool, thinking: bool) -> tuple[str, str]:
    response = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris. Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}},
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}},
    )
    choice = response.choices[0]
    return choice.message.content or "", choice.finish_reason


@pytest.mark.timeout(900)
def test_every_generated_schema_yields_valid_json_or_length(demo_mesh: Mesh) -> None:
    oai = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    cases = schemas(SCHEMAS)
    with ThreadPoolExecutor(SCHEMAS // 2) as pool:  # decoded in two batches
        answers = list(pool.map(lambda i: _chat_json(oai, *cases[i], thinking=i % 4 == 3), range(len(cases))))
    valid = 0
    for (schema, _), (content, finish) in zip(cases, answers, strict=True):
        if finish == "length":
            continue
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)
        valid += 1
    assert valid >= len(cases) // 3  # answers end: the constraint does not just run them out of budget


def test_responses_text_format_is_enforced(demo_mesh: Mesh) -> None:
    oai = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    schema, _ = schemas(1)[0]
    response = oai.responses.create(
        model=MODEL,
        input="Describe Paris. Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        reasoning={"effort": "none"},
        max_output_tokens=96,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def _check_call(name: str, arguments: dict[str, Any], expected: str | None) -> None:
    assert name in TOOLS
    assert expected in (None, name)
    jsonschema.validate(arguments, TOOLS[name])


@pytest.mark.parametrize("named", [None, "search", "get_weather"])
def test_required_and_named_tool_choice_give_a_valid_call_on_every_api(demo_mesh: Mesh, named: str | None) -> None:
    oai = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=demo_mesh.base_url, api_key="unused", max_retries=0, timeout=300)
    question = "Tell me a joke."  # no tool fits: the choice, not the question, makes the call
    chat_tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=chat_tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": named}} if named else "required",  # type: ignore[arg-type]
        max_tokens=96, temperature=0, extra_body=NO_THINKING,
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls or []:
        _check_call(call.function.name, json.loads(call.function.arguments), named)
    assert choice.message.tool_calls

    responses = oai.responses.create(
        model=MODEL, input=question, reasoning={"effort": "none"}, max_output_tokens=96, temperature=0,
        tools=[{"type": "function", "name": n, "parameters": p, "strict": False} for n, p in TOOLS.items()],
        tool_choice={"type": "function", "name": named} if named else "required",
    )  # fmt: skip
    calls = [item for item in responses.output if item.type == "function_call"]
    assert calls
    for call in calls:
        _check_call(call.name, json.loads(call.arguments), named)

    message = claude.messages.create(
        model=MODEL, max_tokens=96, messages=[{"role": "user", "content": question}],
        tools=[{"name": n, "description": n, "input_schema": p} for n, p in TOOLS.items()],  # type: ignore[misc]
        tool_choice={"type": "tool", "name": named} if named else {"type": "any"},
        thinking={"type": "disabled"}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses
    for use in uses:
        _check_call(use.name, use.input, named)  # type: ignore[arg-type]


def _generate(address: str, ids: list[int], constraint: decode_pb2.OutputConstraint | None) -> list[int]:
    request = decode_pb2.GenerateRequest(
        token_ids=decode_pb2.TokenIds(ids=ids), max_tokens=48, stop_token_ids=[1], constraint=constraint
    )
    with grpc.insecure_channel(address) as channel:
        return [t for m in decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=300) for t in m.token_ids]


def test_a_mask_changes_nothing_when_the_answer_already_conforms(demo_mesh: Mesh) -> None:
    tokenizer = load_tokenizer()
    address = demo_mesh.child("decode-0").address
    questions = ["Which country is Paris in? Answer in JSON.", "Give me the capital of Peru as JSON."]
    for question in questions:
        conversation = Conversation([User(question)], thinking=False, response_format=ResponseFormat("json_object"))
        ids = render(conversation, ModelVersion.V41, tokenizer).token_ids or []
        free = _generate(address, ids, None)
        answer = json.loads(tokenizer.decode(free[:-1]))  # the demo model answers these with one JSON object
        types = {str: "string", int: "integer", list: "array", dict: "object", bool: "boolean"}
        properties = {key: {"type": types[type(value)]} for key, value in answer.items()}
        schema = {"type": "object", "properties": properties, "required": list(answer)}
        for constraint in (
            decode_pb2.OutputConstraint(json_object=True, banned_token_ids=[DSML]),
            decode_pb2.OutputConstraint(json_schema=json.dumps(schema), strict=True),
        ):
            assert _generate(address, ids, constraint) == free


def test_no_tool_markup_reaches_the_content_without_tools(demo_mesh: Mesh) -> None:
    """The demo model asked about the weather writes a DSML call even when no tool is declared; the answer is then
    free of the marker, which the gateway bans, and the API returns plain content."""
    tokenizer = load_tokenizer()
    question = "What's the weather in Paris?"
    ids = render(Conversation([User(question)], thinking=False), ModelVersion.V41, tokenizer).token_ids or []
    address = demo_mesh.child("decode-0").address
    assert DSML in _generate(address, ids, None)
    assert DSML not in _generate(address, ids, decode_pb2.OutputConstraint(banned_token_ids=[DSML]))
    oai = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answer = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0,
        extra_body=NO_THINKING,
    )  # fmt: skip
    assert "DSML" not in (answer.choices[0].message.content or "")


def test_a_constraint_that_does_not_compile_is_the_apis_400(demo_mesh: Mesh) -> None:
    oai = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError, match="regex"):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=NO_THINKING,
            response_format={"type": "regex", "regex": "(unclosed"},  # type: ignore[typeddict-item]
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="Unsupported type"):
        oai.responses.create(
            model=MODEL, input="Hi JSON", max_output_tokens=4, reasoning={"effort": "none"},
            text={"format": {"type": "json_schema", "name": "x", "schema": {"properties": {"a": {"type": "wrong"}}}}},
        )  # fmt: skip
