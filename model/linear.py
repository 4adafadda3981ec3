"""Linear layers, row tables and RMSNorm, in the float form training uses and the packed form serving holds.

A weight's format is how the released checkpoint stores it (reference §2.9): `fp8` (E4M3 in 32×32 blocks with a
UE8M0 scale each), `fp4` (routed experts: packed E2M1 with a UE8M0 scale per 32 or 16 inputs — `model.moe`), or
plain (`bf16`, or `fp32` for the compressor, gate bias, mHC and sink). A model exists in one of two forms:

- **float** (training, the exact oracle of the tests): every weight is a float tensor holding exactly the values
  its stored form decodes to (`model.weights` snaps them), and the math is plain torch;
- **packed** (serving, `model.weights.build_model`): quantised weights keep their checkpoint bytes — `Fp8Linear`
  (E4M3 + UE8M0 blocks), `Fp8Rows` (the Engram tables), `model.moe.PackedExperts` (E2M1 nibbles) — and compute
  through `model.kernels` (block-scaled FP8 GEMM, grouped MXFP4 GEMM). No dequantised copy of them is ever kept.

QAT is model semantics (reference §2.10): the input of every FP8/FP4 linear is FP8-quantised (E4M3, UE8M0 scale per
32) first, in training and in inference alike. `cast` is that cast, in the form the layer consumes: fake-quantised
floats (gradient straight through) for the float form, an `Fp8Act` (the bytes) for the packed one; layers sharing one
input share one cast.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import kernels, quant
from model.fused import fused

WeightFormat = Literal["fp8", "fp4", "bf16", "fp32"]
FP8_BLOCK = 32  # FP8 weights: 32×32 blocks (quantization_config.weight_block_size); activations: 32 channels


def param_dtype(fmt: WeightFormat, dtype: torch.dtype) -> torch.dtype:
    """`fp32` parameters stay at least fp32 in a bf16 model (the reference keeps them fp32)."""
    return torch.promote_types(dtype, torch.float32) if fmt == "fp32" else dtype


def packed_param(
    *shape: int, dtype: torch.dtype, device: torch.device | str | None = None, pin_memory: bool = False
) -> nn.Parameter:
    """Storage for checkpoint bytes (E4M3, packed E2M1, UE8M0 scales): a parameter no gradient reaches
    (`pin_memory`: page-locked host memory, which copies to a GPU asynchronously)."""
    storage = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    return nn.Parameter(storage, requires_grad=False)


class Fp8Act(NamedTuple):
    """FP8 activations as the QAT cast stores them: E4M3 bits [..., K], UE8M0 scales [..., K/32], and the float
    dtype the layer computes in (its output dtype)."""

    data: Tensor
    scale: Tensor
    dtype: torch.dtype

    def value(self) -> Tensor:
        """The float values (exactly what `quantize_input` gives)."""
        return quant.fp8_dequant(self.data, self.scale, FP8_BLOCK, self.dtype)


def quantize_input(x: Tensor) -> Tensor:
    """The FP8 (E4M3, UE8M0 per 32) QAT cast of activations as floats: the float form's linear inputs, and the values
    the SWA ring stores. One kernel on a GPU (it runs on every step), the torch reference elsewhere."""
    return kernels.fake_quant_fp8(x, backend=kernels.backend_for(x))


def fp8_act(x: Tensor) -> Fp8Act:
    """The same cast as bytes (the ring's FP8 format): what a packed FP8/FP4 layer reads."""
    data, scale = kernels.quantize_swa_fp8(x, backend=kernels.backend_for(x))
    return Fp8Act(data, scale, x.dtype)


class Linear(nn.Module):
    """y = x Wᵀ (no bias: attention_bias is false) over a float weight. Computes in the weight's dtype."""

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

    def cast(self, x: Tensor) -> Tensor:
        """This layer's input cast (the FP8 QAT cast if quantised), to share between layers of one input."""
        return quantize_input(x) if self.quantized else x

    share = cast  # what the linears of one input share: the cast (the packed form may leave it to each GEMM)

    def forward(self, x: Tensor, prequantized: bool = False) -> Tensor:
        """`prequantized`: x is already `cast`."""
        if not prequantized:
            x = self.cast(x)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"


class Fp8Linear(nn.Module):
    """y = x Wᵀ at native precision: W as E4M3 [out, in] with a UE8M0 scale per 32×32 block, x cast to FP8 on the
    fly, one block-scaled FP8 GEMM (`kernels.fp8_linear`, fp32 accumulation). Returns the input's dtype."""

    fmt: WeightFormat = "fp8"
    quantized = True

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK))
        self.weight = packed_param(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        self.scale = packed_param(*blocks, dtype=torch.uint8, device=device)

    def cast(self, x: Tensor) -> Fp8Act:
        return fp8_act(x)

    def share(self, x: Tensor) -> Tensor | Fp8Act:
        """What the FP8 linears reading x share: its cast, or x itself where each of their GEMMs casts its input in
        its own launch (`kernels.casts_in_gemm`: small batches on a GPU), which saves the cast's launch."""
        rows = x.numel() // x.shape[-1]
        return x if kernels.casts_in_gemm(rows, kernels.backend_for(x)) else self.cast(x)

    def forward(self, x: Tensor | Fp8Act, prequantized: bool = False) -> Tensor:
        """x: floats (cast here: by the GEMM itself where it can) or an `Fp8Act` already cast (shared by layers)."""
        backend = kernels.backend_for(x.data if isinstance(x, Fp8Act) else x)
        if isinstance(x, Fp8Act):
            lead = x.data.shape[:-1]
            data, scale = x.data.reshape(-1, self.in_features), x.scale.reshape(-1, x.scale.shape[-1])
            y = kernels.fp8_linear(data, scale, self.weight, self.scale, x.dtype, backend=backend)
        else:
            lead = x.shape[:-1]
            y = kernels.fp8_linear_cast(x.reshape(-1, self.in_features), self.weight, self.scale, backend=backend)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt=fp8 (packed)"


class Embedding(nn.Module):
    """Row lookup (token embedding, Engram table, Markov head). Created uninitialised: `model.weights` fills it."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype or torch.get_default_dtype()))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class Fp8Rows(nn.Module):
    """A row table at native precision (the Engram tables): E4M3 rows [rows, dim] with a UE8M0 scale per 32
    channels; a lookup decodes only the rows it gathers, into `dtype`."""

    def __init__(
        self,
        rows: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight = packed_param(rows, dim, dtype=torch.float8_e4m3fn, device=device, pin_memory=pin_memory)
        self.scale = packed_param(rows, dim // FP8_BLOCK, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    def forward(self, ids: Tensor) -> Tensor:
        return self.decode(self.weight.view(torch.uint8)[ids], self.scale[ids], self.dtype)

    @staticmethod
    def decode(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        """Gathered rows (E4M3 bytes [..., dim], UE8M0 scales [..., dim/32]) → their values in `dtype` (one kernel on
        a GPU)."""
        return _fp8_row_values(data, scale, dtype)


class RMSNorm(nn.Module):
    """w ⊙ x / rms(x), computed in at least fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype or torch.get_default_dtype()))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused
def _fp8_row_values(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp8_dequant(data, scale, FP8_BLOCK, dtype)


@fused
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.to(compute) * y).to(x.dtype)
