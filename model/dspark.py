"""DSpark: semi-autoregressive drafting with a Markov head and a confidence head (reference §4.4).

Three SWA-only blocks (`mtp.0..2`, mHC + attention + MoE) draft γ = dspark_block_size tokens in one forward:

    context   main_x = main_norm(main_proj([h_l₁; h_l₂; h_l₃]))   h_l = hc-mean of the stream entering target layer l
    ring      each block's window holds K=V of main_x at the real (committed) positions — target-feature injection
    block     inputs [y, noise × (γ−1)] at positions p+1 … p+γ (y: the last sampled, not yet committed token);
              rows attend the ring (positions ≤ p) and every row of the block (bidirectional)
    logits    Uₖ = head(norm(collapse(X)))   (the target's embedding and head are shared)
    Markov    p_k(v) ∝ exp(Uₖ(v) + W2 · W1[x_{k−1}]),  x₀ = y, sampled left to right
    confidence cₖ = σ(w · [collapse(X)ₖ; W1[x_{k−1}]]) — the probability that draft k is accepted given its prefix is

The decode engine may truncate a row's drafts where the running product of confidences falls (adaptive length);
`Transformer.verify` checks them losslessly (model.sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model import kernels
from model.block import Block
from model.cache import KVCache, Step
from model.config import ModelArgs
from model.indexer import backend
from model.linear import Embedding, Linear, RMSNorm


@dataclass
class Draft:
    """γ draft tokens per row, the distributions they were sampled from, and their acceptance confidences."""

    tokens: Tensor  # int64 [B, γ]
    probs: Tensor  # fp32 [B, γ, V]
    confidence: Tensor  # fp32 [B, γ]


class MarkovHead(nn.Module):
    """Rank-r bigram bias B(x_{k−1}, ·) = W1[x_{k−1}] W2ᵀ on the draft logits."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed = Embedding(args.vocab_size, args.dspark_markov_rank, dtype)
        self.head = Linear(args.dspark_markov_rank, args.vocab_size, "bf16", dtype)


class ConfidenceHead(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = Linear(args.hidden_size + args.dspark_markov_rank, 1, "bf16", dtype)


class DSparkBlock(Block):
    """mtp.{stage}: an SWA-only block; the first also builds the context, the last holds the heads."""

    def __init__(self, args: ModelArgs, stage: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(args, args.num_hidden_layers + stage, dtype=dtype)
        C = args.hidden_size
        if stage == 0:
            fp8 = "fp8" if args.quantization_config else "bf16"
            self.main_proj = Linear(len(args.dspark_target_layer_ids) * C, C, fp8, dtype)
            self.main_norm = RMSNorm(C, args.rms_norm_eps, dtype)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(C, args.rms_norm_eps, dtype)
            self.markov_head = MarkovHead(args, dtype)
            self.confidence_head = ConfidenceHead(args, dtype)

    def block_attention(self, x: Tensor, cache: KVCache, positions: Tensor) -> Tensor:
        """Draft rows x [B, γ, C] at positions p+1…: attend the ring at ≤ p and every row of the block."""
        attn, W = self.attn, self.args.sliding_window
        xq = attn.cast_input(x)
        _, q = attn.query(xq, positions)
        data, scale = kernels.quantize_swa_fp8(attn.window_kv(xq, positions), backend=backend(x))
        ring, B, g = cache.rings[self.layer], x.shape[0], x.shape[1]
        anchor = positions[:, :1] - 1  # the newest committed position p
        in_ring = (ring.pos[:B] >= 0) & (ring.pos[:B] <= anchor) & (ring.pos[:B] > anchor - W)
        mask = torch.cat((in_ring.unsqueeze(1).expand(B, g, -1), in_ring.new_ones(B, g, g)), dim=2)
        window = (torch.cat((ring.data[:B], data), 1), torch.cat((ring.scale[:B], scale), 1), mask)
        return attn.attend_packed(q, positions, window, None)


def absorb(mtp: nn.ModuleList, step: Step, taps: list[Tensor]) -> None:
    """Stage every DSpark ring's entries for the step's real positions from the target features `taps`."""
    first = mtp[0]
    main_x = first.main_norm(first.main_proj(torch.cat(taps, dim=-1)))
    for block in mtp:
        kv = block.attn.window_kv(block.attn.cast_input(main_x), step.positions)
        step.rings[block.layer] = kernels.quantize_swa_fp8(kv, backend=backend(kv))
