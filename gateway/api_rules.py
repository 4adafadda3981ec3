"""What the public APIs refuse that the codec converts anyway: deepseek-recipe, the recipe's reference, turns these
into prompts too, so the gateway refuses them itself, with the 400 and the words the OpenAI and Anthropic APIs use.

- A body declared as anything but JSON (`Content-Type: text/plain`, or curl's default form encoding); a body that
  declares no type is read as JSON.
- Anthropic Messages without `max_tokens` (a required field there; `/v1/messages/count_tokens` takes none).
- Anthropic Messages whose first message (after system messages) is not the user's.
"""

from __future__ import annotations

from gateway.errors import GatewayError, Kind
from recipe import Assistant, ConvertedRequest, System

JSON_MEDIA_TYPE = "application/json"


def check_content_type(declared: str | None) -> None:
    """A body must be declared JSON (`application/json`, any parameters) or not declared at all."""
    if not declared or declared.partition(";")[0].strip().lower() == JSON_MEDIA_TYPE:
        return
    raise GatewayError(
        Kind.BAD_REQUEST,
        f"Unsupported content type: '{declared}'. This API method only accepts '{JSON_MEDIA_TYPE}' requests, but "
        f"you specified the header 'Content-Type: {declared}'. Please try again with a supported content type.",
    )


def check_request(request: ConvertedRequest, *, generation: bool) -> None:
    """The API's own rules for a converted request (`generation`: it asks for an answer, not a token count)."""
    if request.api != "messages":
        return
    if generation and request.sampling.max_tokens is None:
        raise GatewayError(Kind.BAD_REQUEST, "max_tokens: Field required", param="max_tokens")
    first = next((m for m in request.conversation.messages if not isinstance(m, System)), None)
    if isinstance(first, Assistant):
        raise GatewayError(Kind.BAD_REQUEST, 'messages: first message must use the "user" role', param="messages")
