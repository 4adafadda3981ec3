"""Grouped MoE GEMMs over packed MXFP4 experts (model-architecture.md §2.7, §2.9): two launches per MoE layer.

    h = silu(min(x W1ᵀ, limit)) · clamp(x W3ᵀ, ±limit) · w     `moe_gate_up`: W1 ‖ W3 stored as one w13, SwiGLU fused
    y = h' W2ᵀ,  h' = FP8(h)                                   `moe_down`

for every (token, slot) pair, W the pair's expert and w its routing weight (applied before W2, as the reference does).
`moe_pairs` sorts the pairs by expert on the device; expert e owns sorted positions offsets[e] … offsets[e+1] − 1.
Decode's few pairs are counted into place by one Triton launch (`_pairs_kernel`), more by torch's sort and search.
Activations come FP8 (E4M3, UE8M0 per 32 inputs: the QAT cast of every quantised linear's input); expert weights
are the checkpoint's packed E2M1 nibbles [out, in/2] (element 2i in the low nibble) with a UE8M0 scale per 16 or 32
inputs ([out, in/16] or [out, in/32], told apart by the scale's shape).

Triton: program (j, e) computes output columns j·BN … of expert e's pairs, BM pairs at a time between offsets[e] and
offsets[e+1], read on the device (an expert without pairs exits at once: no host sync, no loop over experts on the host;
with fewer pairs than experts the grid has a column per pair instead of one per expert, and the column of an expert's
first pair works that expert). Its weight rows are the dot's M side (wgmma's 64-row granule; an expert sees few pairs in
decode). Per K tile of BK inputs, in a loop software-pipelined over `num_stages`: the pairs' activation rows are
gathered (gate_up: their tokens' rows; down: their own) and their E4M3 bytes decoded (the hardware cast) and scaled into
bf16; the packed weight bytes are decoded and scaled into bf16 — on the GPU by `prmt` table lookups
(`formats.E2M1_BF16_PTX`, ≈ 3 instructions a value), in the interpreter by `e2m1_to_f16`'s arithmetic in fp32; exact
either way, as E4M3 and E2M1 values times powers of two fit bf16 — and one bf16 tensor-core dot per projection
accumulates in fp32 (fp32 operands in the interpreter, whose low-precision dots are unreliable). Both operands take the
tile's inputs in the order [even | odd] (a permutation of K: the dot is unchanged), so a packed byte's two values need
no interleaving into operand pairs. Hopper has no FP4 (nor mixed FP8 × FP4) MMA, so FP4 weights cannot reach the tensor
cores packed. With scales per 32 inputs the kernel can instead widen each nibble to an E4M3 byte (a shift) and take FP8
dots of the raw codes per 32-input chunk, rescaled into the accumulator as the FP8 linear does (`MoEGemmTuning.dot`);
scales per 16 inputs rule that out. Weights are never dequantised to memory, and each program reads its weight rows once
per BM pairs: the tile height is chosen from the average pairs per expert, N·k/E, known on the host without a sync.
"""

import functools
import itertools
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
    e2m1_as_e4m3,
    e2m1_scaled,
    e4m3_decode,
    e4m3_encode,
    e4m3_scaled,
    interpreting,
    scale_words,
    ue8m0_block_scales,
)
from model.kernels.fp8_gemm import FOLDED_FROM, _chunk_scales
from model.kernels.kv_quant import FP8_UE8M0, block_scale, quantize_swa_fp8_torch, quantize_triton
from model.kernels.launch import dependent_launch, follow

X_BLOCK = 32  # inputs per activation scale
_X_BLOCK = tl.constexpr(X_BLOCK)  # the same, as kernels read a global
SCALE_BLOCKS = (16, 32)  # inputs per expert-weight scale: the two layouts of reference §2.9
DECODE_BLOCK_P, DECODE_BLOCK_K = 16, 512  # the activation decode's tile: rows × inputs
_TRITON_FLOATS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class MoEGemmTuning:
    """Launch shape of the grouped expert GEMMs (None: chosen per call). Defaults: H200 decode, 64–256 tokens.

    - `block_m`: pairs per tile, the dot's N side (a power of two ≥ 16; None: the average pairs per expert rounded
      up to a power of two, 16 … 64);
    - `block_n`: weight rows per program, the dot's M side (gate_up: half of them W1 rows, half the W3 rows of the
      same output columns); 128: 8 KiB of packed weight per K tile;
    - `block_k`: inputs per pipeline stage (128: at 256 the decoded weight tile alone takes 128 registers a thread
      at 4 warps — spills — and 8 warps cost more instructions per weight byte, `bench/sass.py moe-gemm`);
    - `num_warps`: per program (None: 4, or 8 from 64 pairs × 128 rows on, where 4 warps spill);
    - `num_stages`: K tiles in the pipeline (3: two in flight while one is decoded; 4 and 6 measured no faster);
    - `ptx`: the weight nibbles decoded by `formats.E2M1_BF16_PTX`'s table lookups (None: on a GPU; False there: by
      the arithmetic the interpreter runs, ≈ 2.5× the instructions);
    - `dot`: "bf16": both operands decoded and scaled into bf16, one dot per K tile; "fp8" (scales per 32 inputs
      only): FP8 tensor-core dots of the raw codes per 32-input chunk — each E2M1 nibble widened to the E4M3 byte of
      its value × 2⁻⁶ (sign, magnitude << 2: exact, the subnormal 0.5 included), the activations' E4M3 bytes as
      stored — rescaled by the two scale vectors, as the FP8 linear's chunked dots; "fp32": the same chunks as
      decoded fp32 codes (the interpreter, which has no FP8 dot);
    - `cast`: whether gate_up, asked for its output as FP8 (`moe_gate_up_cast`), casts it in its epilogue (None:
      below 32 tokens, as the FP8 linear casts its input, where a launch weighs most; the cast's registers lower the
      programs per SM) — else the cast kernel runs after it. Needs output columns per program in groups of 32."""

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 128
    num_warps: int | None = None
    num_stages: int = 3
    ptx: bool | None = None
    dot: Literal["bf16", "fp8", "fp32"] = "bf16"
    cast: bool | None = None

    def resolved(self, pairs: int, experts: int) -> "MoEGemmTuning":
        """These settings with the defaults for `pairs` (token, slot) pairs over `experts` experts filled in."""
        block_m = self.block_m or _block_m(pairs, experts)
        warps = self.num_warps or (4 if block_m * self.block_n < 64 * 128 else 8)
        ptx = not interpreting() if self.ptx is None else self.ptx
        return replace(self, block_m=block_m, num_warps=warps, ptx=ptx)


def moe_pairs_torch(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """Expert ids [N, k] → the (token, slot) pairs sorted by expert, on the device and without a host sync:
    - order int64 [N·k]: flat pair indices t·k + s, stably sorted by expert (tokens ascending within an expert); the
      GEMMs read each sorted pair's activation row order // k and routing weight weights.flatten()[order] themselves;
    - offsets int32 [E + 1]: expert e's pairs are sorted positions offsets[e] … offsets[e+1] − 1, found in the
      sorted ids by a binary search per expert (torch.bincount syncs on CUDA to size its output).
    Two launches: the sort and the search. Ids must lie in 0 … E − 1 (unchecked: a check would sync)."""
    expert, order = torch.sort(ids.flatten(), stable=True)
    return order, torch.searchsorted(expert, _expert_ids(n_experts + 1, ids.device), out_int32=True)


PAIRS_COUNTED = 4096  # up to this many pairs, `_pairs_kernel` places them (P² compares); beyond, torch sorts
_PAIRS_PROGRAMS = 8  # placing programs the pairs are spread over (more only where a program would hold > 128 pairs)


@triton.jit
def _pairs_kernel(
    ids_ptr, order_ptr, offsets_ptr, P, E, IB: tl.constexpr, JB: tl.constexpr, EB: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """A stable counting sort of the pair ids [P] by expert. Pair i of program p's IB goes to sorted place
    #(pairs of lower experts) + #(earlier pairs of its expert), counted over all P ids: order_ptr[place] = i. The
    last program writes offsets_ptr[e] = #(pairs of experts below e), e = 0 … E, beside them. Ids past P read as
    E: below no expert."""
    follow(PDL, EARLY)
    if tl.program_id(0) == tl.num_programs(0) - 1:
        for e0 in range(0, E + 1, EB):
            e = e0 + tl.arange(0, EB)
            below = tl.zeros((EB,), tl.int32)
            for j0 in range(0, P, JB):
                j = j0 + tl.arange(0, JB)
                theirs = tl.load(ids_ptr + j, mask=j < P, other=E)[None, :]
                below += tl.sum((theirs < e[:, None]).to(tl.int32), axis=1)
            tl.store(offsets_ptr + e, below, mask=e <= E)
    else:
        i = tl.program_id(0) * IB + tl.arange(0, IB)
        i_ok = i < P
        mine = tl.load(ids_ptr + i, mask=i_ok, other=0)
        place = tl.zeros((IB,), tl.int32)
        for j0 in range(0, P, JB):
            j = j0 + tl.arange(0, JB)
            theirs = tl.load(ids_ptr + j, mask=j < P, other=E)[None, :]
            before = (theirs < mine[:, None]) | ((theirs == mine[:, None]) & (j[None, :] < i[:, None]))
            place += tl.sum(before.to(tl.int32), axis=1)
        tl.store(order_ptr + place, i.to(tl.int64), mask=i_ok)


def moe_pairs_triton(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """`moe_pairs_torch`'s order and offsets in one launch (`_pairs_kernel`) up to PAIRS_COUNTED pairs: the pairs
    placed by up to `_PAIRS_PROGRAMS` programs of 16–128 pairs (a decode step's 2–512 pairs in parallel, each
    program's compare tiles no larger than its pairs need), the offsets by one more."""
    P = ids.numel()
    if P > PAIRS_COUNTED:
        return moe_pairs_torch(ids, n_experts)
    order = torch.empty(P, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(n_experts + 1, dtype=torch.int32, device=ids.device)
    IB = min(128, max(16, triton.next_power_of_2(triton.cdiv(P, _PAIRS_PROGRAMS))))
    JB = min(64, max(16, triton.next_power_of_2(P)))
    EB = min(128, max(16, triton.next_power_of_2(n_experts + 1)))
    grid = (triton.cdiv(P, IB) + 1,)
    _pairs_kernel[grid](
        ids.flatten().contiguous(), order, offsets, P, n_experts, IB, JB, EB, **dependent_launch(ids.device, grid)
    )
    return order, offsets


@functools.cache
def _expert_ids(n: int, device: torch.device) -> Tensor:
    """0 … n − 1 on `device`, made once (a decode step would otherwise launch an arange per MoE layer)."""
    return torch.arange(n, device=device)


def scale_block(inputs: int, scale: Tensor) -> int:
    """Inputs per scale of an expert weight with `inputs` inputs per row, from its scale's last dimension; 0 when it
    fits neither layout."""
    return next((b for b in SCALE_BLOCKS if scale.shape[-1] * b == inputs), 0)


# ------------------------------------------------------------------------------------------- torch references


def _expert_products(x: Tensor, offsets: Tensor, w: Tensor, s: Tensor) -> Tensor:
    """x [P, K] (rows sorted by expert) times each expert's W_eᵀ → [P, O] in x's dtype. Each expert's weight is
    dequantised transiently, one at a time, and the offsets are read on the host: the reference's way, never the
    Triton path's."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    bounds = offsets.tolist()
    block = scale_block(x.shape[1], s)
    for e, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi > lo:
            out[lo:hi] = F.linear(x[lo:hi], quant.fp4_dequant_ue8m0(w[e], s[e], block, x.dtype))
    return out


def moe_gate_up_torch(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """The reference: FP8 rows and FP4 experts dequantised in promote(out_dtype, fp32), F.linear per expert."""
    compute = torch.promote_types(out_dtype, torch.float32)
    x = quant.fp8_dequant(x_data, x_scale, X_BLOCK, compute)[order // weights.shape[1]]
    gate, up = _expert_products(x, offsets, w13, s13).chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return (h * weights.flatten()[order].float().to(compute)[:, None]).to(out_dtype)  # fp32 weights, as the kernel


def moe_gate_up_cast_torch(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    h = moe_gate_up_torch(x_data, x_scale, order, offsets, weights, w13, s13, limit, out_dtype)
    return quantize_swa_fp8_torch(h)


def moe_down_torch(
    h_data: Tensor,
    h_scale: Tensor,
    offsets: Tensor,
    w2: Tensor,
    s2: Tensor,
    out_dtype: torch.dtype,
    order: Tensor | None = None,
) -> Tensor:
    compute = torch.promote_types(out_dtype, torch.float32)
    h = quant.fp8_dequant(h_data, h_scale, X_BLOCK, compute)
    out = _expert_products(h, offsets, w2, s2).to(out_dtype)
    if order is None:
        return out
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted


# ------------------------------------------------------------------------------------------- Triton


@triton.jit
def _pair_rows(order_ptr, p, ok, SLOTS: tl.constexpr):
    """The activation row (int64) of each sorted pair p: order[p] // SLOTS (its token), or p itself when SLOTS is 0
    (the rows are the pairs already)."""
    if SLOTS:
        return tl.load(order_ptr + p, mask=ok, other=0) // SLOTS
    return p.to(tl.int64)


@triton.jit
def _decode_rows_kernel(x_ptr, xs_ptr, order_ptr, out_ptr, P, K: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
                        SLOTS: tl.constexpr, WORDS: tl.constexpr, HW: tl.constexpr, PDL: tl.constexpr,
                        EARLY: tl.constexpr):  # fmt: skip
    """FP8 rows (order_ptr[p] // SLOTS if SLOTS, else p) → out [P, K] bf16 with their scales folded in (exact), the
    inputs in the order [even | odd] (out[p, i] = x[2i], out[p, K/2 + i] = x[2i + 1]): the packed weights' nibble
    order."""
    follow(PDL, EARLY)
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    k0 = tl.program_id(1) * BK
    p_ok = p < P
    rows = _pair_rows(order_ptr, p, p_ok, SLOTS)
    k = k0 + tl.arange(0, BK)
    bits = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=p_ok[:, None] & (k < K)[None, :], other=0)
    scale = ue8m0_block_scales(xs_ptr, rows, p_ok, k0 // _X_BLOCK, K // _X_BLOCK, BK // _X_BLOCK, WORDS)
    even, odd = tl.split(tl.reshape(e4m3_scaled(bits, scale, HW).to(tl.bfloat16), (BP, BK // 2, 2)))
    half = k0 // 2 + tl.arange(0, BK // 2)
    out = out_ptr + p[:, None].to(tl.int64) * K + half[None, :]
    ok = p_ok[:, None] & (half < K // 2)[None, :]
    tl.store(out, even, mask=ok)
    tl.store(out + K // 2, odd, mask=ok)


@triton.jit
def _packed_weights(w_ptr, rows, ok, k0, K: tl.constexpr, BK: tl.constexpr):
    """Rows `rows` of packed E2M1 weights [*, K/2], inputs k0 … k0 + BK − 1 → their bytes [rows, BK/2] (0 past K)."""
    half = k0 // 2 + tl.arange(0, BK // 2)
    return tl.load(w_ptr + rows[:, None] * (K // 2) + half[None, :], mask=ok[:, None] & (half < K // 2)[None, :],
                   other=0)  # fmt: skip


@triton.jit
def _weight_halves(w_ptr, ws_ptr, rows, ok, k0, K: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
                   WORDS: tl.constexpr, HW: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Rows `rows` of packed E2M1 weights [*, K/2] (UE8M0 per SB inputs), inputs k0 … k0 + BK − 1 → the values of
    the even inputs [rows, BK/2] (the low nibbles) and of the odd ones (the high nibbles), scaled, exactly, as dot
    operands (bf16; fp32 in the interpreter)."""
    R: tl.constexpr = rows.shape[0]
    packed = _packed_weights(w_ptr, rows, ok, k0, K, BK)
    scale = ue8m0_block_scales(ws_ptr, rows, ok, k0 // SB, K // SB, BK // SB, WORDS)
    scale = (scale.to(tl.bfloat16) if PTX else scale)[:, :, None]  # per byte: [R, BK/SB, SB/2]
    low, high = e2m1_scaled(tl.reshape(packed, (R, BK // SB, SB // 2)), scale, PTX)
    operand = tl.bfloat16 if HW else tl.float32
    return tl.reshape(low, (R, BK // 2)).to(operand), tl.reshape(high, (R, BK // 2)).to(operand)


@triton.jit
def _activation_halves(x_ptr, p, ok, k0, K: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
    """The decoded rows p of x [*, K] ([even | odd], bf16), inputs k0 … k0 + BK − 1 → their even and odd inputs
    [p, BK/2] each, transposed for the dot (fp32 in the interpreter)."""
    half = k0 // 2 + tl.arange(0, BK // 2)
    ptr = x_ptr + p[:, None].to(tl.int64) * K + half[None, :]
    ok = ok[:, None] & (half < K // 2)[None, :]
    even, odd = tl.load(ptr, mask=ok, other=0.0), tl.load(ptr + K // 2, mask=ok, other=0.0)
    if not HW:
        even, odd = even.to(tl.float32), odd.to(tl.float32)
    return tl.trans(even), tl.trans(odd)


@triton.jit
def _project(acc, w_ptr, ws_ptr, rows, ok, x_even, x_odd, k0, K: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
             WORDS: tl.constexpr, HW: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """acc [BN, BM] plus one K tile of W_rows · x: the even inputs' dot, then the odd ones'."""
    low, high = _weight_halves(w_ptr, ws_ptr, rows, ok, k0, K, SB, BK, WORDS, HW, PTX)
    return tl.dot(high, x_odd, tl.dot(low, x_even, acc))


@triton.jit
def _operand(codes, FP8_DOT: tl.constexpr):
    """E4M3 codes (uint8) as a dot operand: FP8 as they are, or decoded to fp32."""
    return codes.to(tl.float8e4nv, bitcast=True) if FP8_DOT else e4m3_decode(codes)


@triton.jit
def _weight_codes(w_ptr, rows, ok, k0, K: tl.constexpr, FP8_DOT: tl.constexpr, PTX: tl.constexpr):
    """Rows of packed E2M1 weights [*, K/2], inputs k0 … k0 + 31 → [rows, 32] in input order, each code widened to
    the E4M3 byte of its value × 2⁻⁶ (`formats.e2m1_as_e4m3`)."""
    R: tl.constexpr = rows.shape[0]
    even, odd = e2m1_as_e4m3(_packed_weights(w_ptr, rows, ok, k0, K, 32), PTX)
    return _operand(tl.reshape(tl.join(even, odd), (R, 32)), FP8_DOT)


@triton.jit
def _activation_codes(x_ptr, rows, ok, k0, K: tl.constexpr, FP8_DOT: tl.constexpr):
    """FP8 rows of x [*, K], inputs k0 … k0 + 31 → [32, rows], transposed for the dot."""
    k = k0 + tl.arange(0, 32)
    codes = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0)
    return tl.trans(_operand(codes, FP8_DOT))


@triton.jit
def _chunked_projection(
    acc, w_ptr, ws_ptr, w_rows, n_ok, x_ptr, xs_ptr, x_rows, p_ok, tile,
    K: tl.constexpr, BK: tl.constexpr, W_WORDS: tl.constexpr, X_WORDS: tl.constexpr, FP8_DOT: tl.constexpr,
    PTX: tl.constexpr,
):  # fmt: skip
    """acc [BN, BM] plus K tile `tile` of W_rows · x: one code dot per 32-input chunk, rescaled by the chunk's two
    scale vectors (the weight codes' 2⁻⁶ is taken back once, at the end of the K loop)."""
    CHUNKS: tl.constexpr = BK // 32
    w_scales = _chunk_scales(ws_ptr, w_rows, n_ok, tile, K // 32, CHUNKS, W_WORDS)
    x_scales = _chunk_scales(xs_ptr, x_rows, p_ok, tile, K // 32, CHUNKS, X_WORDS)
    for c in tl.static_range(CHUNKS):
        k0 = tile * BK + c * 32
        dot = tl.dot(_weight_codes(w_ptr, w_rows, n_ok, k0, K, FP8_DOT, PTX),
                     _activation_codes(x_ptr, x_rows, p_ok, k0, K, FP8_DOT))  # fmt: skip
        acc += dot * (w_scales[c][:, None] * x_scales[c][None, :])
    return acc


@triton.jit
def _cast_columns(h, ROUND: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """Output tile hᵀ [BN columns, BM pairs] (fp32), rounded to the float dtype ROUND first (as it would be stored),
    cast as `quantize_swa_fp8` casts each pair's 32-column groups → (E4M3 codes [BN, BM], UE8M0 bytes [BN/32, BM])."""
    h = h.to(ROUND).to(tl.float32)
    groups = tl.reshape(h, (BN // 32, 32, BM))
    scale, byte = block_scale(tl.max(abs_bits(groups), axis=1).to(tl.float32, bitcast=True), FP8_UE8M0)
    return tl.reshape(e4m3_encode(groups * (1.0 / scale[:, None, :])), (BN, BM)), byte  # 1/2^k is exact


@triton.jit
def _moe_kernel(
    x_ptr, xs_ptr, order_ptr, offsets_ptr, pw_ptr, w_ptr, ws_ptr, out_ptr, os_ptr, n_out, limit, n_experts,
    K: tl.constexpr, SB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, COMPACT: tl.constexpr, E_BLOCK: tl.constexpr, W_WORDS: tl.constexpr, HW: tl.constexpr,
    PTX: tl.constexpr, CHUNKED: tl.constexpr, FP8_DOT: tl.constexpr, SLOTS: tl.constexpr, X_WORDS: tl.constexpr,
    SCATTER: tl.constexpr, CAST: tl.constexpr, ROUND: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Output columns n of expert e's pairs. x: the pairs' decoded activations [P, K] (`_decode_rows_kernel`), or
    with CHUNKED the FP8 activations themselves (E4M3 bytes, UE8M0 scales xs per 32 inputs; pair p's row
    order_ptr[p] // SLOTS if SLOTS, else p). GATED (gate_up): weight rows n (W1) and n_out + n (W3) of the expert's
    2·n_out, SwiGLU and the routing weight pw_ptr[order_ptr[p]] on the way out; otherwise (down) the weight has n_out
    rows per expert, and with SCATTER pair p's output goes to row order_ptr[p] (the (token, slot) order). CAST: the
    output stored as FP8 bytes, its UE8M0 scales per 32 columns to os_ptr [P, n_out/32] (`_cast_columns`). The program's
    expert is program_id(1), or with COMPACT (one column per pair) that of sorted pair j = program_id(1) — the number
    of experts whose pairs all precede j, counted over the E_BLOCK ≥ n_experts offsets —, worked only if j is its
    first pair."""
    follow(PDL, EARLY)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    if COMPACT:
        j = tl.program_id(1)
        experts = tl.arange(0, E_BLOCK)
        ends = tl.load(offsets_ptr + 1 + experts, mask=experts < n_experts, other=j + 1)
        e = tl.sum((ends <= j).to(tl.int32))
    else:
        e = tl.program_id(1)
    n_ok = n < n_out
    w_rows = e.to(tl.int64) * (2 * n_out if GATED else n_out) + n
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    if COMPACT:
        hi = tl.where(lo == j, hi, lo)  # another column works this expert
    for start in range(lo, hi, BM):
        p = start + tl.arange(0, BM)
        p_ok = p < hi
        acc = tl.zeros((BN, BM), dtype=tl.float32)  # outputᵀ: the weight rows are the dot's M side
        acc_up = tl.zeros((BN, BM), dtype=tl.float32)
        if CHUNKED:
            x_rows = _pair_rows(order_ptr, p, p_ok, SLOTS)
            for tile in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
                acc = _chunked_projection(acc, w_ptr, ws_ptr, w_rows, n_ok, x_ptr, xs_ptr, x_rows, p_ok, tile, K, BK,
                                          W_WORDS, X_WORDS, FP8_DOT, PTX)  # fmt: skip
                if GATED:
                    acc_up = _chunked_projection(acc_up, w_ptr, ws_ptr, w_rows + n_out, n_ok, x_ptr, xs_ptr, x_rows,
                                                 p_ok, tile, K, BK, W_WORDS, X_WORDS, FP8_DOT, PTX)  # fmt: skip
            acc, acc_up = acc * 64.0, acc_up * 64.0  # the weight codes' 2⁻⁶
        else:
            for k0 in tl.range(0, K, BK, num_stages=STAGES):
                x_even, x_odd = _activation_halves(x_ptr, p, p_ok, k0, K, BK, HW)
                acc = _project(acc, w_ptr, ws_ptr, w_rows, n_ok, x_even, x_odd, k0, K, SB, BK, W_WORDS, HW, PTX)
                if GATED:
                    acc_up = _project(acc_up, w_ptr, ws_ptr, w_rows + n_out, n_ok, x_even, x_odd, k0, K, SB, BK,
                                      W_WORDS, HW, PTX)  # fmt: skip
        if GATED:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            weight = tl.load(pw_ptr + tl.load(order_ptr + p, mask=p_ok, other=0), mask=p_ok, other=0.0)
            acc = gate * tl.sigmoid(gate) * up * weight[None, :]
        dest = tl.load(order_ptr + p, mask=p_ok, other=0) if SCATTER else p.to(tl.int64)
        out = out_ptr + dest[None, :] * n_out + n[:, None]
        if CAST:
            codes, byte = _cast_columns(acc, ROUND, BN, BM)
            tl.store(out, codes, mask=p_ok[None, :] & n_ok[:, None])
            groups = tl.program_id(0) * (BN // 32) + tl.arange(0, BN // 32)
            at = os_ptr + dest[None, :] * (n_out // 32) + groups[:, None]
            tl.store(at, byte, mask=p_ok[None, :] & (groups < n_out // 32)[:, None])
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[None, :] & n_ok[:, None])


def _block_m(pairs: int, experts: int) -> int:
    """Pairs per tile from the average per expert (no sync), rounded up to a power of two: a busier expert takes a
    second pass over its weight rows (from the L2), and a tile twice the average costs more in masked rows than the
    passes it saves (H200: 48 experts × 256 tokens, 1.45 ms at 64 against 0.72 at 32). At top-6: 48 experts, 64
    tokens → 16, 256 tokens → 32; 384 experts → 16."""
    return min(max(16, triton.next_power_of_2(triton.cdiv(pairs, max(experts, 1)))), 64)


def decoded_rows(x_data: Tensor, x_scale: Tensor, order: Tensor | None, slots: int = 0) -> Tensor:
    """FP8 rows x_data[order // slots] (all of them when order is None) → bf16 [P, K] with their scales folded in,
    exactly, the inputs in the order [even | odd] (`_decode_rows_kernel`): the grouped GEMMs' activation operand,
    decoded once instead of in every program's K loop. One launch, no sync."""
    K = x_data.shape[1]
    P = x_data.shape[0] if order is None else order.shape[0]
    out = torch.empty((P, K), dtype=torch.bfloat16, device=x_data.device)
    if P == 0:
        return out
    x_scale = x_scale.contiguous()
    bk = min(DECODE_BLOCK_K, triton.next_power_of_2(K))
    rows = x_data if order is None else order.contiguous()  # (unread without a gather)
    grid = (triton.cdiv(P, DECODE_BLOCK_P), triton.cdiv(K, bk))
    _decode_rows_kernel[grid](
        x_data.contiguous(), x_scale, rows, out, P, K, DECODE_BLOCK_P, bk, 0 if order is None else slots,
        scale_words(x_scale, K // X_BLOCK, bk // X_BLOCK), not interpreting(), num_warps=4,
        **dependent_launch(out.device, grid),
    )  # fmt: skip
    return out


def _grouped(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor | None,
    offsets: Tensor,
    weights: Tensor | None,
    w: Tensor,
    s: Tensor,
    limit: float,
    out_dtype: torch.dtype,
    tuning: MoEGemmTuning,
    cast: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One launch of `_moe_kernel` for both projections (gate_up when the routing weights [N, k] are given: each
    sorted pair's row order // k of x_data and weight weights.flatten()[order]; down: the rows are the pairs, and
    with `order` each output row goes back to its pair's (token, slot) place) over the pairs' FP8 activations:
    decoded first (`decoded_rows`), or read as codes by the chunked dots → (out [P, n_out] in out_dtype, None); with
    `cast`, (FP8 bytes [P, n_out], UE8M0 scales [P, n_out/32]) of that output, cast in the kernel when a program's
    columns are whole groups of 32, else by the cast kernel after it."""
    gated = weights is not None
    slots = weights.shape[1] if weights is not None else 0
    E, rows, K = w.shape[0], w.shape[1], 2 * w.shape[2]
    P = x_data.shape[0] if order is None else order.shape[0]
    n_out = rows // 2 if gated else rows
    t = tuning.resolved(P, E)
    block_n = t.block_n // 2 if gated else t.block_n  # output columns
    few = P // max(slots, 1) < FOLDED_FROM  # tokens: where the FP8 linears cast their own inputs too
    in_kernel = cast and block_n % X_BLOCK == 0 and (few if t.cast is None else t.cast)
    out = torch.empty((P, n_out), dtype=torch.uint8 if in_kernel else out_dtype, device=x_data.device)
    out_scale = torch.empty((P, n_out // X_BLOCK), dtype=torch.uint8, device=x_data.device) if in_kernel else None
    if P == 0 or n_out == 0:
        return (out, out_scale) if in_kernel or not cast else quantize_triton(out, FP8_UE8M0.value)
    sb = scale_block(K, s)
    check_tile_sides(block_m=(t.block_m, 16), block_n=(t.block_n, 32 if gated else 16), block_k=(t.block_k, 32))
    if t.ptx and interpreting():
        raise ValueError("tuning.ptx: the interpreter runs no inline PTX")
    chunked = t.dot != "bf16"
    if t.dot not in ("bf16", "fp8", "fp32") or (chunked and sb != X_BLOCK):
        raise ValueError(f"tuning.dot: 'bf16', or 'fp8' / 'fp32' with scales per 32 inputs; got {t.dot!r} (per {sb})")
    if t.dot == "fp8" and interpreting():
        raise ValueError("tuning.dot: the interpreter has no FP8 dot (it decodes to fp32)")
    s, x_scale = s.contiguous(), x_scale.contiguous()
    x = x_data.contiguous() if chunked else decoded_rows(x_data, x_scale, order if gated else None, slots)
    order_arg = offsets if order is None else order.contiguous()  # (unread without a gather)
    weight_arg = weights.float().contiguous() if gated else offsets  # (unread when not gated)
    compact = P < E  # one program column per pair: at 1 token, 6 over 384 experts instead of 384 (nearly all empty)
    grid = (triton.cdiv(n_out, block_n), P if compact else E)
    _moe_kernel[grid](
        x, x_scale, order_arg, offsets.contiguous(), weight_arg, w.contiguous(), s, out,
        out if out_scale is None else out_scale, n_out, float(limit), E, K, sb,
        t.block_m, block_n, t.block_k, t.num_stages, gated, compact, triton.next_power_of_2(E),
        scale_words(s, K // sb, t.block_k // sb), not interpreting(), t.ptx, chunked, t.dot == "fp8",
        slots if chunked else 0, scale_words(x_scale, K // X_BLOCK, t.block_k // X_BLOCK),
        not gated and order is not None, in_kernel, _TRITON_FLOATS[out_dtype], num_warps=t.num_warps,
        **dependent_launch(out.device, grid),
    )  # fmt: skip
    if cast and not in_kernel:
        return quantize_triton(out, FP8_UE8M0.value)
    return out, out_scale


def moe_gate_up_triton(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
    tuning: MoEGemmTuning = MoEGemmTuning(),
) -> Tensor:
    return _grouped(x_data, x_scale, order, offsets, weights, w13, s13, limit, out_dtype, tuning)[0]


def moe_gate_up_cast_triton(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
    tuning: MoEGemmTuning = MoEGemmTuning(),
) -> tuple[Tensor, Tensor]:
    data, scale = _grouped(x_data, x_scale, order, offsets, weights, w13, s13, limit, out_dtype, tuning, cast=True)
    assert scale is not None
    return data, scale


def moe_down_triton(
    h_data: Tensor,
    h_scale: Tensor,
    offsets: Tensor,
    w2: Tensor,
    s2: Tensor,
    out_dtype: torch.dtype,
    order: Tensor | None = None,
    tuning: MoEGemmTuning = MoEGemmTuning(),
) -> Tensor:
    return _grouped(h_data, h_scale, order, offsets, None, w2, s2, 0.0, out_dtype, tuning)[0]
