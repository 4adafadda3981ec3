"""The one error type of the codec: bad input, with its HTTP status and the API-shaped error body."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Api = Literal["chat.completions", "responses", "messages"]
APIS: tuple[Api, ...] = ("chat.completions", "responses", "messages")

# Anthropic names error types by status; OpenAI uses one type per family.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class RecipeError(Exception):
    """A request the codec rejects (or a failure it reports), ready to be sent back to the client.

    status: the HTTP status (4xx for bad input).
    param: the request field at fault, as a dotted path (`messages.2.content`), when one is.
    code: OpenAI's machine-readable error code (`previous_response_not_found`), when there is one.
    api: the API whose error shape `body()` uses; `convert` sets it.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        api: Api = "chat.completions",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.api = api

    @property
    def error_type(self) -> str:
        if self.api == "messages":
            return _ANTHROPIC_TYPES.get(self.status, "api_error")
        return "invalid_request_error" if self.status < 500 else "internal_error"

    def body(self) -> dict[str, Any]:
        """The error response body of `api` (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`)."""
        if self.api == "messages":
            return {"type": "error", "error": {"type": self.error_type, "message": self.message}}
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return msgspec.json.encode(self.body())
