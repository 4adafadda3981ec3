"""The gRPC face: gateway.v1.Gateway/Generate takes the API and its JSON body and streams the same protocol events
the HTTP endpoint sends as SSE (a non-streaming body: one event with the complete response).

A request refused before its reply started ends with the status code of its error kind (bad input:
INVALID_ARGUMENT, naming the problem); the API's error body travels in the `error-body` trailing metadata. A
failure mid-stream sends the API's error events, then ends with UNAVAILABLE. A cancelled call stops decoding.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import msgspec

from gateway.affinity import session_of
from gateway.errors import GatewayError
from gateway.service import Gateway, presented_key, request_id
from proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from recipe import Api

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
APIS: dict[int, Api] = {
    gateway_pb2.API_CHAT_COMPLETIONS: "chat.completions",
    gateway_pb2.API_RESPONSES: "responses",
    gateway_pb2.API_MESSAGES: "messages",
}


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.Event]:
        api = APIS.get(request.api)
        if api is None:
            names = ", ".join(gateway_pb2.Api.Name(k) for k in APIS)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"api must be one of {names}; got {request.api}")
        assert api is not None
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        rid = request_id(metadata.get("x-request-id"))
        try:
            key = request.api_key or presented_key(metadata)
            session = session_of(metadata)
            reply, ticket = await self.gateway.open(api, request.body, api_key=key, request_id=rid, session=session)
        except GatewayError as error:
            await _abort(context, error, api)
            return
        try:
            if reply.job.request.stream:
                async for event in reply.events():
                    yield gateway_pb2.Event(event=event.name or "", data=event.data)
                if reply.failure is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reply.failure.message)
            else:
                try:
                    body = await reply.body()
                except GatewayError as error:
                    await _abort(context, error, api)
                    return
                yield gateway_pb2.Event(event="", data=msgspec.json.encode(body))
        finally:
            self.gateway.close(reply, ticket)


async def _abort(context: grpc.aio.ServicerContext, error: GatewayError, api: Api) -> None:
    trailers = [("error-body", msgspec.json.encode(error.body(api)).decode())]
    if error.retry_after_s is not None:
        trailers.append(("retry-after", str(error.retry_after_s)))
    context.set_trailing_metadata(tuple(trailers))
    await context.abort(error.kind.code, error.message)
