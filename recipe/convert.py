"""`convert(api, body)`: an API request body → ConvertedRequest, or one RecipeError."""

from __future__ import annotations

from collections.abc import Callable

from recipe.errors import APIS, Api, RecipeError
from recipe.options import ConversionOptions, ConvertedRequest
from recipe.request import chat, messages, responses

DEFAULT_OPTIONS = ConversionOptions()

_CONVERTERS: dict[str, Callable[[bytes | str | dict, ConversionOptions], ConvertedRequest]] = {
    "chat.completions": chat.convert,
    "responses": responses.convert,
    "messages": messages.convert,
}


def convert(api: Api, body: bytes | str | dict, options: ConversionOptions | None = None) -> ConvertedRequest:
    """Convert a request of `api` ("chat.completions", "responses" or "messages").

    `body` is the JSON body (bytes or text) or its decoded dict. Raises `RecipeError` (with the HTTP status
    and `api`'s error body) for anything invalid; never anything else for bad input.
    """
    converter = _CONVERTERS.get(api)
    if converter is None:
        raise ValueError(f"unknown api {api!r}; expected one of {', '.join(APIS)}")
    try:
        return converter(body, options or DEFAULT_OPTIONS)
    except RecipeError as error:
        error.api = api
        raise
