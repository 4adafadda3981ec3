"""FP8 activation casts (E4M3, UE8M0 per 32) fused into the ops that produce the activations.

A packed FP8 linear reads its input cast; a cast kernel of its own after the producer costs a launch and a round trip
of the activations, and a cast inside the GEMM is redone by every weight tile. Here the producer casts what it made,
once per value, as `quantize_swa_fp8` would cast it (vLLM fuses RMSNorm and SwiGLU with their quantisers likewise):

- `norm_cast`: a sublayer's input — RMSNorm, after the mHC collapse Σₖ preₖ Xₖ where there is one — stored in X's
  dtype (the indexer, the compressor and the MoE gate read it as floats) and cast;
- `swiglu_cast`: the shared expert's hidden silu(min(gate, limit)) · clamp(up, ±limit), cast only (W2 alone reads it).

Each program holds BLOCK_M whole rows in registers. The torch sides are `model.norm` and `model.activation`, then
`quant.fp8_quant`.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import activation, norm, quant
from model.kernels.formats import unit_stride
from model.kernels.kv_quant import SWA_BLOCK, rms_norm_rows, store_fp8
from model.kernels.launch import dependent_launch, follow

_TILE_ELEMENTS = 4096  # fp32 values per program held in registers


def norm_cast_torch(X: Tensor, pre: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    x = norm.rms_norm(X, weight, eps) if pre is None else norm.collapse_norm(X, pre, weight, eps)
    return x, *quant.fp8_quant(x, SWA_BLOCK)


@triton.jit(do_not_specialize=["M"])  # one binary for every row count (model.kernels.invariance)
def _norm_cast_kernel(
    X_ptr, pre_ptr, w_ptr, y_ptr, data_ptr, scale_ptr, M, stride, eps,
    N: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Rows BLOCK_M · program …: y = RMSNorm(Σₖ pre[r, k] X[r, k]) (N streams, X [M, N, C]; N = 0: X [M, C] itself,
    rows `stride` apart), each sum and the norm in fp32, rounded to X's dtype where the torch forms round (the
    collapse's result, then y)."""
    follow(PDL, EARLY)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, CP)
    row_ok = rows < M
    ok = row_ok[:, None] & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    if N == 0:
        x = tl.load(X_ptr + r64[:, None] * stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        x = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
        for k in tl.static_range(N):
            mix = tl.load(pre_ptr + r64 * N + k, mask=row_ok, other=0.0).to(tl.float32)
            stream = tl.load(X_ptr + (r64[:, None] * N + k) * C + cols[None, :], mask=ok, other=0.0)
            x += mix[:, None] * stream.to(tl.float32)
        x = x.to(X_ptr.dtype.element_ty).to(tl.float32)
    y = rms_norm_rows(x, w_ptr, C, CP, eps).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r64[:, None] * C + cols[None, :], y, mask=ok)
    store_fp8(y.to(tl.float32), data_ptr, scale_ptr, rows, M, C, CP, BLOCK_M, False)


def norm_cast_triton(X: Tensor, pre: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    C = X.shape[-1]
    N = 0 if pre is None else X.shape[-2]
    lead = X.shape[:-1] if pre is None else X.shape[:-2]
    M = lead.numel()
    y = torch.empty((*lead, C), dtype=X.dtype, device=X.device)
    data = torch.empty((*lead, C), dtype=torch.uint8, device=X.device)
    scale = torch.empty((*lead, C // SWA_BLOCK), dtype=torch.uint8, device=X.device)
    if M:
        CP = triton.next_power_of_2(C)
        block_m = max(1, _TILE_ELEMENTS // CP)
        X = unit_stride(X.reshape(-1, C)) if pre is None else X.contiguous()
        pre_rows = X if pre is None else pre.contiguous()
        grid = (triton.cdiv(M, block_m),)
        _norm_cast_kernel[grid](
            X, pre_rows, weight.contiguous(), y, data, scale, M, X.stride(0), eps, N, C, CP, block_m, num_warps=4,
            **dependent_launch(X.device, grid),
        )  # fmt: skip
    return y, data, scale


def swiglu_cast_torch(gate: Tensor, up: Tensor, limit: float) -> tuple[Tensor, Tensor]:
    return quant.fp8_quant(activation.swiglu(gate, up, limit), SWA_BLOCK)


@triton.jit
def _swiglu_cast_kernel(
    gate_ptr, up_ptr, data_ptr, scale_ptr, M, stride, limit,
    I: tl.constexpr, IP: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Rows BLOCK_M · program … of gate and up (row stride `stride`): h in fp32, rounded to gate's dtype, cast."""
    follow(PDL, EARLY)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, IP)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    at = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    gate = tl.minimum(tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32), limit)
    up = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(up, -limit), limit)
    store_fp8(h.to(gate_ptr.dtype.element_ty).to(tl.float32), data_ptr, scale_ptr, rows, M, I, IP, BLOCK_M, False)


def swiglu_cast_triton(gate: Tensor, up: Tensor, limit: float) -> tuple[Tensor, Tensor]:
    M, I = gate.shape
    data = torch.empty((M, I), dtype=torch.uint8, device=gate.device)
    scale = torch.empty((M, I // SWA_BLOCK), dtype=torch.uint8, device=gate.device)
    if M:
        IP = triton.next_power_of_2(I)
        block_m = max(1, _TILE_ELEMENTS // IP)
        gate, up = unit_stride(gate), unit_stride(up)
        if gate.stride(0) != up.stride(0):
            gate, up = gate.contiguous(), up.contiguous()
        grid = (triton.cdiv(M, block_m),)
        _swiglu_cast_kernel[grid](
            gate, up, data, scale, M, gate.stride(0), float(limit), I, IP, block_m, num_warps=4,
            **dependent_launch(gate.device, grid),
        )  # fmt: skip
    return data, scale
