"""Rotary position embedding of x's last 2·len(inv_freq) dims (model/rope.py holds the frequencies and the rule).

Pairs are adjacent (interleaved) dims viewed as complex numbers; angles are position × frequency in fp64 (so 1 M
positions stay exact), cos / sin rounded to x's compute precision. The torch form is ≈ 24 small ops per call and a
decode step rotates ≈ 40 times (queries, keys, compressed keys, indexer queries, the inverse rotation of the output);
Triton: one launch, each element reading its pair partner.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_ELEMENTS = 4096


def _position_axes(positions: Tensor, x: Tensor) -> Tensor:
    """positions ([S] or [B, S], x's leading dims up to its position axis) with a unit axis for each later axis of
    x but the last (heads), so that it broadcasts against x.shape[:-1]."""
    while positions.dim() < x.dim() - 1:
        positions = positions.unsqueeze(-1)
    return positions


def rope_rotate_torch(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool) -> Tensor:
    rd = inv_freq.shape[0] * 2
    # angles per position, not per head: the heads axis broadcasts (cos / sin are the costly part on a CPU)
    angles = _position_axes(positions, x).to(torch.float64).unsqueeze(-1) * inv_freq.to(x.device, torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    compute = torch.promote_types(x.dtype, torch.float32)
    pairs = x[..., -rd:].to(compute).unflatten(-1, (rd // 2, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.to(compute), sin.to(compute)
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, R,
    D: tl.constexpr, DP: tl.constexpr, RD: tl.constexpr, BLOCK_R: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, DP)
    ok = (rows[:, None] < R) & (d[None, :] < D)
    row = rows[:, None].to(tl.int64) * D
    x = tl.load(x_ptr + row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(x_ptr + row + (d ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)  # the pair's other half
    rope = (d >= D - RD) & (d < D)  # the rotary dims (DP pads D to a power of two)
    pair = tl.where(rope, (d - (D - RD)) // 2, 0)
    angle = tl.load(pos_ptr + rows, mask=rows < R, other=0).to(tl.float64)[:, None] * tl.load(freq_ptr + pair)[None, :]
    cos, sin = tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)
    if INVERSE:
        sin = -sin
    even = (d % 2 == 0)[None, :]
    rotated = tl.where(even, x * cos - partner * sin, partner * sin + x * cos)  # (re·c − im·s, re·s + im·c)
    out = tl.where(rope[None, :], rotated, x)
    tl.store(out_ptr + row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def rope_rotate_triton(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool) -> Tensor:
    """fp32 / bf16 / fp16 x (computed in fp32); x's pair dims must start at an even offset."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    pos = _position_axes(positions, x).expand(x.shape[:-1]).reshape(-1).contiguous()  # one position per row of x2
    out = torch.empty_like(x2)
    if x2.shape[0]:
        DP = triton.next_power_of_2(D)
        block_r = max(1, _BLOCK_ELEMENTS // DP)
        grid = (triton.cdiv(x2.shape[0], block_r),)
        freq = inv_freq.to(x.device, torch.float64).contiguous()
        _rope_kernel[grid](x2, pos, freq, out, x2.shape[0], D, DP, inv_freq.shape[0] * 2, block_r, inverse)
    return out.view(x.shape)
