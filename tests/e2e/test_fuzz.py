"""Bad input on the HTTP side: schemathesis generates requests from the gateway's own OpenAPI document, valid and
invalid (positive and negative modes), for each POST endpoint. No answer may be a 5xx, every error
body must be in its API's shape, statuses and content types must be the documented ones. The fuzzed gateway caps
output at 2 tokens, so the valid requests stay fast.

(schemathesis's pytest plugin does not run on this pytest, so the strategies drive a plain hypothesis test.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from e2e_helpers import start_gateway
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from mesh.processes import Mesh

ENDPOINTS = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]


@pytest.fixture(scope="module")
def fuzzed_schema(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    url, process = start_gateway(mesh, tmp_path_factory.mktemp("fuzz") / "gateway.log", "--max-output-tokens", "2")
    yield schemathesis.openapi.from_url(url + "/openapi.json")
    process.terminate()
    process.wait(30)


def error_body_in_the_api_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
    else:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"], body
    return True


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, error_body_in_the_api_shape]


def test_fuzzed_requests_get_no_5xx_and_api_shaped_errors(fuzzed_schema: Any) -> None:
    for path in ENDPOINTS:
        operation = fuzzed_schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                      derandomize=True)  # fmt: skip
            def fuzz(case: Any) -> None:
                response = case.call(timeout=120)
                case.validate_response(response, checks=CHECKS)

            fuzz()
