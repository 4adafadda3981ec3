"""Single-Pass mHC: manifold-constrained hyper-connections with the delayed input mix (reference §4.1–4.2).

The residual stream is `hc_mult` copies X ∈ R^{n×C} per token. Each sublayer site (attention, FFN) predicts from
its own input stream three coefficient sets with one projection `hc_fn` [(2+n)n, nC] of the rms-scaled stream:

    pre  = σ(s₀·m[:n] + b) + hc_eps                     (input mix, handed to the *next* site: Single-Pass)
    post = 2σ(s₁·m[n:2n] + b)                           (how much of the sublayer output each copy receives)
    comb = Sinkhorn(softmax_row(s₂·m[2n:] + b) + hc_eps) (doubly stochastic copy mixing; ends on a column norm)

and updates X' = combᵀ X + post ⊗ F(collapse(X, pre_prev)), where collapse(X, pre) = Σₖ preₖ Xₖ. "Single-Pass"
(V4.1): the site collapses its input with the pre-mix of the *previous* site, so mixing, residual update and
coefficient prediction fuse into one pass over X.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from model.fused import fused


@fused
def hc_mixes(X: Tensor, fn: Tensor, eps: float) -> Tensor:
    """X [..., n, C] → mixes [..., (2+n)n]: the flattened stream projected by fn, scaled by 1/rms (fp32 or wider)."""
    compute = torch.promote_types(fn.dtype, torch.float32)
    xf = X.flatten(-2).to(compute)
    return (xf @ fn.to(compute).T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def hc_split_sinkhorn(
    mixes: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """mixes [..., (2+n)n] → pre [..., n], post [..., n], comb [..., n, n] (rows: source copy, cols: target)."""
    scale, base = scale.to(mixes.dtype), base.to(mixes.dtype)
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n)).softmax(-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """`iters` Sinkhorn rounds on a fresh comb [..., n, n]: a column normalisation, then (iters − 1) × (rows, cols).

    The last step is a column normalisation, on purpose. In place unless autograd records comb: ≈ 120 tiny ops per
    sublayer site on the torch path, where each one's allocation costs about as much as its arithmetic.
    """
    inplace = not (comb.requires_grad and torch.is_grad_enabled())
    for i in range(2 * iters - 1):
        sums = comb.sum(-1 if i % 2 else -2, keepdim=True).add_(eps)
        comb = comb.div_(sums) if inplace else comb / sums
    return comb


@fused
def hc_collapse(X: Tensor, pre: Tensor) -> Tensor:
    """Σₖ preₖ Xₖ: [..., n, C] × [..., n] → [..., C] in X's dtype."""
    compute = torch.promote_types(X.dtype, torch.float32)
    return (pre.to(compute).unsqueeze(-1) * X.to(compute)).sum(-2).to(X.dtype)


@fused
def hc_expand(out: Tensor, X: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Copy k ← postₖ·out + Σⱼ comb[j, k]·Xⱼ: out [..., C], X [..., n, C] → [..., n, C]."""
    compute = torch.promote_types(X.dtype, torch.float32)
    mixed = (comb.to(compute).unsqueeze(-1) * X.to(compute).unsqueeze(-2)).sum(-3)  # n ≤ 8 terms: one fused pass
    return (post.to(compute).unsqueeze(-1) * out.to(compute).unsqueeze(-2) + mixed).to(X.dtype)


class Update(NamedTuple):
    """A site's residual update X ← post ⊗ out + combᵀ X, not yet made: the next site makes it in its coefficients'
    pass (Single-Pass mHC; `model.block.Block`), or `apply` does."""

    out: Tensor  # the sublayer's output [..., C]
    post: Tensor  # [..., n]
    comb: Tensor  # [..., n, n]

    def apply(self, X: Tensor) -> Tensor:
        return hc_expand(self.out, X, self.post, self.comb)


def mix_dtype(stream: torch.dtype) -> torch.dtype:
    """dtype of the mHC coefficients of a stream: at least fp32, like the hc_* parameters that produce them (a bf16
    model's pre-mix is fp32, and every copy of it — the identity mix, cached H^{L/2} rows — must be too)."""
    return torch.promote_types(stream, torch.float32)


def identity_pre(shape: tuple[int, ...], n: int, stream: torch.dtype, device: torch.device | str) -> Tensor:
    """The pre-mix entering layer 0 (and DSpark's first block): one-hot on copy 0, in the stream's `mix_dtype`."""
    pre = torch.zeros(*shape, n, dtype=mix_dtype(stream), device=device)
    pre[..., 0] = 1.0
    return pre
