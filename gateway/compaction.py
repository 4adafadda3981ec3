"""`POST /v1/responses/compact` (Open Responses 2026-04-24): the model summarises a conversation — a previous
response's chain, the given input, or both — into one compaction item. The result is the conversation's user
messages followed by that item; a client starts a new chain with it as `input` (no `previous_response_id`), and
the recipe renders the item as the summary it carries (recipe/request/responses.py).

The summary is an ordinary generation through the same path as `/v1/responses` (admission, routing, the prefix
cache: the conversation's prompt is the opening of the summary's), with reasoning off, `store: false` and a budget
of `compact_max_tokens`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from gateway.errors import GatewayError
from gateway.service import Gateway
from recipe import RecipeError
from recipe.request.common import decode
from recipe.request.responses import compaction_item

COMPACT_PROMPT = (
    "Summarise the conversation so far for your own later use: the task, the decisions and facts established, "
    "what has been done and what remains. Write only the summary."
)


class CompactRequest(msgspec.Struct):
    """The body of `/v1/responses/compact` (`model` is required; `prompt_cache_key` is accepted and unused)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None


def _summary_body(request: CompactRequest, items: list[dict[str, Any]], max_tokens: int) -> bytes:
    prompt = {"type": "message", "role": "user", "content": COMPACT_PROMPT}
    body: dict[str, Any] = {
        "model": request.model,
        "input": [*items, prompt],
        "reasoning": {"effort": "none"},
        "max_output_tokens": max_tokens,
        "store": False,
    }
    if request.instructions is not None:
        body["instructions"] = request.instructions
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return msgspec.json.encode(body)


def _text(response: dict[str, Any]) -> str:
    """The answer text of a Responses response object."""
    parts = (part for item in response["output"] if item["type"] == "message" for part in item["content"])
    return "".join(part["text"] for part in parts if part["type"] == "output_text")


async def compact(
    gateway: Gateway, body: bytes, *, api_key: str | None, request_id: str, session: str | None, max_tokens: int
) -> dict[str, Any]:
    """The compacted conversation of a `/v1/responses/compact` body (CompactResource); GatewayError if refused."""
    gateway.authorize(api_key)
    gateway.check_size(len(body))
    try:
        request = await gateway.workers.run(len(body), decode, body, CompactRequest)
    except RecipeError as error:
        raise GatewayError.from_recipe(error) from None
    chain = await gateway.chain(body, {})
    items = [*(chain.previous.items if chain.previous else ()), *chain.input_items]
    summary = _summary_body(request, items, max_tokens)
    reply, ticket = await gateway.open("responses", summary, api_key=api_key, request_id=request_id, session=session)
    try:
        response = await reply.body()
    finally:
        gateway.close(reply, ticket)
    kept = [item for item in items if item["type"] == "message" and item.get("role") == "user"]
    return {
        "id": response["id"],
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*kept, compaction_item(f"cmp_{uuid.uuid4().hex}", _text(response))],
        "usage": response["usage"],
    }
