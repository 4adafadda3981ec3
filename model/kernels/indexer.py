"""Lightning-indexer scores straight from FP4 q and K (model-architecture.md §2.5).

I[b,t,s] = Σ_h w[b,t,h] · ReLU(q[b,t,h] · K[b,s]), −inf where s ≥ n_visible[b,t].

Triton: one program scores TILES consecutive K tiles of BLOCK_S positions of one sequence for BLOCK_T queries × all
heads (columns m = (t, h)). The queries' packed codes are unpacked once per program, for all of its tiles. A K tile
is read in two loads, its positions' packed bytes and their UE8M0 scales as 32-bit words (all of its bytes in
flight at once), and cut into 32-channel blocks in registers. Per block j the codes are unpacked into tensor-core
operands — FP8 E4M3 on sm_89 and later (an E2M1 code is an E4M3 code shifted: one and + shift + or per nibble, four
nibbles per 32-bit instruction, and the FP8 rate is twice FP16's), FP16 before, FP32 in the interpreter — with the
channels in [even | odd] order, the same for q and K; one dot K_j · q_jᵀ gives [BLOCK_S, columns] of exact code
sums, and the scales multiply it: q·K = Σ_j qs_j · ks_j · Σ_{i∈j} codeq_i · codek_i. A query's qs_j ride in its
operand relative to its largest block scale (exactly: a power of two within the operand's range) and that largest
one in its head weight, so the per-block rescale is one FMA by ks_j, decoded in two operations once the program has
found its K scales to be the quantiser's (no 2^-127, no NaN). The K tile is the dot's M side (the tensor core's
natural 128 rows) and the heads its N side. The loop over tiles is software-pipelined over STAGES: the next tiles'
loads are in flight while this one's dots run — on sm_90 as TMA copies of whole tiles. K is read once per query tile,
never dequantised to memory.
"""

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from model.kernels.formats import (
    dense_rows,
    e2m1_to_f16,
    fp8_tensor_cores,
    interpreting,
    multiprocessors,
    ue8m0_decode,
)
from model.kernels.invariance import batch_invariant
from model.kernels.kv_quant import dequantize_index_fp4_torch
from model.kernels.launch import dependent_launch, follow


def indexer_scores_torch(
    q_data: Tensor, q_scale: Tensor, weights: Tensor, k_data: Tensor, k_scale: Tensor, n_visible: Tensor
) -> Tensor:
    q = dequantize_index_fp4_torch(q_data, q_scale, torch.float32)  # [B, T, H, Di]
    k = dequantize_index_fp4_torch(k_data, k_scale, torch.float32)  # [B, S, Di]
    scores = torch.einsum("bth,bths->bts", weights.float(), torch.einsum("bthd,bsd->bths", q, k).relu())
    positions = torch.arange(k.shape[1], device=k.device)
    return scores.masked_fill(positions >= n_visible[..., None], float("-inf"))


# tensor-core operand of the unpacked codes (constexpr): K's hold code value · 2^-6 (FP8) or · 2^-14, exactly
FP8 = tl.constexpr(0)
FP16 = tl.constexpr(1)
FP32 = tl.constexpr(2)  # the interpreter (its low-precision tl.dot is unreliable)


@triton.jit
def _halves(x):
    """[rows, 2w] → its left and right [rows, w] halves."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _column_blocks(x, N: tl.constexpr):
    """[rows, N · w] → the tuple of its N (a power of two) column blocks [rows, w], in order."""
    if N == 1:
        blocks = (x,)
    else:  # (an early return inside a constexpr `if` still compiles the code after it)
        left, right = _halves(x)
        blocks = _column_blocks(left, N // 2) + _column_blocks(right, N // 2)
    return blocks


@triton.jit
def _channel_blocks(
    k, b, s0, byte_offsets, scale_offsets, ok, DI: tl.constexpr, DIP: tl.constexpr, SCALE_WORDS: tl.constexpr,
    PLAIN: tl.constexpr, TMA_K: tl.constexpr, TMA_SCALES: tl.constexpr,
):  # fmt: skip
    """Rows s0 … of batch row b of the K entries `k` = (bytes, scales, their tensor descriptors): DI packed FP4
    channels → the tuple of their DI/32 channel blocks (bytes [rows, 16], UE8M0 scale [rows] as fp32). One load of
    the rows' bytes and one of their scales, cut in registers: a load per block compiles to loads each issued only
    after the previous block's dot (shared-memory barriers between them), four serial global latencies per tile at
    DI = 128. With SCALE_WORDS the scales are read as 32-bit words (four blocks each): a thread's share of a tile's
    scales is then ≥ 4 bytes, what `cp.async` needs to pipeline the load — byte-wise, the scale load stalled every
    tile. TMA_K / TMA_SCALES: the bytes / scale words come by TMA (sm_90: one copy of the whole tile into shared
    memory, no per-thread addresses or masks; rows ≥ S read as zeros) — 9 % faster at B=64 × 64 K. PLAIN: every
    scale byte is known to lie in 1 … 254 (`_all_plain_scales`). DIP: DI padded to a power of two (a tl.arange's
    length)."""
    k_ptr, ks_ptr, k_desc, ks_desc = k
    if TMA_K:  # DI = DIP
        packed = tl.reshape(k_desc.load([b, s0, 0]), (ok.shape[0], DI // 2))
    else:
        byte = tl.arange(0, DIP // 2)
        byte_ok = ok[:, None] if DI == DIP else ok[:, None] & (byte < DI // 2)[None, :]
        packed = tl.load(k_ptr + byte_offsets[:, None] + byte[None, :], mask=byte_ok, other=0)
    packed = _column_blocks(packed, DIP // 32)
    if SCALE_WORDS:  # DI is a multiple of 128: whole words, no padding
        if TMA_SCALES:
            words = tl.reshape(ks_desc.load([b, s0 * (DI // 128)]), (ok.shape[0], DI // 128))
        else:
            word_ptr = (ks_ptr + scale_offsets).to(tl.pointer_type(tl.int32))
            word = tl.arange(0, DI // 128)
            words = tl.load(word_ptr[:, None] + word, mask=ok[:, None], other=0)  # rows ≥ S: unstored
        words = _column_blocks(words, DI // 128)
    else:
        block = tl.arange(0, DIP // 32)
        block_ok = ok[:, None] if DI == DIP else ok[:, None] & (block < DI // 32)[None, :]
        scales = tl.load(ks_ptr + scale_offsets[:, None] + block[None, :], mask=block_ok, other=127)
        scales = _column_blocks(scales, DIP // 32)
    blocks = ()
    for j in tl.static_range(DI // 32):
        if SCALE_WORDS:  # little-endian: block j's byte is bits 8·(j mod 4) … of word j / 4
            word = tl.reshape(words[j // 4], (ok.shape[0],))
            scale = _plain_scale(word, j % 4) if PLAIN else ue8m0_decode((word >> (8 * (j % 4))) & 0xFF)
        else:
            scale = ue8m0_decode(tl.reshape(scales[j], (ok.shape[0],)))
        blocks = blocks + ((packed[j], scale),)  # noqa: RUF005 (no starred tuples)
    return blocks


@triton.jit
def _plain_scale(word, j: tl.constexpr):
    """2^(e − 127) for the UE8M0 byte e of a little-endian word's byte j, e in 1 … 254: e moved into the fp32
    exponent field, two operations instead of ue8m0_decode's five (which also serve 2^-127 and NaN)."""
    bits = (word >> 1) if j == 3 else (word << (23 - 8 * j))
    return (bits & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _all_plain_scales(ks_ptr, ks_base, first, last, DI: tl.constexpr, SCAN: tl.constexpr):
    """Whether every K scale byte of positions first … last − 1 lies in 1 … 254, as every scale the quantiser
    writes does (its floor is 2^-126): then the tiles decode scales with `_plain_scale`. One load of the program's
    scale words (SCAN ≥ last − first of them, a power of two) before its tiles stream them again, from L2."""
    s = first + tl.arange(0, SCAN)
    word_ptr = (ks_ptr + ks_base + s * (DI // 32)).to(tl.pointer_type(tl.int32))
    words = tl.load(word_ptr[:, None] + tl.arange(0, DI // 128)[None, :], mask=(s < last)[:, None], other=0x01010101)
    special = tl.zeros_like(words)
    for j in tl.static_range(4):
        byte = (words >> (8 * j)) & 0xFF
        special |= ((byte == 0) | (byte == 255)).to(tl.int32)
    return tl.max(tl.max(special, axis=1), axis=0) == 0


@triton.jit
def _codes(packed, OPERAND: tl.constexpr):
    """[rows, 16] packed bytes of a channel block → its [rows, 32] dot operand, code · 2^-K_SHIFT, channels in the
    order [even | odd]: a permutation (the same for q and K, so the dot is unchanged) under which a thread's 4-byte
    slice of the FP8 operand is the low or high nibbles of one packed word — the interleaved order cost byte
    permutes and 2-byte shared-memory loads per operand register."""
    if OPERAND == FP8:  # E2M1 s|e1e0|m → E4M3 s|0 0 e1 e0|m 0 0: the same number · 2^-6 (bias 7 instead of 1)
        # four bytes per 32-bit instruction (PTX), where byte-wise Triton would spend one per byte
        low = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $1, 0x08080808; shl.b32 t, t, 4; and.b32 $0, $1, 0x07070707; "
            "shl.b32 $0, $0, 2; or.b32 $0, $0, t; }",
            "=r,r",
            [packed],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        ).to(tl.float8e4nv, bitcast=True)
        high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $1, 0x70707070; shr.b32 t, t, 2; and.b32 $0, $1, 0x80808080; "
            "or.b32 $0, $0, t; }",
            "=r,r",
            [packed],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        ).to(tl.float8e4nv, bitcast=True)
    else:
        low, high = e2m1_to_f16(packed & 0xF), e2m1_to_f16(packed >> 4)
        if OPERAND == FP32:
            low, high = low.to(tl.float32), high.to(tl.float32)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (low.shape[0], 2 * low.shape[1]))


@triton.jit
def _query_operands(q_ptr, qs_ptr, q_row, col_ok, w, may_fold, DI: tl.constexpr, OPERAND: tl.constexpr):
    """The program's queries, unpacked once for all of its K tiles → (per channel block the transposed operand
    [32, columns] and the scale [columns] that the block's dot needs, the head weights [columns], `folded`).

    Folded (the usual case; only if `may_fold`): each block's codes carry its scale relative to the column's
    largest, 2^-d_j, exactly (FP8 holds code · 2^(Q_SHIFT − d) for d ≤ 14), and the largest scale goes into the
    column's weight — the ReLU commutes with a positive factor. Each K tile then spends one fp32 FMA per block and
    element instead of two. Blocks of zero codes do not count (the quantiser gives them the smallest scale).
    Otherwise (a wider spread, or a NaN scale) each block's dot is rescaled by its own scale, as the reference's
    dequantised values give."""
    K_SHIFT: tl.constexpr = 6 if OPERAND == FP8 else 14  # _codes' code · 2^-K_SHIFT
    Q_SHIFT: tl.constexpr = 6 if OPERAND == FP8 else (13 if OPERAND == FP16 else 14)  # 6 · 2^Q_SHIFT fits
    SPREAD: tl.constexpr = 14 if OPERAND == FP8 else (36 if OPERAND == FP16 else 100)  # code · 2^(Q_SHIFT − d) exact
    UNSHIFT: tl.constexpr = 2.0 ** (K_SHIFT - Q_SHIFT)  # dot = 2^(Q_SHIFT − K_SHIFT − d) · Σ code_q · code_k
    codes, exponents, used = (), (), ()
    for j in tl.static_range(DI // 32):  # a load per block here: one load of whole query rows, cut in registers,
        # compiles (sm_90) to byte-wise shared-memory shuffles, 16 barriers instead of 4, for no gain once per program
        packed = tl.load(
            q_ptr + q_row[:, None] * (DI // 2) + j * 16 + tl.arange(0, 16)[None, :], mask=col_ok[:, None], other=0
        )
        codes = codes + (_codes(packed, OPERAND).to(tl.float32),)  # noqa: RUF005 (no starred tuples)
        exponents = exponents + (tl.load(qs_ptr + q_row * (DI // 32) + j, mask=col_ok, other=127).to(tl.int32),)  # noqa: RUF005
        used = used + (tl.max((packed & 0x77).to(tl.int32), axis=1) > 0,)  # noqa: RUF005
    top = tl.zeros_like(exponents[0])
    nan = tl.zeros_like(exponents[0])
    for j in tl.static_range(DI // 32):
        top = tl.maximum(top, tl.where(used[j], exponents[j], 0))
        nan = tl.maximum(nan, (exponents[j] == 255).to(tl.int32))
    spread = tl.zeros_like(top)
    for j in tl.static_range(DI // 32):
        spread = tl.maximum(spread, tl.where(used[j], top - exponents[j], 0))
    folded = may_fold & (tl.max(spread, axis=0) <= SPREAD) & (tl.max(nan, axis=0) == 0)
    operands = ()
    for j in tl.static_range(DI // 32):
        d = tl.where(folded & used[j], top - exponents[j], 0)
        operand = codes[j] * ue8m0_decode(127 + K_SHIFT + Q_SHIFT - d)[:, None]  # 2^(Q_SHIFT − d) / 2^-K_SHIFT
        if OPERAND == FP8:
            operand = operand.to(tl.float8e4nv)
        elif OPERAND == FP16:
            operand = operand.to(tl.float16)
        operands = operands + ((tl.trans(operand), ue8m0_decode(exponents[j]) * UNSHIFT),)  # noqa: RUF005
    w = tl.where(folded, w * ue8m0_decode(top) * UNSHIFT, w)
    return operands, w, folded


@triton.jit
def _qk(
    k, b, s0, k_row, ks_row, s_ok, q_ops, DI: tl.constexpr, DIP: tl.constexpr, OPERAND: tl.constexpr,
    SCALE_WORDS: tl.constexpr, FAST: tl.constexpr, TMA_K: tl.constexpr, TMA_SCALES: tl.constexpr,
):  # fmt: skip
    """q·K per (position, column) = Σ_j qs_j · ks_j · (code sum of block j): per channel block one dot of exact code
    sums (small integers times a power of two) and its fp32 rescale. FAST: the queries' scales are folded
    (`_query_operands`) and the K scales plain (`_all_plain_scales`)."""
    k_blocks = _channel_blocks(k, b, s0, k_row, ks_row, s_ok, DI, DIP, SCALE_WORDS, FAST, TMA_K, TMA_SCALES)
    acc = tl.zeros((k_row.shape[0], q_ops[0][1].shape[0]), dtype=tl.float32)
    for j in tl.static_range(DI // 32):
        packed, k_scale = k_blocks[j]
        q_codes, q_scale = q_ops[j]
        dot = tl.dot(_codes(packed, OPERAND), q_codes) * k_scale[:, None]
        acc += dot if FAST else dot * q_scale[None, :]
    return acc


@triton.jit
def _score_tile(
    k, out_ptr, q_ops, w, n_visible, tq, b, s0, T, S, k_stride, ks_stride, DI: tl.constexpr, DIP: tl.constexpr,
    HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, OPERAND: tl.constexpr, SCALE_WORDS: tl.constexpr,
    FAST: tl.constexpr, TMA_K: tl.constexpr, TMA_SCALES: tl.constexpr,
):  # fmt: skip
    """Scores of positions s0 … s0 + BLOCK_S − 1 for the program's queries, stored."""
    s = s0 + tl.arange(0, BLOCK_S)
    s_ok = s < S
    k_row, ks_row = b * k_stride + s * (DI // 2), b * ks_stride + s * (DI // 32)  # a batch row's entries are dense
    qk = _qk(k, b.to(tl.int32), s0, k_row, ks_row, s_ok, q_ops, DI, DIP, OPERAND, SCALE_WORDS, FAST, TMA_K, TMA_SCALES)
    per_head = tl.maximum(qk, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]  # ReLU(NaN) = NaN, as in torch
    scores = tl.sum(tl.reshape(per_head, (BLOCK_S, BLOCK_T, HP)), axis=2)  # [BLOCK_S, BLOCK_T]
    scores = tl.where(s[:, None] < n_visible[None, :], scores, float("-inf"))
    out = out_ptr + (b * T + tq[None, :]) * S + s[:, None]
    tl.store(out, scores, mask=(tq[None, :] < T) & s_ok[:, None])


@triton.jit
def _score_tiles(
    k, out_ptr, q_ops, w, n_visible, tq, b, first, T, S, k_stride, ks_stride, DI: tl.constexpr, DIP: tl.constexpr,
    HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, OPERAND: tl.constexpr, TILES: tl.constexpr,
    STAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, FAST: tl.constexpr, TMA_K: tl.constexpr, TMA_SCALES: tl.constexpr,
):  # fmt: skip
    """The program's TILES consecutive K tiles from position `first`."""
    if TILES == 1:  # no loop: a pipelined loop of one trip would still pay its prologue
        _score_tile(
            k, out_ptr, q_ops, w, n_visible, tq, b, first, T, S, k_stride, ks_stride, DI, DIP, HP, BLOCK_T, BLOCK_S,
            OPERAND, SCALE_WORDS, FAST, TMA_K, TMA_SCALES
        )  # fmt: skip
    else:
        for i in tl.range(0, TILES, num_stages=STAGES):
            _score_tile(
                k, out_ptr, q_ops, w, n_visible, tq, b, first + i * BLOCK_S, T, S, k_stride, ks_stride, DI, DIP, HP,
                BLOCK_T, BLOCK_S, OPERAND, SCALE_WORDS, FAST, TMA_K, TMA_SCALES
            )  # fmt: skip


@triton.jit(do_not_specialize=["T"])  # one binary for every query count (model.kernels.invariance)
def _indexer_kernel(
    q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, k_desc, ks_desc, nv_ptr, out_ptr, T, H, S, k_stride, ks_stride,
    DI: tl.constexpr, DIP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    OPERAND: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, SCAN: tl.constexpr,
    TMA_K: tl.constexpr, TMA_SCALES: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """One program: TILES consecutive K tiles of BLOCK_S positions × BLOCK_T queries × all heads. k_desc /
    ks_desc: tensor descriptors of the K bytes [B, S, DI/2] / scale words [B, S·DI/128] where TMA_K / TMA_SCALES
    (otherwise the pointers again, unused)."""
    follow(PDL, EARLY)
    t0 = tl.program_id(1) * BLOCK_T
    b = tl.program_id(2).to(tl.int64)
    first = tl.program_id(0) * TILES * BLOCK_S
    if SCALE_WORDS:
        plain = _all_plain_scales(ks_ptr, b * ks_stride, first, tl.minimum(first + TILES * BLOCK_S, S), DI, SCAN)
    else:
        plain = False
    m = tl.arange(0, BLOCK_T * HP)
    t, h = t0 + m // HP, m % HP
    col_ok = (t < T) & (h < H)
    q_row = (b * T + t) * H + h  # [M] row of q_data / q_scale / weights
    w = tl.load(w_ptr + q_row, mask=col_ok, other=0.0).to(tl.float32)
    q_ops, w, fast = _query_operands(q_ptr, qs_ptr, q_row, col_ok, w, plain, DI, OPERAND)
    tq = t0 + tl.arange(0, BLOCK_T)
    n_visible = tl.load(nv_ptr + b * T + tq, mask=tq < T, other=0).to(tl.int32)  # ≤ S: 32-bit compares per tile
    k = (k_ptr, ks_ptr, k_desc, ks_desc)
    if fast:
        _score_tiles(
            k, out_ptr, q_ops, w, n_visible, tq, b, first, T, S, k_stride, ks_stride, DI, DIP, HP, BLOCK_T, BLOCK_S,
            OPERAND, TILES, STAGES, SCALE_WORDS, True, TMA_K, TMA_SCALES
        )  # fmt: skip
    else:
        _score_tiles(
            k, out_ptr, q_ops, w, n_visible, tq, b, first, T, S, k_stride, ks_stride, DI, DIP, HP, BLOCK_T, BLOCK_S,
            OPERAND, TILES, STAGES, SCALE_WORDS, False, TMA_K, TMA_SCALES
        )  # fmt: skip


def _operand() -> int:
    if interpreting():
        return FP32.value
    return FP8.value if fp8_tensor_cores() else FP16.value


@functools.cache
def _tma() -> bool:
    """Whether K tiles may come by TMA: on sm_90 and later, and in the interpreter (which runs the same loads)."""
    return interpreting() or torch.cuda.get_device_capability() >= (9, 0)


def _tma_rows(t: Tensor, box: list[int]) -> bool:
    """Whether boxes of `box` elements ([1, rows, bytes] or [1, words]) can be copied by TMA out of `t`'s batch rows:
    rows 16-byte aligned at a 16-byte multiple apart, every box dimension at most 256, the innermost 16-byte
    multiples."""
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return aligned and max(box) <= 256 and box[-1] * t.element_size() % 16 == 0


_MAX_PROGRAM_POSITIONS = 16384  # `_all_plain_scales` loads a program's scale words at once: 128 per thread at most
DECODE_REGISTERS = (
    128  # the decode launch's register cap: four 4-warp programs per SM, few spills at 128-position tiles
)
_RESIDENT = 4  # decode programs per SM under that cap


def _default_tiling(B: int, T: int, S: int) -> tuple[int, int]:
    """(block_s, tiles_per_program). Decode: tiles of 128 positions (under `DECODE_REGISTERS`: four programs per SM),
    and the fewest tiles per program (a power of two, up to 32) that keep every program resident at once — a row's
    programs are whole, so a grid larger than the resident places runs a second, mostly idle wave (B=64 × 64 K: 0.233
    ms at 63 tiles per program against 0.116 at 64 on the H200). Prefill (64 columns share a K tile): tiles of 128,
    4 per program. The interpreter's cost grows with the tile: small tiles, and the decode loop kept (2 tiles)."""
    if interpreting():
        return (32, 2) if T == 1 else (32, 1)
    if T > 1:
        return 128, 4
    per_row, resident = triton.cdiv(S, 128), _RESIDENT * multiprocessors()
    return 128, next((t for t in (1, 2, 4, 8, 16) if B * triton.cdiv(per_row, t) <= resident), 32)


@dataclass(frozen=True)
class IndexerTuning:
    """Launch shape of `indexer_scores_triton` (None: chosen per call; every shape gives the same scores up to fp32
    summation order; `bench/kernels.py --bench tune-indexer` times them).

    - `block_s`: positions per K tile, a power of two ≥ 16 (the dot's M side; None: `_default_tiling`);
    - `tiles_per_program`: consecutive K tiles per program, in a loop software-pipelined over `num_stages` (None:
      `_default_tiling`);
    - `num_warps`: warps per program;
    - `operand`: the code operands' type, FP8 (sm_89 and later), FP16 or FP32 (`FP8.value` …; None: the GPU's);
    - `max_registers`: a cap on registers per thread, so that more programs fit an SM (spills are the price; None:
      `DECODE_REGISTERS` for decode launches of tiles up to 128 positions on a GPU, else none);
    - `tma`: K tiles by TMA where the layout allows it (None: on sm_90 and later and in the interpreter), else by
      per-thread loads."""

    block_s: int | None = None
    tiles_per_program: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    operand: int | None = None
    max_registers: int | None = None
    tma: bool | None = None

    def resolved(self, B: int, T: int, S: int) -> "IndexerTuning":
        """These settings with the defaults for B rows of T queries over S positions filled in (`max_registers` stays
        None where uncapped, `tma` None until the launch asks the GPU); a ValueError names a setting out of range."""
        default_block_s, default_tiles = _default_tiling(B, T, S)
        block_s = default_block_s if self.block_s is None else self.block_s
        tiles = default_tiles if self.tiles_per_program is None else self.tiles_per_program
        max_registers = self.max_registers
        if max_registers is None and T == 1 and block_s <= 128 and not interpreting():
            max_registers = DECODE_REGISTERS  # measured at 128-position tiles; larger ones spill under it
        operand = _operand() if self.operand is None else self.operand
        if block_s < 16 or block_s & (block_s - 1):
            raise ValueError(f"block_s must be a power of two ≥ 16 (a dot's M side), got {block_s}")
        if not 1 <= tiles <= _MAX_PROGRAM_POSITIONS // block_s:
            raise ValueError(
                f"tiles_per_program must be 1 … {_MAX_PROGRAM_POSITIONS // block_s} at block_s {block_s} (at most "
                f"{_MAX_PROGRAM_POSITIONS} positions per program, whose scales it scans at once), got {tiles}"
            )
        if max_registers is not None and not 16 <= max_registers <= 255:
            raise ValueError(f"max_registers must be 16 … 255 (registers per thread), got {max_registers}")
        if operand not in (FP8.value, FP16.value, FP32.value):
            raise ValueError(
                f"operand must be FP8 ({FP8.value}), FP16 ({FP16.value}) or FP32 ({FP32.value}), got {operand}"
            )
        return replace(self, block_s=block_s, tiles_per_program=tiles, operand=operand, max_registers=max_registers)


def query_block(T: int, HP: int) -> int:
    """Queries per program (BLOCK_T) for T queries of HP heads (a power of two). Columns = queries × heads: tl.dot
    needs ≥ 16, and prefill tiles share each K tile among up to 64 columns — but the head sum's order follows the
    tile's layout, so under batch invariance every T takes the decode tile's."""
    columns_wanted = 16 if T == 1 or batch_invariant() else 64
    return max(min(max(1, columns_wanted // HP), triton.next_power_of_2(T)), max(1, 16 // HP))


def indexer_scores_triton(
    q_data: Tensor,
    q_scale: Tensor,
    weights: Tensor,
    k_data: Tensor,
    k_scale: Tensor,
    n_visible: Tensor,
    tuning: IndexerTuning = IndexerTuning(),
) -> Tensor:
    """The kernel (module docstring) at the launch shape `tuning`."""
    B, T, H, half = q_data.shape
    S = k_data.shape[1]
    t = tuning.resolved(B, T, S)
    block_s, tiles_per_program = t.block_s, t.tiles_per_program
    out = torch.empty((B, T, S), dtype=torch.float32, device=q_data.device)
    if out.numel() == 0:
        return out
    HP = triton.next_power_of_2(H)
    block_t = query_block(T, HP)
    grid = (triton.cdiv(triton.cdiv(S, block_s), tiles_per_program), triton.cdiv(T, block_t), B)
    k_data, k_scale = dense_rows(k_data), dense_rows(k_scale)
    # scale rows of whole 32-bit words, word-aligned: read as words (see _channel_blocks)
    scale_words = 2 * half % 128 == 0 and k_scale.data_ptr() % 4 == 0 and k_scale.stride(0) % 4 == 0
    DI, DIP = 2 * half, 32 * triton.next_power_of_2(half // 16)
    k_box, ks_box = [1, block_s, half], [1, block_s * DI // 128]
    tma = _tma() if t.tma is None else t.tma
    tma_k = tma and DI == DIP and _tma_rows(k_data, k_box)
    words = k_scale.view(torch.int32).flatten(1) if scale_words else k_scale  # [B, S · DI/128]
    tma_scales = tma_k and scale_words and _tma_rows(words, ks_box)
    k_desc = TensorDescriptor.from_tensor(k_data, k_box) if tma_k else k_data
    ks_desc = TensorDescriptor.from_tensor(words, ks_box) if tma_scales else k_scale
    _indexer_kernel[grid](
        q_data.contiguous(), q_scale.contiguous(), weights.contiguous(), k_data, k_scale, k_desc, ks_desc,
        n_visible.contiguous(), out, T, H, S, k_data.stride(0), k_scale.stride(0), DI, DIP, HP, block_t, block_s,
        t.operand, tiles_per_program, t.num_stages, scale_words, triton.next_power_of_2(tiles_per_program * block_s),
        tma_k, tma_scales, num_warps=t.num_warps, **({} if t.max_registers is None else {"maxnreg": t.max_registers}),
        **dependent_launch(out.device, grid)
    )  # fmt: skip
    return out
