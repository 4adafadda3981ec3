"""Fixtures of the prefill service tests: a real cache, prefill and decode on loopback (service_mesh)."""

from __future__ import annotations

from service_mesh import loop, mesh, models, prompt, salt, serve, start_mesh

__all__ = ["loop", "mesh", "models", "prompt", "salt", "serve", "start_mesh"]
