"""Rotary position embedding of x's last 2·len(inv_freq) dims (model/rope.py holds the frequencies and the rule).

Pairs are adjacent (interleaved) dims viewed as complex numbers; angles are position × frequency in fp64 (so 1 M
positions stay exact), cos / sin rounded to x's compute precision. The torch form is ≈ 24 small ops per call and a
decode step rotates ≈ 40 times (queries, keys, compressed keys, indexer queries, the inverse rotation of the output);
Triton: one launch. Every head of a position shares its angles, and fp64 cos / sin are slow on a GPU, so a program
takes one position and a block of its heads and evaluates the transcendentals once per rotary dim, not per element:
the non-rotary dims are a copy, the rotary ones read their pair partner.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import unit_stride
from model.kernels.launch import dependent_launch, follow

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
def rope_pairs(ptr, rows, ok, d, pos, freq_ptr, D: tl.constexpr, RD: tl.constexpr, INVERSE: tl.constexpr):
    """Dims d (of D) of `rows` [R] (element offsets) at ptr where `ok` [R, len(d)], RoPE (INVERSE: RoPE⁻¹) applied
    at positions `pos` (a scalar, or [R, 1]: one a row) to those among the last RD, in fp32: each value and its pair
    partner (d ^ 1) loaded, cos / sin of the fp64 angle position × freq_ptr rounded to fp32. The others as loaded.
    Every kernel that applies RoPE computes it here, so a RoPE inside another kernel rounds as this module's does."""
    rot = (d >= D - RD) & (d < D)
    x = tl.load(ptr + rows[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(ptr + rows[:, None] + (d ^ 1)[None, :], mask=ok & rot[None, :], other=0.0).to(tl.float32)
    angle = pos.to(tl.float64) * tl.load(freq_ptr + (d - (D - RD)) // 2, mask=rot, other=0.0)[None, :]
    cos, sin = tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)
    if INVERSE:
        sin = -sin
    rotated = tl.where((d % 2 == 0)[None, :], x * cos - partner * sin, partner * sin + x * cos)  # (re·c − im·s, …)
    return tl.where(rot[None, :], rotated, x)


@triton.jit
def rope_values(x, pos, freq_ptr, D: tl.constexpr, DP: tl.constexpr, RD: tl.constexpr, BLOCK_M: tl.constexpr):
    """RoPE on fp32 rows x [BLOCK_M, DP] held in registers (dims ≥ D padding) at positions `pos` [BLOCK_M, 1]: the
    last RD of D dims rotate pair by pair, as `rope_pairs` computes them (the same angles and products)."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_M, DP // 2, 2)))
    d = 2 * tl.arange(0, DP // 2)  # each pair's even dim
    rot = (d >= D - RD) & (d < D)
    angle = pos.to(tl.float64) * tl.load(freq_ptr + (d - (D - RD)) // 2, mask=rot, other=0.0)[None, :]
    cos, sin = tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)
    rotated_even = tl.where(rot[None, :], even * cos - odd * sin, even)
    rotated_odd = tl.where(rot[None, :], even * sin + odd * cos, odd)
    return tl.reshape(tl.join(rotated_even, rotated_odd), (BLOCK_M, DP))


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, H, x_stride_p, x_stride_h,
    D: tl.constexpr, RD: tl.constexpr, KEEP: tl.constexpr, BLOCK_H: tl.constexpr, INVERSE: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """x [P, H, D] (rows by their strides), out [P, H, D] dense: position p = program 0, heads BLOCK_H · program 1 …;
    the last RD dims rotate."""
    follow(PDL, EARLY)
    p = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = p * x_stride_p + heads * x_stride_h
    out_row = (p * H + heads) * D
    live = heads[:, None] < H
    if D > RD:  # the non-rotary dims are copied
        k = tl.arange(0, KEEP)
        kept = live & (k[None, :] < D - RD)
        tl.store(out_ptr + out_row[:, None] + k[None, :], tl.load(x_ptr + row[:, None] + k[None, :], mask=kept),
                 mask=kept)  # fmt: skip
    d = (D - RD) + tl.arange(0, RD)
    rotated = rope_pairs(x_ptr, row, live, d, tl.load(pos_ptr + p), freq_ptr, D, RD, INVERSE)  # angles once a dim
    tl.store(out_ptr + out_row[:, None] + d[None, :], rotated.to(out_ptr.dtype.element_ty), mask=live)


def rope_arguments(
    rope: tuple[Tensor, Tensor] | None, lead: torch.Size, device: torch.device
) -> tuple[Tensor, Tensor, int]:
    """The arguments of a kernel that applies RoPE (`rope_pairs`) to rows of leading dims `lead`: their positions,
    one a row (positions broadcast to `lead`), the fp64 frequencies, and the rotary dims (0 without `rope`: the two
    tensors are then empty and unread)."""
    if rope is None:
        empty = torch.empty(0, dtype=torch.float64, device=device)
        return empty, empty, 0
    positions, inv_freq = rope
    pos = positions.expand(lead).reshape(-1).contiguous()
    return pos, inv_freq.to(device, torch.float64).contiguous(), 2 * inv_freq.shape[0]


def rope_rotate_triton(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool) -> Tensor:
    """fp32 / bf16 / fp16 x (computed in fp32); x's pair dims must start at an even offset; a power-of-two count of
    rotary dims (the model's 64)."""
    D, RD = x.shape[-1], inv_freq.shape[0] * 2
    pos = positions.expand(x.shape[: positions.dim()]).reshape(-1).contiguous()  # one position per row of x3
    x3 = unit_stride(x.reshape(max(pos.shape[0], 1), -1, D))  # [P, heads, D]
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        H = x3.shape[1]
        block_h = min(triton.next_power_of_2(H), max(1, _BLOCK_ELEMENTS // triton.next_power_of_2(D)))
        grid = (pos.shape[0], triton.cdiv(H, block_h))
        freq = inv_freq.to(x.device, torch.float64).contiguous()
        keep = triton.next_power_of_2(max(D - RD, 1))
        _rope_kernel[grid](
            x3, pos, freq, out, H, x3.stride(0), x3.stride(1), D, RD, keep, block_h, inverse,
            **dependent_launch(out.device, grid),
        )  # fmt: skip
    return out.view(x.shape)
