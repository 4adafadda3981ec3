"""JSON text as the prompt spells it: Python's `json.dumps(value, ensure_ascii=False)`.

The official encoder serialises tool schemas and non-string tool arguments with Python's json module,
so the prompt has `", "` / `": "` separators, unescaped non-ASCII and Python float spelling
(`1e-05`, `1e+16`, `100.0`). Integers outside the 64-bit range are read as floats first, as the
reference's JSON reader does (`1e+20` for `100000000000000000000`).
"""

from __future__ import annotations

import json
import re
from typing import Any

_encode = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), allow_nan=False).encode

# Only a literal of 19+ digits can fall outside [-2**63, 2**64): checking the raw text spares the walk.
_LONG_INTEGER = re.compile(rb"\d{19}")
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def dumps(value: Any) -> str:
    """Python-style JSON text of a decoded JSON value."""
    return _encode(value)


def has_long_integers(raw: bytes) -> bool:
    return _LONG_INTEGER.search(raw) is not None


def narrow_integers(value: Any) -> Any:
    """`value` with every integer outside the 64-bit range turned into a float."""
    if isinstance(value, dict):
        return {key: narrow_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [narrow_integers(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
        return float(value)
    return value
