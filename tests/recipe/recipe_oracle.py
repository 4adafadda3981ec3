"""deepseek-recipe 0.2.0 as a test oracle (tests only; the product never imports it).

Helpers run the reference on the same inputs as ours and normalise both outputs for comparison:
ids, timestamps and signatures are random or clock-dependent, so they are replaced by placeholders.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import deepseek_recipe as dr

from recipe import Tokenizer
from recipe.tokens import OFFICIAL_IMAGE_TOKEN

REQUESTS = {
    "chat.completions": dr.ChatCompletionRequest,
    "responses": dr.ResponsesRequest,
    "messages": dr.MessagesRequest,
}
RESPONSES = {
    "chat.completions": dr.ChatCompletionResponse,
    "responses": dr.ResponsesResponse,
    "messages": dr.MessagesResponse,
}
FINISH = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "content_filter": dr.InferenceFinishReason.ContentFilter,
}
VOLATILE = {"id", "call_id", "created", "created_at", "completed_at", "item_id", "encrypted_content", "signature"}


class RejectedError(Exception):
    """The reference rejected the request."""


def _options(image_token: str) -> dr.ConversionOptions:
    options = dr.ConversionOptions()
    return options.with_special_tokens(dr.SpecialTokens(image=image_token))


def _encoding(model: str, image_token: str) -> Any:
    encoding = dr.DeepseekV4Encoding() if model == "DeepSeek-V4-Pro" else dr.DeepseekV41Encoding()
    return encoding.with_special_tokens(dr.SpecialTokens(image=image_token))


def _raw(body: dict[str, Any]) -> bytes:
    """The body as JSON text: the reference reads integers beyond 64 bits only from text."""
    return json.dumps(body).encode()


def convert(api: str, body: dict[str, Any], image_token: str = OFFICIAL_IMAGE_TOKEN) -> Any:
    try:
        return REQUESTS[api](_raw(body)).convert(_options(image_token))
    except (dr.ConversionError, ValueError) as error:
        raise RejectedError(str(error)) from None


def prompt(api: str, body: dict[str, Any], image_token: str = OFFICIAL_IMAGE_TOKEN) -> str:
    converted = convert(api, body, image_token)
    return _encoding(body["model"], image_token).render_conversation(converted.conversation).prompt


def token_ids(
    api: str, body: dict[str, Any], tokenizer_json: str, image_token: str = OFFICIAL_IMAGE_TOKEN
) -> list[int]:
    converted = convert(api, body, image_token)
    tokenizer = _tokenizer(tokenizer_json)
    return _encoding(body["model"], image_token).with_tokenizer(tokenizer).encode(converted.conversation)


_TOKENIZERS: dict[int, Any] = {}


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """Our (patched) tokenizer as tokenizer.json text, to load the very same vocabulary into the reference."""
    return _json_of(id(tokenizer), tokenizer)


@functools.lru_cache(maxsize=4)
def _json_of(key: int, tokenizer: Tokenizer) -> str:
    return tokenizer.hf.to_str()


def _tokenizer(tokenizer_json: str) -> Any:
    key = hash(tokenizer_json)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = dr.Tokenizer.from_str(tokenizer_json)
    return _TOKENIZERS[key]


def run_stream(
    api: str,
    body: dict[str, Any],
    chunks: list[str] | list[list[int]],
    finish: str | None,
    *,
    usage: tuple[int, int] = (10, 3),
    tokenizer_json: str | None = None,
    logprobs: list[list[tuple[float, list[tuple[int, float]]]]] | None = None,
) -> tuple[list[tuple[str | None, Any]], dict[str, Any]]:
    """The reference's events (name, decoded data) and complete response for backend output `chunks`."""
    request = REQUESTS[api](_raw(body))
    extras: dict[str, Any] = {}
    if api == "responses":
        extras["namespaces"] = request.namespace_tool_map(dr.ConversionOptions())
        extras["echo"] = request.echo()
        request = REQUESTS[api](_raw(body))
    converted = request.convert(dr.ConversionOptions())
    generator = REQUESTS[api].chunk_generator(converted, "ID", "MODEL")
    if api == "responses":
        generator = generator.with_namespace_tool_map(extras["namespaces"]).with_echo(extras["echo"])
    tokenizer = _tokenizer(tokenizer_json) if tokenizer_json is not None else None
    processor = dr.StreamProcessor(generator, converted.parsing_options, tokenizer)
    prompt_usage = dr.PromptUsage(prompt_tokens=usage[0], prompt_cache_hit_tokens=usage[1])
    out = list(processor.push(dr.InferenceChunk.ready(prompt_usage=prompt_usage, system_fingerprint="fp")))
    for position, chunk in enumerate(chunks):
        if processor.finished:
            break
        if isinstance(chunk, str):
            out += processor.push(dr.InferenceChunk.text(chunk, 1))
        else:
            out += processor.push(dr.InferenceChunk.tokens(chunk, logprobs[position] if logprobs else None))
    if finish is not None and not processor.finished:
        out += processor.push(dr.InferenceChunk.finish(FINISH[finish]))
    out += processor.finish()
    response = RESPONSES[api]("ID", "MODEL", 0, usage[0], usage[1])
    events = [(RESPONSES[api].sse_event_name(e), json.loads(e.to_json())) for e in out]
    for event in out:
        response.accumulate(event)
    return events, json.loads(response.to_json())


DROPPED = ("completion_tokens_details", "output_tokens_details", "cache_write_tokens")


def normalize(value: Any) -> Any:
    """`value` with ids, timestamps and signatures replaced, and usage detail fields the reference omits
    in text mode dropped (reasoning-token counts are ours, see docs/recipe.md). Two Responses fields differ on
    purpose: `store` echoes the request (the reference always says false), and an unset `text.verbosity` is absent,
    as the Open Responses schema requires (the reference writes null)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in VOLATILE and isinstance(item, str | int) and not isinstance(item, bool):
                out[key] = "<volatile>"
            elif key == "store" and isinstance(item, bool):
                out[key] = "<echoed>"
            elif key in DROPPED or (key == "verbosity" and item is None):
                continue
            elif key == "model":
                out[key] = "MODEL"
            else:
                out[key] = normalize(item)
        return out
    if isinstance(value, list):
        return [normalize(item) for item in value]
    return value
