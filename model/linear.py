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

Siblings — FP8 linears reading one input (attention's wq_a and wkv, its wq_b and the indexer's, an expert's w1 and
w3) — are laid out by `stack` as adjacent views of one weight and one scale buffer; `project_together` then runs them
as one GEMM over the stacked rows, the outputs being column views of its result.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import kernels, quant
from model.fused import fused
from model.norm import RMSNorm, collapse_norm

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
        return fp8_project(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt=fp8 (packed)"


def fp8_project(x: Tensor | Fp8Act, weight: Tensor, scale: Tensor) -> Tensor:
    """x Wᵀ [..., N] for E4M3 weight [N, K] with UE8M0 scale blocks, x floats [..., K] (cast by the GEMM where it
    can) or an `Fp8Act`."""
    backend = kernels.backend_for(x.data if isinstance(x, Fp8Act) else x)
    K = weight.shape[1]
    if isinstance(x, Fp8Act):
        lead = x.data.shape[:-1]
        data, x_scale = x.data.reshape(-1, K), x.scale.reshape(-1, x.scale.shape[-1])
        y = kernels.fp8_linear(data, x_scale, weight, scale, x.dtype, backend=backend)
    else:
        lead = x.shape[:-1]
        y = kernels.fp8_linear_cast(x.reshape(-1, K), weight, scale, backend=backend)
    return y.view(*lead, weight.shape[0])


def stack(linears: list[Fp8Linear]) -> None:
    """Lay out FP8 sibling linears (one input, the same in_features) as adjacent rows of one weight and one scale
    buffer, each keeping its own parameters as views of them; uninitialised (the loader fills the views). Every
    sibling but the last must hold whole 32-row scale blocks."""
    K = linears[0].in_features
    if any(lin.in_features != K for lin in linears) or any(lin.out_features % FP8_BLOCK for lin in linears[:-1]):
        raise ValueError(f"siblings {[(lin.out_features, lin.in_features) for lin in linears]} do not stack")
    first = linears[0]
    rows = sum(lin.out_features for lin in linears)
    weight = torch.empty(rows, K, dtype=first.weight.dtype, device=first.weight.device)
    scale = torch.empty(math.ceil(rows / FP8_BLOCK), first.scale.shape[1], dtype=torch.uint8, device=weight.device)
    top = 0
    for lin in linears:
        lin.weight = nn.Parameter(weight[top : top + lin.out_features], requires_grad=False)
        lin.scale = nn.Parameter(scale[top // FP8_BLOCK : top // FP8_BLOCK + lin.scale.shape[0]], requires_grad=False)
        top += lin.out_features


def _stacked(linears: tuple[nn.Module, ...]) -> tuple[Tensor, Tensor] | None:
    """The stacked weight and scale of siblings still laid out by `stack` (adjacent, contiguous), else None."""
    if not all(isinstance(lin, Fp8Linear) for lin in linears):
        return None
    weight, scale = linears[0].weight, linears[0].scale
    w_at, s_at = weight.data_ptr(), scale.data_ptr()
    for lin in linears:
        if lin.weight.data_ptr() != w_at or lin.scale.data_ptr() != s_at:
            return None
        if not (lin.weight.is_contiguous() and lin.scale.is_contiguous()):
            return None
        w_at, s_at = w_at + lin.weight.nbytes, s_at + lin.scale.nbytes
    rows = sum(lin.weight.shape[0] for lin in linears)
    K, blocks = weight.shape[1], scale.shape[1]
    return weight.as_strided((rows, K), (K, 1)), scale.as_strided((math.ceil(rows / FP8_BLOCK), blocks), (blocks, 1))


def project_together(x: Tensor | Fp8Act, *linears: nn.Module) -> list[Tensor]:
    """Each of `linears` applied to their shared input x (cast as they share it: `share`): one GEMM over the stacked
    weights of packed siblings (`stack`), the outputs column views of its result; else one call each."""
    stacked = _stacked(linears)
    if stacked is None:
        return [lin(x, True) for lin in linears]
    y = fp8_project(x, *stacked)
    return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))


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


@fused
def _fp8_row_values(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp8_dequant(data, scale, FP8_BLOCK, dtype)


def norm_share(X: Tensor, pre: Tensor | None, norm: RMSNorm, first: nn.Module) -> tuple[Tensor, Tensor | Fp8Act]:
    """(x = norm(collapse(X, pre)) — norm(X) without pre —, x as the linear `first` and its siblings share it
    (`share`)). For a packed FP8 `first` one kernel gives both (`kernels.norm_cast`): the cast takes no launch of its
    own, and the GEMMs read its bytes at every batch size."""
    if isinstance(first, Fp8Linear):
        x, data, scale = kernels.norm_cast(X, pre, norm.weight, norm.eps, backend=kernels.backend_for(X))
        return x, Fp8Act(data, scale, x.dtype)
    x = norm(X) if pre is None else collapse_norm(X, pre, norm.weight, norm.eps)
    return x, first.share(x)
