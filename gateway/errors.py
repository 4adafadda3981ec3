"""What can go wrong with a request before its response starts, as one error type with an HTTP status, a gRPC
code and each API's own error body (the recipe's `RecipeError` shapes it)."""

from __future__ import annotations

import enum
from typing import Any

import grpc

from recipe import Api, RecipeError


class Kind(enum.Enum):
    """Error kinds: the `kind` label of v41mesh_gateway_errors_total, each with its HTTP status and gRPC code."""

    BAD_REQUEST = ("bad_request", 400, grpc.StatusCode.INVALID_ARGUMENT)
    UNAUTHORIZED = ("unauthorized", 401, grpc.StatusCode.UNAUTHENTICATED)
    NOT_FOUND = ("not_found", 404, grpc.StatusCode.NOT_FOUND)
    TOO_LARGE = ("too_large", 413, grpc.StatusCode.INVALID_ARGUMENT)
    OVERLOADED = ("overloaded", 429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    INTERNAL = ("internal", 500, grpc.StatusCode.INTERNAL)
    UNAVAILABLE = ("unavailable", 503, grpc.StatusCode.UNAVAILABLE)
    TIMEOUT = ("timeout", 504, grpc.StatusCode.DEADLINE_EXCEEDED)
    # Failures after the response started: only ever reported inside the stream, as the API's error event.
    BACKEND_FAILED = ("backend_failed", 503, grpc.StatusCode.UNAVAILABLE)

    def __init__(self, label: str, status: int, code: grpc.StatusCode) -> None:
        self.label = label
        self.status = status
        self.code = code


class GatewayError(Exception):
    """A request the gateway cannot serve: `kind` says how to answer; `retry_after_s` goes to Retry-After."""

    def __init__(
        self,
        kind: Kind,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_recipe(cls, error: RecipeError) -> GatewayError:
        kind = next((k for k in Kind if k.status == error.status), Kind.BAD_REQUEST)
        return cls(kind, error.message, param=error.param, code=error.code)

    def body(self, api: Api) -> dict[str, Any]:
        """The error body of `api` (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", "error": {...}}`)."""
        return RecipeError(self.message, param=self.param, status=self.kind.status, api=api, code=self.code).body()

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}
