"""Linear layers with the checkpoint's storage format, and RMSNorm.

A weight's format is how the released checkpoint stores it (reference §2.9): `fp8` (E4M3 in 32×32 blocks with a
UE8M0 scale each), `fp4` (routed experts: packed E2M1 with a UE8M0 scale per 32 inputs), or plain (`bf16`, or
`fp32` for the compressor, gate bias, mHC and sink). In memory every weight is a float tensor holding exactly the
values the stored form decodes to, so the math below is plain torch; `model.weights` converts to and from the
packed forms. QAT is model semantics (reference §2.10): the input of every FP8/FP4 linear is FP8-quantised
(E4M3, UE8M0 scale per 32) first, in training and in inference alike.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import kernels

WeightFormat = Literal["fp8", "fp4", "bf16", "fp32"]


def param_dtype(fmt: WeightFormat, dtype: torch.dtype) -> torch.dtype:
    """`fp32` parameters stay at least fp32 in a bf16 model (the reference keeps them fp32)."""
    return torch.promote_types(dtype, torch.float32) if fmt == "fp32" else dtype


class Linear(nn.Module):
    """y = x Wᵀ (no bias: attention_bias is false). Computes in the weight's dtype and returns that dtype."""

    def __init__(
        self, in_features: int, out_features: int, fmt: WeightFormat = "bf16", dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        dtype = param_dtype(fmt, dtype or torch.get_default_dtype())
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    @property
    def quantized(self) -> bool:
        return self.fmt in ("fp8", "fp4")

    def forward(self, x: Tensor, prequantized: bool = False) -> Tensor:
        """`prequantized`: x already went through `quantize_input` (one cast shared by linears of the same input)."""
        if self.quantized and not prequantized:
            x = quantize_input(x)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"


class Embedding(nn.Module):
    """Row lookup (token embedding, Engram table, Markov head). Created uninitialised: `model.weights` fills it."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype or torch.get_default_dtype()))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


def quantize_input(x: Tensor) -> Tensor:
    """The FP8 (E4M3, UE8M0 per 32) QAT cast of activations: every FP8/FP4 linear's input, and the values the SWA
    ring stores. One kernel on a GPU (it runs on every linear input of every step), the torch reference elsewhere."""
    return kernels.fake_quant_fp8(x, backend=kernels.backend_for(x))


class RMSNorm(nn.Module):
    """w ⊙ x / rms(x), computed in at least fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype or torch.get_default_dtype()))

    def forward(self, x: Tensor) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(compute) * y).to(x.dtype)
