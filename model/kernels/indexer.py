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

from model.kernels.formats import dense_rows, e2m1_decode, e2m1_to_f16, interpreting, ue8m0_decode
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
def _block_bytes(ptr, row_offsets, row_ok, j: tl.constexpr):
    """Bytes 16j..16j+15 of each row: the packed codes of channel block j."""
    return tl.load(ptr + row_offsets[:, None] + j * 16 + tl.arange(0, 16)[None, :], mask=row_ok[:, None], other=0)


@triton.jit
def _nibble_codes(packed, OPERAND: tl.constexpr):
    """[rows, 16] packed bytes → two [rows, 16] dot operands: the codes of the even channels (low nibbles) and of
    the odd ones (high nibbles), times 2^-shift."""
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
    return low, high


@triton.jit
def _interleave(low, high):
    """[rows, 16] even-channel and odd-channel codes → [rows, 32] in channel order."""
    return tl.reshape(tl.join(low, high), (low.shape[0], 2 * low.shape[1]))


@triton.jit
def _folded_halves(ptr, scale_ptr, row_offsets, scale_offsets, row_ok, DI: tl.constexpr, DTYPE: tl.constexpr):
    """Rows of packed codes and their UE8M0 scales → (even channels, odd channels), each [rows, DI/2] of values
    code · 2^(e − 127) in DTYPE: one load of the rows' DI/2 bytes, one of their DI/32 scale bytes.

    Exact in bf16: it has fp32's exponent range and a code needs 2 significant bits, so every product the fp32
    reference forms (subnormal 2^-128 · 1.5 included, inf where it overflows) is a bf16 number."""
    NBK: tl.constexpr = DI // 32
    block = tl.arange(0, NBK)
    packed = tl.load(
        ptr + row_offsets[:, None, None] + block[None, :, None] * 16 + tl.arange(0, 16)[None, None, :],
        mask=row_ok[:, None, None], other=0,
    )  # fmt: skip
    scale = ue8m0_decode(tl.load(scale_ptr + scale_offsets[:, None] + block[None, :], mask=row_ok[:, None], other=127))
    even = (e2m1_decode(packed & 0xF) * scale[:, :, None]).to(DTYPE)
    odd = (e2m1_decode(packed >> 4) * scale[:, :, None]).to(DTYPE)
    return tl.reshape(even, (packed.shape[0], DI // 2)), tl.reshape(odd, (packed.shape[0], DI // 2))


@triton.jit
def _query_codes(q_ptr, qs_ptr, q_row, col_ok, DI: tl.constexpr, OPERAND: tl.constexpr, SPLIT: tl.constexpr):
    """The program's queries as transposed code operands, unpacked once for all its K tiles: per block j its codes
    (SPLIT: even and odd halves) and its scales."""
    UNSHIFT: tl.constexpr = 4096.0 if OPERAND == FP8 else 268435456.0  # both operands carry 2^-6 (or 2^-14)
    blocks = ()
    for j in tl.static_range(DI // 32):
        low, high = _nibble_codes(_block_bytes(q_ptr, q_row * (DI // 2), col_ok, j), OPERAND)
        scale = ue8m0_decode(tl.load(qs_ptr + q_row * (DI // 32) + j, mask=col_ok, other=127)) * UNSHIFT
        if SPLIT:
            blocks = blocks + ((tl.trans(low), tl.trans(high), scale),)  # noqa: RUF005 (no starred tuples in @jit)
        else:
            blocks = blocks + ((tl.trans(_interleave(low, high)), scale),)  # noqa: RUF005
    return blocks


@triton.jit
def _query_values(q_ptr, qs_ptr, q_row, col_ok, DI: tl.constexpr, OPERAND: tl.constexpr):
    """The program's queries as transposed folded operands (even channels, odd channels), made once."""
    DTYPE: tl.constexpr = tl.float32 if OPERAND == FP32 else tl.bfloat16
    even, odd = _folded_halves(q_ptr, qs_ptr, q_row * (DI // 2), q_row * (DI // 32), col_ok, DI, DTYPE)
    return tl.trans(even), tl.trans(odd)


@triton.jit
def _halves(x):
    """[rows, 2w] → its left and right [rows, w] halves."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _column_blocks(x, N: tl.constexpr):
    """[rows, N · w] → the tuple of its N = 1, 2 or 4 column blocks [rows, w], in order."""
    if N == 1:
        return (x,)
    left, right = _halves(x)
    if N == 2:
        return left, right
    return _halves(left) + _halves(right)


@triton.jit
def _exact_dots(k_ptr, ks_ptr, k_row, ks_row, s_ok, q_ops, DI: tl.constexpr, OPERAND: tl.constexpr,
                SPLIT: tl.constexpr, WHOLE: tl.constexpr):  # fmt: skip
    """q·K per (position, column) as Σ_j qs_j · ks_j · (code sum of block j): per block one dot of exact code sums
    (small integers times a power of two) and one fp32 rescale. SPLIT: the even-channel dot plus the odd-channel
    one (K = 16 each: 16-bit operands only), the same sum without interleaving K's nibbles (tl.join's layout
    conversion); else one K = 32 dot. WHOLE: the tile's bytes and scales in one load each (all of the tile's
    loads in flight at once, cut into blocks in registers) instead of one load per block, each of which the
    compiler issues only after the previous block's dot (the shared-memory barriers between them)."""
    acc = tl.zeros((k_row.shape[0], q_ops[0][-1].shape[0]), dtype=tl.float32)
    if WHOLE:
        tile = tl.load(k_ptr + k_row[:, None] + tl.arange(0, DI // 2)[None, :], mask=s_ok[:, None], other=0)
        scales = tl.load(ks_ptr + ks_row[:, None] + tl.arange(0, DI // 32)[None, :], mask=s_ok[:, None], other=127)
        tile, scales = _column_blocks(tile, DI // 32), _column_blocks(scales, DI // 32)
    for j in tl.static_range(DI // 32):
        if WHOLE:
            packed, k_scale = tile[j], tl.reshape(scales[j], (k_row.shape[0],))
        else:
            packed = _block_bytes(k_ptr, k_row, s_ok, j)
            k_scale = tl.load(ks_ptr + ks_row + j, mask=s_ok, other=127)
        k_low, k_high = _nibble_codes(packed, OPERAND)
        if SPLIT:
            q_low, q_high, q_scale = q_ops[j]
            part = tl.dot(k_high, q_high, tl.dot(k_low, q_low))
        else:
            q_codes, q_scale = q_ops[j]
            part = tl.dot(_interleave(k_low, k_high), q_codes)
        acc += part * ue8m0_decode(k_scale)[:, None] * q_scale[None, :]
    return acc


@triton.jit
def _folded_dots(k_ptr, ks_ptr, k_row, ks_row, s_ok, q_ops, DI: tl.constexpr, OPERAND: tl.constexpr):
    """q·K with the scales folded into the operands: the tensor core sums over all DI channels (the even-channel dot
    plus the odd-channel one), no per-block fp32 rescale of the accumulator."""
    q_even, q_odd = q_ops
    k_even, k_odd = _folded_halves(k_ptr, ks_ptr, k_row, ks_row, s_ok, DI, q_even.dtype)
    return tl.dot(k_odd, q_odd, tl.dot(k_even, q_even))


@triton.jit
def _score_tile(k_ptr, ks_ptr, out_ptr, q_ops, w, n_visible, tq, b, s0, T, S, k_stride, ks_stride,
                DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                OPERAND: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr, WHOLE: tl.constexpr):  # fmt: skip
    """Scores of positions s0 … s0 + BLOCK_S − 1 for the program's queries, stored."""
    s = s0 + tl.arange(0, BLOCK_S)
    s_ok = s < S
    k_row, ks_row = b * k_stride + s * (DI // 2), b * ks_stride + s * (DI // 32)  # a batch row's entries are dense
    if FOLD:
        qk = _folded_dots(k_ptr, ks_ptr, k_row, ks_row, s_ok, q_ops, DI, OPERAND)
    else:
        qk = _exact_dots(k_ptr, ks_ptr, k_row, ks_row, s_ok, q_ops, DI, OPERAND, SPLIT, WHOLE)
    per_head = tl.maximum(qk, 0.0) * w[None, :]
    scores = tl.sum(tl.reshape(per_head, (BLOCK_S, BLOCK_T, HP)), axis=2)  # [BLOCK_S, BLOCK_T]
    scores = tl.where(s[:, None] < n_visible[None, :], scores, float("-inf"))
    out = out_ptr + (b * T + tq[None, :]) * S + s[:, None]
    tl.store(out, scores, mask=(tq[None, :] < T) & s_ok[:, None])


@triton.jit
def _indexer_kernel(
    q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, nv_ptr, out_ptr,
    T, H, S, k_stride, ks_stride,
    DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, OPERAND: tl.constexpr,
    SPLIT: tl.constexpr, FOLD: tl.constexpr, WHOLE: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """One program: TILES consecutive K tiles of BLOCK_S positions (a software-pipelined loop of STAGES stages when
    TILES > 1: the next tiles' loads in flight while this one's dots run) × BLOCK_T queries × all heads."""
    t0 = tl.program_id(1) * BLOCK_T
    b = tl.program_id(2).to(tl.int64)
    m = tl.arange(0, BLOCK_T * HP)
    t, h = t0 + m // HP, m % HP
    col_ok = (t < T) & (h < H)
    q_row = (b * T + t) * H + h  # [M] row of q_data / q_scale / weights
    if FOLD:
        q_ops = _query_values(q_ptr, qs_ptr, q_row, col_ok, DI, OPERAND)
    else:
        q_ops = _query_codes(q_ptr, qs_ptr, q_row, col_ok, DI, OPERAND, SPLIT)
    w = tl.load(w_ptr + q_row, mask=col_ok, other=0.0).to(tl.float32)
    tq = t0 + tl.arange(0, BLOCK_T)
    n_visible = tl.load(nv_ptr + b * T + tq, mask=tq < T, other=0)
    first = tl.program_id(0) * TILES * BLOCK_S
    if TILES == 1:
        _score_tile(k_ptr, ks_ptr, out_ptr, q_ops, w, n_visible, tq, b, first, T, S, k_stride, ks_stride, DI, HP,
                    BLOCK_T, BLOCK_S, OPERAND, SPLIT, FOLD, WHOLE)  # fmt: skip
    else:
        for i in tl.range(0, TILES, num_stages=STAGES):
            _score_tile(k_ptr, ks_ptr, out_ptr, q_ops, w, n_visible, tq, b, first + i * BLOCK_S, T, S, k_stride,
                        ks_stride, DI, HP, BLOCK_T, BLOCK_S, OPERAND, SPLIT, FOLD, WHOLE)  # fmt: skip


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
    split: bool = False,
    fold: bool = False,
    whole_tile: bool = False,
    tiles_per_program: int = 1,
    num_stages: int = 3,
) -> Tensor:
    """The launch knobs (bench/kernels.py tunes them; each gives the same scores up to fp32 summation order):
    `block_s` positions per tile, `num_warps`, `operand` (FP8 / FP16 / FP32 code operands); `split`: even- and
    odd-channel dots instead of interleaving the nibbles (16-bit operands); `whole_tile`: the tile's bytes and scales
    in one load each; `fold`: scales folded into bf16 operands, one dot over all channels (it loads whole tiles
    anyway); `tiles_per_program` consecutive tiles per program, in a loop pipelined over `num_stages`."""
    B, T, H, half = q_data.shape
    S = k_data.shape[1]
    operand = _operand() if operand is None else operand
    if split and operand == FP8.value:
        raise ValueError("split needs 16-bit code operands (operand=FP16): an FP8 dot takes K ≥ 32, a half block is 16")
    if tiles_per_program < 1:
        raise ValueError(f"tiles_per_program must be ≥ 1, got {tiles_per_program}")
    out = torch.empty((B, T, S), dtype=torch.float32, device=q_data.device)
    if out.numel() == 0:
        return out
    HP = triton.next_power_of_2(H)
    # columns = queries × heads: tl.dot needs ≥ 16; prefill tiles share each K tile among up to 64 columns
    columns_wanted = 16 if T == 1 else 64
    block_t = max(min(max(1, columns_wanted // HP), triton.next_power_of_2(T)), max(1, 16 // HP))
    block_s = block_s or (32 if interpreting() else 256)  # H200 (tune-indexer): 256 × 4 warps, 1.4× over 128
    grid = (triton.cdiv(triton.cdiv(S, block_s), tiles_per_program), triton.cdiv(T, block_t), B)
    k_data, k_scale = dense_rows(k_data), dense_rows(k_scale)
    _indexer_kernel[grid](
        q_data.contiguous(), q_scale.contiguous(), weights.contiguous(), k_data, k_scale, n_visible.contiguous(), out,
        T, H, S, k_data.stride(0), k_scale.stride(0), 2 * half, HP, block_t, block_s, operand, split, fold,
        whole_tile, tiles_per_program, num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out
