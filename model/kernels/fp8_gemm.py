"""Block-scaled FP8 GEMM (W8A8) of the released FP8 linears (model-architecture.md §2.9, §2.10).

    y[m, n] = Σ_k x[m, k] · w[n, k],   x = E4M3 · UE8M0 per 32 inputs (the QAT activation cast, `quantize_swa_fp8`),
                                       w = E4M3 · UE8M0 per 32 × 32 block (the checkpoint's `.weight` / `.scale`)

Both scales are constant over a 32-wide K chunk, so y = Σ_chunks (code dot of the chunk) · sx[m] · sw[n]: each chunk's
dot of raw E4M3 codes (exact products, a 32-term sum) is rescaled by the outer product of the two scale vectors and
added to an fp32 accumulator — DeepGEMM's "promote every chunk to CUDA cores", here every 32 inputs, which also
bounds the error of the FP8 tensor cores' reduced-precision accumulation to one chunk.

Triton: a program computes the transposed output tile yᵀ [BN weight rows, BM tokens]: the weight is the dot's M side
(wgmma's 64-row granule; decode has 1–256 tokens, and the dot's N side may be as small as 16). Per K tile of BK (a
software-pipelined loop over `num_stages`) it loads BK inputs of both operands and their scales (as 32-bit words when
a row's scales are whole words: a thread's share of a byte-wise scale load is under the 4 bytes `cp.async` needs, so
it would not be pipelined), then takes one of two ways (`FP8GemmTuning.dot`):
- chunked ("fp8", "fp32"): per 32-input chunk one dot of the raw codes, rescaled into the accumulator as above — on
  sm_89+ the chunks are FP8 tensor-core operands as loaded, elsewhere fp32 decoded codes (tf32 dots: exact for E4M3
  codes). The fewest operand bytes and instructions per weight byte while the dot is narrow (a few tokens), but the
  rescale is BN × BM multiply-adds per chunk: from 32 tokens on the epilogue of every chunk dominates;
- folded ("bf16"): both tiles decoded (the hardware E4M3 cast) and multiplied by their scales into bf16 — exact, an
  E4M3 value times a power of two fits bf16 — then ONE bf16 tensor-core dot per K tile accumulates in fp32; the
  scales cost a multiply per operand value instead of per output and chunk (fp32 operands in the interpreter, whose
  low-precision dots are unreliable).
Decode leaves few output tiles (N/BN × ⌈M/BM⌉: 10 at N = 1280), so K is split over up to one program per SM; the
splits write fp32 partial sums that a second launch adds in split order and casts (deterministic; no atomics, no
sync).

Under batch invariance (model.kernels.invariance) the numerics depend on the weight's shape only: folded dots at every
M, and the K splits of a single token tile.

`fp8_linear_cast` takes the float activations instead and casts them as `quantize_swa_fp8` does (the same bytes):
below `FOLDED_FROM` tokens, and whenever the dots are chunked, inside the GEMM — each program casts the 32-input
chunks of its BM token rows as it loads them (BM/BN of the weight's decode work, redone by each weight tile), one
launch instead of two for every small-batch linear, under batch invariance too; with folded dots from `FOLDED_FROM`
tokens, whose token tiles are as wide as the weight's, by the cast kernel first. Either way the dot's operands are
the same values, so where the cast runs does not change a row's bits.
"""

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model import quant
from model.kernels.formats import (
    abs_bits,
    check_tile_sides,
    e4m3_decode,
    e4m3_encode,
    e4m3_scaled,
    fp8_tensor_cores,
    interpreting,
    multiprocessors,
    scale_words,
    ue8m0_block_scales,
    ue8m0_decode,
)
from model.kernels.invariance import batch_invariant
from model.kernels.kv_quant import FP8_UE8M0, block_scale, quantize_triton
from model.kernels.launch import dependent_launch, follow

BLOCK = 32  # inputs per activation scale, and the weight's square scale block
FOLDED_FROM = 32  # tokens from which the folded (bf16) dots are the default

Dot = Literal["fp8", "fp32", "bf16"]


@dataclass(frozen=True)
class FP8GemmTuning:
    """Launch shape of `fp8_linear_triton` (None: chosen per call). Defaults: H200 decode, memory-bound on the weight.

    - `block_m`: tokens per tile, the dot's N side (a power of two ≥ 16; None: M rounded up to a power of two,
      16 … 128);
    - `block_n`: weight rows per tile, the dot's M side (two wgmma granules);
    - `block_k`: K per pipeline stage, a multiple of 32 (128: 16 KiB of weight per stage at block_n 128);
    - `split_k`: K splits (None: as many as bring the grid to about one program per SM, each ≥ `num_stages` K tiles);
    - `num_warps`: per program (None: 4, or 8 from block_m 64 on, where 4 warps' accumulators spill);
    - `num_stages`: K tiles in the pipeline (None: 4, three in flight (≈ 54 KiB at decode); 3 at block_m 128, whose
      tiles need the shared memory);
    - `dot`: "bf16": scales folded into bf16 operands, one dot per K tile (None: from 32 tokens on, or always under
      batch invariance); "fp8": FP8
      tensor-core dots of the codes per 32-input chunk, rescaled (None: below 32 tokens on sm_89+); "fp32": the
      same chunks as decoded fp32 codes (None: below 32 tokens elsewhere and in the interpreter, which has no FP8
      dot). "bf16" runs fp32 operands in the interpreter."""

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 128
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dot: Dot | None = None

    def resolved(self, M: int) -> "FP8GemmTuning":
        """These settings with the defaults for M tokens filled in (`split_k` depends on the shape: left as is)."""
        block_m = self.block_m or min(max(16, triton.next_power_of_2(M)), 128)
        warps = self.num_warps or (4 if block_m <= 32 else 8)
        stages = self.num_stages or (3 if block_m >= 128 else 4)
        return replace(self, block_m=block_m, num_warps=warps, num_stages=stages, dot=self.dot or _default_dot(M))


def _default_dot(M: int) -> Dot:
    if M >= FOLDED_FROM or batch_invariant():
        return "bf16"
    return "fp8" if fp8_tensor_cores() and not interpreting() else "fp32"


def dequantize_fp8_weight(w: Tensor, w_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """E4M3 [N, K] (float8_e4m3fn or its bytes), UE8M0 per 32 × 32 block [⌈N/32⌉, K/32] → [N, K] in dtype, exactly."""
    N = w.shape[0]
    scale = quant.ue8m0_decode(w_scale).repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)
    return (quant.e4m3_decode(w.view(torch.uint8)) * scale).to(dtype)


def fp8_linear_torch(x_data: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The reference: both operands dequantised (transiently), F.linear in promote(out_dtype, fp32), then cast."""
    compute = torch.promote_types(out_dtype, torch.float32)
    x = quant.fp8_dequant(x_data, x_scale, BLOCK, compute)
    return F.linear(x, dequantize_fp8_weight(w, w_scale, compute)).to(out_dtype)


def fp8_linear_cast_torch(x: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The reference: the activation cast (`quant.fp8_quant`), then `fp8_linear_torch` in x's dtype."""
    return fp8_linear_torch(*quant.fp8_quant(x, BLOCK), w, w_scale, x.dtype)


@triton.jit
def _chunk_scales(ptr, rows, ok, tile, PER_ROW: tl.constexpr, CHUNKS: tl.constexpr, WORDS: tl.constexpr):
    """UE8M0 scales of K tile `tile`'s CHUNKS chunks for `rows` (PER_ROW scale bytes each) → a tuple of CHUNKS fp32
    [rows] vectors. WORDS: one 32-bit word per four chunks (PER_ROW and CHUNKS multiples of 4)."""
    first = tile * CHUNKS
    scales = ()
    if WORDS:
        word_ptr = (ptr + rows * PER_ROW + first).to(tl.pointer_type(tl.int32))
        for g in tl.static_range(CHUNKS // 4):
            word = tl.load(word_ptr + g, mask=ok & (first + 4 * g < PER_ROW), other=0x7F7F7F7F)
            for j in tl.static_range(4):  # little-endian: chunk 4g + j is byte j
                scales = scales + (ue8m0_decode((word >> (8 * j)) & 0xFF),)  # noqa: RUF005 (no starred tuples)
    else:
        for c in tl.static_range(CHUNKS):
            byte = tl.load(ptr + rows * PER_ROW + first + c, mask=ok & (first + c < PER_ROW), other=127)
            scales = scales + (ue8m0_decode(byte),)  # noqa: RUF005
    return scales


@triton.jit
def _codes(ptr, rows, ok, k, K: tl.constexpr, FP8_DOT: tl.constexpr):
    """E4M3 codes [rows, 32] of one K chunk: as loaded (FP8 operand pointers), or decoded to fp32."""
    codes = tl.load(ptr + rows[:, None] * K + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0.0)
    return codes if FP8_DOT else e4m3_decode(codes)


@triton.jit
def _cast_chunk(ptr, rows, ok, k, K: tl.constexpr, FP8_DOT: tl.constexpr):
    """Float activations [rows, 32] of one K chunk, cast as `quantize_swa_fp8` casts them → (their E4M3 codes as
    `_codes` gives them, their UE8M0 scales [rows] as fp32)."""
    x = tl.load(ptr + rows[:, None] * K + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    codes, scale = _cast_blocks(x, 1)
    return (codes.to(tl.float8e4nv, bitcast=True) if FP8_DOT else e4m3_decode(codes)), scale


@triton.jit
def _cast_blocks(x, AXIS: tl.constexpr):
    """fp32 activations whose 32-input blocks lie along AXIS, cast as `quantize_swa_fp8` casts them → (their E4M3
    codes, the blocks' UE8M0 scales as fp32, AXIS reduced)."""
    scale, _ = block_scale(tl.max(abs_bits(x), axis=AXIS).to(tl.float32, bitcast=True), FP8_UE8M0)
    return e4m3_encode(x * (1.0 / tl.expand_dims(scale, AXIS))), scale  # 1/2^k is exact


@triton.jit
def _chunked_tile(acc, x_ptr, xs_ptr, w_ptr, ws_ptr, m, m_ok, n, n_ok, tile, K: tl.constexpr, BK: tl.constexpr,
                  FP8_DOT: tl.constexpr, WORDS: tl.constexpr, CAST_X: tl.constexpr):  # fmt: skip
    """acc [BN, BM] plus K tile `tile`, one code dot per 32-input chunk, each rescaled by its two scale vectors.
    CAST_X: x_ptr holds float activations, cast chunk by chunk here (xs_ptr unused)."""
    CHUNKS: tl.constexpr = BK // 32
    w_scales = _chunk_scales(ws_ptr, n // 32, n_ok, tile, K // 32, CHUNKS, WORDS)
    if not CAST_X:
        x_scales = _chunk_scales(xs_ptr, m, m_ok, tile, K // 32, CHUNKS, WORDS)
    for c in tl.static_range(CHUNKS):
        k = tile * BK + c * 32 + tl.arange(0, 32)
        if CAST_X:
            x, x_scale = _cast_chunk(x_ptr, m, m_ok, k, K, FP8_DOT)
        else:
            x, x_scale = _codes(x_ptr, m, m_ok, k, K, FP8_DOT), x_scales[c]
        dot = tl.dot(_codes(w_ptr, n, n_ok, k, K, FP8_DOT), tl.trans(x))
        acc += dot * (w_scales[c][:, None] * x_scale[None, :])
    return acc


@triton.jit
def _folded_operand(ptr, s_ptr, rows, scale_rows, ok, k0, K: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr,
                    HW: tl.constexpr):  # fmt: skip
    """Rows `rows` of an FP8 operand [*, K], inputs k0 … k0 + BK − 1, times their scales (rows `scale_rows` of
    [*, K/32]) → values [rows, BK], exactly: bf16 on the GPU, fp32 in the interpreter."""
    k = k0 + tl.arange(0, BK)
    bits = tl.load(ptr + rows[:, None] * K + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0)
    return e4m3_scaled(bits, ue8m0_block_scales(s_ptr, scale_rows, ok, k0 // 32, K // 32, BK // 32, WORDS), HW)


@triton.jit
def _cast_operand(ptr, rows, ok, k0, K: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
    """Float activations [rows, BK] from input k0, cast as `quantize_swa_fp8` casts them, times their scales →
    `_folded_operand`'s values of the cast kernel's bytes, exactly."""
    k = k0 + tl.arange(0, BK)
    x = tl.load(ptr + rows[:, None] * K + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    R: tl.constexpr = x.shape[0]
    codes, scale = _cast_blocks(tl.reshape(x, (R, BK // 32, 32)), 2)
    return e4m3_scaled(tl.reshape(codes, (R, BK)), scale, HW)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, tiles_per_split,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    FOLDED: tl.constexpr, FP8_DOT: tl.constexpr, WORDS: tl.constexpr, HW: tl.constexpr, CAST_X: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """One [BM, BN] output tile over K tiles tiles_per_split · split … of the program's split; out_ptr: y [M, N], or
    the split's fp32 partial sums [splits, M, N]. FOLDED: one dot of scaled operands per K tile, else chunked
    (FP8_DOT: x and w as float8e4nv). CAST_X: x as floats, cast here."""
    follow(PDL, EARLY)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    split = tl.program_id(2)
    m_ok, n_ok = m < M, n < N
    m, n = m.to(tl.int64), n.to(tl.int64)
    acc = tl.zeros((BN, BM), dtype=tl.float32)  # yᵀ: the weight rows are the dot's M side
    first = split * tiles_per_split
    for tile in tl.range(first, tl.minimum(first + tiles_per_split, tl.cdiv(K, BK)), num_stages=STAGES):
        if FOLDED:
            w = _folded_operand(w_ptr, ws_ptr, n, n // 32, n_ok, tile * BK, K, BK, WORDS, HW)
            if CAST_X:
                x = _cast_operand(x_ptr, m, m_ok, tile * BK, K, BK, HW)
            else:
                x = _folded_operand(x_ptr, xs_ptr, m, m, m_ok, tile * BK, K, BK, WORDS, HW)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = _chunked_tile(
                acc, x_ptr, xs_ptr, w_ptr, ws_ptr, m, m_ok, n, n_ok, tile, K, BK, FP8_DOT, WORDS, CAST_X
            )
    out = out_ptr + split.to(tl.int64) * M * N + m[None, :] * N + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr
):
    """out = Σ_s partials[s] (fp32 [SPLITS, M·N], added in split order) in out's dtype: one launch for the sum and
    the cast."""
    follow(PDL, EARLY)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + split * MN + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


_SUM_BLOCK = 1024  # outputs per program of `_sum_splits_kernel`


def _split_k(programs: int, k_tiles: int, stages: int) -> int:
    """K splits that bring `programs` output tiles to about one program per SM, each split ≥ `stages` K tiles (fewer
    trips would leave the pipeline's prologue unhidden). At M = 1 on 132 SMs: N×K 1280×5120 → 10 splits of 4 tiles,
    5120×8192 → 3 of 22, 32768×1280 → 1."""
    return max(1, min(multiprocessors() // programs, k_tiles // stages))


def fp8_linear_triton(
    x_data: Tensor,
    x_scale: Tensor,
    w: Tensor,
    w_scale: Tensor,
    out_dtype: torch.dtype,
    tuning: FP8GemmTuning = FP8GemmTuning(),
) -> Tensor:
    """The kernel (module docstring) at the launch shape `tuning`; K split into fp32 partials when the grid is small."""
    return _launch(x_data, x_scale, w, w_scale, out_dtype, tuning)


def casts_inside(M: int, tuning: FP8GemmTuning = FP8GemmTuning()) -> bool:
    """Whether `fp8_linear_cast_triton` casts M tokens inside the GEMM (below `FOLDED_FROM` tokens, or with chunked
    dots), not by the cast kernel first."""
    return M < FOLDED_FROM or tuning.resolved(M).dot != "bf16"


def fp8_linear_cast_triton(x: Tensor, w: Tensor, w_scale: Tensor, tuning: FP8GemmTuning = FP8GemmTuning()) -> Tensor:
    """`fp8_linear_cast`: float activations x [M, K], cast inside the GEMM or by the cast kernel first
    (`casts_inside`); y in x's dtype."""
    if not casts_inside(x.shape[0], tuning):
        return _launch(*quantize_triton(x, FP8_UE8M0.value), w, w_scale, x.dtype, tuning)
    return _launch(x, None, w, w_scale, x.dtype, tuning)


def _launch(
    x: Tensor, x_scale: Tensor | None, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype, tuning: FP8GemmTuning
) -> Tensor:
    """Run the kernel on E4M3 activations x with their scales, or (x_scale None: chunked dots only) on float ones."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=x.device)
    t = tuning.resolved(M)
    if t.dot not in ("fp8", "fp32", "bf16"):
        raise ValueError(f"tuning.dot: expected 'fp8', 'fp32' or 'bf16', got {t.dot!r}")
    if t.dot == "fp8" and interpreting():
        raise ValueError("tuning.dot: the interpreter has no FP8 dot (it decodes to fp32)")
    cast = x_scale is None
    check_tile_sides(block_m=(t.block_m, 16), block_n=(t.block_n, 16), block_k=(t.block_k, BLOCK))
    m_tiles, n_tiles, k_tiles = triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n), triton.cdiv(K, t.block_k)
    # under batch invariance, the K splits of one token tile whatever M
    programs, stages = (
        (n_tiles, tuning.resolved(1).num_stages) if batch_invariant() else (m_tiles * n_tiles, t.num_stages)
    )
    splits = t.split_k or _split_k(programs, k_tiles, stages)
    tiles_per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    out = torch.empty((M, N) if splits == 1 else (splits, M, N), device=x.device,
                      dtype=out_dtype if splits == 1 else torch.float32)  # fmt: skip
    w_scale = w_scale.contiguous()
    per_row, per_tile = K // BLOCK, t.block_k // BLOCK
    operand = torch.float8_e4m3fn if t.dot == "fp8" else torch.uint8
    if cast:
        words = scale_words(w_scale, per_row, per_tile)
        x, x_scale = x.contiguous(), w_scale  # the kernel casts x; no activation scales to read
    else:
        x_scale = x_scale.contiguous()
        words = scale_words(x_scale, per_row, per_tile) and scale_words(w_scale, per_row, per_tile)
        x = x.contiguous().view(operand)
    grid = (m_tiles, n_tiles, splits)
    _fp8_linear_kernel[grid](
        x, x_scale, w.contiguous().view(operand), w_scale, out, M, N, tiles_per_split,
        K, t.block_m, t.block_n, t.block_k, t.num_stages, t.dot == "bf16", t.dot == "fp8", words, not interpreting(),
        cast, num_warps=t.num_warps, **dependent_launch(x.device, grid),
    )  # fmt: skip
    if splits == 1:
        return out
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(M * N, _SUM_BLOCK),)
    _sum_splits_kernel[grid](out, y, M * N, splits, _SUM_BLOCK, num_warps=4, **dependent_launch(x.device, grid))
    return y
