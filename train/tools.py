"""The demo's tools: their JSON Schemas as the model sees them, and deterministic implementations.

The training conversations call these four tools, the evaluation checks calls against their schemas, and the
end-to-end test answers a real `get_weather` call with `run_tool`. Every implementation is a pure function of its
arguments (weather comes from a hash of the city name), so a conversation is a pure function of its seed.
"""

from __future__ import annotations

import ast
import hashlib
import operator
from collections.abc import Callable
from typing import Any

import msgspec

from recipe import Tool

WEATHER = Tool(
    name="get_weather",
    description="Get the current weather in a city.",
    parameters={
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location"],
    },
)
CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
        "required": ["expression"],
    },
)
# Each unit's dimension and its size in that dimension's base unit (temperatures are affine, see _to_base).
UNITS: dict[str, tuple[str, float]] = {
    "km": ("length", 1000.0),
    "miles": ("length", 1609.344),
    "meters": ("length", 1.0),
    "feet": ("length", 0.3048),
    "kg": ("mass", 1.0),
    "pounds": ("mass", 0.45359237),
    "liters": ("volume", 1.0),
    "gallons": ("volume", 3.785411784),
    "celsius": ("temperature", 1.0),
    "fahrenheit": ("temperature", 1.0),
}
CONVERT = Tool(
    name="convert_units",
    description="Convert a value between units.",
    parameters={
        "type": "object",
        "properties": {
            "value": {"type": "number"},
            "from_unit": {"type": "string", "enum": list(UNITS)},
            "to_unit": {"type": "string", "enum": list(UNITS)},
        },
        "required": ["value", "from_unit", "to_unit"],
    },
)
SEARCH = Tool(
    name="search",
    description="Search a small encyclopedia.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
)
TOOLS: dict[str, Tool] = {t.name: t for t in (WEATHER, CALCULATOR, CONVERT, SEARCH)}

CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear")

# The encyclopedia `search` looks in: title → one-sentence article.
ENCYCLOPEDIA: dict[str, str] = {
    "Eiffel Tower": "The Eiffel Tower is a wrought-iron tower in Paris, completed in 1889.",
    "Great Wall": "The Great Wall of China is more than 21,000 km long.",
    "Mount Everest": "Mount Everest is the highest mountain on Earth at 8,849 m.",
    "Amazon River": "The Amazon River in South America carries more water than any other river.",
    "Moon": "The Moon is Earth's only natural satellite, about 384,400 km away.",
    "Mars": "Mars is the fourth planet from the Sun and is known as the red planet.",
    "Python": "Python is a programming language created by Guido van Rossum in 1991.",
    "Shakespeare": "William Shakespeare was an English playwright born in 1564.",
    "Photosynthesis": "Photosynthesis lets plants turn light, water and carbon dioxide into sugar.",
    "Honey bee": "A honey bee colony can hold tens of thousands of bees.",
    "Pacific Ocean": "The Pacific is the largest and deepest ocean on Earth.",
    "Sahara": "The Sahara is the largest hot desert in the world.",
    "Penicillin": "Penicillin was discovered by Alexander Fleming in 1928.",
    "Jupiter": "Jupiter is the largest planet in the Solar System.",
    "Leonardo da Vinci": "Leonardo da Vinci painted the Mona Lisa.",
    "DNA": "DNA carries the genetic instructions of living things.",
    "Tokyo": "Tokyo is the capital of Japan and its largest city.",
    "Nile": "The Nile flows north through Africa into the Mediterranean Sea.",
    "Speed of light": "Light travels at about 299,792 km per second in a vacuum.",
    "Beethoven": "Ludwig van Beethoven composed nine symphonies.",
    "Kangaroo": "Kangaroos are marsupials that live in Australia.",
    "Volcano": "A volcano is an opening in the crust where molten rock escapes.",
    "Chess": "Chess is a board game for two players on a board of 64 squares.",
    "Coffee": "Coffee is brewed from the roasted seeds of the coffee plant.",
}


def weather(location: str, unit: str = "celsius") -> dict[str, Any]:
    """A plausible, fixed weather report for any city name."""
    digest = hashlib.blake2b(location.strip().lower().encode(), digest_size=8).digest()
    celsius = digest[0] % 41 - 5
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"location": location, "temperature": temperature, "unit": unit, "condition": CONDITIONS[digest[1] % 7]}


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def number(value: float) -> int | float:
    """A result as people write it: 4 significant digits, integral values without a fraction."""
    rounded = float(f"{value:.4g}")
    return int(rounded) if rounded.is_integer() else rounded


def calculator(expression: str) -> dict[str, Any]:
    try:
        return {"result": number(_evaluate(ast.parse(expression, mode="eval").body))}
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return {"error": str(exc) or type(exc).__name__}


def _to_base(value: float, unit: str) -> float:
    return (value - 32) * 5 / 9 if unit == "fahrenheit" else value * UNITS[unit][1]


def _from_base(value: float, unit: str) -> float:
    return value * 9 / 5 + 32 if unit == "fahrenheit" else value / UNITS[unit][1]


def convert_units(value: float, from_unit: str, to_unit: str) -> dict[str, Any]:
    if from_unit not in UNITS or to_unit not in UNITS or UNITS[from_unit][0] != UNITS[to_unit][0]:
        return {"error": f"cannot convert {from_unit} to {to_unit}"}
    return {"value": number(_from_base(_to_base(value, from_unit), to_unit)), "unit": to_unit}


def search(query: str) -> dict[str, Any]:
    """Articles sharing the most words with the query (at most two)."""
    words = set(query.lower().split())
    scored = [(len(words & set(title.lower().split())), title) for title in ENCYCLOPEDIA]
    hits = [title for score, title in sorted(scored, key=lambda s: -s[0]) if score > 0][:2]
    return {"results": [{"title": title, "snippet": ENCYCLOPEDIA[title]} for title in hits]}


_IMPLEMENTATIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "get_weather": weather,
    "calculator": calculator,
    "convert_units": convert_units,
    "search": search,
}


def run_tool(name: str, arguments: str) -> str:
    """Run a tool call (arguments as JSON object text) → the result as JSON text, `{"error": ...}` on bad input."""
    if name not in _IMPLEMENTATIONS:
        return msgspec.json.encode({"error": f"unknown tool {name}"}).decode()
    try:
        args = msgspec.json.decode(arguments)
        result = _IMPLEMENTATIONS[name](**args) if isinstance(args, dict) else {"error": "arguments must be an object"}
    except (msgspec.DecodeError, TypeError) as exc:
        result = {"error": str(exc)}
    return msgspec.json.encode(result).decode()
