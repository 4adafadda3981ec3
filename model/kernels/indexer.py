"""Lightning-indexer scores straight from FP4 q and K (model-architecture.md §2.5).

I[b,t,s] = Σ_h w[b,t,h] · ReLU(q[b,t,h] · K[b,s]), −inf where s ≥ n_visible[b,t].

Triton: one program scores BLOCK_S positions of one sequence for BLOCK_T queries × all heads (rows m = (t, h)).
The packed bytes of each 32-channel block are unpacked in registers into even (low nibble) and odd (high nibble)
channels, two fp16 dots per block (E2M1 codes are exact in fp16), and the two UE8M0 scales multiply the block's
partial sum: q·K = Σ_j qs_j · ks_j · Σ_{i∈j} codeq_i · codek_i. K is read once per query tile, never dequantised
to memory.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import dense_rows, e2m1_to_f16, interpreting, ue8m0_decode
from model.kernels.kv_quant import dequantize_index_fp4_torch


def indexer_scores_torch(
    q_data: Tensor, q_scale: Tensor, weights: Tensor, k_data: Tensor, k_scale: Tensor, n_visible: Tensor
) -> Tensor:
    q = dequantize_index_fp4_torch(q_data, q_scale, torch.float32)  # [B, T, H, Di]
    k = dequantize_index_fp4_torch(k_data, k_scale, torch.float32)  # [B, S, Di]
    scores = torch.einsum("bth,bths->bts", weights.float(), torch.einsum("bthd,bsd->bths", q, k).relu())
    positions = torch.arange(k.shape[1], device=k.device)
    return scores.masked_fill(positions >= n_visible[..., None], float("-inf"))


@triton.jit
def _unpacked_block(ptr, row_offsets, row_ok, j: tl.constexpr, DOT_F32: tl.constexpr):
    """Bytes 16j..16j+15 of each row → (even channels, odd channels) of the 32-channel block j, as dot operands
    holding code values · 2^-14."""
    packed = tl.load(ptr + row_offsets[:, None] + j * 16 + tl.arange(0, 16)[None, :], mask=row_ok[:, None], other=0)
    even, odd = e2m1_to_f16(packed & 0xF), e2m1_to_f16(packed >> 4)
    if DOT_F32:
        even, odd = even.to(tl.float32), odd.to(tl.float32)
    return even, odd


@triton.jit
def _indexer_kernel(
    q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, nv_ptr, out_ptr,
    T, H, S, k_stride, ks_stride,
    DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    NBK: tl.constexpr = DI // 32
    s0 = tl.program_id(0) * BLOCK_S
    t0 = tl.program_id(1) * BLOCK_T
    b = tl.program_id(2).to(tl.int64)
    m = tl.arange(0, BLOCK_T * HP)
    t, h = t0 + m // HP, m % HP
    row_ok = (t < T) & (h < H)
    qrow = (b * T + t) * H + h  # [M] row of q_data / q_scale / weights
    s = s0 + tl.arange(0, BLOCK_S)
    s_ok = s < S
    k_row, ks_row = b * k_stride + s * (DI // 2), b * ks_stride + s * NBK  # a batch row's entries are dense
    acc = tl.zeros((BLOCK_T * HP, BLOCK_S), dtype=tl.float32)
    for j in tl.static_range(NBK):
        q_even, q_odd = _unpacked_block(q_ptr, qrow * (DI // 2), row_ok, j, DOT_F32)
        k_even, k_odd = _unpacked_block(k_ptr, k_row, s_ok, j, DOT_F32)
        part = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))  # Σ codes · 2^-28, exact
        q_scale = ue8m0_decode(tl.load(qs_ptr + qrow * NBK + j, mask=row_ok, other=127)) * 268435456.0  # · 2^28
        k_scale = ue8m0_decode(tl.load(ks_ptr + ks_row + j, mask=s_ok, other=127))
        acc += part * q_scale[:, None] * k_scale[None, :]
    w = tl.load(w_ptr + qrow, mask=row_ok, other=0.0).to(tl.float32)
    per_head = tl.maximum(acc, 0.0) * w[:, None]
    scores = tl.sum(tl.reshape(per_head, (BLOCK_T, HP, BLOCK_S)), axis=1)
    tq = t0 + tl.arange(0, BLOCK_T)
    n_visible = tl.load(nv_ptr + b * T + tq, mask=tq < T, other=0)
    scores = tl.where(s[None, :] < n_visible[:, None], scores, float("-inf"))
    out = out_ptr + (b * T + tq[:, None]) * S + s[None, :]
    tl.store(out, scores, mask=(tq[:, None] < T) & s_ok[None, :])


def indexer_scores_triton(
    q_data: Tensor,
    q_scale: Tensor,
    weights: Tensor,
    k_data: Tensor,
    k_scale: Tensor,
    n_visible: Tensor,
    block_s: int | None = None,
    num_warps: int = 4,
) -> Tensor:
    """`block_s` (positions per program) and `num_warps` override the launch shape (bench/kernels.py tunes them)."""
    B, T, H, half = q_data.shape
    S = k_data.shape[1]
    out = torch.empty((B, T, S), dtype=torch.float32, device=q_data.device)
    if out.numel() == 0:
        return out
    HP = triton.next_power_of_2(H)
    # rows = queries × heads: tl.dot needs ≥ 16; prefill tiles share each K tile among up to 64 rows
    rows_wanted = 16 if T == 1 else 64
    block_t = max(min(max(1, rows_wanted // HP), triton.next_power_of_2(T)), max(1, 16 // HP))
    block_s = block_s or (32 if interpreting() else 128)
    grid = (triton.cdiv(S, block_s), triton.cdiv(T, block_t), B)
    k_data, k_scale = dense_rows(k_data), dense_rows(k_scale)
    _indexer_kernel[grid](
        q_data.contiguous(), q_scale.contiguous(), weights.contiguous(), k_data, k_scale, n_visible.contiguous(), out,
        T, H, S, k_data.stride(0), k_scale.stride(0), 2 * half, HP, block_t, block_s, interpreting(),
        num_warps=num_warps,
    )  # fmt: skip
    return out
