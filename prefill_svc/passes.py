"""How one pass of the encoder thread runs its prompts (prefill_svc.encoder_queue): one process runs them one by one;
a rank group attends data-parallel and runs up to W at once, each on a rank of its own (the first on rank 0), its
ranks' MoE rounds meeting whatever each runs (`model.parallel`). The outputs come back to rank 0, which writes them
to the cache."""

from __future__ import annotations

from model import Past, PrefillOutput, Transformer
from model_service.kvstore import encode_with_past
from model_service.ranks import GroupCalls, ModelCalls, Outcome
from prefill_svc.encoder_queue import Runner

Prompt = tuple[list[int], Past | None]


def encoder_pass(calls: ModelCalls, chunk_tokens: int) -> tuple[Runner, int]:
    """The runner of an encoder pass and how many prompts it takes (W)."""
    if isinstance(calls, GroupCalls):
        return SpreadEncoder(calls, chunk_tokens), calls.world_size
    return lambda prompts: [_attempt(calls, prompt, chunk_tokens) for prompt in prompts], 1


def _attempt(calls: ModelCalls, prompt: Prompt, chunk_tokens: int) -> Outcome:
    try:
        return Outcome(calls.run(encode_with_past, *prompt, chunk_tokens))
    except Exception as exc:
        return Outcome(error=exc)


class RankEncoder:
    """One rank's part of a pass: its own prompt, or none, then the other ranks' MoE rounds until all are done."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def encode(self, prompt: Prompt | None, chunk_tokens: int) -> PrefillOutput | None:
        try:
            return encode_with_past(self.model, *prompt, chunk_tokens) if prompt is not None else None
        finally:
            self.model.serve_idle()


class SpreadEncoder:
    """Rank 0's side: up to W prompts → each one's outcome, prompt i on rank i."""

    def __init__(self, calls: GroupCalls, chunk_tokens: int) -> None:
        self.calls, self.chunk_tokens = calls, chunk_tokens
        self.ranks = calls.new(RankEncoder)

    def __call__(self, prompts: list[Prompt]) -> list[Outcome]:
        mine = [*prompts, *[None] * (self.calls.world_size - len(prompts))]
        return self.calls.spread(self.ranks, "encode", [(p, self.chunk_tokens) for p in mine])[: len(prompts)]
