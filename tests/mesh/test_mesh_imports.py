"""mesh holds only what every service shares: importing all of it pulls in neither torch nor any package of ours
but proto (the gateway and the cache service import it without a model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mesh_imports_neither_torch_nor_the_model_services() -> None:
    files = (ROOT / "mesh").rglob("*.py")  # every module of mesh, its CLI included
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in files)
    heavy = ("torch", "model", "model_service", "cache_svc", "prefill_svc", "decode_svc", "gateway")
    code = f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; " + (
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == b"[]"
