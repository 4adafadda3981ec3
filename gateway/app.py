"""The HTTP face (Starlette): the three generation endpoints, the stored Responses (retrieve, delete, input items),
/v1/responses/compact, the Responses WebSocket (gateway/websocket.py), /v1/messages/count_tokens, /v1/models,
/health (ready), /live (the process answers), /metrics and /openapi.json.

Every error leaves in the caller's API shape: OpenAI `{"error": {...}}` on /v1/chat/completions and /v1/responses,
Anthropic `{"type": "error", "error": {...}}` on /v1/messages, with the request id in `x-request-id`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.affinity import session_of
from gateway.api_rules import check_content_type
from gateway.compaction import compact
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, Kind
from gateway.openapi import openapi_document
from gateway.service import Gateway, presented_key, request_id
from gateway.streaming import EventStream, cancel_on_disconnect
from gateway.websocket import ResponsesSocket
from mesh.logging import get_logger
from recipe import Api
from recipe.request import common

ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat.completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}

log = get_logger("gateway")


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers=dict(headers or {}), media_type="application/json")


def _api_of(request: Request) -> Api:
    """The API whose error shape a request expects (Anthropic clients send `anthropic-version`)."""
    if request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        return "messages"
    return "chat.completions"


def _error(error: GatewayError, api: Api, rid: str) -> Response:
    return _json(error.body(api), error.kind.status, {**error.headers(), "x-request-id": rid})


async def _read_body(request: Request, gateway: Gateway) -> bytes:
    """The body, refused with 400 if it is not declared JSON, and with 413 as soon as it is known to be too large
    (declared or streamed)."""
    check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        gateway.check_size(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        gateway.check_size(len(body))
    return bytes(body)


def _generate(gateway: Gateway, api: Api) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        key = presented_key(request.headers)
        try:
            gateway.authorize(key)  # before reading a body that may be huge
            body = await _read_body(request, gateway)
        except GatewayError as error:
            gateway.refused(api, error)
            return _error(error, api, rid)
        except ClientDisconnect:
            return Response(status_code=499)  # gone while sending the body; nobody reads this
        try:
            session = session_of(request.headers)
            reply, ticket = await gateway.open(api, body, api_key=key, request_id=rid, session=session)
        except GatewayError as error:
            return _error(error, api, rid)
        headers = {"x-request-id": rid}
        if reply.job.request.stream:
            events = (event.sse() async for event in reply.events())
            return EventStream(events, lambda: gateway.close(reply, ticket), headers)
        try:
            return _json(await cancel_on_disconnect(request.receive, reply.body()), headers=headers)
        except GatewayError as error:
            return _error(error, api, rid)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        finally:
            gateway.close(reply, ticket)

    return endpoint


def _count_tokens(gateway: Gateway) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        key = presented_key(request.headers)
        try:
            gateway.authorize(key)
            count = await gateway.count_tokens(await _read_body(request, gateway), api_key=key)
        except GatewayError as error:
            return _error(error, "messages", rid)
        except ClientDisconnect:
            return Response(status_code=499)
        return _json({"input_tokens": count}, headers={"x-request-id": rid})

    return endpoint


def _not_found(response_id: str) -> GatewayError:
    return GatewayError(Kind.NOT_FOUND, f"Response with id '{response_id}' not found.", param="response_id")


class _ItemsPage(msgspec.Struct):
    """The query of `GET /v1/responses/{id}/input_items`."""

    limit: Annotated[int, msgspec.Meta(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


def _items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of a response's input items, as OpenAI lists them (newest first unless `order=asc`)."""
    try:
        page = msgspec.convert(dict(query), _ItemsPage, strict=False)
    except msgspec.ValidationError as exc:
        raise GatewayError(Kind.BAD_REQUEST, f"Invalid query: {exc}", param=common.field_of(str(exc))) from None
    ordered = items if page.order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = ids.index(page.after) + 1 if page.after in ids else 0
    data = ordered[start : start + page.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + page.limit < len(ordered),
    }


def _stored(gateway: Gateway) -> Callable[[Request], Any]:
    """GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: 404 for an id not stored (or
    deleted, or past its retention)."""

    async def endpoint(request: Request) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        response_id = request.path_params["response_id"]
        try:
            gateway.authorize(presented_key(request.headers))
            if request.method == "DELETE":
                if not await gateway.store.delete(response_id):
                    raise _not_found(response_id)
                return _json({"id": response_id, "object": "response.deleted", "deleted": True})
            turn = await gateway.store.get(response_id)
            if turn is None:
                raise _not_found(response_id)
            if request.url.path.endswith("/input_items"):
                return _json(_items_page(turn.input_items, request.query_params), headers={"x-request-id": rid})
            return _json(turn.response, headers={"x-request-id": rid})
        except GatewayError as error:
            gateway.refused("responses", error)
            return _error(error, "responses", rid)

    return endpoint


def _compact(gateway: Gateway, max_tokens: int) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        key = presented_key(request.headers)
        try:
            gateway.authorize(key)
            body = await _read_body(request, gateway)
            work = compact(gateway, body, api_key=key, request_id=rid, session=session_of(request.headers),
                           max_tokens=max_tokens)  # fmt: skip
            return _json(await cancel_on_disconnect(request.receive, work), headers={"x-request-id": rid})
        except GatewayError as error:
            return _error(error, "responses", rid)
        except ClientDisconnect:
            return Response(status_code=499)

    return endpoint


def create_app(
    gateway: Gateway, registry: CollectorRegistry, readiness: Callable[[], dict[str, Any]], cfg: GatewayConfig
) -> Starlette:
    """The Starlette app. `readiness()` reports {"ready": bool, ...} for /health."""
    started = int(time.time())
    document = msgspec.json.encode(
        openapi_document(gateway.codec.model_names, gateway.codec.max_output_tokens, gateway.api_key_required)
    )

    async def models(request: Request) -> Response:
        try:
            gateway.authorize(presented_key(request.headers))
        except GatewayError as error:
            return _error(error, _api_of(request), request_id(request.headers.get("x-request-id")))
        data = [
            {"id": name, "object": "model", "created": started, "owned_by": "v41mesh", "type": "model",
             "display_name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
            for name in gateway.codec.model_names
        ]  # fmt: skip
        return _json({"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"],
                      "last_id": data[-1]["id"]})  # fmt: skip

    async def health(request: Request) -> Response:
        state = readiness()
        return _json(state, 200 if state["ready"] else 503)

    async def live(request: Request) -> Response:
        return _json({"live": True})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = Kind.NOT_FOUND if exc.status_code == 404 else Kind.BAD_REQUEST
        error = GatewayError(kind, f"{request.method} {request.url.path}: {exc.detail}")
        response = _error(error, _api_of(request), request_id(request.headers.get("x-request-id")))
        response.status_code = exc.status_code
        return response

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal_error", path=request.url.path)
        error = GatewayError(Kind.INTERNAL, "The gateway failed unexpectedly; the error is logged.")
        return _error(error, _api_of(request), request_id(request.headers.get("x-request-id")))

    async def responses_socket(socket: WebSocket) -> None:
        await ResponsesSocket(gateway, socket, cfg.websocket_max_s).serve()

    routes = [Route(path, _generate(gateway, api), methods=["POST"]) for path, api in ROUTES.items()]
    stored = _stored(gateway)
    routes += [
        Route("/v1/responses/compact", _compact(gateway, cfg.compact_max_tokens), methods=["POST"]),
        Route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", stored, methods=["GET"]),
        WebSocketRoute("/v1/responses", responses_socket),
        Route("/v1/messages/count_tokens", _count_tokens(gateway), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})
