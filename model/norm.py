"""RMSNorm, alone or after the mHC collapse: every sublayer site's input (reference §2.8, §4.2).

The packed model takes a site's input and its FP8 cast from one kernel (`kernels.norm_cast`); these are the plain
forms, which that kernel reproduces and the float model runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.fused import fused
from model.mhc import hc_collapse


class RMSNorm(nn.Module):
    """w ⊙ x / rms(x), computed in at least fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype or torch.get_default_dtype()))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.to(compute) * y).to(x.dtype)


@fused
def collapse_norm(X: Tensor, pre: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(collapse(X, pre)) with `weight`: a sublayer site's (or the head's) input, in one pass over X."""
    return rms_norm.__wrapped__(hc_collapse.__wrapped__(X, pre), weight, eps)
