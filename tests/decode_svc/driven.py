"""An engine on the tiny model whose thread never runs: a test calls `iterate()` itself, one deterministic iteration
at a time, and reads what each sequence's stream would have sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from service_mesh import new_id

from decode_svc.engine import Engine, EngineSettings
from decode_svc.guide import Guide
from decode_svc.metrics import DecodeMetrics
from decode_svc.sequence import Outbox, Params, Prompt, Sampling, Sequence
from model import Past, PrefillOutput, Transformer
from model_service.ranks import ModelCalls

GREEDY = Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)


@dataclass
class Driven:
    engine: Engine
    registry: CollectorRegistry
    loop: asyncio.AbstractEventLoop
    written: list[tuple[Any, ...]] = field(default_factory=list)

    def submit(
        self,
        ids: list[int],
        limit: int,
        past: Past | None = None,
        handoff: PrefillOutput | None = None,
        sampling: Sampling = GREEDY,
        speculate: bool = True,
        stop_token_ids: frozenset[int] = frozenset(),
        guide: Guide | None = None,
    ) -> Sequence:
        """A token-ids prompt decode prefills itself (on top of `past`), or a prefill's `handoff` of `ids`; `guide`:
        its output constraint."""
        params = Params(new_id(), sampling, stop_token_ids, limit, False, 0, speculate, b"")
        if handoff is None:
            prompt = Prompt(ids, past=past, local_prefill="token_ids")
        else:
            prompt = Prompt(ids, blocks=handoff.blocks, state=handoff.encoder_state)
        seq = Sequence(params, Outbox(self.loop), prompt, limit=limit, guide=guide)
        self.engine.register(seq)
        self.engine.submit(seq)
        return seq

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value("v41mesh_decode_" + name, labels or {}) or 0.0

    def received(self, seq: Sequence) -> list[Any]:
        """What the sequence's stream would have sent so far."""
        return self.loop.run_until_complete(seq.outbox.get())

    def run_to_end(self, *seqs: Sequence) -> None:
        for _ in range(64):
            if not any(seq.live for seq in seqs):
                return
            self.engine.iterate()
        raise AssertionError(f"{[seq.state for seq in seqs]} after 64 iterations")


def json_logger() -> Any:
    """JSON lines, as the services log (mesh.logging), without configuring structlog for the whole test process: its
    default console renderer draws a logged exception's traceback with every frame's locals (seconds per failure)."""
    processors = [
        structlog.processors.add_log_level,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(),
    ]
    return structlog.wrap_logger(structlog.PrintLogger(), processors=processors, service="decode")


@contextmanager
def driven_engine(
    model: Transformer,
    calls: ModelCalls | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    **settings: Any,
) -> Iterator[Driven]:
    """A driven engine (`calls`: a rank group's, default this process only; `loop`: the streams' event loop, closed
    with the engine, default a new one); `settings` override EngineSettings' test defaults (4 slots, no speculation,
    16-token chunks)."""
    defaults = {"max_batch": 4, "max_queue": 4, "speculation": False, "max_draft": 1, "draft_policy": "measured"}
    registry = CollectorRegistry()
    loop = loop or asyncio.new_event_loop()
    written: list[tuple[Any, ...]] = []
    engine = Engine(
        model,
        EngineSettings(**{**defaults, "chunk_size": 16, **settings}),
        DecodeMetrics(registry),
        json_logger(),
        lambda *a: written.append(a),
        calls=calls,
    )
    try:
        yield Driven(engine, registry, loop, written)
    finally:
        loop.close()
