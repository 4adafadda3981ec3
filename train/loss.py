"""Next-token cross-entropy on the learned tokens of a batch, through the head at those positions only.

The head maps C → 129,280: the logits of every position of a 128 K-token batch would be 66 GB in fp32, and most
positions of a conversation (its prompt) are not learned. So the dense forward stops before the head
(`Transformer.features`), the learned positions are gathered, and they go through the head `CE_CHUNK` rows at a
time; in training each chunk is recomputed in the backward pass (activation checkpointing), so at most one chunk's
logits are alive at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model import Transformer
from train.batches import Batch

CE_CHUNK = 8192  # rows of [rows, 129,280] logits at a time: 4.2 GB in fp32, ≈ 15 GB with the backward's


def learned_token_loss(
    model: Transformer, batch: Batch, replay_start: int = 0, chunk: int = CE_CHUNK
) -> tuple[Tensor, int]:
    """(summed next-token cross-entropy over the batch's learned tokens, how many there are)."""
    X, pre, _ = model.features(batch.tokens, replay_start)
    learned = batch.targets[:, 1:]  # token t+1 is learned from position t
    labels = batch.tokens[:, 1:][learned]
    return head_cross_entropy(model, X[:, :-1][learned], pre[:, :-1][learned], labels, chunk), labels.numel()


def head_cross_entropy(model: Transformer, X: Tensor, pre: Tensor, labels: Tensor, chunk: int = CE_CHUNK) -> Tensor:
    """Summed cross-entropy of the head's logits of streams X [N, n, C] (pre-mix [N, n]) against labels [N]."""
    total = torch.zeros((), device=X.device)
    for start in range(0, labels.numel(), chunk):
        rows = slice(start, start + chunk)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, model, X[rows], pre[rows], labels[rows], use_reentrant=False)
        else:
            total = total + _chunk_loss(model, X[rows], pre[rows], labels[rows])
    return total


def _chunk_loss(model: Transformer, X: Tensor, pre: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(model.logits(X, pre), labels, reduction="sum")
