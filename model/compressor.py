"""CSA2 compressor of a KV-source (Full) layer: one latent entry per m tokens (reference §2.4).

    m = 2 (encoder owners):  entry j over tokens {2j, 2j+1}:  Cⱼ = RMSNorm(Σₜ softmaxₜ(Zₜ) ⊙ (W_KV xₜ)),  Z = W_Z x
    m = 1 (decoder owner):   Cₜ = RMSNorm(W_KV xₜ)   — CED: layer L/2's input is the encoder output H^{L/2}

Non-overlapping, no positional bias (V4.1 dropped V4's overlap and APE). The latent is returned pre-RoPE: the
indexer key is projected from it; the caller rotates it at position j·m and quantises it to FP4.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.cache import Step
from model.config import ModelArgs
from model.fused import fused
from model.linear import Linear
from model.norm import RMSNorm, rms_norm


class Compressor(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer, self.ratio = layer, args.compress_ratios[layer]
        # Gated m=2 compressors keep fp32 weights (reference); the m=1 projection is a plain bf16 linear.
        fmt = "fp32" if self.ratio > 1 else "bf16"
        self.wkv = Linear(args.hidden_size, args.head_dim, fmt, dtype)
        if self.ratio > 1:
            self.wgate = Linear(args.hidden_size, args.head_dim, "fp32", dtype)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype)

    def pool(self, kv: Tensor, score: Tensor) -> Tensor:
        """kv, score [..., G, m, D] → pre-RoPE latents [..., G, D]: per-channel softmax over the m tokens."""
        return _pool(kv, score, self.norm.weight, self.norm.eps)

    def forward(self, x: Tensor) -> Tensor:
        """Whole sequences from position 0: x [B, T, C] → latents [B, ⌊T/m⌋, D] of the complete groups."""
        m = self.ratio
        kv = self.wkv(x)
        if m == 1:
            return self.norm(kv)
        G = x.shape[1] // m
        groups = (x.shape[0], G, m, kv.shape[-1])
        return self.pool(kv[:, : G * m].reshape(groups), self.wgate(x)[:, : G * m].reshape(groups))

    def forward_step(self, x: Tensor, step: Step) -> tuple[Tensor, Tensor, int]:
        """Latents of this step's groups: (latents [B, G, D], first entry index per row [B], max first + G).

        Latents past a row's complete groups (its open group) are computed too; see `Entries.write`. An m>1 group
        may straddle steps: the open group's tokens are prepended (group-aligned per row) and the step stages the
        aligned kv/gate sequence so that commit can keep the new open group.
        """
        m, T = self.ratio, step.length
        kv = self.wkv(x)
        first = torch.div(step.positions[:, 0], m, rounding_mode="floor")
        if m == 1:
            return self.norm(kv), first, max(step.start) + T
        pending = step.cache.pending[self.layer]
        n_open = step.positions[:, 0] % m
        open_kv, open_score = pending.kv[step.rows], pending.score[step.rows]
        aligned_kv, aligned_score = _aligned(open_kv, open_score, kv, self.wgate(x), n_open, m)
        step.groups[self.layer] = (aligned_kv, aligned_score, n_open)
        L = aligned_kv.shape[1]
        groups = (step.batch, L // m, m, kv.shape[-1])
        latents = self.pool(aligned_kv.view(groups), aligned_score.view(groups))
        return latents, first, max(step.start) // m + L // m


@fused
def _aligned(
    open_kv: Tensor, open_score: Tensor, kv: Tensor, score: Tensor, n_open: Tensor, m: int
) -> tuple[Tensor, Tensor]:
    """Each row's [n_open pending tokens (of its open group, [B, m−1, D]), its T new ones, zeros], group-aligned to
    L = ⌈(m − 1 + T)/m⌉·m positions, for the kv and the gate logits alike → two [B, L, D], each gathered from one
    concatenation (one compiled region on a GPU)."""
    B, T, D = kv.shape
    L = -(-(m - 1 + T) // m) * m
    i = torch.arange(L, device=kv.device)
    o = n_open.unsqueeze(1)
    take = torch.where(i < o, i, torch.where(i < o + T, m - 1 + i - o, m - 1 + T)).unsqueeze(-1).expand(-1, -1, D)
    zero = kv.new_zeros(B, 1, D)
    aligned_kv = torch.cat((open_kv.to(kv.dtype), kv, zero), dim=1).gather(1, take)
    aligned_score = torch.cat((open_score.to(score.dtype), score, zero.to(score.dtype)), dim=1).gather(1, take)
    return aligned_kv, aligned_score


@fused
def _pool(kv: Tensor, score: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(Σₜ softmaxₜ(score) ⊙ kv) over the m tokens of each group (dim −2): one compiled region on a GPU."""
    return rms_norm.__wrapped__((kv * score.softmax(dim=-2)).sum(-2), weight, eps)
