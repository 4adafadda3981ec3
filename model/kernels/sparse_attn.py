"""Sparse decode attention over [FP8 SWA window ‖ selected FP4 compressed entries] (model-architecture.md §1.2, §2.3).

One softmax per (query, head) over its window's keys and the selected entries, with the head's sink logit in the
denominator only: o = Σ_i exp(s_i) v_i / (Σ_j exp(s_j) + exp(sink_h)), s = scale · q·k. K = V = the shared
dequantised latent. Given `rope` (positions, inverse frequencies), q arrives before RoPE and the output leaves after
RoPE⁻¹, both applied in the same launch, bit for bit as `rope_rotate` would apply them to q and to the output;
without it q is rotated already and the output is before the inverse RoPE. A query's window keys are slots of its
row's FP8 keys — [the committed ring ‖ this step's new ones], read from each where they lie, never concatenated —
named by `swa_idx`, oldest position first, −1 where a position has no key: every query meets its keys in the order
of their positions, whichever step wrote them, so a verify pass sums a position's attention as the plain step of
that position does.

Triton (flash-decoding): a program takes one query, all its heads (BLOCK_H, up to 64: V4.1-Flash's 64 heads in one
pass, so each selected entry is read and dequantised once per query) and a contiguous run of key tiles (ring tiles
first, then tiles of selected entries). Each key tile is dequantised in registers (FP8 × UE8M0, or E2M1 × E4M3:
both exact in bf16), serves as K for q·Kᵀ and as V for P·V, and feeds an online softmax in base 2. With one split
the program also folds in the sink and writes the output; with several, a combine kernel merges the partial
(max, sum, accumulator) triples and the sink. Splits follow the number of queries; under batch invariance
(model.kernels.invariance) they follow the layer's shape alone (`_invariant_splits`), so a query's keys meet the same
splits, merged in the same order, in every batch, plain step and verify pass. RoPE in the kernel: a program loads its
query's rotary dims twice, as they are and as their pair partners, rotates them in fp32, rounds them to q's dtype
(`rope.rope_pairs`, the RoPE kernel's arithmetic) into a scratch copy and loads its q tile from [q ‖ copy]
(`_rotate_queries`); the program that writes a query's output then reads its rotary dims back the same way and
rotates them in place (`_unrotate`): the roundings of the separate RoPE launches, without the launches.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import (
    dense_rows,
    e2m1_decode,
    e4m3_decode,
    interpreting,
    multiprocessors,
    ue8m0_decode,
    unit_stride,
)
from model.kernels.invariance import batch_invariant
from model.kernels.kv_quant import dequantize_kv_fp4_torch, dequantize_swa_fp8_torch
from model.kernels.launch import dependent_launch, follow
from model.kernels.rope import rope_arguments, rope_pairs, rope_rotate_torch

LOG2E = math.log2(math.e)


def gather_entries(kv_data: Tensor, kv_scale: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Rows idx [B, T, K] (−1 → row 0, masked later) of [B, N, ...] → [B, T, K, ...]."""
    if kv_data.shape[1] == 0:  # nothing stored yet, so every slot is −1: gather from one zero row instead
        kv_data, kv_scale = (t.new_zeros(t.shape[0], 1, t.shape[2]) for t in (kv_data, kv_scale))
    rows = idx.clamp(min=0).long()
    batch = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    return kv_data[batch, rows], kv_scale[batch, rows]


def sparse_attention_torch(
    q: Tensor,
    swa_data: Tensor,
    swa_scale: Tensor,
    new_data: Tensor,
    new_scale: Tensor,
    swa_idx: Tensor,
    kv_data: Tensor,
    kv_scale: Tensor,
    idx: Tensor,
    sink: Tensor,
    softmax_scale: float,
    rope: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    q = _rotated_queries(q, rope)
    swa_data, swa_scale = torch.cat((swa_data, new_data), 1), torch.cat((swa_scale, new_scale), 1)
    # fp32, or fp64 for a float64 q: the exactness tests compare this with the dense fp64 attention, and an fp32
    # rounding here moves FP8 codes downstream (the QAT cast of the output projection's input)
    compute = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(compute)
    ring = dequantize_swa_fp8_torch(swa_data, swa_scale, compute)  # [B, S, D]: each slot once, not per query
    entries = dequantize_kv_fp4_torch(*gather_entries(kv_data, kv_scale, idx), compute)  # [B, T, K, D]
    slots = swa_idx.clamp(min=0).long()
    s_ring = torch.einsum("bthd,bsd->bths", qf, ring).gather(3, slots[:, :, None].expand(-1, -1, q.shape[2], -1))
    s_ring = s_ring.masked_fill(swa_idx[:, :, None, :] < 0, float("-inf"))
    s_sel = torch.einsum("bthd,btkd->bthk", qf, entries).masked_fill(idx[:, :, None, :] < 0, float("-inf"))
    logits = torch.cat((s_ring, s_sel), dim=-1) * softmax_scale
    sink_logit = sink.to(compute)[None, None, :, None]
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_logit)
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink_logit - m)
    Wn = swa_idx.shape[2]
    p_slots = torch.zeros_like(s_ring[..., :1]).expand(*s_ring.shape[:3], ring.shape[1]).contiguous()
    p_slots.scatter_add_(3, slots[:, :, None].expand(-1, -1, q.shape[2], -1), p[..., :Wn])  # a −1 key's p is 0
    out = torch.einsum("bths,bsd->bthd", p_slots, ring) + torch.einsum("bthk,btkd->bthd", p[..., Wn:], entries)
    out = (out / denom).to(q.dtype)
    return out if rope is None else rope_rotate_torch(out, *rope, inverse=True)


def _rotated_queries(q: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    return q if rope is None else rope_rotate_torch(q, *rope, inverse=False)


@triton.jit
def _fp8_rows(data_ptr, scale_ptr, row, ok, d, D: tl.constexpr):
    """FP8 key rows `row` (E4M3 bytes, UE8M0 per 32) where `ok` [rows, DP], zero bytes elsewhere."""
    fp8 = tl.load(data_ptr + row[:, None] * D + d[None, :], mask=ok, other=0)
    return fp8, tl.load(scale_ptr + row[:, None] * (D // 32) + d[None, :] // 32, mask=ok, other=0)


@triton.jit
def _ring_tile(
    swa_ptr, swas_ptr, new_ptr, news_ptr, sidx_ptr, b, bt, R, TN, W, tile,
    BLOCK_N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    """Window keys of one key tile, the query's swa_idx slots of [its row's R ring slots ‖ the step's TN new keys]
    → (latents [BLOCK_N, DP] fp32, valid [BLOCK_N])."""
    w = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DP)
    slot = tl.load(sidx_ptr + bt * W + w, mask=w < W, other=-1)
    valid, fresh = slot >= 0, slot >= R
    in_d = d[None, :] < D
    ring, ring_scale = _fp8_rows(swa_ptr, swas_ptr, b * R + slot, (valid & ~fresh)[:, None] & in_d, d, D)
    new, new_scale = _fp8_rows(new_ptr, news_ptr, b * TN + slot - R, fresh[:, None] & in_d, d, D)
    return e4m3_decode(ring | new) * ue8m0_decode(ring_scale | new_scale), valid  # one of each pair is zero


@triton.jit
def _entry_tile(
    kv_ptr, kvs_ptr, idx_ptr, b, bt, kv_stride, kvs_stride, K, tile,
    BLOCK_N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    """Selected compressed entries of one key tile → (latents [BLOCK_N, DP] fp32, valid [BLOCK_N])."""
    e = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    entry = tl.load(idx_ptr + bt * K + e, mask=e < K, other=-1)
    valid = entry >= 0
    entry = tl.maximum(entry, 0)
    half = tl.arange(0, DP // 2)
    ok_half = valid[:, None] & (half[None, :] < D // 2)
    packed = tl.load(kv_ptr + b * kv_stride + entry[:, None] * (D // 2) + half[None, :], mask=ok_half, other=0)
    codes = tl.reshape(tl.join(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4)), (BLOCK_N, DP))
    d = tl.arange(0, DP)
    ok = valid[:, None] & (d[None, :] < D)
    scale = tl.load(kvs_ptr + b * kvs_stride + entry[:, None] * (D // 16) + d[None, :] // 16, mask=ok, other=0x38)
    return codes * e4m3_decode(scale), valid


@triton.jit
def _rotate_queries(q_ptr, rq_ptr, rows, rq_rows, h_ok, pos, freq_ptr, D: tl.constexpr, RD: tl.constexpr):
    """The last RD dims of q rows `rows` (element offsets) rotated, in q's dtype, to rows `rq_rows` of rq [*, RD];
    the barrier makes them visible to the program's threads. The q tile the key loop holds is then a plain load,
    laid out as it is without RoPE. The splits of a query write the same values."""
    d = (D - RD) + tl.arange(0, RD)
    rotated = rope_pairs(q_ptr, rows, h_ok[:, None], d, pos, freq_ptr, D, RD, False)
    at = rq_ptr + rq_rows[:, None] + (d - (D - RD))[None, :]
    tl.store(at, rotated.to(rq_ptr.dtype.element_ty), mask=h_ok[:, None])
    tl.debug_barrier()


@triton.jit
def _unrotate(out_ptr, rows, h_ok, pos_ptr, freq_ptr, bt, D: tl.constexpr, RD: tl.constexpr):
    """RoPE⁻¹ in place on the last RD dims of the output rows `rows` [BLOCK_H] (element offsets) of query bt, from
    the stored values. The barriers: the program's stores are visible before it reads them back, and every pair
    partner is read before any is overwritten."""
    d = (D - RD) + tl.arange(0, RD)
    tl.debug_barrier()
    rotated = rope_pairs(out_ptr, rows, h_ok[:, None], d, tl.load(pos_ptr + bt), freq_ptr, D, RD, True)
    tl.debug_barrier()
    tl.store(out_ptr + rows[:, None] + d[None, :], rotated.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit(do_not_specialize=["T"])  # one binary for every query count (model.kernels.invariance)
def _sparse_attention_kernel(
    q_ptr, swa_ptr, swas_ptr, new_ptr, news_ptr, sidx_ptr, kv_ptr, kvs_ptr, idx_ptr, sink_ptr, out_ptr, po_ptr,
    pm_ptr, pl_ptr, pos_ptr, freq_ptr, rq_ptr, T, H, R, TN, W, q_stride, q_head_stride, kv_stride, kvs_stride, K,
    qk_scale, tiles_per_split,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr, RD: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Query bt = program 0, heads BLOCK_H · program 1 …, key-tile split program 2; q's rows q_stride apart, its
    heads q_head_stride (the output dense); RD > 0: q's last RD dims read rotated at pos_ptr[bt] × freq_ptr (fp64)
    from their copy rq_ptr [B·T·H, RD] (`_rotate_queries`), the output's rotated back once written."""
    follow(PDL, EARLY)
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    d = tl.arange(0, DP)
    h_ok = h < H
    q_rows = bt * q_stride + h * q_head_stride
    q_at = q_ptr + q_rows[:, None] + d[None, :]
    if RD > 0:  # the rotary dims from their rotated copy
        rq_rows = (bt * H + h) * RD
        _rotate_queries(q_ptr, rq_ptr, q_rows, rq_rows, h_ok, tl.load(pos_ptr + bt), freq_ptr, D, RD)
        q_at = tl.where(d[None, :] < D - RD, q_at, rq_ptr + rq_rows[:, None] + (d - (D - RD))[None, :])
    q = tl.load(q_at, mask=h_ok[:, None] & (d[None, :] < D), other=0.0)
    q = q.to(tl.float32 if DOT_F32 else tl.bfloat16)  # exact for a bf16 q; the scale is applied in fp32 below
    ring_tiles = tl.cdiv(W, BLOCK_N)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, ring_tiles + tl.cdiv(K, BLOCK_N))
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DP), tl.float32)
    for tile in range(first, last):
        if tile < ring_tiles:
            kv, valid = _ring_tile(
                swa_ptr, swas_ptr, new_ptr, news_ptr, sidx_ptr, b, bt, R, TN, W, tile, BLOCK_N, D, DP
            )
        else:
            kv, valid = _entry_tile(
                kv_ptr, kvs_ptr, idx_ptr, b, bt, kv_stride, kvs_stride, K, tile - ring_tiles, BLOCK_N, D, DP
            )
        kv = kv.to(tl.float32 if DOT_F32 else tl.bfloat16)  # exact: ≤ 6 significant bits
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv)) * qk_scale, float("-inf"))  # log2 units: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp2 away from −inf − −inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new
    if SPLITS == 1:
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        denom = l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f)
        out = acc * (tl.exp2(m_i - m_f) / denom)[:, None]
        out_ptrs = out_ptr + (bt * H + h[:, None]) * D + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (d[None, :] < D))
        if RD > 0:
            _unrotate(out_ptr, (bt * H + h) * D, h_ok, pos_ptr, freq_ptr, bt, D, RD)
    else:
        part = (bt * SPLITS + split) * H + h
        tl.store(pm_ptr + part, m_i, mask=h_ok)
        tl.store(pl_ptr + part, l_i, mask=h_ok)
        tl.store(po_ptr + part[:, None] * DP + d[None, :], acc, mask=h_ok[:, None])


@triton.jit
def _combine_kernel(
    sink_ptr, po_ptr, pm_ptr, pl_ptr, out_ptr, pos_ptr, freq_ptr, H,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr, RD: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, DP)
    m_f = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    sink = m_f
    for split in range(SPLITS):
        m_f = tl.maximum(m_f, tl.load(pm_ptr + (bt * SPLITS + split) * H + h, mask=h_ok, other=float("-inf")))
    denom = tl.exp2(sink - m_f)
    acc = tl.zeros((BLOCK_H, DP), tl.float32)
    for split in range(SPLITS):
        part = (bt * SPLITS + split) * H + h
        weight = tl.exp2(tl.load(pm_ptr + part, mask=h_ok, other=float("-inf")) - m_f)
        denom += tl.load(pl_ptr + part, mask=h_ok, other=0.0) * weight
        acc += tl.load(po_ptr + part[:, None] * DP + d[None, :], mask=h_ok[:, None], other=0.0) * weight[:, None]
    out_ptrs = out_ptr + (bt * H + h[:, None]) * D + d[None, :]
    tl.store(out_ptrs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (d[None, :] < D))
    if RD > 0:
        _unrotate(out_ptr, (bt * H + h) * D, h_ok, pos_ptr, freq_ptr, bt, D, RD)


_MAX_HEADS = 64  # heads per program: a [64, 512] fp32 accumulator is 128 registers a thread at 8 warps
_COMBINE_HEADS = 16  # heads per combine program: [16, 512] fp32 partial sums are 64 registers a thread at 4 warps


def _invariant_splits(tiles: int, block_n: int, H: int, D: int, DP: int) -> int:
    """Key-range splits of every query under batch invariance, from the layer's shape alone: as many as keep the
    partials' traffic (H·DP fp32 a split, written and read back) within the bytes of the keys they summarise (block_n
    keys of ≥ D/2 bytes a tile), at most one a tile. A batch-1 step then spreads a query over several programs where
    heads are few: the demo checkpoint's 4 heads over 18 tiles take 18 programs instead of one, `small`'s 8 heads of
    512 over 4 tiles take 2, V4.1-Flash's 64 heads one (as without invariance at large batches)."""
    return max(1, min(tiles, tiles * block_n * D // (16 * H * DP)))


def _splits(programs: int, tiles: int) -> int:
    """Key-range splits per (query, head group): as many as keep every program in one wave, one per multiprocessor
    (a 64-head program holds 128 accumulator registers a thread): at B=64 (64 K context) 2 splits take 0.085 ms on
    the H200, 5 (two programs per multiprocessor) 0.120–0.127."""
    return max(1, min(tiles, multiprocessors() // programs))


def sparse_attention_triton(
    q: Tensor,
    swa_data: Tensor,
    swa_scale: Tensor,
    new_data: Tensor,
    new_scale: Tensor,
    swa_idx: Tensor,
    kv_data: Tensor,
    kv_scale: Tensor,
    idx: Tensor,
    sink: Tensor,
    softmax_scale: float,
    rope: tuple[Tensor, Tensor] | None = None,
    splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int = 8,
) -> Tensor:
    """`splits` (key-range splits; tests use it to reach both output paths), `block_n` (keys per tile), `block_h`
    (heads per program) and `num_warps` override the launch shape (bench/kernels.py tunes them).

    Default: every head of a query in one program (up to 64) over 64-key tiles, `_splits` splits, so that each
    gathered entry is dequantised once per query: B=64 takes 0.084 ms on the H200 against 0.145–0.167 with 16 heads
    per program (64 heads × 512 latent, 128 ring slots + 512 entries). B=1 is the exception (10 programs on 132 SMs,
    each carrying all 64 heads of its key range: 0.022 ms against 0.015; docs/kernels.md)."""
    B, T, H, D = q.shape
    R, TN, W, K = swa_data.shape[1], new_data.shape[1], swa_idx.shape[2], idx.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    q3 = unit_stride(q.reshape(B * T, H, D))
    DP = triton.next_power_of_2(D)
    block_n = block_n or (16 if interpreting() else 64)
    block_h = block_h or min(_MAX_HEADS, triton.next_power_of_2(H))
    head_groups = triton.cdiv(H, block_h)
    tiles = max(1, triton.cdiv(W, block_n) + triton.cdiv(K, block_n))
    by_shape = batch_invariant()  # never by the number of queries
    default = _invariant_splits(tiles, block_n, H, D, DP) if by_shape else _splits(B * T * head_groups, tiles)
    n_splits = max(1, min(splits or default, tiles))
    tiles_per_split = triton.cdiv(tiles, n_splits)
    n_splits = triton.cdiv(tiles, tiles_per_split)
    partial_o = torch.empty((B * T, n_splits, H, DP) if n_splits > 1 else (0,), device=q.device)
    partial_m = torch.empty((B * T, n_splits, H) if n_splits > 1 else (0,), device=q.device)
    partial_l = torch.empty_like(partial_m)
    args = (q3, swa_data.contiguous(), swa_scale.contiguous(), new_data.contiguous(),
            new_scale.contiguous(), swa_idx.to(torch.int32).contiguous())  # fmt: skip
    kv_data, kv_scale = dense_rows(kv_data), dense_rows(kv_scale)  # the cache's [:, :n] views, never copied
    args += (kv_data, kv_scale, idx.to(torch.int32).contiguous(), sink.contiguous())
    pos, freq, rd = rope_arguments(rope, q.shape[:2], q.device)
    rotated_q = q.new_empty(B * T * H * rd)
    grid = (B * T, head_groups, n_splits)
    _sparse_attention_kernel[grid](
        *args, out, partial_o, partial_m, partial_l, pos, freq, rotated_q, T, H, R, TN, W, q3.stride(0), q3.stride(1),
        kv_data.stride(0), kv_scale.stride(0), K, softmax_scale * LOG2E, tiles_per_split,
        D, DP, block_h, block_n, n_splits, interpreting(), rd, num_warps=num_warps,
        **dependent_launch(out.device, grid),
    )  # fmt: skip
    if n_splits > 1:  # its own head blocks: a [block_h, DP] fp32 accumulator of 64 heads spills at 4 warps
        combine_h = min(block_h, _COMBINE_HEADS)
        grid = (B * T, triton.cdiv(H, combine_h))
        _combine_kernel[grid](
            sink, partial_o, partial_m, partial_l, out, pos, freq, H, D, DP, combine_h, n_splits, rd,
            **dependent_launch(out.device, grid),
        )  # fmt: skip
    return out
