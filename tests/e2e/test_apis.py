"""The three APIs end to end through the real mesh (tiny model, random weights), driven by the real SDKs: every test
on the mesh of single-process replicas, then on `mesh up --prefill-ranks 2 --decode-ranks 2`, where the prefill and
the decode replica are each a group of two rank processes (routed experts split over them, gloo on the CPU).

The model's words are noise, so the checks are about the protocol: responses parse, finish reasons follow the
budget and stop sequences, streamed output equals the complete response (greedy is deterministic), usage is
reported in each API's own fields, n choices come back as n choices, an answer under a JSON Schema validates, a
second turn reuses the first turn's cached prefix and equals a cold run.
The two meshes' answers are not compared: a prefix hit in the cache resumes with other float reduction orders, so
greedy text moves with the cache's state. That a group computes what one process computes is tested at the service
level, on fixed inputs (tests/decode_svc/test_decode_ranks.py, tests/prefill_svc/test_prefill_ranks.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import grpc
import jsonschema
import openai
import pytest
from e2e_helpers import MODEL, killed, metric, model_info, serve, tiny_mesh
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.client import CacheClient
from mesh.block_keys import sequence_key
from mesh.processes import Mesh
from proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from recipe import convert, load_tokenizer, render

NO_THINKING = {"thinking": {"type": "disabled"}}
FAILURE_S = 10.0  # a rank group fails within this of a rank's death
# This anthropic SDK has no `temperature` argument any more; the API (and the gateway) still take the field.
GREEDY_MESSAGES = {"extra_body": {"temperature": 0}, "thinking": {"type": "disabled"}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = "Explain, step by step, how a prefix cache decides what it can reuse. " * 5
# The noise has a handful of choices under this schema (the grammar caps whitespace), so a constrained answer ends.
SWITCH = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}},
    "required": ["on"],
    "additionalProperties": False,
}
# One xdist worker runs the module (make test distributes by --dist loadgroup): split over two, each would start
# its own ranked mesh, six more processes on the machine.
pytestmark = pytest.mark.xdist_group("apis")


@pytest.fixture(scope="module", params=["single", "ranked"])
def mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The session's mesh of single-process replicas, then one of rank groups: a prefill and a decode replica of two
    ranks each, as `mesh up --prefill-ranks 2 --decode-ranks 2` starts it."""
    if request.param == "single":
        yield request.getfixturevalue("mesh")  # conftest's, which this fixture overrides
    else:
        yield from serve(tiny_mesh(tmp_path_factory.mktemp("ranked-mesh"), replicas=1, ranks=2))


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def streamed_chat(oai: openai.OpenAI, **request: object) -> tuple[dict[int, str], dict[int, str | None], object]:
    """Content and finish reason per choice, and the usage, of a streamed chat completion."""
    content: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):  # type: ignore[call-overload]
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return content, finish, usage


def test_chat_complete_and_streamed_agree(oai: openai.OpenAI) -> None:
    request = {"model": MODEL, "messages": ask("Name three colours."), "max_tokens": 8, "temperature": 0,
               "extra_body": NO_THINKING}  # fmt: skip
    complete = oai.chat.completions.create(**request)  # type: ignore[call-overload]
    (choice,) = complete.choices
    assert choice.finish_reason == "length"
    assert complete.usage.completion_tokens == 8
    assert complete.usage.prompt_tokens > 0
    assert complete.usage.prompt_tokens_details.cached_tokens >= 0
    assert complete.system_fingerprint.startswith("fp_")
    content, finish, usage = streamed_chat(oai, **request)
    assert content == {0: choice.message.content}
    assert finish == {0: "length"}
    assert usage.completion_tokens == 8


def test_thinking_on_and_off(oai: openai.OpenAI) -> None:
    thinking = oai.chat.completions.create(
        model=MODEL,
        messages=ask("Think, then answer: 2+2?"),
        max_tokens=6,
        extra_body={"thinking": {"type": "enabled"}},
    )
    message = thinking.choices[0].message
    assert isinstance(message.model_extra.get("reasoning_content"), str)
    assert thinking.usage.completion_tokens_details.reasoning_tokens <= thinking.usage.completion_tokens
    plain = oai.chat.completions.create(model=MODEL, messages=ask("2+2?"), max_tokens=6, extra_body=NO_THINKING)
    assert "reasoning_content" not in plain.choices[0].message.model_extra


def test_tools_declared_the_response_parses(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    for tool_choice in ("auto", "required"):
        response = oai.chat.completions.create(
            model=MODEL, messages=ask("Weather in Paris?"), tools=[WEATHER_TOOL], tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=6, extra_body=NO_THINKING,
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in choice.message.tool_calls or []:
            assert call.type == "function"
            assert isinstance(call.function.arguments, str)
    schema = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    message = claude.messages.create(
        model=MODEL, max_tokens=6, messages=ask("Weather in Paris?"),  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "description": "Weather", "input_schema": schema}],
    )  # fmt: skip
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert all(block.type in ("thinking", "text", "tool_use") for block in message.content)


def test_stop_sequences_end_the_answer(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "messages": ask("Count upwards."), "max_tokens": 10, "temperature": 0,
               "extra_body": NO_THINKING}  # fmt: skip
    full = oai.chat.completions.create(**request).choices[0].message.content  # type: ignore[call-overload]
    start = next(i for i in range(1, len(full) - 1) if full[i : i + 2].strip() == full[i : i + 2])
    stop = full[start : start + 2]
    cut = oai.chat.completions.create(**request, stop=[stop]).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.find(stop)]
    content, finish, _ = streamed_chat(oai, **request, stop=[stop])
    assert content == {0: full[: full.find(stop)]}
    assert finish == {0: "stop"}

    first = claude.messages.create(model=MODEL, max_tokens=10, messages=ask("Count upwards."), **GREEDY_MESSAGES)
    text = "".join(block.text for block in first.content if block.type == "text")
    start = next(i for i in range(1, len(text) - 1) if text[i : i + 2].strip() == text[i : i + 2])
    stopped = claude.messages.create(
        model=MODEL, max_tokens=10, messages=ask("Count upwards."), stop_sequences=[text[start : start + 2]],
        **GREEDY_MESSAGES,
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == text[start : start + 2]


def test_n_choices(oai: openai.OpenAI) -> None:
    greedy = oai.chat.completions.create(
        model=MODEL, messages=ask("Hi"), n=3, max_tokens=5, temperature=0, extra_body=NO_THINKING
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: the same answer three times
    assert all(c.finish_reason == "length" for c in greedy.choices)
    assert greedy.usage.completion_tokens == 15
    sampled = oai.chat.completions.create(
        model=MODEL, messages=ask("Hi"), n=2, max_tokens=6, temperature=1.0, seed=7, extra_body=NO_THINKING
    )
    assert sampled.choices[0].message.content != sampled.choices[1].message.content  # each choice its own seed
    content, finish, usage = streamed_chat(
        oai, model=MODEL, messages=ask("Hi"), n=2, max_tokens=5, temperature=0, extra_body=NO_THINKING
    )
    assert content == {0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10


def test_logprobs(oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(
        model=MODEL, messages=ask("Hi"), max_tokens=4, logprobs=True, top_logprobs=2, extra_body=NO_THINKING
    )
    entries = response.choices[0].logprobs.content
    assert entries
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2


def test_responses_complete_and_streamed_agree(oai: openai.OpenAI) -> None:
    request = {"model": MODEL, "input": "Say something.", "max_output_tokens": 8, "temperature": 0,
               "reasoning": {"effort": "none"}}  # fmt: skip
    complete = oai.responses.create(**request)  # type: ignore[call-overload]
    assert complete.status == "incomplete"
    assert complete.incomplete_details.reason == "max_output_tokens"
    assert complete.usage.output_tokens == 8
    assert complete.usage.input_tokens_details.cached_tokens >= 0
    events = list(oai.responses.create(stream=True, **request))  # type: ignore[call-overload]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == complete.output_text


def test_an_answer_under_a_json_schema_validates(oai: openai.OpenAI) -> None:
    question = "Is it on? Answer in JSON."
    response_format = {"type": "json_schema", "json_schema": {"name": "switch", "schema": SWITCH, "strict": True}}
    request = {"model": MODEL, "messages": ask(question), "response_format": response_format, "max_tokens": 128,
               "temperature": 0, "extra_body": NO_THINKING}  # fmt: skip
    (choice,) = oai.chat.completions.create(**request).choices  # type: ignore[call-overload]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SWITCH)
    # The schema makes the prompt long enough for a prefix hit, so the streamed answer is no copy of the first.
    content, finish, _ = streamed_chat(oai, **request)
    assert finish == {0: "stop"}
    jsonschema.validate(json.loads(content[0]), SWITCH)
    response = oai.responses.create(
        model=MODEL, input=question, max_output_tokens=128, temperature=0, reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "switch", "schema": SWITCH, "strict": True}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SWITCH)


def test_messages_complete_and_streamed_agree(claude: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": ask("Say something."), **GREEDY_MESSAGES}
    complete = claude.messages.create(**request)  # type: ignore[call-overload]
    assert complete.stop_reason == "max_tokens"
    assert complete.usage.output_tokens == 8
    assert complete.usage.input_tokens > 0
    assert complete.usage.cache_read_input_tokens >= 0
    with claude.messages.stream(**request) as stream:  # type: ignore[call-overload]
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in complete.content]
    assert final.stop_reason == "max_tokens"


def test_grpc_face_streams_the_same_events(mesh: Mesh, oai: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": ask("Hello"), "max_tokens": 6, "temperature": 0, "stream": True,
            **NO_THINKING}  # fmt: skip
    with grpc.insecure_channel(mesh.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = gateway_pb2.GenerateRequest(api=gateway_pb2.API_CHAT_COMPLETIONS, body=json.dumps(body).encode())
        events = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
    assert events[-1].data == b"[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    expected = oai.chat.completions.create(
        model=MODEL, messages=ask("Hello"), max_tokens=6, temperature=0, extra_body=NO_THINKING
    )
    assert text == expected.choices[0].message.content


def prompt_ids(messages: list[dict]) -> list[int]:
    """The prompt's token ids, rendered as the gateway renders them."""
    body = json.dumps({"model": MODEL, "messages": messages, **NO_THINKING})
    request = convert("chat.completions", body)
    return render(request.conversation, request.version, load_tokenizer()).token_ids or []


def served_by(mesh: Mesh, *request_ids: str) -> list[tuple[str, str]]:
    """(prefill, decode) replica of each request, from the gateway's `request` log lines."""
    found = {}
    for line in mesh.child("gateway").log.read_text().splitlines():
        if '"event": "request"' in line:
            entry = json.loads(line)
            found[entry["request_id"]] = (entry["prefill"], entry["decode"][0])
    return [found[rid] for rid in request_ids]


def test_second_turn_reuses_the_first_and_equals_a_cold_run(
    mesh: Mesh, oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """A second turn reports the first turn's blocks as cached, in each API's own usage field, and, with the first
    turn's SWA record in the cache, its greedy output equals a cold run of the same conversation (a fresh
    `cache_salt` shares nothing). It is sent as soon as the first is answered: the gateway waits for the first
    turn's write-back, so it never misses the record."""
    info = model_info(mesh.child("prefill-0").address)
    salt = f"reuse-{uuid.uuid4().hex}"  # a conversation of its own, whatever ran before
    history = [{"role": "user", "content": QUESTION}]
    # One output token: decode's SWA record then ends exactly where the first prompt ends (the last sampled token
    # is not run through the model), so the second turn extends the record's tokens whatever the model said.
    first = oai.chat.completions.create(
        model=MODEL, messages=history, max_tokens=1, temperature=0, extra_body={**NO_THINKING, "cache_salt": salt},
        extra_headers={"x-request-id": f"{salt}-turn-1"},
    )  # fmt: skip
    first_prompt = prompt_ids(history)
    assert first.usage.prompt_tokens == len(first_prompt)
    full_blocks = len(first_prompt) // info.kv_block_tokens * info.kv_block_tokens
    assert full_blocks >= 2 * info.kv_block_tokens

    # Sent at once: decode may still be writing the first turn's SWA record back; the gateway waits for it.
    second = [*history, {"role": "assistant", "content": first.choices[0].message.content}, *[
        {"role": "user", "content": "Now give a short example."}]]  # fmt: skip
    replays = metric(mesh.base_url, "v41mesh_gateway_bounded_replays_total")
    warm = oai.chat.completions.create(
        model=MODEL, messages=second, max_tokens=8, temperature=0, extra_body={**NO_THINKING, "cache_salt": salt},
        extra_headers={"x-request-id": f"{salt}-turn-2"},
    )  # fmt: skip
    cold = oai.chat.completions.create(
        model=MODEL, messages=second, max_tokens=8, temperature=0,
        extra_body={**NO_THINKING, "cache_salt": f"cold-{uuid.uuid4().hex}"},
    )  # fmt: skip
    assert metric(mesh.base_url, "v41mesh_gateway_bounded_replays_total") == replays  # exact SWA: the record was there
    record = sequence_key(
        first_prompt, block_tokens=info.kv_block_tokens, fingerprint=info.fingerprint, salt=salt.encode()
    )
    with CacheClient(mesh.child("cache").address) as cache:
        assert cache.has_record(record)
    assert warm.usage.prompt_tokens_details.cached_tokens >= full_blocks
    assert warm.usage.model_extra["prompt_cache_hit_tokens"] == warm.usage.prompt_tokens_details.cached_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # The idle single mesh has two replicas of each role: the second turn went back to the first turn's replicas.
    turns = served_by(mesh, f"{salt}-turn-1", f"{salt}-turn-2")
    assert turns[0] == turns[1]

    # The same first prompt through the other two APIs: the cache is shared, each reports it in its own field.
    message = claude.messages.create(
        model=MODEL, max_tokens=1, messages=history, thinking={"type": "disabled"}, extra_body={"cache_salt": salt}
    )
    assert message.usage.cache_read_input_tokens >= full_blocks
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(first_prompt)
    response = oai.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=1, reasoning={"effort": "none"},
        extra_body={"cache_salt": salt},
    )  # fmt: skip
    assert response.usage.input_tokens_details.cached_tokens >= full_blocks


def test_a_rank_killed_mid_stream_ends_the_stream_and_its_group_comes_back(mesh: Mesh, oai: openai.OpenAI) -> None:
    """Ranked mesh: decode-0's follower rank killed while a stream runs on the group → the client's stream ends with
    the mid-generation error within seconds, decode-0 exits non-zero, and once restarted the group serves again."""
    spawned = [e for e in log_events(mesh.child("decode-0").log) if e.get("event") == "ranks_spawned"]
    if not spawned:
        pytest.skip("single-process replicas: tests/e2e/test_failures.py kills whole replicas")
    (follower,) = spawned[-1]["pids"]
    request = {"model": MODEL, "messages": ask("a long story"), "max_tokens": 3000, "extra_body": NO_THINKING}
    with killed(mesh, "decode-0"):
        stream = oai.chat.completions.create(stream=True, **request)  # type: ignore[call-overload]
        next(iter(stream))
        os.kill(follower, signal.SIGKILL)
        at = time.monotonic()
        with pytest.raises(openai.APIError, match="failed mid-generation"):
            for _ in stream:
                pass
        assert time.monotonic() - at < FAILURE_S
        assert mesh.child("decode-0").process.wait(timeout=FAILURE_S) == 1  # type: ignore[union-attr]
    after = oai.chat.completions.create(**{**request, "max_tokens": 4})  # type: ignore[call-overload]
    assert after.choices[0].finish_reason == "length"


def log_events(path: Path) -> list[dict]:
    """The JSON log lines of a child's log file (every run's, oldest first)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return [e for e in events if isinstance(e, dict)]
