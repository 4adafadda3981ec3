"""mHC coefficients of a sublayer site: X → pre, post and the Sinkhorn-normalised comb (model/mhc.py).

The torch form is a projection of the flattened stream, an RMS, then ≈ 115 tiny ops on [.., n, n] matrices
(20 Sinkhorn iterations of two normalisations each), 24+ sites per decode step. Triton, in two launches:

1. `_mix_partials_kernel`: a split-K projection. Program (row block, split) takes BLOCK_R rows and n·C / 64
   channels of the flattened stream and writes their dot products with fn's (2+n)n rows and their sum of squares
   to a partial slot; the splits spread the projection over the GPU at batch 1 (one program per row block would
   read all of fn alone), and their count depends on the channel count alone, so a row's value is the same
   whatever the batch. With EXPAND it first makes those channels of the stream: the residual update of the site
   before, X' = post ⊗ out + combᵀ X (`mhc.hc_expand`), stored and projected in the same pass — Single-Pass mHC's
   fusion of the update with the next site's coefficient prediction (`hc_expand_coefficients`).
2. `_coefficients_kernel`: per BLOCK_R rows, sums the splits' partials (a fixed tree over each chunk of 16 splits,
   the chunks in order), scales by 1/rms and runs the split, softmax and Sinkhorn loop in registers.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import mhc
from model.kernels.formats import unit_stride
from model.kernels.launch import dependent_launch, follow


@dataclass(frozen=True)
class MixTuning:
    """Launch shape of the two kernels (`bench/kernels.py --bench tune-mhc` times others): rows a program takes,
    channels a projection iteration takes, the projection's split count (n·C / max_splits channels a split, rounded
    up to block_k: a count fixed by the channels alone, so a row's sums do not depend on the batch), the
    projection's warps and software-pipeline stages, and the Sinkhorn kernel's warps."""

    block_r: int = 16
    block_k: int = 64
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 3
    sinkhorn_warps: int = 4


# The launch shape measured best at 1–256 rows of C = 512 and 1–64 of C = 5120, with the update's pass and without
# (docs/benchmarks.md): many splits (few channels a program: at batch 1 the projection is a read of fn spread over
# the GPU), two warps, no software pipelining (the update's loop stores X' as it goes). One shape for both, so a
# site's coefficients are the same sums made in the update's pass or after it.
MIXES = MixTuning(max_splits=64, num_warps=2, num_stages=1)
_CHUNK = 16  # splits whose partials the Sinkhorn kernel loads at once (a tile of BLOCK_R × CHUNK × n² in registers)


def hc_coefficients_torch(
    X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, rms_eps: float, hc_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return mhc.hc_split_sinkhorn(mhc.hc_mixes(X, fn, rms_eps), scale, base, n, iters, hc_eps)


def hc_expand_coefficients_torch(
    out: Tensor, X: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int,
    rms_eps: float, hc_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    X = mhc.hc_expand(out, X, post, comb)
    return X, *hc_coefficients_torch(X, fn, scale, base, n, iters, rms_eps, hc_eps)


@triton.jit
def _expanded(x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, r, ok, k, K, x_stride, C, N: tl.constexpr):
    """Channels k (of the flattened n·C) of rows r of X' = post ⊗ out + combᵀ X, in fp32 and rounded to X's dtype as
    `mhc.hc_expand` rounds them, stored at new_ptr (rows of K) → their values as fp32. Each product is fused into its
    sum explicitly (`tl.fma`): under batch invariance kernels compile without fp fusion (model.kernels.invariance),
    and the expansion keeps its fused multiply-adds, the same in every binary."""
    mask = ok[:, None] & (k < K)[None, :]
    copy, c = k // C, k % C  # X'ₖ's copy and channel
    mixed = tl.zeros(mask.shape, dtype=tl.float32)
    for j in tl.static_range(N):
        weight = tl.load(comb_ptr + r[:, None] * (N * N) + j * N + copy[None, :], mask=mask, other=0.0)
        stream = tl.load(x_ptr + r[:, None] * x_stride + j * C + c[None, :], mask=mask, other=0.0)
        mixed = tl.fma(weight.to(tl.float32), stream.to(tl.float32), mixed)
    post = tl.load(post_ptr + r[:, None] * N + copy[None, :], mask=mask, other=0.0).to(tl.float32)
    update = tl.load(out_ptr + r[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.fma(post, update, mixed).to(new_ptr.dtype.element_ty)
    tl.store(new_ptr + r[:, None] * K + k[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["R"])  # one binary for every row count (model.kernels.invariance)
def _mix_partials_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr, R, K, x_stride, split_k, out_ptr, post_ptr, comb_ptr, new_ptr, C,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EXPAND: tl.constexpr,
    N: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """EXPAND: x_ptr holds the site before's stream X [R, N·C]: X' (`_expanded`) is made, stored and projected."""
    follow(PDL, EARLY)
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    m = tl.arange(0, M_PAD)
    acc = tl.zeros((BLOCK_R, M_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(split * split_k, split * split_k + split_k, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EXPAND:
            x = _expanded(x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, r, ok, k, K, x_stride, C, N)
        else:
            x = tl.load(x_ptr + r[:, None] * x_stride + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    slot = split.to(tl.int64) * R + r
    tl.store(part_ptr + slot[:, None] * M_PAD + m[None, :], acc, mask=ok[:, None])
    tl.store(sq_ptr + slot, sq, mask=ok)


@triton.jit(do_not_specialize=["R"])  # one binary for every row count (model.kernels.invariance)
def _coefficients_kernel(
    part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, R, K, splits, iters, rms_eps, eps,
    N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    i = tl.arange(0, N)
    jk = i[:, None] * N + i[None, :]  # [N, N]: row j (source copy), column k (target)
    flat = tl.arange(0, N * N)  # comb's logits row-major, summed as [BLOCK_R, CHUNK, N·N] (no 4-D block)
    pre = tl.zeros((BLOCK_R, N), dtype=tl.float32)
    post = tl.zeros((BLOCK_R, N), dtype=tl.float32)
    logits = tl.zeros((BLOCK_R, N * N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s0 in range(0, splits, CHUNK):  # CHUNK splits' partials a load, each chunk summed as a fixed tree
        s = s0 + tl.arange(0, CHUNK)
        live = ok[:, None] & (s < splits)[None, :]  # [BLOCK_R, CHUNK]
        slot = s[None, :].to(tl.int64) * R + r[:, None]
        mix = part_ptr + slot * M_PAD
        pre += tl.sum(tl.load(mix[:, :, None] + i[None, None, :], mask=live[:, :, None], other=0.0), axis=1)
        post += tl.sum(tl.load(mix[:, :, None] + N + i[None, None, :], mask=live[:, :, None], other=0.0), axis=1)
        logits += tl.sum(
            tl.load(mix[:, :, None] + 2 * N + flat[None, None, :], mask=live[:, :, None], other=0.0), axis=1
        )
        sq += tl.sum(tl.load(sq_ptr + slot, mask=live, other=0.0), axis=1)
    logits = tl.reshape(logits, (BLOCK_R, N, N))
    inv_rms = 1.0 / tl.sqrt(sq / K + rms_eps)
    pre = pre * inv_rms[:, None] * tl.load(scale_ptr)
    pre = tl.sigmoid(pre + tl.load(base_ptr + i)[None, :]) + eps
    post = post * inv_rms[:, None] * tl.load(scale_ptr + 1)
    post = 2.0 * tl.sigmoid(post + tl.load(base_ptr + N + i)[None, :])
    logits = logits * inv_rms[:, None, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + jk)[None]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # the last step is a column normalisation
    tl.store(pre_ptr + r[:, None] * N + i[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + r[:, None] * N + i[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + r[:, None, None] * (N * N) + jk[None], comb, mask=ok[:, None, None])


def hc_coefficients_triton(
    X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, rms_eps: float, hc_eps: float,
    tuning: MixTuning = MIXES,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """fp32 fn, a float X (the coefficients are fp32: a float64 model stays on the torch form)."""
    return _coefficients(X, fn, scale, base, n, iters, rms_eps, hc_eps, tuning)


def hc_expand_coefficients_triton(
    out: Tensor, X: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int,
    rms_eps: float, hc_eps: float, tuning: MixTuning = MIXES,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """`hc_coefficients_triton` of X' = `mhc.hc_expand`(out, X, post, comb), made in the projection's pass."""
    new = torch.empty_like(X, memory_format=torch.contiguous_format)
    expand = (out.reshape(-1, out.shape[-1]).contiguous(), post.contiguous(), comb.contiguous(), new)
    return new, *_coefficients(X, fn, scale, base, n, iters, rms_eps, hc_eps, tuning, expand)


def _coefficients(
    X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int, rms_eps: float, hc_eps: float,
    tuning: MixTuning, expand: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    lead = X.shape[:-2]
    x = unit_stride(X.reshape(-1, X.shape[-2] * X.shape[-1]))
    (R, K), M = x.shape, fn.shape[0]
    t = tuning
    M_PAD, split_k = triton.next_power_of_2(M), t.block_k * triton.cdiv(K, t.block_k * t.max_splits)
    splits = triton.cdiv(K, split_k)
    pre = torch.empty((*lead, n), dtype=fn.dtype, device=X.device)
    post = torch.empty_like(pre)
    comb = torch.empty((*lead, n, n), dtype=fn.dtype, device=X.device)
    if R:
        part = torch.empty((splits, R, M_PAD), dtype=torch.float32, device=X.device)
        sq = torch.empty((splits, R), dtype=torch.float32, device=X.device)
        blocks = triton.cdiv(R, t.block_r)
        update, old_post, old_comb, new = expand if expand is not None else (x, x, x, x)
        _mix_partials_kernel[(blocks, splits)](
            x, fn.contiguous(), part, sq, R, K, x.stride(0), split_k, update, old_post, old_comb, new, X.shape[-1],
            M, M_PAD, t.block_r, t.block_k, expand is not None, n, num_warps=t.num_warps, num_stages=t.num_stages,
            **dependent_launch(X.device, (blocks, splits)),
        )  # fmt: skip
        _coefficients_kernel[(blocks,)](
            part, sq, scale.to(fn.dtype).contiguous(), base.to(fn.dtype).contiguous(), pre, post, comb, R, K, splits,
            iters, rms_eps, hc_eps, n, M_PAD, t.block_r, _CHUNK, num_warps=t.sinkhorn_warps,
            **dependent_launch(X.device, (blocks,)),
        )  # fmt: skip
    return pre, post, comb
