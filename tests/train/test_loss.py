"""train.loss: the loss through the head at learned positions only equals the loss of the full logits, value and
gradient, however the head's rows are chunked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import Transformer
from train.batches import Batch
from train.loss import learned_token_loss


def _batch() -> Batch:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, 5000, (2, 30), generator=g)
    targets = torch.rand(2, 30, generator=g) < 0.4
    targets[:, 0] = False
    return Batch("chat", tokens, targets)


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_learned_token_loss_equals_the_full_logits_loss(tiny: Transformer) -> None:
    batch = _batch()
    logits = tiny(batch.tokens, replay_start=3)
    mask = batch.targets[:, 1:]
    reference = F.cross_entropy(logits[:, :-1][mask], batch.tokens[:, 1:][mask], reduction="sum")
    reference.backward()
    want = _grads(tiny)
    for chunk in (5, 10_000):  # several checkpointed chunks, and one
        total, count = learned_token_loss(tiny, batch, replay_start=3, chunk=chunk)
        assert count == int(mask.sum())
        torch.testing.assert_close(total, reference)
        total.backward()
        got = _grads(tiny)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
    with torch.no_grad():
        torch.testing.assert_close(learned_token_loss(tiny, batch, replay_start=3, chunk=5)[0], reference)
