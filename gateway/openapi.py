"""The OpenAPI 3.1 document served at /openapi.json.

Request schemas are generated (msgspec) from the recipe's own request types, the ones that validate bodies, so the
document cannot drift from what is accepted; the gateway adds what it decides itself: the served model names,
`cache_salt`, the output cap, the error bodies and the API-key schemes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import msgspec

from gateway.job import MAX_SALT_CHARS
from recipe.request.chat import ChatRequest
from recipe.request.messages import MessagesRequest
from recipe.request.responses import ResponsesRequest

# path → (operation id, request type, budget field, the API's error-body schema)
ENDPOINTS: dict[str, tuple[str, type, str, str]] = {
    "/v1/chat/completions": ("createChatCompletion", ChatRequest, "max_tokens", "OpenAIError"),
    "/v1/responses": ("createResponse", ResponsesRequest, "max_output_tokens", "OpenAIError"),
    "/v1/messages": ("createMessage", MessagesRequest, "max_tokens", "AnthropicError"),
}
REQUIRED_BUDGET = {"/v1/messages"}  # Anthropic Messages requires max_tokens (gateway/api_rules.py)
COUNT_TOKENS_REQUEST = "MessageCountTokensRequest"  # a Messages request without max_tokens
ERROR_STATUSES = {
    "400": "The request is invalid (the message names the field)",
    "401": "Missing or wrong API key",
    "413": "The body is larger than the gateway accepts",
    "429": "The gateway's queue is full; retry after the Retry-After header's seconds",
    "503": "No replica could serve the request",
}

_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMAS = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _NULLABLE_STRING,
                    "code": _NULLABLE_STRING,
                },
            }
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}


def _operation(operation_id: str, request: str, error: str, secured: bool) -> dict[str, Any]:
    error_body = {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}},
        },
        "responses": {
            "200": {
                "description": "The complete response, or (stream: true) its server-sent events",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **{status: {"description": text, "content": error_body} for status, text in ERROR_STATUSES.items()},
        },
    }
    if secured:
        operation["security"] = [{"bearer": []}, {"apiKey": []}]
    return operation


def _count_tokens_operation(secured: bool) -> dict[str, Any]:
    """A Messages request without `max_tokens` → {"input_tokens": n}."""
    operation = _operation("countMessageTokens", COUNT_TOKENS_REQUEST, "AnthropicError", secured)
    counted = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}
    operation["responses"]["200"] = {
        "description": "Input tokens of the request as the model reads it",
        "content": {"application/json": {"schema": counted}},
    }
    del operation["responses"]["429"], operation["responses"]["503"]  # counting takes no queue slot nor replica
    return operation


def openapi_document(model_names: Sequence[str], max_output_tokens: int, secured: bool) -> dict[str, Any]:
    types = [request for _, request, _, _ in ENDPOINTS.values()]
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    paths: dict[str, Any] = {}
    for path, (operation_id, request, budget, error) in ENDPOINTS.items():
        properties = components[request.__name__]["properties"]
        properties["model"] = {"type": "string", "enum": list(model_names)}
        properties["cache_salt"] = {
            "type": "string",
            "maxLength": MAX_SALT_CHARS,
            "description": "Isolates this tenant's prefix cache: requests share cached prefixes only with equal salts",
        }
        limit = {"type": "integer", "minimum": 1, **({"maximum": max_output_tokens} if max_output_tokens else {})}
        if path in REQUIRED_BUDGET:
            counting = copy.deepcopy(components[request.__name__])
            del counting["properties"][budget]
            components[COUNT_TOKENS_REQUEST] = counting
            properties[budget] = limit
            components[request.__name__]["required"] = [*components[request.__name__]["required"], budget]
        else:
            properties[budget] = {"anyOf": [limit, {"type": "null"}]}
        paths[path] = {"post": _operation(operation_id, request.__name__, error, secured)}
    paths["/v1/messages/count_tokens"] = {"post": _count_tokens_operation(secured)}
    paths["/v1/models"] = {"get": {"operationId": "listModels", "responses": {"200": {"description": "Served models"}}}}
    health = {"200": {"description": "Ready"}, "503": {"description": "Starting or draining"}}
    paths["/health"] = {"get": {"operationId": "health", "responses": health}}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "v41mesh gateway", "version": "1", "description": "OpenAI and Anthropic APIs of the mesh"},
        "paths": paths,
        "components": {"schemas": {**components, **ERROR_SCHEMAS}},
    }
    if secured:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    return document
