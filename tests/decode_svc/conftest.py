"""Fixtures of the decode service tests: a real cache, prefill and decode on loopback (tests/prefill_svc/service_mesh,
put on sys.path here so this directory runs on its own too)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prefill_svc"))

from service_mesh import loop, mesh, models, prompt, salt, serve, start_mesh

__all__ = ["loop", "mesh", "models", "prompt", "salt", "serve", "start_mesh"]
