"""DSpark training against the frozen target (reference §4.4), on the model's dense draft `draft_logits`.

For an anchor p (the newest committed position), serving drafts γ tokens from the block [t_{p+1}, noise × (γ−1)]
at positions p+1 … p+γ against the DSpark ring of positions (p−W, p]; `model.dspark.draft_logits` is the dense,
differentiable, teacher-forced form of that draft (x_{k−1} = t_{p+k} for the Markov head). Training picks A
anchors per row where the pending token is one the model learns, and scores the drafts of learned tokens:

    L = 0.1·CE(p_d, t) + 0.9·Σₖ wₖ ‖p_d,k − p_t,k‖₁ + 1.0·BCE(cₖ, 1 − ½‖p_d,k − p_t,k‖₁),   wₖ = exp(−(k−1)/γ)

with p_t the frozen target's next-token distribution at position p+k and c the confidence head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model import Transformer
from model.dspark import draft_logits

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0


@dataclass
class DraftOutput:
    """Per (sequence, anchor, draft k): draft logits, confidence logits, target probabilities, validity."""

    logits: Tensor  # fp32 [B, A, γ, V]: base logits + Markov bias
    confidence: Tensor  # fp32 [B, A, γ]: confidence-head logits (before any temperature)
    target: Tensor  # fp32 [B, A, γ, V]: the frozen target's distribution of the same token
    labels: Tensor  # int64 [B, A, γ]: the data's token at that position
    valid: Tensor  # bool [B, A, γ]: the pending token and the drafted one are learned tokens of the row


def pick_anchors(targets: Tensor, n: int, gamma: int, generator: torch.Generator | None = None) -> Tensor:
    """[B, ≤ n] anchor positions p per row (p + γ < T, sorted), drawn without replacement among the positions whose
    next token the row learns; a row with fewer such positions fills up with others (their drafts are invalid)."""
    T = targets.shape[1]
    count = T - gamma - 1
    if count < 1:
        raise ValueError(f"sequences of {T} tokens are too short for a block of {gamma} drafts")
    weights = targets[:, 1 : count + 1].float() + 1e-6  # every position stays possible
    return torch.multinomial(weights, min(n, count), replacement=False, generator=generator).sort(-1).values


def draft_forward(model: Transformer, tokens: Tensor, targets: Tensor, anchors: Tensor) -> DraftOutput:
    """The frozen target's forward, then DSpark's draft of every anchor's block (anchors [B, A] or shared [A])."""
    g = model.args.dspark_block_size
    B, T = tokens.shape
    anchors = anchors.expand(B, -1)
    A = anchors.shape[1]
    with torch.no_grad():
        X, pre, taps = model.features(tokens)
    logits, confidence = draft_logits(model, tokens, taps, anchors)
    rows = (anchors.unsqueeze(-1) + 1 + torch.arange(g, device=tokens.device)).flatten(1)  # [B, A·γ]: p+1 … p+γ
    drafted = (rows + 1).clamp(max=T - 1)  # the token each row predicts
    learned = targets.gather(1, drafted) & (rows + 1 < T) & targets.gather(1, anchors + 1).repeat_interleave(g, 1)
    with torch.no_grad():
        at = rows.unsqueeze(-1).unsqueeze(-1)
        streams = X.gather(1, at.expand(-1, -1, *X.shape[2:]))  # [B, A·γ, n, C]
        mix = pre.gather(1, at.squeeze(-1).expand(-1, -1, pre.shape[-1]))
        target = model.logits(streams, mix).softmax(-1).view(B, A, g, -1)
    return DraftOutput(logits, confidence, target, tokens.gather(1, drafted).view(B, A, g), learned.view(B, A, g))


def dspark_loss(out: DraftOutput) -> tuple[Tensor, dict[str, float]]:
    """The DSpark loss over valid drafts, and its parts (for logging)."""
    g = out.logits.shape[-2]
    weights = torch.exp(-torch.arange(g, device=out.logits.device) / g)  # w_k = exp(−(k−1)/γ), k = 1…γ
    valid = out.valid.float()
    drafts, anchors = valid.sum().clamp_min(1.0), valid[..., 0].sum().clamp_min(1.0)
    l1 = (out.logits.softmax(-1) - out.target).abs().sum(-1)
    ce = F.cross_entropy(out.logits.flatten(0, 2), out.labels.flatten(), reduction="none").view_as(l1)
    bce = F.binary_cross_entropy_with_logits(out.confidence, (1 - 0.5 * l1).detach().clamp(0, 1), reduction="none")
    parts = {
        "ce": (ce * valid).sum() / drafts,  # per drafted token
        "l1": (l1 * weights * valid).sum() / anchors,  # Σₖ over each anchor's block
        "bce": (bce * valid).sum() / drafts,
    }
    loss = CE_WEIGHT * parts["ce"] + L1_WEIGHT * parts["l1"] + BCE_WEIGHT * parts["bce"]
    return loss, {name: float(v.detach()) for name, v in parts.items()}


def greedy_acceptance(out: DraftOutput) -> Tensor:
    """bool [B, A, γ]: draft k is the target's arg-max (accepted under greedy verification, given its prefix)."""
    return out.logits.argmax(-1) == out.target.argmax(-1)


def expected_accepted_length(out: DraftOutput) -> float:
    """Mean over the anchors of (leading accepted drafts + the bonus/correction) under greedy verification.

    Every anchor counts once; a greedy decode verifies only at the anchors it reaches (`train.eval.walk`), which
    weighs a run of easy tokens by its steps, not its length: the served figure is lower (chat 2.94 → 2.74 with the
    demo checkpoint). `train.eval` measures both."""
    accepted = (greedy_acceptance(out) & out.valid).long().cumprod(-1).sum(-1)
    anchors = out.valid[..., 0]
    return float((accepted[anchors].float() + 1).mean()) if bool(anchors.any()) else math.nan
