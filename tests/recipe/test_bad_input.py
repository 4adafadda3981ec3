"""Malformed request bodies are rejected with one error type: a 4xx RecipeError naming the bad field,
in the API's error shape — never another exception, never a 5xx."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from recipe_strategies import REQUESTS, examples

from recipe import APIS, ConversionOptions, ModelVersion, RecipeError, convert, render

WRONG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.sampled_from([[], {}, [1, "x"], {"role": "robot"}, {"type": "unknown"}, "x" * 100_000, 10**30, -1]),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON body."""
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _paths(item, (*prefix, index))
    return paths


def _set(body: Any, path: tuple[Any, ...], value: Any, delete: bool) -> None:
    for key in path[:-1]:
        body = body[key]
    if delete:
        del body[path[-1]]
    else:
        body[path[-1]] = value


@st.composite
def mutated(draw: st.DrawFn, api: str) -> tuple[dict[str, Any], tuple[Any, ...]]:
    body = copy.deepcopy(draw(REQUESTS[api]()))
    path = draw(st.sampled_from(_paths(body)))
    _set(body, path, draw(WRONG_VALUES), delete=draw(st.integers(0, 4)) == 0)
    return body, path


def _assert_clean_rejection(error: RecipeError, api: str) -> None:
    assert 400 <= error.status < 500
    assert error.message
    assert error.api == api
    body = error.body()
    if api == "messages":
        assert body["type"] == "error"
        assert body["error"]["message"] == error.message
    else:
        assert body["error"]["message"] == error.message
        assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(60)
def test_mutated_bodies_are_rejected_cleanly(api: str, data: st.DataObject) -> None:
    body, path = data.draw(mutated(api))
    error = _rejection(api, body)
    if error is None:
        converted = convert(api, body)
        render(converted.conversation, converted.version)  # whatever is accepted renders
        return
    _assert_clean_rejection(error, api)
    assert error.param, f"no field named for a bad {path}: {error.message}"


def _rejection(api: str, body: dict[str, Any]) -> RecipeError | None:
    try:
        convert(api, body)
    except RecipeError as error:
        return error
    return None


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(25)
def test_broken_json_is_rejected_cleanly(api: str, data: st.DataObject) -> None:
    raw = json.dumps(data.draw(REQUESTS[api]())).encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(RecipeError) as rejected:
        convert(api, raw[:cut])
    _assert_clean_rejection(rejected.value, api)


@pytest.mark.parametrize(
    ("api", "body", "field"),
    [
        ("chat.completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
        ("chat.completions", {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ("chat.completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ("chat.completions", {"model": "DeepSeek-V4.1-Flash", "messages": [], "temperature": 3}, "messages"),
        ("chat.completions", {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": 7}]}, "content"),
        (
            "responses",
            {"model": "DeepSeek-V4.1-Flash", "input": [{"type": "function_call_output", "call_id": "x"}]},
            "input",
        ),
        ("responses", {"model": "DeepSeek-V4.1-Flash", "input": "x", "previous_response_id": "r1"}, "previous"),
        (
            "messages",
            {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": [{"type": "x"}]}]},
            "type",
        ),
        ("messages", {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": []}]}, "messages"),
        (  # found by the gateway's schemathesis run: a system message holding a tool_result was a 500
            "messages",
            {
                "model": "DeepSeek-V4.1-Flash",
                "max_tokens": 5,
                "messages": [
                    {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}
                ],
            },
            "messages.0.content.0",
        ),
        (
            "chat.completions",
            {
                "model": "DeepSeek-V4.1-Flash",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"nan": float("nan")}}}],
            },
            "tools[0].function.parameters.nan",
        ),
    ],
)
def test_errors_name_the_field(api: str, body: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as rejected:
        convert(api, body)
    error = rejected.value
    _assert_clean_rejection(error, api)
    assert field in (error.param or "") or field in error.message


def test_an_unknown_model_name_is_refused_listing_only_the_names_accepted() -> None:
    """By default both official names (as the reference lists them); a server of one encoding lists only its names."""
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(RecipeError) as every:
        convert("chat.completions", body)
    assert every.value.message == (
        "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, but you passed gpt-4o."
    )
    served = ConversionOptions(versions=(ModelVersion.V41,), model_aliases={"mine": ModelVersion.V41})
    for name in ("gpt-4o", "DeepSeek-V4-Pro"):
        with pytest.raises(RecipeError) as one:
            convert("chat.completions", {**body, "model": name}, served)
        assert one.value.message == (
            f"The supported API model names are DeepSeek-V4.1-Flash, mine, but you passed {name}."
        )
        assert one.value.param == "model"
    assert convert("chat.completions", {**body, "model": "mine"}, served).version is ModelVersion.V41


def test_unknown_api_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown api"):
        convert("completions", {})  # type: ignore[arg-type]
