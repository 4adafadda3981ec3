"""mHC coefficients from the projected mixes: pre, post and the Sinkhorn-normalised comb (model/mhc.py).

The torch form is ≈ 115 tiny ops per sublayer site (20 Sinkhorn iterations of two normalisations each on [.., n, n]
matrices), 24+ sites per decode step: on a GPU, thousands of launches for a few hundred bytes. Triton: one program
takes BLOCK_R rows and runs the whole split, softmax and Sinkhorn loop in registers.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import mhc

_BLOCK_R = 16


def hc_split_sinkhorn_torch(
    mixes: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return mhc.hc_split_sinkhorn(mixes, scale, base, n, iters, eps)


@triton.jit
def _hc_split_sinkhorn_kernel(
    m_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, R, iters, eps,
    N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    WIDTH: tl.constexpr = (2 + N) * N
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    i = tl.arange(0, N)
    jk = i[:, None] * N + i[None, :]  # [N, N]: row j (source copy), column k (target)
    mix = m_ptr + r * WIDTH
    pre = tl.load(mix[:, None] + i[None, :], mask=ok[:, None], other=0.0) * tl.load(scale_ptr)
    pre = tl.sigmoid(pre + tl.load(base_ptr + i)[None, :]) + eps
    post = tl.load(mix[:, None] + N + i[None, :], mask=ok[:, None], other=0.0) * tl.load(scale_ptr + 1)
    post = 2.0 * tl.sigmoid(post + tl.load(base_ptr + N + i)[None, :])
    logits = tl.load(mix[:, None, None] + 2 * N + jk[None], mask=ok[:, None, None], other=0.0) * tl.load(scale_ptr + 2)
    logits += tl.load(base_ptr + 2 * N + jk)[None]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # the last step is a column normalisation
    tl.store(pre_ptr + r[:, None] * N + i[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + r[:, None] * N + i[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + r[:, None, None] * (N * N) + jk[None], comb, mask=ok[:, None, None])


def hc_split_sinkhorn_triton(
    mixes: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 mixes only (a bf16 model's mixes are fp32; a float64 model stays on the torch form)."""
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.shape[-1]).contiguous()
    R = m.shape[0]
    pre = torch.empty((*lead, n), dtype=mixes.dtype, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty((*lead, n, n), dtype=mixes.dtype, device=mixes.device)
    if R:
        grid = (triton.cdiv(R, _BLOCK_R),)
        _hc_split_sinkhorn_kernel[grid](
            m, scale.to(mixes.dtype).contiguous(), base.to(mixes.dtype).contiguous(), pre, post, comb, R, iters, eps,
            n, _BLOCK_R,
        )  # fmt: skip
    return pre, post, comb
