"""JSON text as the prompt spells it: Python's `json.dumps(value, ensure_ascii=False)`.

The official encoder serialises tool schemas and non-string tool arguments with Python's json module,
so the prompt has `", "` / `": "` separators, unescaped non-ASCII and Python float spelling
(`1e-05`, `1e+16`, `100.0`). Integers outside the 64-bit range are read as floats first, as the
reference's JSON reader does (`1e+20` for `100000000000000000000`).

V4 prompts spell small floats differently (deepseek-recipe's V4 encoder): decimals down to 1e-5
(`0.00001`) and unpadded exponents below that (`1e-7`, not `1e-07`).

Containers are written by msgspec (compact, then laid out with Python's separators: 3× faster than the json
module's encoder) unless its text may differ from Python's: a float with an exponent (msgspec writes `1e16`,
`0.00001` and `1e-7` where Python writes `1e+16`, `1e-05` and `1e-07`) or a run of 19+ digits (an integer that may
be outside 64 bits). Such text, or a string msgspec cannot encode (a lone surrogate), takes the json module.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

_encode = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), allow_nan=False).encode
_encode_compact = msgspec.json.encode
_format = msgspec.json.format

# Only a literal of 19+ digits can fall outside [-2**63, 2**64): checking the text spares the walk
# (a byte translation and a substring search, far cheaper than a regular expression).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def dumps(value: Any, *, v4: bool = False) -> str:
    """Python-style JSON text of a decoded JSON value (`v4`: with V4's small-float spelling)."""
    kind = type(value)
    if kind is float and math.isfinite(value) and (not v4 or _v4_float(value) is None):
        return repr(value)  # the common scalars, without the encoder
    if kind is int and _INT_MIN <= value <= _INT_MAX:
        return str(value)
    if kind is bool:
        return "true" if value else "false"
    if value is None:
        return "null"
    try:
        fast = _format(_encode_compact(value), indent=0)
    except UnicodeEncodeError:  # a lone surrogate: the json module writes it
        fast = b""
    if fast and not _may_differ(fast):
        return fast.decode()
    text = _encode(value)
    if _may_hold_wide_integers(text):  # rare: only then walk the value
        value = narrow_integers(value)
        text = _encode(value)
    if not v4 or "e-0" not in text:
        return text
    spellings: dict[str, str] = {}
    text = _encode(_mark_v4_floats(value, spellings))
    for mark, spelling in spellings.items():
        text = text.replace(f'"{mark}"', spelling)
    return text


def _v4_float(value: float) -> str | None:
    """V4's spelling of `value` where it differs from Python's (exponents -5 to -9), else None."""
    text = repr(value)
    mantissa, _, exponent = text.partition("e-0")
    if not exponent:
        return None
    if exponent != "5":
        return f"{mantissa}e-{exponent}"
    sign, digits = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    return f"{sign}0.0000{digits.replace('.', '')}"


def _mark_v4_floats(value: Any, spellings: dict[str, str]) -> Any:
    """`value` with each float V4 spells differently replaced by a unique placeholder string."""
    if isinstance(value, float):
        spelling = _v4_float(value)
        if spelling is None:
            return value
        mark = f"\ufdef{len(spellings)}\ufdef"  # a noncharacter: never in real text
        spellings[mark] = spelling
        return mark
    if isinstance(value, dict):
        return {key: _mark_v4_floats(item, spellings) for key, item in value.items()}
    if isinstance(value, list):
        return [_mark_v4_floats(item, spellings) for item in value]
    return value


def loads(text: str) -> Any:
    """A JSON value as the reference's reader gives it: integers outside the 64-bit range as floats (the model's
    tool arguments, decoded for the Messages API's `input`). Raises `msgspec.DecodeError` on malformed text."""
    value = msgspec.json.decode(text)
    return narrow_integers(value) if _may_hold_wide_integers(text) else value


def _may_differ(text: bytes) -> bool:
    """Whether msgspec's `text` may spell a number unlike Python: a digit before `e` (an exponent), `0.0000` (1e-5
    written out), or 19+ digits in a row (matches inside strings only cost the json module)."""
    digits = text.translate(_DIGITS_AS_ZERO)
    return b"0e" in digits or _LONG_RUN in digits or b"0.0000" in text


def _may_hold_wide_integers(text: str) -> bool:
    """Whether `text` holds a run of 19+ digits, which any integer outside [-2**63, 2**64) needs."""
    return _LONG_RUN in text.encode().translate(_DIGITS_AS_ZERO)


def narrow_integers(value: Any) -> Any:
    """`value` with every integer outside the 64-bit range turned into a float."""
    if isinstance(value, dict):
        return {key: narrow_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [narrow_integers(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
        return float(value)
    return value
