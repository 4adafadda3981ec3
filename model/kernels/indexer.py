"""Lightning-indexer scores straight from FP4 q and K (model-architecture.md §2.5).

I[b,t,s] = Σ_h w[b,t,h] · ReLU(q[b,t,h] · K[b,s]), −inf where s ≥ n_visible[b,t].

Triton: one program scores BLOCK_S positions of one sequence for BLOCK_T queries × all heads (columns m = (t, h)).
Per 32-channel block j, the packed K bytes of the tile and of the queries are unpacked in registers into tensor-core
operands — FP8 E4M3 on Hopper and later (an E2M1 code is an E4M3 code shifted: one and + shift + or per nibble, and
the FP8 rate is twice FP16's), FP16 before — one dot K_j · q_jᵀ gives [BLOCK_S, columns] of exact code sums, and the
two UE8M0 scales multiply it: q·K = Σ_j qs_j · ks_j · Σ_{i∈j} codeq_i · codek_i. The K tile is the dot's M side
(128+ rows, the tensor core's natural tile) and the heads its N side; K is read once per query tile, never
dequantised to memory.
"""

import functools

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


# tensor-core operand of the unpacked codes (constexpr): it holds code value · 2^-6 (FP8) or · 2^-14, exactly
FP8 = tl.constexpr(0)
FP16 = tl.constexpr(1)
FP32 = tl.constexpr(2)  # the interpreter (its low-precision tl.dot is unreliable)


@triton.jit
def _codes_block(ptr, row_offsets, row_ok, j: tl.constexpr, OPERAND: tl.constexpr):
    """Bytes 16j..16j+15 of each row → [rows, 32] dot operand holding the codes of channel block j (as stored:
    low nibble = even channel) times 2^-shift."""
    packed = tl.load(ptr + row_offsets[:, None] + j * 16 + tl.arange(0, 16)[None, :], mask=row_ok[:, None], other=0)
    if OPERAND == FP8:  # E2M1 s|e1e0|m → E4M3 s|0 0 e1 e0|m 0 0: the same number · 2^-6 (bias 7 instead of 1)
        # four bytes per 32-bit instruction (PTX), where byte-wise Triton would spend one per byte
        low = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $1, 0x08080808; shl.b32 t, t, 4; and.b32 $0, $1, 0x07070707; "
            "shl.b32 $0, $0, 2; or.b32 $0, $0, t; }",
            "=r,r", [packed], dtype=tl.uint8, is_pure=True, pack=4,
        ).to(tl.float8e4nv, bitcast=True)  # fmt: skip
        high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $1, 0x70707070; shr.b32 t, t, 2; and.b32 $0, $1, 0x80808080; "
            "or.b32 $0, $0, t; }",
            "=r,r", [packed], dtype=tl.uint8, is_pure=True, pack=4,
        ).to(tl.float8e4nv, bitcast=True)  # fmt: skip
    else:
        low, high = e2m1_to_f16(packed & 0xF), e2m1_to_f16(packed >> 4)
        if OPERAND == FP32:
            low, high = low.to(tl.float32), high.to(tl.float32)
    return tl.reshape(tl.join(low, high), (packed.shape[0], 32))


@triton.jit
def _indexer_kernel(
    q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, nv_ptr, out_ptr,
    T, H, S, k_stride, ks_stride,
    DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    NBK: tl.constexpr = DI // 32
    UNSHIFT: tl.constexpr = 4096.0 if OPERAND == FP8 else 268435456.0  # both operands carry 2^-6 (or 2^-14)
    s0 = tl.program_id(0) * BLOCK_S
    t0 = tl.program_id(1) * BLOCK_T
    b = tl.program_id(2).to(tl.int64)
    m = tl.arange(0, BLOCK_T * HP)
    t, h = t0 + m // HP, m % HP
    col_ok = (t < T) & (h < H)
    qrow = (b * T + t) * H + h  # [M] row of q_data / q_scale / weights
    s = s0 + tl.arange(0, BLOCK_S)
    s_ok = s < S
    k_row, ks_row = b * k_stride + s * (DI // 2), b * ks_stride + s * NBK  # a batch row's entries are dense
    acc = tl.zeros((BLOCK_S, BLOCK_T * HP), dtype=tl.float32)
    for j in tl.static_range(NBK):
        k_codes = _codes_block(k_ptr, k_row, s_ok, j, OPERAND)
        q_codes = _codes_block(q_ptr, qrow * (DI // 2), col_ok, j, OPERAND)
        part = tl.dot(k_codes, tl.trans(q_codes))  # exact: small integers times a power of two
        k_scale = ue8m0_decode(tl.load(ks_ptr + ks_row + j, mask=s_ok, other=127))
        q_scale = ue8m0_decode(tl.load(qs_ptr + qrow * NBK + j, mask=col_ok, other=127)) * UNSHIFT
        acc += part * k_scale[:, None] * q_scale[None, :]
    w = tl.load(w_ptr + qrow, mask=col_ok, other=0.0).to(tl.float32)
    per_head = tl.maximum(acc, 0.0) * w[None, :]
    scores = tl.sum(tl.reshape(per_head, (BLOCK_S, BLOCK_T, HP)), axis=2)  # [BLOCK_S, BLOCK_T]
    tq = t0 + tl.arange(0, BLOCK_T)
    n_visible = tl.load(nv_ptr + b * T + tq, mask=tq < T, other=0)
    scores = tl.where(s[:, None] < n_visible[None, :], scores, float("-inf"))
    out = out_ptr + (b * T + tq[None, :]) * S + s[:, None]
    tl.store(out, scores, mask=(tq[None, :] < T) & s_ok[:, None])


def _operand() -> int:
    if interpreting():
        return FP32.value
    return FP8.value if _fp8_tensor_cores() else FP16.value


@functools.cache
def _fp8_tensor_cores() -> bool:
    """Asked once, not on every layer of every step: whether the GPU's tensor cores take FP8 (sm_89 and later)."""
    return torch.cuda.get_device_capability() >= (8, 9)


def indexer_scores_triton(
    q_data: Tensor,
    q_scale: Tensor,
    weights: Tensor,
    k_data: Tensor,
    k_scale: Tensor,
    n_visible: Tensor,
    block_s: int | None = None,
    num_warps: int = 4,
    operand: int | None = None,
) -> Tensor:
    """`block_s` (positions per program), `num_warps` and `operand` (FP8 / FP16 / FP32) override the launch
    (bench/kernels.py tunes them)."""
    B, T, H, half = q_data.shape
    S = k_data.shape[1]
    out = torch.empty((B, T, S), dtype=torch.float32, device=q_data.device)
    if out.numel() == 0:
        return out
    HP = triton.next_power_of_2(H)
    # columns = queries × heads: tl.dot needs ≥ 16; prefill tiles share each K tile among up to 64 columns
    columns_wanted = 16 if T == 1 else 64
    block_t = max(min(max(1, columns_wanted // HP), triton.next_power_of_2(T)), max(1, 16 // HP))
    block_s = block_s or (32 if interpreting() else 256)  # H200 (tune-indexer): 256 × 4 warps, 1.4× over 128
    grid = (triton.cdiv(S, block_s), triton.cdiv(T, block_t), B)
    k_data, k_scale = dense_rows(k_data), dense_rows(k_scale)
    _indexer_kernel[grid](
        q_data.contiguous(), q_scale.contiguous(), weights.contiguous(), k_data, k_scale, n_visible.contiguous(), out,
        T, H, S, k_data.stride(0), k_scale.stride(0), 2 * half, HP, block_t, block_s,
        _operand() if operand is None else operand, num_warps=num_warps,
    )  # fmt: skip
    return out
