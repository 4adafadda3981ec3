"""recipe is importable without torch or grpc (the gateway and dataset tools use it on small machines)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_import_pulls_in_neither_torch_nor_grpc() -> None:
    code = (
        "import sys, recipe, recipe.__main__; "
        "print(sorted(m for m in ('torch', 'grpc', 'deepseek_recipe') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert done.stdout.strip() == b"[]"
