"""Responses chains: a request's `previous_response_id` resolved into its conversation, and a finished response
kept as the `Turn` the next one continues from.

The spec's concatenation `previous.input + previous.output + input` is spliced into the request's `input` before
the recipe converts it (the recipe keeps nothing), so the prompt renders the same conversation again and its
opening is a prefix hit on the KV the previous turn left in the cache: the previous turn's cache salt is reused
unless the request names its own. Instructions are not carried over, as the API says.

A turn is looked up in the caller's connection-local memory first (a WebSocket keeps its latest turn, stored or
not), then in the store (`store: true` responses only).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from gateway.errors import GatewayError, Kind
from gateway.response_store import ResponseStore, Turn
from mesh.logging import get_logger
from recipe import RecipeError
from recipe.request.common import decode

ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}

log = get_logger("gateway")


class _ChainFields(msgspec.Struct):
    """The fields of a Responses body that chaining reads (the recipe validates the rest)."""

    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    cache_salt: str | None = None


class Chain(msgspec.Struct):
    """A Responses request with its chain resolved.

    body: the body the recipe converts (the previous conversation spliced into `input`).
    input_items: the request's own input, as items with ids.
    previous: the turn it continues, if any.
    store: keep the finished response (the API's default).
    """

    body: bytes
    input_items: list[dict[str, Any]]
    previous: Turn | None
    store: bool

    def turn(self, response: dict[str, Any], salt: bytes, token_ids: list[int]) -> Turn:
        """What this finished response leaves for its continuation."""
        history = self.previous.items if self.previous else []
        items = [*history, *self.input_items, *response["output"]]
        return Turn(response["id"], items, self.input_items, response, salt.decode(), token_ids)


class Request(msgspec.Struct):
    """A Responses body read for chaining: the whole body and the fields chaining needs (`fields` None when the
    body is not a JSON object: the recipe then reports what is wrong with it)."""

    raw: bytes
    body: dict[str, Any] | None
    fields: _ChainFields | None


def read(raw: bytes) -> Request:
    """Decode a body for chaining (on a worker thread: bodies can be large)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return Request(raw, None, None)
    if not isinstance(body, dict):
        return Request(raw, None, None)
    try:
        return Request(raw, body, decode(raw, _ChainFields))
    except RecipeError as error:
        raise GatewayError.from_recipe(error) from None


def input_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A request's input as items with ids (a string is one user message; a message's text content a list of one
    text part), the shape `input_items` lists and a compaction returns."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given or ():
        kind = item.get("type", "message")
        normal = {"id": f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}", **item, "type": kind}
        if kind == "message":
            normal.setdefault("status", "completed")
            if isinstance(normal.get("content"), str):
                part = "output_text" if normal.get("role") == "assistant" else "input_text"
                normal["content"] = [{"type": part, "text": normal["content"]}]
        items.append(normal)
    return items


def previous_not_found(response_id: str) -> GatewayError:
    return GatewayError(
        Kind.BAD_REQUEST,
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def spliced(request: Request, previous: Turn | None) -> Chain:
    """The chain of a read request continuing `previous` (None: a new conversation)."""
    fields = request.fields
    if fields is None or request.body is None:
        return Chain(request.raw, [], None, store=False)
    own = input_items(fields.input)
    store = fields.store is not False
    if previous is None:
        return Chain(request.raw, own, None, store)
    body = {**request.body, "input": [*previous.items, *own]}
    if fields.cache_salt is None and previous.salt:
        body["cache_salt"] = previous.salt
    return Chain(msgspec.json.encode(body), own, previous, store)


async def find(store: ResponseStore, response_id: str, local: Mapping[str, Turn]) -> tuple[Turn, str]:
    """The turn `response_id` names and where it was found (connection, store); 400 previous_response_not_found."""
    if response_id in local:
        return local[response_id], "connection"
    turn = await store.get(response_id)
    if turn is None:
        raise previous_not_found(response_id)
    return turn, "store"


def reused_tokens(previous: Turn, token_ids: list[int]) -> int:
    """How many leading tokens a continued prompt shares with its previous turn's sequence: the part of it whose
    KV that turn left in the cache."""
    shared = 0
    for mine, theirs in zip(token_ids, previous.token_ids, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared
