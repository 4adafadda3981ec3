"""JSON text as the prompt spells it: exactly Python's `json.dumps(value, ensure_ascii=False)` for any decoded JSON
value (V4's small-float spelling aside), whichever encoder writes it."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from recipe_strategies import examples

from recipe import pyjson

FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e16, 1e-5, 1e-7, 0.0001, 100.0, -0.0, 1e21, 123456789012345678.0, 2347710.000087127, 5e-324]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    FLOATS,
    st.text(st.characters(codec="utf-8"), max_size=8),
    st.sampled_from(["", "1e5", "0.0000", "a, b: c", "\\u00e9", '"', "\\", "\u2028", "\x00\x1f\x7f", "😀"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def python_spelling(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


@given(value=VALUES)
@examples(400)
def test_dumps_is_pythons_json_text(value: object) -> None:
    assert pyjson.dumps(value) == python_spelling(value)


def floats(value: object) -> list[float]:
    """The floats of a decoded JSON value (strings, keys among them, may spell anything)."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [f for item in value for f in floats(item)] if isinstance(value, list) else []


@given(value=VALUES)
@examples(200)
def test_v4_spells_only_small_exponent_floats_differently(value: object) -> None:
    text = pyjson.dumps(value, v4=True)
    small = [f for f in floats(value) if "e-0" in python_spelling(f)]
    if not small:
        assert text == python_spelling(value)
    else:
        assert all("e-0" not in pyjson.dumps(f, v4=True) for f in small)
        assert json.loads(text) == json.loads(python_spelling(value))


def test_integers_beyond_64_bits_are_read_as_floats_as_the_reference_reads_them() -> None:
    assert (
        pyjson.dumps({"n": [10**20, -(2**63) - 1, 2**64 - 1]})
        == '{"n": [1e+20, -9.223372036854776e+18, 18446744073709551615]}'
    )
