"""The demo tools: deterministic, correct, and bad input answered with an error object."""

from __future__ import annotations

import random

import msgspec
import pytest

from train import tools


def _run(name: str, args: object) -> dict:
    return msgspec.json.decode(tools.run_tool(name, msgspec.json.encode(args).decode()))


def test_calculator_matches_python_arithmetic() -> None:
    rng = random.Random(1)
    for _ in range(50):
        a, b, c = rng.randint(1, 999), rng.randint(1, 99), rng.randint(1, 50)
        expression = f"({a} {rng.choice('+-*/')} {b}) {rng.choice('+-*/')} {c}"
        assert _run("calculator", {"expression": expression})["result"] == pytest.approx(eval(expression), rel=1e-3)


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 8", "1 / 0", "", "x + 1"])
def test_calculator_refuses_anything_else(expression: str) -> None:
    assert "error" in _run("calculator", {"expression": expression})


def test_unit_conversion_round_trips() -> None:
    for src, (dim, _) in tools.UNITS.items():
        for dst, (other, _) in tools.UNITS.items():
            if dim != other:
                assert "error" in _run("convert_units", {"value": 3, "from_unit": src, "to_unit": dst})
                continue
            there = _run("convert_units", {"value": 37.5, "from_unit": src, "to_unit": dst})["value"]
            back = tools.convert_units(there, dst, src)["value"]
            assert back == pytest.approx(37.5, rel=2e-3)
    assert _run("convert_units", {"value": 100, "from_unit": "celsius", "to_unit": "fahrenheit"})["value"] == 212


def test_weather_is_a_function_of_the_city() -> None:
    first = _run("get_weather", {"location": "Paris"})
    assert first == _run("get_weather", {"location": "paris "}) | {"location": "Paris"}
    assert first["condition"] in tools.CONDITIONS
    assert -5 <= first["temperature"] <= 35
    f = _run("get_weather", {"location": "Paris", "unit": "fahrenheit"})["temperature"]
    assert f == round(first["temperature"] * 9 / 5 + 32)


def test_search_finds_the_article() -> None:
    hits = _run("search", {"query": "Eiffel Tower"})["results"]
    assert hits[0]["title"] == "Eiffel Tower"
    assert _run("search", {"query": "nothing matches this"})["results"] == []


@pytest.mark.parametrize(
    ("name", "arguments"),
    [("get_weather", "not json"), ("get_weather", "[1]"), ("get_weather", '{"city": "Paris"}'), ("nope", "{}")],
)
def test_bad_calls_give_an_error_object(name: str, arguments: str) -> None:
    assert "error" in msgspec.json.decode(tools.run_tool(name, arguments))
