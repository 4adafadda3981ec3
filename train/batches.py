"""Training batches: one sample kind per batch, padded to its longest sample, a fixed token budget.

Batch `step` is a pure function of (seed, step), so training resumes at any step without replaying the stream and
data-loader workers build batches in parallel (`StepBatches` is a map-style dataset indexed by step). Samples of
one kind have similar lengths (chat ≈ 60 tokens, tool conversations ≈ 530, text windows 257), so padding stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from train import data

PAD_ID = 2  # never learned: padding positions are not targets
CONVERSATION_KINDS = ("chat", "tool", "json")


@dataclass
class Batch:
    kind: str
    tokens: Tensor  # int64 [B, T]
    targets: Tensor  # bool [B, T]: token t is learned (predicted from position t−1)

    def pin_memory(self) -> Batch:
        return Batch(self.kind, self.tokens.pin_memory(), self.targets.pin_memory())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.kind, self.tokens.to(device, non_blocking=True), self.targets.to(device, non_blocking=True))

    @property
    def n_targets(self) -> int:
        return int(self.targets.sum())


def pad(kind: str, samples: list[data.Sample], max_len: int) -> Batch:
    T = min(max_len, max(len(s.tokens) for s in samples))
    tokens = torch.full((len(samples), T), PAD_ID, dtype=torch.int64)
    targets = torch.zeros((len(samples), T), dtype=torch.bool)
    for row, s in enumerate(samples):
        n = min(T, len(s.tokens))
        tokens[row, :n] = torch.tensor(s.tokens[:n])
        targets[row, :n] = torch.tensor(s.targets[:n])
    return Batch(kind, tokens, targets)


def make_batch(
    seed: int,
    step: int,
    token_budget: int,
    max_len: int,
    kinds: tuple[str, ...] = data.KINDS,
    weights: tuple[float, ...] = data.WEIGHTS,
    *,
    held_out: bool = False,
) -> Batch:
    """Batch `step`: a kind drawn by weight, then samples of it while (rows × longest) fits the budget."""
    kind = data.rng_for(seed, "batch", held_out, step).choices(kinds, weights)[0]
    samples: list[data.Sample] = []
    longest = 0
    while True:
        s = data.sample(seed, step * 65536 + len(samples), kind, held_out=held_out)
        longest_next = min(max_len, max(longest, len(s.tokens)))
        if samples and (len(samples) + 1) * longest_next > token_budget:
            break
        samples.append(s)
        longest = longest_next
    return pad(kind, samples, max_len)


class StepBatches(Dataset):
    """Map-style dataset: item `step` is `make_batch(seed, step, …)`."""

    def __init__(self, seed: int, token_budget: int, max_len: int, weights: tuple[float, ...] = data.WEIGHTS) -> None:
        """`weights` are those of data.KINDS; kinds of weight 0 are left out."""
        self.seed, self.token_budget, self.max_len = seed, token_budget, max_len
        kept = [(k, w) for k, w in zip(data.KINDS, weights, strict=True) if w > 0]
        self.kinds, self.weights = tuple(k for k, _ in kept), tuple(w for _, w in kept)

    def __len__(self) -> int:
        return 2**31 - 1

    def __getitem__(self, step: int) -> Batch:
        return make_batch(self.seed, step, self.token_budget, self.max_len, self.kinds, self.weights)


def held_out_batches(seed: int, kind: str, count: int, token_budget: int, max_len: int) -> list[Batch]:
    """`count` evaluation batches of one kind, from the held-out split."""
    return [make_batch(seed, i, token_budget, max_len, (kind,), (1.0,), held_out=True) for i in range(count)]
