"""Prefix reuse through the mesh: a second turn reports the first turn's blocks as cached, in each API's own usage
field, and, with the first turn's SWA record in the cache, its greedy output equals a cold run of the same
conversation (a fresh `cache_salt` shares nothing). The second turn is sent as soon as the first is answered: the
gateway waits for the first turn's write-back, so it never misses the record."""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
from e2e_helpers import MODEL, metric, model_info

from cache_svc.client import CacheClient
from mesh.block_keys import sequence_key
from mesh.processes import Mesh
from recipe import convert, load_tokenizer, render

NO_THINKING = {"thinking": {"type": "disabled"}}
QUESTION = "Explain, step by step, how a prefix cache decides what it can reuse. " * 5


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
    # The idle mesh has two replicas of each role: the second turn went back to the first turn's replicas.
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
