"""DSpark training against the frozen target: the dense form of `model.serving.dspark_draft` (reference §4.4).

For an anchor p (the newest committed position), serving drafts γ tokens from the block [t_{p+1}, noise × (γ−1)]
at positions p+1 … p+γ; its rows attend the DSpark ring (K=V of main_x at positions p−W < j ≤ p) and every row of
the block. Training runs A anchors per sequence at once: the A·γ rows of a sequence attend their own anchor's ring
window and block (masks), with the same FP8 fake-quant the serving path stores. Teacher forcing gives the Markov
head its previous token: x_{k−1} = t_{p+k}.

    L = 0.1·CE(p_d, t) + 0.9·Σₖ wₖ ‖p_d,k − p_t,k‖₁ + 1.0·BCE(cₖ, 1 − ½‖p_d,k − p_t,k‖₁),   wₖ = exp(−(k−1)/γ)

with p_t the frozen target's next-token distribution at position p+k and c the confidence head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model import Transformer, quant
from model.attention import dense_attention
from model.mhc import hc_collapse

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0


@dataclass
class DraftOutput:
    """Per (sequence, anchor, draft k): draft logits, confidence logits, target probabilities, validity."""

    logits: Tensor  # fp32 [B, A, γ, V]: base logits + Markov bias
    confidence: Tensor  # fp32 [B, A, γ]: confidence-head logits (before any temperature)
    target: Tensor  # fp32 [B, A, γ, V]: the frozen target's distribution of the same token
    labels: Tensor  # int64 [B, A, γ]: the data's token at that position
    valid: Tensor  # bool [B, A, γ]: the drafted position is a learned token inside the sequence


def pick_anchors(targets: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """[B, n] anchor positions p whose pending token t_{p+1} is a learned (assistant) token, chosen at random.

    Rows with fewer such positions repeat valid ones; a row with none gets anchor 0 (its drafts are all invalid).
    """
    T = targets.shape[1]
    eligible = torch.zeros_like(targets)
    eligible[:, : T - 1] = targets[:, 1:]
    eligible[:, max(0, T - 2) :] = False  # at least one drafted position after the pending token
    weights = eligible.float() + 1e-9 * (~eligible).float()  # a row without eligible positions still samples
    picks = torch.multinomial(weights, n, replacement=True, generator=generator)
    return torch.where(eligible.gather(1, picks), picks, torch.zeros_like(picks))


def draft_forward(model: Transformer, tokens: Tensor, targets: Tensor, anchors: Tensor) -> DraftOutput:
    """Target forward (frozen) and the DSpark blocks over every anchor's block, batched."""
    a = model.args
    g, W, V = a.dspark_block_size, a.sliding_window, a.vocab_size
    B, T = tokens.shape
    A = anchors.shape[1]
    with torch.no_grad():
        target_logits, taps = model(tokens, return_taps=True)
    device = tokens.device
    k = torch.arange(g, device=device)
    rows = (anchors.unsqueeze(-1) + 1 + k).clamp(max=T - 1)  # [B, A, γ] positions p+1 … p+γ
    drafted = anchors.unsqueeze(-1) + 2 + k  # the token each row predicts
    valid = (drafted < T) & targets.gather(1, drafted.clamp(max=T - 1).view(B, -1)).view(B, A, g)
    valid &= targets.gather(1, anchors + 1).unsqueeze(-1)  # drops the stand-in anchors of pick_anchors
    labels = tokens.gather(1, drafted.clamp(max=T - 1).view(B, -1)).view(B, A, g)
    ids = torch.full((B, A, g), a.dspark_noise_token_id, dtype=torch.int64, device=device)
    ids[..., 0] = tokens.gather(1, rows[..., 0])
    positions = rows.view(B, A * g)

    # Masks: a row sees the ring at its anchor's window and the rows of its own block.
    anchor_of_row = anchors.repeat_interleave(g, dim=1)  # [B, A·γ]
    j = torch.arange(T, device=device)
    ring_mask = (j <= anchor_of_row.unsqueeze(-1)) & (j > anchor_of_row.unsqueeze(-1) - W)
    block_id = torch.arange(A, device=device).repeat_interleave(g)
    block_mask = (block_id.unsqueeze(1) == block_id.unsqueeze(0)).expand(B, -1, -1)

    first = model.mtp[0]
    main_x = first.main_norm(first.main_proj(taps))
    all_positions = j.expand(B, T)
    X, pre = model.embed_stream(ids.view(B, A * g))
    for block in model.mtp:
        attn = block.attn
        ring = quant.fake_quant_fp8(attn.window_kv(attn.cast_input(main_x), all_positions))

        def attend(x: Tensor, attn=attn, ring=ring) -> Tensor:
            xq = attn.cast_input(x)  # the FP8 input cast wq_a and wkv share
            _, q = attn.query(xq, positions)
            own = quant.fake_quant_fp8(attn.window_kv(xq, positions))
            o = dense_attention(q, [(ring, ring_mask), (own, block_mask)], attn.attn_sink, attn.softmax_scale)
            return attn.project_out(o, positions)

        X, pre = block(X, pre, attend)
    last = model.mtp[-1]
    x = hc_collapse(X, pre)
    base = model.head(last.norm(x)).float().view(B, A, g, V)
    previous = tokens.gather(1, rows.view(B, -1)).view(B, A, g)  # x_{k−1} = t_{p+k} (teacher forcing)
    e = last.markov_head.embed(previous)
    logits = base + last.markov_head.head(e).float()
    confidence = last.confidence_head.proj(torch.cat((x.view(B, A, g, -1), e.to(x.dtype)), -1)).float().squeeze(-1)
    target = target_logits[torch.arange(B, device=device).unsqueeze(1), rows.view(B, -1)].view(B, A, g, V).softmax(-1)
    return DraftOutput(logits, confidence, target, labels, valid)


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
    """Mean tokens per verification step under greedy decoding: leading accepted drafts + the bonus/correction."""
    accepted = (greedy_acceptance(out) & out.valid).long().cumprod(-1).sum(-1)
    anchors = out.valid[..., 0]
    return float((accepted[anchors].float() + 1).mean()) if bool(anchors.any()) else math.nan
