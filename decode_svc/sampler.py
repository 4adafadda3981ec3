"""Per-row sampling over a batch and the logprobs the API reports.

Each sequence owns a generator (seeded by its request, else at random), so a seeded request samples the same tokens
whatever else shares its batch. Logprobs are those of the model's own distribution (log-softmax of the raw logits,
before temperature, top-k and top-p), as the OpenAI API reports them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from decode_svc.sequence import Sampling, Sequence, TokenLogprob
from model import SamplingParams, sample


def batch_sampling(rows: Seq[Sequence]) -> SamplingParams:
    """The sampling parameters of a lane's rows, in row order."""
    s = [row.params.sampling for row in rows]
    return SamplingParams(
        torch.tensor([x.temperature for x in s]),
        torch.tensor([x.top_k for x in s]),
        torch.tensor([x.top_p for x in s]),
    )


def new_generator(sampling: Sampling, device: torch.device) -> torch.Generator:
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def sample_rows(probs: Tensor, rows: Seq[Sequence]) -> list[int]:
    """One token per row of probs [B, V], each from its own sequence's generator (a greedy row's one-hot needs none)."""
    greedy = probs.argmax(-1).tolist()
    return [
        greedy[b] if row.params.sampling.greedy else int(sample(probs[b : b + 1], row.generator)[0])
        for b, row in enumerate(rows)
    ]


def token_logprobs(logits: Tensor, tokens: Seq[int], top: int) -> list[TokenLogprob]:
    """(logprob of tokens[t], the `top` most likely (id, logprob)) for each row t of logits [T, V]."""
    logp = logits[: len(tokens)].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if top <= 0:
        return [(lp, []) for lp in chosen]
    values, ids = logp.topk(top, dim=-1)
    return [
        (lp, list(zip(row_ids, row_values, strict=True)))
        for lp, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]
