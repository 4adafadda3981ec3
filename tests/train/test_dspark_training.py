"""DSpark training is the dense form of the serving draft; calibration fits the temperature it should."""

from __future__ import annotations

import torch

from model import DecodeBatch, SamplingParams, Transformer, draft_logits, encode_prefill
from train import calibrate, dspark


def test_dense_draft_equals_the_serving_draft(tiny: Transformer) -> None:
    """Anchor p: the serving path drafts after committing tokens 0..p with t_{p+1} pending; the first draft's
    distribution and confidence must match the dense training form (windows short enough to be exact)."""
    a = tiny.args
    torch.manual_seed(3)
    T = a.sliding_window + a.dspark_block_size + 1
    tokens = torch.randint(3, 5000, (1, T))
    p = a.sliding_window - 2  # prefix ≤ W: the decoder's bounded replay is exact
    targets = torch.ones(1, T, dtype=torch.bool)
    out = dspark.draft_forward(tiny, tokens, targets, torch.tensor([p]))
    with torch.no_grad():
        prefill = encode_prefill(tiny, tokens[0, : p + 1])
        batch = DecodeBatch(tiny, 1)
        batch.join(prefill.blocks, prefill.encoder_state)
        draft = batch.dspark_draft([int(tokens[0, p + 1])], SamplingParams.uniform(1, temperature=1.0))
    dense = out.logits[0, 0, 0].softmax(-1)
    torch.testing.assert_close(dense.float(), draft.probs[0, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        torch.sigmoid(out.confidence[0, 0, 0]).float(), draft.confidence[0, 0], atol=1e-5, rtol=1e-4
    )
    assert bool(out.valid[0, 0].all())
    assert out.labels[0, 0].tolist() == tokens[0, p + 2 : p + 2 + a.dspark_block_size].tolist()
    with torch.no_grad():  # the target distribution of draft k is the full forward's at position p+1+k
        full = tiny(tokens)[0, p + 1 : p + 1 + a.dspark_block_size].softmax(-1)
    torch.testing.assert_close(out.target[0, 0], full)


def test_per_row_anchors_draft_as_each_row_alone(tiny: Transformer) -> None:
    """Anchors [B, A] (one set per row) give each row the draft it gets alone with its anchors shared."""
    torch.manual_seed(5)
    tokens = torch.randint(3, 5000, (2, 40))
    with torch.no_grad():
        _, _, taps = tiny.features(tokens)
        anchors = torch.tensor([[3, 17, 30], [0, 21, 34]])
        logits, confidence = draft_logits(tiny, tokens, taps, anchors)
        for row in range(2):
            alone, alone_confidence = draft_logits(tiny, tokens[row : row + 1], taps[row : row + 1], anchors[row])
            torch.testing.assert_close(logits[row], alone[0])
            torch.testing.assert_close(confidence[row], alone_confidence[0])
    assert not torch.allclose(logits[0], logits[1])


def test_loss_trains_only_dspark_and_drops_invalid_drafts(tiny: Transformer) -> None:
    a = tiny.args
    torch.manual_seed(4)
    tokens = torch.randint(3, 5000, (2, 24))
    targets = torch.zeros(2, 24, dtype=torch.bool)
    targets[0, 10:20] = True  # row 1 has nothing to learn
    anchors = dspark.pick_anchors(targets, 6, a.dspark_block_size, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 6)
    assert bool(targets[0].gather(0, anchors[0] + 1).all())  # row 0 anchors where its next token is learned
    out = dspark.draft_forward(tiny, tokens, targets, anchors)
    assert not bool(out.valid[1].any())
    drafted = anchors.unsqueeze(-1) + 2 + torch.arange(a.dspark_block_size)
    for i, k in out.valid[0].nonzero().tolist():
        assert drafted[0, i, k] < 24
        assert targets[0, drafted[0, i, k]]
        assert out.labels[0, i, k] == tokens[0, drafted[0, i, k]]
    assert bool(out.valid[0].any())
    tiny.zero_grad(set_to_none=True)
    loss, parts = dspark.dspark_loss(out)
    loss.backward()
    assert torch.isfinite(loss)
    assert set(parts) == {"ce", "l1", "bce"}
    assert all(p.grad is None for p in tiny.layers.parameters())  # the target is frozen
    assert tiny.mtp[-1].markov_head.embed.weight.grad is not None
    tiny.zero_grad(set_to_none=True)


def test_sequential_temperature_scaling_recovers_the_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(20000, 3, generator=g)
    truth = torch.sigmoid(logits / 2.5)  # the head is over-confident by a factor 2.5 at every position
    accepted = torch.rand(20000, 3, generator=g) < truth
    valid = torch.ones(20000, 3, dtype=torch.bool)
    fit = calibrate.sequential_temperature_scaling(logits, accepted, valid)
    assert all(abs(t - 2.5) < 0.35 for t in fit.temperatures)
    assert all(after < before / 3 for before, after in zip(fit.ece_before, fit.ece_after, strict=True))


def test_ece_of_a_perfect_predictor_is_small() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.rand(50000, generator=g)
    assert calibrate.ece(p, torch.rand(50000, generator=g) < p) < 0.01
    assert calibrate.ece(torch.full((100,), 0.9), torch.zeros(100, dtype=torch.bool)) > 0.89
