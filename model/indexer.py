"""Lightning indexer and the two-level (hierarchical) selection of CSA2 (reference §2.5).

    Owner keys (Full layers):  Kᴵ = k_norm(W_k · latent_preRoPE), RoPE at the entry position, FP4 (UE8M0 / 32)
    Queries (index sources):   qᴵ = W_qb · c^Q (the attention's q latent), RoPE, FP4;  w = W_w x · (Dᵢ·Hᵢ)^-½
    Score:                     I[t, s] = Σₕ w[t, h] · ReLU(qᴵ[t, h] · Kᴵ[s]),  −∞ for s ≥ ⌊(t+1)/m⌋
    Level 1 (candidate source, layer L/2): block score = max over candidate_block_size positions, keep the top
        candidate_topk_blocks blocks (the block of the newest visible position pinned) → the candidate pool.
    Level 2 (Reindex layers after it): I ← −∞ outside the pool, then their own top-k.
    Top-k = min(index_topk, visible) positions sorted by position, −1 padded.
    Ties (ReLU makes many scores exactly 0) go to the lower position, in both selections: the rule lives in
    model.kernels (topk_indices, candidate_mask), so a selection depends on the scores alone, never on how many
    positions a step scores (chunked prefill, batching and verification select as the one-shot dense forward does).

Owner keys come from the owner's own key cache on every step. The reference's decode path instead scores against
whichever indexer K was published last when no new group completed (§2.5 "known quirk"); we take the recommended
HF/vLLM/MLX behaviour.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import kernels
from model.config import LayerRole, ModelArgs
from model.fused import fused
from model.linear import Linear
from model.norm import RMSNorm


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, role: LayerRole, queries: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        H, Di = args.index_n_heads, args.index_head_dim
        fp8 = "fp8" if args.quantization_config else "bf16"
        self.n_heads, self.head_dim = H, Di
        if queries:
            self.wq_b = Linear(args.q_lora_rank, H * Di, fp8, dtype)
            self.weights_proj = Linear(args.hidden_size, H, "bf16", dtype)
        if role.owns_kv:
            self.wk = Linear(args.head_dim, Di, "bf16", dtype)
            self.k_norm = RMSNorm(Di, args.rms_norm_eps, dtype)

    def keys(self, latent: Tensor) -> Tensor:
        """Pre-RoPE indexer keys [..., Dᵢ] of pre-RoPE compressed latents [..., D]."""
        return self.k_norm(self.wk(latent))

    def head_weights(self, x: Tensor) -> Tensor:
        """The head weights w [B, T, H] (at least fp32) of the input x. The queries, W_qb · c^Q, come with the
        attention's own (`Attention.heads`: one GEMM over both wq_b)."""
        return _scaled_weights(x, self.weights_proj.weight, 1.0 / math.sqrt(self.head_dim * self.n_heads))


@fused
def _scaled_weights(x: Tensor, weight: Tensor, scale: float) -> Tensor:
    """x Wᵀ (in W's dtype, as `Linear` computes it), widened to at least fp32 and scaled: the GEMM and one kernel."""
    return F.linear(x.to(weight.dtype), weight).to(torch.promote_types(x.dtype, torch.float32)) * scale


class Selection:
    """The cross-layer slots of one forward: Top-K per index source and the candidate pool (SharedAttentionRuntime)."""

    def __init__(self) -> None:
        self.topk: dict[int, Tensor] = {}
        self.candidates: Tensor | None = None

    def select(self, args: ModelArgs, role: LayerRole, scores: Tensor, n_visible: Tensor) -> Tensor:
        """Candidate pool (level 1) or restriction to it (level 2), then top-k; publishes and returns [B, T, K]."""
        be = kernels.backend_for(scores)
        if role.candidate_source:
            block, top = args.candidate_block_size, args.candidate_topk_blocks
            self.candidates = kernels.candidate_mask(scores, n_visible, block, top, backend=be)
        elif role.uses_candidates:
            scores = torch.where(self.candidates, scores, -math.inf)
        B, T, S = scores.shape
        idx = kernels.topk_indices(scores.reshape(B * T, S), args.index_topk, n_visible.reshape(-1), backend=be)
        self.topk[role.layer_id] = idx.view(B, T, -1)
        return self.topk[role.layer_id]
