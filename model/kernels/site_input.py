"""A sublayer's input and its FP8 cast in one pass: RMSNorm (after the mHC collapse Σₖ preₖ Xₖ where there is one)
and the activation cast (E4M3, UE8M0 per 32) of the result.

A packed FP8 linear reads its input cast; a separate cast kernel after the norm costs a launch and a round trip of
the activations. Here each program normalises BLOCK_M whole rows in registers, stores them in X's dtype (the
attention's indexer and compressor, the MoE gate, read them as floats) and casts what it stored, as
`quantize_swa_fp8` would cast it. The torch side is `model.norm` then `quant.fp8_quant`.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import norm, quant
from model.kernels.kv_quant import SWA_BLOCK, store_fp8

_TILE_ELEMENTS = 4096  # fp32 values per program held in registers


def norm_cast_torch(X: Tensor, pre: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    x = norm.rms_norm(X, weight, eps) if pre is None else norm.collapse_norm(X, pre, weight, eps)
    return x, *quant.fp8_quant(x, SWA_BLOCK)


@triton.jit
def _norm_cast_kernel(
    X_ptr, pre_ptr, w_ptr, y_ptr, data_ptr, scale_ptr, M, eps,
    N: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Rows BLOCK_M · program …: y = RMSNorm(Σₖ pre[r, k] X[r, k]) (N streams; N = 0: X [M, C] itself), each sum
    and the norm in fp32, rounded to X's dtype where the torch forms round (the collapse's result, then y)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, CP)
    row_ok = rows < M
    ok = row_ok[:, None] & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    if N == 0:
        x = tl.load(X_ptr + r64[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        x = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
        for k in tl.static_range(N):
            mix = tl.load(pre_ptr + r64 * N + k, mask=row_ok, other=0.0).to(tl.float32)
            stream = tl.load(X_ptr + (r64[:, None] * N + k) * C + cols[None, :], mask=ok, other=0.0)
            x += mix[:, None] * stream.to(tl.float32)
        x = x.to(X_ptr.dtype.element_ty).to(tl.float32)
    rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)
    w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = (w[None, :] * (x * rms[:, None])).to(y_ptr.dtype.element_ty)
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
        pre_rows = X if pre is None else pre.contiguous()
        _norm_cast_kernel[(triton.cdiv(M, block_m),)](
            X.contiguous(), pre_rows, weight.contiguous(), y, data, scale, M, eps, N, C, CP, block_m, num_warps=4
        )
    return y, data, scale
