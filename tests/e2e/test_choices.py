"""Chat `n > 1` through the real mesh: one prefill serves every choice (each decodes from its own handoff record of
it), and its seeded choices equal the n = 1 requests with seeds seed + i."""

from __future__ import annotations

import uuid
from typing import Any

import openai
from e2e_helpers import MODEL, metric, prefills_of

from mesh.processes import Mesh

NO_THINKING = {"thinking": {"type": "disabled"}}
QUESTION = [{"role": "user", "content": "Write a short poem about prefix caches. " * 4}]


def sampled(oai: openai.OpenAI, n: int, seed: int, request_id: str) -> Any:
    """A sampled completion of QUESTION with a cache salt of its own: its prefill starts cold, as every other's."""
    return oai.chat.completions.create(
        model=MODEL, messages=QUESTION, n=n, seed=seed, max_tokens=6, temperature=1.0,
        extra_body={**NO_THINKING, "cache_salt": uuid.uuid4().hex}, extra_headers={"x-request-id": request_id},
    )  # fmt: skip


def test_n_choices_share_one_prefill_and_equal_single_requests_seeded_apart(mesh: Mesh, oai: openai.OpenAI) -> None:
    rid = f"choices-{uuid.uuid4().hex}"
    prefill_calls = metric(mesh.base_url, "v41mesh_gateway_prefill_seconds_count")
    shared = sampled(oai, n=3, seed=11, request_id=rid)
    (encoded,) = prefills_of(mesh, rid)  # one prompt encoded for the three choices
    assert encoded["prompt_tokens"] == shared.usage.prompt_tokens
    assert metric(mesh.base_url, "v41mesh_gateway_prefill_seconds_count") == prefill_calls + 1
    singles = [sampled(oai, n=1, seed=11 + i, request_id=f"{rid}-single-{i}") for i in range(3)]
    contents = [c.message.content for c in shared.choices]
    assert contents == [s.choices[0].message.content for s in singles]
    assert len(set(contents)) > 1  # each choice its own seed
    assert shared.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert shared.usage.prompt_tokens_details.cached_tokens == 0
    assert shared.usage.completion_tokens == 3 * 6
