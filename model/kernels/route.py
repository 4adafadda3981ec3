"""The MoE gate's routing (model/moe.py `Gate`): scores, the k best experts in ascending id, their weights.

    s = √softplus(x W_gᵀ)  (fp32),  experts = top-k(s + bias) (ties to the lower id),  w = s[experts] / Σ · scale

The torch form is a cast, a GEMM, two sorts and a gather (five launches per MoE layer, compiled). Triton, two launches:

1. `_gate_scores_kernel`: program (row block, expert block) takes BLOCK_R rows against BLOCK_E experts' gate rows
   over every channel (fp32 `tl.dot`), then √softplus; the expert blocks spread the gate's weights (the largest
   read of the layer at batch 1) over the GPU.
2. `_route_select_kernel`: per 4 rows, k rounds of an argmax over the biased scores (the first maximum: the
   lower id) mark the chosen experts; a chosen expert's slot is the number of chosen experts below it (a cumulative
   sum), so the ids come out ascending without a sort; the weights are its scores over their sum, times the scale.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model.fused import fused

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


@triton.jit
def _gate_scores_kernel(
    x_ptr, w_ptr, s_ptr, R, C, E, x_stride,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok, live = rows < R, experts < E
    r, e = rows.to(tl.int64), experts.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r[:, None] * x_stride + k[None, :], mask=ok[:, None] & (k < C)[None, :], other=0.0)
        w = tl.load(w_ptr + e[:, None] * C + k[None, :], mask=live[:, None] & (k < C)[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    softplus = tl.where(acc > 20.0, acc, tl.log(1.0 + tl.exp(tl.minimum(acc, 20.0))))  # torch's threshold
    tl.store(s_ptr + r[:, None] * E + e[None, :], tl.sqrt(softplus), mask=ok[:, None] & live[None, :])


@triton.jit
def _route_select_kernel(
    s_ptr, bias_ptr, w_ptr, ids_ptr, R, E, topk, scale, NORM: tl.constexpr, BLOCK_R: tl.constexpr,
    E_PAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    r = rows.to(tl.int64)
    col = tl.arange(0, E_PAD)
    live = col < E
    s = tl.load(s_ptr + r[:, None] * E + col[None, :], mask=ok[:, None] & live[None, :], other=0.0)
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
    x: Tensor, weight: Tensor, bias: Tensor, topk: int, norm: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """fp32 gate weights and bias (a float64 model stays on the torch form)."""
    (R, C), E = x.shape, weight.shape[0]
    scores = torch.empty((R, E), dtype=torch.float32, device=x.device)
    weights = torch.empty((R, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((R, topk), dtype=torch.int64, device=x.device)
    if R:
        x = x if x.stride(-1) == 1 else x.contiguous()
        blocks = triton.cdiv(R, _BLOCK_R)
        _gate_scores_kernel[(blocks, triton.cdiv(E, _BLOCK_E))](
            x, weight.contiguous(), scores, R, C, E, x.stride(0), _BLOCK_R, _BLOCK_E, _BLOCK_K
        )  # fmt: skip
        _route_select_kernel[(triton.cdiv(R, _SELECT_ROWS),)](
            scores, bias.contiguous(), weights, ids, R, E, topk, scale, norm, _SELECT_ROWS, triton.next_power_of_2(E)
        )  # fmt: skip
    return weights, ids
