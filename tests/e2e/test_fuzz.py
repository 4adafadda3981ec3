"""Bad input on the HTTP side: schemathesis fuzzes the gateway's own OpenAPI document (positive and negative
cases for the three POST endpoints). No answer may be a 5xx, every error body must be in its API's shape, and
statuses and content types must be the documented ones. The fuzzed gateway caps output at 2 tokens, so the valid
requests it generates stay fast."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from conftest import start_gateway
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from mesh.processes import Mesh


@pytest.fixture(scope="module")
def fuzzed_gateway(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    url, process = start_gateway(mesh, tmp_path_factory.mktemp("fuzz") / "gateway.log", "--max-output-tokens", "2")
    yield schemathesis.openapi.from_url(url + "/openapi.json")
    process.terminate()
    process.wait(30)


schema = schemathesis.pytest.from_fixture("fuzzed_gateway")


@schemathesis.check
def error_body_in_the_api_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path == "/v1/messages":
        assert body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
    else:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"], body
    return True


@schema.include(method="POST").parametrize()
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_5xx_and_api_shaped_errors(case: Any) -> None:
    response = case.call(timeout=120)
    case.validate_response(
        response,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, error_body_in_the_api_shape],
    )
