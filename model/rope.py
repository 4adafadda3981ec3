"""Rotary position embedding on the last `qk_rope_head_dim` dims, with the per-layer θ / YaRN rule (reference §2.3).

Layers with compress ratio > 0 rotate with `compress_rope_theta` and YaRN frequency interpolation (no attention
temperature); ratio-0 layers (SWA-only, DSpark) with `rope_theta` and no YaRN. Pairs are adjacent (interleaved)
dims viewed as complex numbers, as in DeepSeek's reference. The attention output is rotated back by the inverse
rotation (position −i, reference eq. 26) before the output projection.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model import kernels
from model.config import ModelArgs


def _yarn_ramp_bounds(dim: int, original: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """Dims whose wavelength completes beta_fast (resp. beta_slow) rotations over the original context."""

    def dim_for(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), dim - 1)
    return low, high


def inverse_frequencies(args: ModelArgs, yarn: bool) -> Tensor:
    """fp64 [rope_dim/2] angular frequencies of one layer kind."""
    dim = args.qk_rope_head_dim
    base = args.compress_rope_theta if yarn else args.rope_theta
    # Always on the CPU (also inside a `meta` device context); the module moves it with the model.
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if yarn:
        s = args.rope_scaling
        low, high = _yarn_ramp_bounds(dim, s.original_max_position_embeddings, base, s.beta_fast, s.beta_slow)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        # Low-index (high-frequency) dims keep their frequency; past `high` they are divided by the factor.
        freqs = freqs / s.factor * ramp + freqs * (1 - ramp)
    return freqs


class Rope(torch.nn.Module):
    """The rotary frequencies of one layer kind; `rotate(x, positions)` rotates x[..., -rope_dim:]."""

    def __init__(self, args: ModelArgs, yarn: bool) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(args, yarn), persistent=False)

    def rotate(self, x: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """x [..., S, (heads,) D] with positions broadcastable to x's position axis; rotates the last rope dims.

        `positions` has the shape of x's leading dims up to the position axis ([S] or [B, S]); a heads axis after
        it is broadcast. The math: `model.kernels.rope.rope_rotate_torch`.
        """
        return kernels.rope_rotate(x, positions, self.inv_freq, inverse, backend=kernels.backend_for(x))
