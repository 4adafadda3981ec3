"""Real decode replicas (the tiny model, in this process, on loopback) for the gateway tests that need a mesh to
answer: describe the model, generate, report their load."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from decode_svc.config import DecodeConfig
from decode_svc.server import DecodeServer
from model import build_model, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prefill_svc"))
from service_mesh import WAIT_S, Loop, wait_until  # the service tests' background loop and polling wait

__all__ = ["WAIT_S", "Decodes", "wait_until"]


class Decodes:
    """`count` decode replicas sharing one tiny model (no cache: each prefills its prompts itself), each decoding at
    most `max_batch` sequences together."""

    def __init__(self, count: int, max_batch: int = 32) -> None:
        torch.set_num_threads(1)
        model = build_model(preset("tiny"), "full")
        self.loop = Loop()
        config = DecodeConfig(port=0, metrics_port=0, speculation=False, max_batch=max_batch)
        self.servers = [DecodeServer(config, model=model)]
        self.servers += [DecodeServer(self.servers[0].cfg, model=model) for _ in range(count - 1)]
        for server in self.servers:
            self.loop.call(server.start())
        self.addresses = [f"127.0.0.1:{server.port}" for server in self.servers]

    def generations(self) -> list[float]:
        """Generate calls each replica has finished (its own Prometheus counter)."""
        return [
            sum(
                sample.value
                for metric in server.registry.collect()
                if metric.name == "v41mesh_decode_requests"
                for sample in metric.samples
                if sample.name.endswith("_total")
            )
            for server in self.servers
        ]

    def stop(self) -> None:
        for server in self.servers:
            self.loop.call(server.stop(1.0))
        self.loop.close()
