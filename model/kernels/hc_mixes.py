"""mHC in Triton: the coefficients of a sublayer site (pre, post and the Sinkhorn-normalised comb, model/mhc.py), and
a site's whole entry in one pass over the stream (`hc_site`).

The torch form of the coefficients is ≈ 115 tiny ops per sublayer site (20 Sinkhorn iterations of two normalisations
each on [.., n, n] matrices), 24+ sites per decode step: on a GPU, thousands of launches for a few hundred bytes.
Triton: one program takes BLOCK_R rows and runs the whole split, softmax and Sinkhorn loop in registers.

A site's entry is otherwise five to seven launches per token row — the previous site's exit (hc_expand), the mixes
projection (a GEMV and its rms scale), the Sinkhorn split, the input collapse and its RMSNorm — each reading the
stream X [n, C] again. `_hc_site_kernel` streams X once per BLOCK_R rows: the exit's new X, the projection by
tl.dot against hc_fn chunk by chunk, the sum of squares of both normalisations and the collapse, then the split and
the norm from what it wrote. Rows never share a reduction, and the chunk order is fixed: a row's values do not
depend on the batch it runs in.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import mhc

_BLOCK_R = 16
_SITE_BLOCK_C = 32  # channels per chunk: the hc_fn tile is (2+n)n (padded) × n × 32 fp32


def hc_split_sinkhorn_torch(
    mixes: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return mhc.hc_split_sinkhorn(mixes, scale, base, n, iters, eps)


@triton.jit
def _split_sinkhorn(m_ptr, rows, ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps, N: tl.constexpr):
    """pre, post and comb of mixes rows `rows` (m_ptr: [R, (2+N)N] fp32), stored to [R, N], [R, N], [R, N, N]."""
    WIDTH: tl.constexpr = (2 + N) * N
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


@triton.jit
def _hc_split_sinkhorn_kernel(
    m_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, R, iters, eps,
    N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    _split_sinkhorn(m_ptr, rows, rows < R, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps, N)


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


@triton.jit
def _hc_site_kernel(
    x_ptr, sx_row, sx_copy, out_ptr, exit_post_ptr, exit_comb_ptr, collapse_ptr, norm_ptr, fn_ptr, scale_ptr, base_ptr,
    x_new_ptr, mix_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr,
    R, C, iters, norm_eps, hc_eps, rms_eps,
    N: tl.constexpr, WIDTHP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXIT: tl.constexpr,
):  # fmt: skip
    """Rows `BLOCK_R` of X [R, N, C] (row and copy strides given, channels contiguous): X ← the exit (EXIT), the
    site's mixes (stored to mix_ptr, then split), y = RMSNorm(collapse(X, collapse_ptr's pre-mix)) · norm."""
    WIDTH: tl.constexpr = (2 + N) * N
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    k = tl.arange(0, N)
    o = tl.arange(0, WIDTHP)
    cc = tl.arange(0, BLOCK_C)
    collapse = tl.load(collapse_ptr + r[:, None] * N + k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if EXIT:
        post = tl.load(exit_post_ptr + r[:, None] * N + k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    dots = tl.zeros((BLOCK_R, WIDTHP), dtype=tl.float32)
    x_squares = tl.zeros((BLOCK_R,), dtype=tl.float32)
    y_squares = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + cc
        ok2 = ok[:, None] & (c < C)[None, :]
        ok3 = ok2[:, None, :] & (k < N)[None, :, None]
        if EXIT:  # X_k ← post_k · out + Σ_j comb[j, k] · X_j, rounded to the stream's dtype
            out = tl.load(out_ptr + r[:, None] * C + c[None, :], mask=ok2, other=0.0).to(tl.float32)
            mixed = tl.zeros((BLOCK_R, N, BLOCK_C), dtype=tl.float32)
            for j in tl.static_range(N):
                comb_j = tl.load(exit_comb_ptr + r[:, None] * (N * N) + j * N + k[None, :], mask=ok[:, None], other=0.0)
                x_j = tl.load(x_ptr + r[:, None] * sx_row + j * sx_copy + c[None, :], mask=ok2, other=0.0)
                mixed += comb_j.to(tl.float32)[:, :, None] * x_j.to(tl.float32)[:, None, :]
            xs = (post[:, :, None] * out[:, None, :] + mixed).to(x_new_ptr.dtype.element_ty)
            tl.store(x_new_ptr + r[:, None, None] * (N * C) + k[None, :, None] * C + c[None, None, :], xs, mask=ok3)
            xs = xs.to(tl.float32)
        else:
            at = x_ptr + r[:, None, None] * sx_row + k[None, :, None] * sx_copy + c[None, None, :]
            xs = tl.load(at, mask=ok3, other=0.0).to(tl.float32)
        x_squares += tl.sum(tl.sum(xs * xs, axis=2), axis=1)
        fn = tl.load(
            fn_ptr + o[:, None, None] * (N * C) + k[None, :, None] * C + c[None, None, :],
            mask=(o < WIDTH)[:, None, None] & (c < C)[None, None, :] & (k < N)[None, :, None],
            other=0.0,
        )
        dots += tl.dot(
            tl.reshape(xs, (BLOCK_R, N * BLOCK_C)),
            tl.trans(tl.reshape(fn, (WIDTHP, N * BLOCK_C))),
            input_precision="ieee",
        )
        y = tl.sum(collapse[:, :, None] * xs, axis=1).to(y_ptr.dtype.element_ty)  # collapse, in the stream's dtype
        tl.store(y_ptr + r[:, None] * C + c[None, :], y, mask=ok2)
        y = y.to(tl.float32)
        y_squares += tl.sum(y * y, axis=1)
    mixes = dots * (1.0 / tl.sqrt_rn(x_squares / (N * C) + rms_eps))[:, None]
    tl.store(mix_ptr + r[:, None] * WIDTH + o[None, :], mixes, mask=ok[:, None] & (o < WIDTH)[None, :])
    tl.debug_barrier()  # the split reads the mixes, and the norm the collapse, that other threads stored
    _split_sinkhorn(mix_ptr, rows, ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, hc_eps, N)
    inverse_rms = 1.0 / tl.sqrt_rn(y_squares / C + norm_eps)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + cc
        ok2 = ok[:, None] & (c < C)[None, :]
        y = tl.load(y_ptr + r[:, None] * C + c[None, :], mask=ok2, other=0.0).to(tl.float32)
        w = tl.load(norm_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        y = w[None, :] * (y * inverse_rms[:, None])
        tl.store(y_ptr + r[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok2)


def hc_site_torch(
    X: Tensor, pre: Tensor, norm: Tensor, norm_eps: float, fn: Tensor, scale: Tensor, base: Tensor, iters: int,
    hc_eps: float, rms_eps: float, exit: tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor]:  # fmt: skip
    from model.block import collapse_norm  # the model's own form (model.block imports model.kernels)

    if exit is not None:
        out, post, comb = exit
        X = mhc.hc_expand(out, X, post, comb)
    mixes = mhc.hc_mixes(X, fn, rms_eps)
    coefficients = mhc.hc_split_sinkhorn(mixes, scale, base, X.shape[-2], iters, hc_eps)
    return X, coefficients, collapse_norm(X, pre, norm, norm_eps)


def hc_site_triton(
    X: Tensor, pre: Tensor, norm: Tensor, norm_eps: float, fn: Tensor, scale: Tensor, base: Tensor, iters: int,
    hc_eps: float, rms_eps: float, exit: tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor]:  # fmt: skip
    """fp32 hc_fn; X may be a broadcast view (the embedding in every copy) as long as its channels are contiguous."""
    lead, (n, C) = X.shape[:-2], X.shape[-2:]
    x = X if X.stride(-1) == 1 else X.contiguous()
    x = x.reshape(-1, n, C)
    R = x.shape[0]
    f32 = {"dtype": torch.float32, "device": X.device}
    mixes = torch.empty(R, (2 + n) * n, **f32)
    new_pre, new_post, comb = torch.empty(R, n, **f32), torch.empty(R, n, **f32), torch.empty(R, n, n, **f32)
    y = torch.empty(R, C, dtype=X.dtype, device=X.device)
    new_x = X
    if exit is not None:
        out, post, exit_comb = (t.reshape(R, *t.shape[len(lead) :]).contiguous() for t in exit)
        new_x = torch.empty(R, n, C, dtype=X.dtype, device=X.device)
    if R:
        _hc_site_kernel[(triton.cdiv(R, _BLOCK_R),)](
            x, x.stride(0), x.stride(1), *((out, post, exit_comb) if exit is not None else (x, x, x)),
            pre.reshape(R, n).contiguous(), norm, fn.contiguous(), scale.to(torch.float32).contiguous(),
            base.to(torch.float32).contiguous(), new_x, mixes, new_pre, new_post, comb, y,
            R, C, iters, norm_eps, hc_eps, rms_eps,
            n, triton.next_power_of_2((2 + n) * n), _BLOCK_R, _SITE_BLOCK_C, exit is not None,
        )  # fmt: skip
    if exit is not None:
        new_x = new_x.view(*lead, n, C)
    coefficients = (new_pre.view(*lead, n), new_post.view(*lead, n), comb.view(*lead, n, n))
    return new_x, coefficients, y.view(*lead, C)
