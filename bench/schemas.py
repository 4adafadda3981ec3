"""Random JSON Schemas for structured-output tests and benchmarks: nested objects, arrays, enums, numbers with bounds,
required and optional fields, strict (every property required, no others) every other one — the same list every run.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ["city", "country", "name", "count", "items", "score", "tags", "ok", "kind", "meta"]
WORDS = ["red", "green", "blue", "north", "south", "Paris", "Oslo", "yes", "no"]


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "array", "object"]
    kind = rng.choice(kinds if depth < 2 else kinds[:5])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 32])}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, 3)}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 4)}
    return _object(rng, depth + 1, strict=False)


def _object(rng: random.Random, depth: int, strict: bool) -> dict[str, Any]:
    names = rng.sample(NAMES, 3)
    properties = {name: _value(rng, depth) for name in names[: rng.randint(1, 3)]}
    required = list(properties) if strict else [name for name in properties if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if strict or rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def schemas(count: int, seed: int = 20) -> list[tuple[dict[str, Any], bool]]:
    """`count` (object schema, strict) pairs."""
    rng = random.Random(seed)
    return [(_object(rng, 0, strict=i % 2 == 0), i % 2 == 0) for i in range(count)]
