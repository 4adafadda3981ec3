"""KV formats: FP4 main KV (E4M3 scale / 16), FP4 indexer K (UE8M0 / 32), FP8 SWA ring (UE8M0 / 32).

The torch side is model/quant.py itself; the Triton side reproduces its bytes exactly. One quantise kernel and one
dequantise kernel serve the three formats (a constexpr picks the format); each program handles BLOCK_M rows of a
[M, D] view, so leading dimensions are flattened and any D that is a multiple of the block works.

bf16 input (what serving stores) takes a faster FP4 kernel: it reads the rows as 32-bit words, so each word already is
the (even, odd) pair one packed byte holds and bf16 → fp32 is a shift; and it divides by the E4M3 scale with one
multiply by its reciprocal instead of a correctly rounded division per element, and rounds to E2M1 with saturating
fp32 arithmetic (`e2m1_code_bits`, exact for such quotients of bf16 values); a tile holding an inf or NaN takes the
reference's division and special cases instead.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import quant
from model.kernels.formats import (
    abs_bits,
    ceil_pow2,
    e2m1_code_bits,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    interpreting,
    ue8m0_decode,
    ue8m0_encode,
    unit_stride,
)
from model.kernels.launch import dependent_launch, follow
from model.kernels.rope import rope_arguments, rope_pairs, rope_rotate_torch, rope_values
from model.norm import rms_norm

KV_BLOCK = 16
INDEX_BLOCK = 32
SWA_BLOCK = 32

# format switch of the two kernels (constexpr: each format compiles to its own kernel)
FP4_E4M3 = tl.constexpr(0)  # main KV
FP4_UE8M0 = tl.constexpr(1)  # indexer q / K
FP8_UE8M0 = tl.constexpr(2)  # SWA ring
_BLOCKS = {FP4_E4M3.value: KV_BLOCK, FP4_UE8M0.value: INDEX_BLOCK, FP8_UE8M0.value: SWA_BLOCK}
_TILE_ELEMENTS = 4096  # per program: a few KiB in, enough independent loads in flight


def quantize_kv_fp4_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    return quant.fp4_quant_e4m3(x, KV_BLOCK)


def quantize_index_fp4_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    return quant.fp4_quant_ue8m0(x, INDEX_BLOCK)


def quantize_swa_fp8_torch(
    x: Tensor, rope: tuple[Tensor, Tensor] | None = None, norm: tuple[Tensor, float] | None = None
) -> tuple[Tensor, Tensor]:
    if norm is not None:
        x = rms_norm(x, *norm)
    return quant.fp8_quant(x if rope is None else rope_rotate_torch(x, *rope, inverse=False), SWA_BLOCK)


def dequantize_kv_fp4_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp4_dequant_e4m3(data, scale, KV_BLOCK, dtype)


def dequantize_index_fp4_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp4_dequant_ue8m0(data, scale, INDEX_BLOCK, dtype)


def dequantize_swa_fp8_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp8_dequant(data, scale, SWA_BLOCK, dtype)


@triton.jit
def block_scale(amax, FORMAT: tl.constexpr):
    """Block amax → (scale as fp32, its stored byte) per format (model/quant.py)."""
    if FORMAT == FP4_E4M3:
        byte = e4m3_encode(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), 6.0))
        scale = e4m3_decode(byte)
    elif FORMAT == FP4_UE8M0:
        scale = ceil_pow2(tl.math.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0))
        byte = ue8m0_encode(scale)
    else:
        scale = ceil_pow2(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        byte = ue8m0_encode(scale)
    return scale, byte


@triton.jit
def _store_scales(scale_ptr, byte, rows, M, NB: tl.constexpr, NBP: tl.constexpr):
    """The scale bytes [BLOCK_M, NBP] of rows `rows` (NB per row; the padding blocks and rows ≥ M left out)."""
    blocks = tl.arange(0, NBP)
    ok = (rows[:, None] < M) & (blocks[None, :] < NB)
    tl.store(scale_ptr + rows[:, None].to(tl.int64) * NB + blocks[None, :], byte, mask=ok)


@triton.jit
def rms_norm_rows(x, w_ptr, D: tl.constexpr, DP: tl.constexpr, eps):
    """RMSNorm of fp32 rows x [·, DP] (dims ≥ D zero) with weight w_ptr [D], in fp32 as `model.norm.rms_norm`
    computes it (rounding to the rows' dtype is the caller's)."""
    cols = tl.arange(0, DP)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return w[None, :] * (x * tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None])


@triton.jit
def store_fp8(x, data_ptr, scale_ptr, rows, M, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
              FAKE: tl.constexpr):  # fmt: skip
    """The FP8 cast (E4M3, UE8M0 per 32) of fp32 rows x [BLOCK_M, DP] (rows `rows` of [M, D], columns ≥ D padding)
    stored as codes at data_ptr and scales at scale_ptr, or (FAKE) as the values they decode to at data_ptr."""
    NB: tl.constexpr = D // 32
    NBP: tl.constexpr = DP // 32
    xb = tl.reshape(x, (BLOCK_M, NBP, 32))
    scale, byte = block_scale(tl.max(abs_bits(xb), axis=2).to(tl.float32, bitcast=True), FP8_UE8M0)
    stored = e4m3_encode(xb * (1.0 / scale[:, :, None]))  # the codes (1/2^k is exact) …
    if FAKE:  # … or the values they decode to
        stored = (e4m3_decode(stored) * scale[:, :, None]).to(data_ptr.dtype.element_ty)
    else:
        _store_scales(scale_ptr, byte, rows, M, NB, NBP)
    cols = tl.arange(0, DP)
    ok = (rows[:, None] < M) & (cols[None, :] < D)
    tl.store(data_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], tl.reshape(stored, (BLOCK_M, DP)), mask=ok)


@triton.jit
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr, pos_ptr, freq_ptr, w_ptr, M, x_stride, eps,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, FORMAT: tl.constexpr, FAKE: tl.constexpr,
    RD: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Rows of x x_stride elements apart. FAKE (FP8 only): store the dequantised values in data_ptr's dtype instead
    of codes and scales. RD > 0: the rows' last RD dims take RoPE first (row r at pos_ptr[r] × freq_ptr), rounded to
    x's dtype as the RoPE kernel would store them. NORM: before that, RMSNorm with weight w_ptr (`rms_norm_rows`),
    rounded to x's dtype as the norm would store it."""
    follow(PDL, EARLY)
    BLOCK: tl.constexpr = 16 if FORMAT == FP4_E4M3 else 32
    NB: tl.constexpr = D // BLOCK
    NBP: tl.constexpr = DP // BLOCK
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, DP)
    ok = (rows[:, None] < M) & (cols[None, :] < D)
    x_rows = rows.to(tl.int64) * x_stride
    if RD > 0:
        pos = tl.load(pos_ptr + rows, mask=rows < M, other=0)[:, None]
    if NORM:
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        x = rms_norm_rows(x, w_ptr, D, DP, eps).to(x_ptr.dtype.element_ty).to(tl.float32)
        if RD > 0:
            x = rope_values(x, pos, freq_ptr, D, DP, RD, BLOCK_M).to(x_ptr.dtype.element_ty).to(tl.float32)
    elif RD > 0:
        x = rope_pairs(x_ptr, x_rows, ok, cols, pos, freq_ptr, D, RD, False)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if FORMAT == FP8_UE8M0:
        store_fp8(x, data_ptr, scale_ptr, rows, M, D, DP, BLOCK_M, FAKE)
    else:
        xb = tl.reshape(x, (BLOCK_M, NBP, BLOCK))
        scale, byte = block_scale(tl.max(abs_bits(xb), axis=2).to(tl.float32, bitcast=True), FORMAT)
        _store_scales(scale_ptr, byte, rows, M, NB, NBP)
        # E4M3 scales need a correctly rounded division (as torch divides); 1/2^k is exact, so UE8M0 multiplies
        q = tl.math.div_rn(xb, scale[:, :, None]) if FORMAT == FP4_E4M3 else xb * (1.0 / scale[:, :, None])
        even, odd = tl.split(tl.reshape(e2m1_encode(q), (BLOCK_M, DP // 2, 2)))
        half = tl.arange(0, DP // 2)
        half_ok = (rows[:, None] < M) & (half[None, :] < D // 2)
        tl.store(data_ptr + rows[:, None].to(tl.int64) * (D // 2) + half[None, :], even | (odd << 4), mask=half_ok)


@triton.jit
def _dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, M, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, FORMAT: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    BLOCK: tl.constexpr = 16 if FORMAT == FP4_E4M3 else 32
    NB: tl.constexpr = D // BLOCK
    NBP: tl.constexpr = DP // BLOCK
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, NBP)
    scale_ok = (rows[:, None] < M) & (blocks[None, :] < NB)
    scale_bytes = tl.load(scale_ptr + rows[:, None].to(tl.int64) * NB + blocks[None, :], mask=scale_ok, other=0)
    scale = e4m3_decode(scale_bytes) if FORMAT == FP4_E4M3 else ue8m0_decode(scale_bytes)
    cols = tl.arange(0, DP)
    ok = (rows[:, None] < M) & (cols[None, :] < D)
    if FORMAT == FP8_UE8M0:
        values = e4m3_decode(tl.load(data_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=ok, other=0))
    else:
        half = tl.arange(0, DP // 2)
        half_ok = (rows[:, None] < M) & (half[None, :] < D // 2)
        packed = tl.load(data_ptr + rows[:, None].to(tl.int64) * (D // 2) + half[None, :], mask=half_ok, other=0)
        values = tl.reshape(tl.join(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4)), (BLOCK_M, DP))
    values = tl.reshape(tl.reshape(values, (BLOCK_M, NBP, BLOCK)) * scale[:, :, None], (BLOCK_M, DP))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quantize_fp4_bf16_kernel(
    w_ptr, data_ptr, scale_ptr, M,
    W: tl.constexpr, WP: tl.constexpr, BLOCK_M: tl.constexpr, FORMAT: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """FP4 quantise + pack of bf16 rows read as W = D/2 int32 words: word i holds elements 2i (low half) and 2i + 1
    (high half), the two nibbles of output byte i."""
    follow(PDL, EARLY)
    WORDS: tl.constexpr = 8 if FORMAT == FP4_E4M3 else 16  # words per scale block
    NB: tl.constexpr = W // WORDS
    NBP: tl.constexpr = WP // WORDS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    words = tl.arange(0, WP)
    ok = (rows[:, None] < M) & (words[None, :] < W)
    offsets = rows[:, None].to(tl.int64) * W + words[None, :]
    w = tl.load(w_ptr + offsets, mask=ok, other=0)
    even = tl.reshape((w << 16).to(tl.float32, bitcast=True), (BLOCK_M, NBP, WORDS))
    odd = tl.reshape((w & -65536).to(tl.float32, bitcast=True), (BLOCK_M, NBP, WORDS))
    amax_bits = tl.max(tl.maximum(abs_bits(even), abs_bits(odd)), axis=2)
    scale, byte = block_scale(amax_bits.to(tl.float32, bitcast=True), FORMAT)
    _store_scales(scale_ptr, byte, rows, M, NB, NBP)
    if tl.max(amax_bits) < 0x7F800000:  # a finite tile (every tile in practice)
        inverse = (tl.math.div_rn(1.0, scale) if FORMAT == FP4_E4M3 else 1.0 / scale)[:, :, None]  # UE8M0: exact
        q_even, q_odd = even * inverse, odd * inverse  # within 2^-23 of x / s (UE8M0: exact)
        packed = (e2m1_code_bits(q_even, PTX) + (e2m1_code_bits(q_odd, PTX) << 4)).to(tl.uint8)
    else:  # inf or NaN: the reference's own division and special cases (a NaN quotient → ±0 by its sign bit)
        s = scale[:, :, None]
        packed = e2m1_encode(tl.math.div_rn(even, s)) | (e2m1_encode(tl.math.div_rn(odd, s)) << 4)
    tl.store(data_ptr + offsets, tl.reshape(packed, (BLOCK_M, WP)), mask=ok)


def _launch_shape(M: int, D: int, tile: int = _TILE_ELEMENTS) -> tuple[int, int, tuple[int]]:
    DP = triton.next_power_of_2(D)
    block_m = max(1, tile // DP)
    return DP, block_m, (triton.cdiv(M, block_m),)


def quantize_triton(
    x: Tensor,
    fmt: int,
    tile: int = _TILE_ELEMENTS,
    num_warps: int = 4,
    rope: tuple[Tensor, Tensor] | None = None,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """`tile` (elements, or bf16 pairs, per program) and `num_warps` override the launch (bench/kernels.py tunes);
    `rope` (positions over x's leading dims, inv_freq): RoPE on x's last dims first; `norm` (weight, eps): RMSNorm
    before that (FP8 only)."""
    block = _BLOCKS[fmt]
    quant.check_block(x, block, "quantize")
    D = x.shape[-1]
    x2 = unit_stride(x.reshape(-1, D))
    M = x2.shape[0]
    width = D if fmt == FP8_UE8M0.value else D // 2
    data = torch.empty((*x.shape[:-1], width), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], D // block), dtype=torch.uint8, device=x.device)
    if M and fmt != FP8_UE8M0.value and x2.dtype == torch.bfloat16:
        WP, block_m, grid = _launch_shape(M, D // 2, tile)
        _quantize_fp4_bf16_kernel[grid](
            x2.contiguous().view(torch.int32), data, scale, M, D // 2, WP, block_m, fmt, not interpreting(),
            num_warps=num_warps, **dependent_launch(x.device, grid),
        )  # fmt: skip
    elif M:
        DP, block_m, grid = _launch_shape(M, D, tile)
        pos, freq, rd = rope_arguments(rope, x.shape[:-1], x.device)
        weight, eps = (x2, 0.0) if norm is None else (norm[0].contiguous(), norm[1])
        _quantize_kernel[grid](
            x2, data, scale, pos, freq, weight, M, x2.stride(0), eps, D, DP, block_m, fmt, False, rd, norm is not None,
            num_warps=num_warps, **dependent_launch(x.device, grid),
        )  # fmt: skip
    return data, scale


def fake_quant_fp8_torch(x: Tensor) -> Tensor:
    return quant.fake_quant_fp8(x)


def fake_quant_fp8_triton(x: Tensor) -> Tensor:
    """quant.fake_quant_fp8 in one launch (the torch form is several small ops — block amax, scale, E4M3 cast,
    rescale — on every linear input of every step)."""
    quant.check_block(x, SWA_BLOCK, "fake_quant_fp8")
    D = x.shape[-1]
    x2 = x.detach().reshape(-1, D).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        DP, block_m, grid = _launch_shape(x2.shape[0], D)
        M = x2.shape[0]
        _quantize_kernel[grid](
            x2, out, out, out, out, out, M, D, 0.0, D, DP, block_m, FP8_UE8M0, True, 0, False,
            **dependent_launch(x.device, grid),
        )  # fmt: skip
    return quant.straight_through(x, out.view(x.shape))


def _dequantize_triton(data: Tensor, scale: Tensor, dtype: torch.dtype, fmt: int) -> Tensor:
    block = _BLOCKS[fmt]
    D = data.shape[-1] * (1 if fmt == FP8_UE8M0.value else 2)
    quant.check_scale_shape(data, scale, block, D // data.shape[-1], "dequantize")
    out = torch.empty((*data.shape[:-1], D), dtype=dtype, device=data.device)
    M = out.numel() // D if D else 0
    if M:
        DP, block_m, grid = _launch_shape(M, D)
        _dequantize_kernel[grid](
            data.contiguous(), scale.contiguous(), out, M, D, DP, block_m, fmt, **dependent_launch(out.device, grid)
        )
    return out


def quantize_kv_fp4_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    return quantize_triton(x, FP4_E4M3.value)


def quantize_index_fp4_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    return quantize_triton(x, FP4_UE8M0.value)


def quantize_swa_fp8_triton(
    x: Tensor, rope: tuple[Tensor, Tensor] | None = None, norm: tuple[Tensor, float] | None = None
) -> tuple[Tensor, Tensor]:
    return quantize_triton(x, FP8_UE8M0.value, rope=rope, norm=norm)


def dequantize_kv_fp4_triton(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return _dequantize_triton(data, scale, dtype, FP4_E4M3.value)


def dequantize_index_fp4_triton(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return _dequantize_triton(data, scale, dtype, FP4_UE8M0.value)


def dequantize_swa_fp8_triton(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return _dequantize_triton(data, scale, dtype, FP8_UE8M0.value)
