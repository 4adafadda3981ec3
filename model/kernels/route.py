"""The MoE gate's routing (model/moe.py `Gate`): scores, the k best experts in ascending id, their weights.

    s = √softplus(x W_gᵀ)  (fp32),  experts = top-k(s + bias) (ties to the lower id),  w = s[experts] / Σ · scale

The torch form is a cast, a GEMM, two sorts and a gather (five launches per MoE layer, compiled). Triton, two launches:

1. `_gate_logits_kernel`: program (row block, expert block, K split) takes BLOCK_R rows against BLOCK_E experts'
   gate rows over its split's channels (fp32 `tl.dot`) and writes those partial logits. The expert blocks and the
   K splits spread the gate's weights (the largest read of the layer at batch 1) over the GPU: at one row block
   there are only E / 16 programs (one at the small preset's 8 experts), so K is split until the grid has about one
   program per SM.
2. `_route_select_kernel`: per 4 rows, the splits' partial logits added in split order and √softplus give the
   scores; k rounds of an argmax over the biased scores (the first maximum: the lower id) mark the chosen experts;
   a chosen expert's slot is the number of chosen experts below it (a cumulative sum), so the ids come out ascending
   without a sort; the weights are its scores over their sum, times the scale.

Under batch invariance (kernels/invariance.py) the splits are those of one row block whatever the rows, so a row's
scores are summed in one order at every batch size.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model.fused import fused
from model.kernels.formats import multiprocessors
from model.kernels.invariance import batch_invariant
from model.kernels.launch import dependent_launch, follow

_BLOCK_R = 16
_BLOCK_E = 16
_BLOCK_K = 64
_SELECT_ROWS = 4  # rows per top-k program: 4 × E_PAD scores in registers (no spills at 384 experts)


@fused
def moe_route_torch(
    x: Tensor, weight: Tensor, bias: Tensor, topk: int, norm: bool, scale: float
) -> tuple[Tensor, Tensor]:
    scores = F.softplus(F.linear(x.to(weight.dtype), weight)).sqrt()
    ids = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :topk]
    ids = ids.sort(-1).values
    weights = scores.gather(-1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


@triton.jit(do_not_specialize=["R"])  # one binary for every row count (model.kernels.invariance)
def _gate_logits_kernel(
    x_ptr, w_ptr, p_ptr, R, C, E, x_stride, k_per_split,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    ok, live = rows < R, experts < E
    r, e = rows.to(tl.int64), experts.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32)
    first = split * k_per_split
    for k0 in range(first, tl.minimum(first + k_per_split, C), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r[:, None] * x_stride + k[None, :], mask=ok[:, None] & (k < C)[None, :], other=0.0)
        w = tl.load(w_ptr + e[:, None] * C + k[None, :], mask=live[:, None] & (k < C)[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    out = p_ptr + split.to(tl.int64) * R * E + r[:, None] * E + e[None, :]
    tl.store(out, acc, mask=ok[:, None] & live[None, :])


@triton.jit(do_not_specialize=["R"])  # one binary for every row count (model.kernels.invariance)
def _route_select_kernel(
    p_ptr, bias_ptr, w_ptr, ids_ptr, R, E, topk, scale, SPLITS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_R: tl.constexpr, E_PAD: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    col = tl.arange(0, E_PAD)
    live = col < E
    at, here = r[:, None] * E + col[None, :], ok[:, None] & live[None, :]
    logits = tl.load(p_ptr + at, mask=here, other=0.0)
    for split in tl.static_range(1, SPLITS):  # unrolled: every split's load in flight at once
        logits += tl.load(p_ptr + split * R * E + at, mask=here, other=0.0)
    softplus = tl.where(logits > 20.0, logits, tl.log(1.0 + tl.exp(tl.minimum(logits, 20.0))))  # torch's threshold
    s = tl.sqrt(softplus)
    biased = tl.where(live[None, :], s + tl.load(bias_ptr + col, mask=live, other=0.0)[None, :], -float("inf"))
    chosen = tl.zeros((BLOCK_R, E_PAD), dtype=tl.int32)
    for _ in range(topk):
        best = tl.argmax(tl.where(chosen > 0, -float("inf"), biased), axis=1, tie_break_left=True)
        chosen = tl.where(col[None, :] == best[:, None], 1, chosen)
    w = tl.where(chosen > 0, s, 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    slot = r[:, None] * topk + tl.cumsum(chosen, axis=1) - 1
    keep = ok[:, None] & (chosen > 0)
    tl.store(w_ptr + slot, w * scale, mask=keep)
    tl.store(ids_ptr + slot, col[None, :].to(tl.int64) + tl.zeros((BLOCK_R, E_PAD), dtype=tl.int64), mask=keep)


def moe_route_triton(
    x: Tensor, weight: Tensor, bias: Tensor, topk: int, norm: bool, scale: float, splits: int | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 gate weights and bias (a float64 model stays on the torch form); `splits`: the gate's K splits (None:
    as many as bring the grid to about one program per SM, each ≥ 2 K blocks)."""
    (R, C), E = x.shape, weight.shape[0]
    weights = torch.empty((R, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((R, topk), dtype=torch.int64, device=x.device)
    if R:
        x = x if x.stride(-1) == 1 else x.contiguous()
        row_blocks, expert_blocks = triton.cdiv(R, _BLOCK_R), triton.cdiv(E, _BLOCK_E)
        programs = expert_blocks if batch_invariant() else row_blocks * expert_blocks
        k_blocks = triton.cdiv(C, _BLOCK_K)
        splits = splits or max(1, min(multiprocessors() // programs, k_blocks // 2))
        k_per_split = triton.cdiv(k_blocks, splits) * _BLOCK_K
        splits = triton.cdiv(C, k_per_split)
        logits = torch.empty((splits, R, E), dtype=torch.float32, device=x.device)
        grid = (row_blocks, expert_blocks, splits)
        _gate_logits_kernel[grid](
            x, weight.contiguous(), logits, R, C, E, x.stride(0), k_per_split, _BLOCK_R, _BLOCK_E, _BLOCK_K,
            **dependent_launch(x.device, grid),
        )  # fmt: skip
        grid = (triton.cdiv(R, _SELECT_ROWS),)
        _route_select_kernel[grid](
            logits, bias.contiguous(), weights, ids, R, E, topk, scale, splits, norm, _SELECT_ROWS,
            triton.next_power_of_2(E), **dependent_launch(x.device, grid),
        )  # fmt: skip
    return weights, ids
