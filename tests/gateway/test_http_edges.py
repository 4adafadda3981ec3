"""The gateway's own answers, with no model behind it: keys, sizes, shapes, health, metrics, models, gRPC codes.

The real `openai` and `anthropic` SDKs must recognise every error (their exception types are keyed on status and
body shape); a gRPC caller gets INVALID_ARGUMENT naming the problem."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx
import openai
import pytest
from gateway_helpers import API_KEY, InProcessGateway
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from recipe import ConversionOptions, ModelVersion, convert, load_tokenizer, render

MODEL = "DeepSeek-V4.1-Flash"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def openai_client(gw: InProcessGateway, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)


def anthropic_client(gw: InProcessGateway, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0)


def assert_openai_error(body: object, status_type: str = "invalid_request_error") -> dict:
    assert isinstance(body, dict)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == status_type
    return error


def assert_anthropic_error(body: object, error_type: str) -> dict:
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == error_type
    assert body["error"]["message"]
    return body["error"]


def test_api_key_is_required_in_each_apis_own_way(lone_gateway: InProcessGateway) -> None:
    with pytest.raises(openai.AuthenticationError) as denied:
        openai_client(lone_gateway, "wrong").chat.completions.create(**CHAT)
    assert denied.value.status_code == 401
    assert "not valid" in denied.value.message
    with pytest.raises(anthropic.AuthenticationError) as denied_a:
        anthropic_client(lone_gateway, "wrong").messages.create(**MESSAGES)
    assert_anthropic_error(denied_a.value.body, "authentication_error")
    raw = httpx.post(lone_gateway.base_url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert raw.status_code == 401
    assert raw.headers["x-request-id"]
    assert_openai_error(raw.json())


def test_health_and_metrics_need_no_key_models_do(lone_gateway: InProcessGateway) -> None:
    health = httpx.get(lone_gateway.base_url + "/health")
    assert health.status_code == 503  # no replica has described the model
    assert health.json()["ready"] is False
    assert health.json()["replicas_up"] == {"prefill": 0, "decode": 0}
    assert httpx.get(lone_gateway.base_url + "/live").status_code == 200  # alive, though not ready
    metrics = httpx.get(lone_gateway.base_url + "/metrics")
    assert metrics.status_code == 200
    assert "v41mesh_gateway_queue_depth 0.0" in metrics.text
    with pytest.raises(openai.AuthenticationError):
        openai_client(lone_gateway, "wrong").models.list()
    assert [m.id for m in openai_client(lone_gateway).models.list().data] == [MODEL]
    assert [m.id for m in anthropic_client(lone_gateway).models.list().data] == [MODEL]


def test_grpc_health_follows_readiness(lone_gateway: InProcessGateway) -> None:
    with grpc.insecure_channel(lone_gateway.grpc_address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # like /health: no model, no decode


def test_bodies_over_the_limit_are_413(lone_gateway: InProcessGateway) -> None:
    huge = "x" * 5000
    with pytest.raises(openai.APIStatusError) as too_large:
        openai_client(lone_gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=4
        )
    assert too_large.value.status_code == 413
    assert "limit is 4096 bytes" in too_large.value.message
    with pytest.raises(anthropic.APIStatusError) as too_large_a:
        anthropic_client(lone_gateway).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": huge}]
        )
    assert too_large_a.value.status_code == 413
    assert_anthropic_error(too_large_a.value.body, "request_too_large")


def test_bad_input_is_400_even_without_a_model(lone_gateway: InProcessGateway) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client(lone_gateway).chat.completions.create(model=MODEL, messages=[], temperature=9)
    assert bad.value.status_code == 400
    raw = httpx.post(lone_gateway.base_url + "/v1/messages", content=b"{not json", headers={"x-api-key": API_KEY})
    assert raw.status_code == 400
    assert "JSON" in assert_anthropic_error(raw.json(), "invalid_request_error")["message"]


def test_what_the_apis_refuse_is_a_400_though_the_codec_converts_it(lone_gateway: InProcessGateway) -> None:
    """deepseek-recipe converts these; the OpenAI and Anthropic APIs answer 400, and so does the gateway: a body not
    declared JSON, Anthropic Messages without max_tokens or opening with an assistant turn."""
    for path, api_key in (("/v1/chat/completions", {"authorization": f"Bearer {API_KEY}"}),
                          ("/v1/messages", {"x-api-key": API_KEY}),
                          ("/v1/messages/count_tokens", {"x-api-key": API_KEY})):  # fmt: skip
        for declared in ("text/plain", "application/x-www-form-urlencoded"):  # the second: curl -d's default
            raw = httpx.post(lone_gateway.base_url + path, content=json.dumps(MESSAGES),
                             headers={**api_key, "content-type": declared})  # fmt: skip
            assert raw.status_code == 400
            error = raw.json()["error"]
            assert error["message"].startswith(f"Unsupported content type: '{declared}'.")
            assert error["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as no_budget:
        anthropic_client(lone_gateway).post(
            "/v1/messages", body={"model": MODEL, "messages": MESSAGES["messages"]}, cast_to=httpx.Response
        )
    assert assert_anthropic_error(no_budget.value.body, "invalid_request_error")["message"] == (
        "max_tokens: Field required"
    )
    assistant_first = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "hi"}]
    for system in ({}, {"system": "Be brief."}):
        with pytest.raises(anthropic.BadRequestError) as wrong_turn:
            anthropic_client(lone_gateway).messages.create(model=MODEL, max_tokens=4, messages=assistant_first,
                                                           **system)  # type: ignore[arg-type]  # fmt: skip
        message = assert_anthropic_error(wrong_turn.value.body, "invalid_request_error")["message"]
        assert message == 'messages: first message must use the "user" role'
    counting = anthropic_client(lone_gateway).messages.count_tokens
    with pytest.raises(anthropic.BadRequestError):
        counting(model=MODEL, messages=assistant_first)  # type: ignore[arg-type]
    # What the APIs take gets past these checks (to the 503 of a gateway without replicas): JSON with a charset,
    # and a Chat conversation that opens with an assistant turn (OpenAI accepts one).
    charset = httpx.post(lone_gateway.base_url + "/v1/messages", content=json.dumps(MESSAGES),
                         headers={"x-api-key": API_KEY, "content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert charset.status_code == 503
    chat = openai_client(lone_gateway).chat.completions
    with pytest.raises(openai.InternalServerError):
        chat.create(model=MODEL, messages=assistant_first)  # type: ignore[arg-type]


def test_no_backend_is_a_503_with_a_clear_message(lone_gateway: InProcessGateway) -> None:
    with pytest.raises(openai.InternalServerError) as unavailable:
        openai_client(lone_gateway).chat.completions.create(**CHAT)
    assert unavailable.value.status_code == 503
    assert "no replica answered GetModelInfo" in unavailable.value.message
    assert "prefill 127.0.0.1:" in unavailable.value.message  # every replica asked is named, with why
    assert "decode 127.0.0.1:" in unavailable.value.message
    with pytest.raises(anthropic.APIStatusError) as unavailable_a:
        anthropic_client(lone_gateway).messages.create(**MESSAGES)
    assert unavailable_a.value.status_code == 503


def test_count_tokens_is_the_rendered_prompt_length_without_a_replica(lone_gateway: InProcessGateway) -> None:
    """The Anthropic SDK's count_tokens: the length of the prompt the model would read (system and tools
    included), from the gateway's own tokenizer, so it answers while no replica is up."""
    tools = [
        {
            "name": "get_weather",
            "description": "The weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    request = {"model": MODEL, "system": "Be brief.", "tools": tools,
               "messages": [{"role": "user", "content": "Weather in Oslo? <｜end▁of▁sentence｜>"}]}  # fmt: skip
    counted = anthropic_client(lone_gateway).messages.count_tokens(**request)
    converted = convert("messages", json.dumps({**request, "max_tokens": 1}).encode(), ConversionOptions())
    assert counted.input_tokens == len(render(converted.conversation, ModelVersion.V41, load_tokenizer()).token_ids)
    bare = anthropic_client(lone_gateway).messages.count_tokens(model=MODEL, messages=request["messages"])
    assert 0 < bare.input_tokens < counted.input_tokens
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_client(lone_gateway).messages.count_tokens(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert "role" in bad.value.message
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(lone_gateway, key="wrong").messages.count_tokens(model=MODEL, messages=request["messages"])


def test_unknown_paths_and_methods_answer_in_the_api_shape(lone_gateway: InProcessGateway) -> None:
    missing = httpx.get(lone_gateway.base_url + "/v1/nothing")
    assert missing.status_code == 404
    assert_openai_error(missing.json())
    wrong_method = httpx.get(lone_gateway.base_url + "/v1/messages")
    assert wrong_method.status_code == 405
    assert_anthropic_error(wrong_method.json(), "invalid_request_error")


def test_openapi_document_describes_the_endpoints(lone_gateway: InProcessGateway) -> None:
    document = httpx.get(lone_gateway.base_url + "/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        operation = document["paths"][path]["post"]
        schema_name = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        properties = document["components"]["schemas"][schema_name]["properties"]
        assert properties["model"]["enum"] == [MODEL]
        assert "cache_salt" in properties
        assert {"400", "401", "413", "429", "503"} <= set(operation["responses"])
        assert operation["security"]  # the key is required here
    schemas = document["components"]["schemas"]
    assert "max_tokens" in schemas["MessagesRequest"]["required"]  # Anthropic requires it; counting takes none
    counting = document["paths"]["/v1/messages/count_tokens"]["post"]
    counted_schema = counting["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "max_tokens" not in schemas[counted_schema]["properties"]
    assert counting["responses"]["200"]["content"]["application/json"]["schema"]["required"] == ["input_tokens"]
    assert set(document["components"]["securitySchemes"]) == {"bearer", "apiKey"}


@pytest.mark.parametrize(
    ("request_fields", "code", "needle"),
    [
        ({"api": 0, "body": json.dumps(CHAT).encode(), "api_key": API_KEY}, "INVALID_ARGUMENT", "api must be one of"),
        ({"api": 7, "body": json.dumps(CHAT).encode(), "api_key": API_KEY}, "INVALID_ARGUMENT", "got 7"),
        ({"api": 1, "body": b"\xff\x00", "api_key": API_KEY}, "INVALID_ARGUMENT", "JSON"),
        ({"api": 1, "body": json.dumps({**CHAT, "max_tokens": -1}).encode(), "api_key": API_KEY}, "INVALID_ARGUMENT",
         "max_tokens"),
        ({"api": 3, "body": json.dumps({**MESSAGES, "top_p": 3}).encode(), "api_key": API_KEY}, "INVALID_ARGUMENT",
         "top_p"),
        ({"api": 2, "body": b"x" * 5000, "api_key": API_KEY}, "INVALID_ARGUMENT", "limit is 4096 bytes"),
        ({"api": 1, "body": json.dumps(CHAT).encode(), "api_key": "wrong"}, "UNAUTHENTICATED", "not valid"),
    ],
)  # fmt: skip
def test_grpc_malformed_and_out_of_range_requests(
    lone_gateway: InProcessGateway, request_fields: dict, code: str, needle: str
) -> None:
    with grpc.insecure_channel(lone_gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Generate(gateway_pb2.GenerateRequest(**request_fields), timeout=10))
    assert failed.value.code().name == code
    assert needle in failed.value.details()
    if code == "INVALID_ARGUMENT" and request_fields["api"] in (1, 2, 3):
        trailers = dict(failed.value.trailing_metadata())
        assert json.loads(trailers["error-body"])  # the API's own error body rides along
