"""Top-k positions of score rows, returned sorted by position and −1 padded (model-architecture.md §2.5, §5.1).

Ties go to the lowest positions, in both backends: the chosen set is then a function of the scores alone, never of
the row length or the batch, so chunked prefill, batching and verification select exactly as one-shot runs do.
The torch reference is a stable descending sort.

Triton: a threshold select in the spirit of DeepSelect, each score read once, on order-preserving uint32 keys.

1. Group maxima (a streaming kernel over every row): the maximum key of each group of GS consecutive positions.
2. Threshold (a kernel, one program per row): T = the k-th largest group maximum. k groups reach T, so the k-th
   largest score is ≥ T; and a score ≥ T lies in a group whose maximum is ≥ T — about k groups on ordinary rows, and
   never more than k·GS scores whatever the row (ties at T aside). The passing groups' ids are listed, ascending.
3. Gather (a kernel, P programs per row): program p reads the p-th slice of that list and appends every score ≥ T
   of its groups, in position order, to its own segment of the row's candidate buffer.
4. Select (a kernel, one program per row): exact radix select among the candidates, the P segments read in order
   (bitwise search for the k-th key; keys equal to it are taken in position order, so ties go to the lowest
   positions), held in registers when they fit. The k-th key lies between T and the row's maximum key, so it has
   every bit those two share: the search starts below them (8 steps instead of 16 on Gaussian bf16 rows of 64 K–1 M
   at k = 512). The candidates are in position order, so the chosen ones are written sorted. A row whose candidates
   overflow a segment (adversarial ties) is selected the same way straight from its scores.

Rows of at most `_TILE` scores skip steps 1–3: the row itself is the candidate set.

Where a row's time went on the H200 with one program doing 2–4 (clock64 stamps, docs/benchmarks.md): the serial
gather 50–80 %, each search 2–5 µs; hence the gather's own kernel with P programs per row, whose loads overlap.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import multiprocessors


def selectable(scores: Tensor, lengths: Tensor | None) -> Tensor:
    """Entries that may be chosen: inside the row's length and above −inf (NaN counts as −inf)."""
    valid = scores > float("-inf")
    if lengths is not None:
        valid &= torch.arange(scores.shape[-1], device=scores.device) < lengths[..., None]
    return valid


def topk_indices_torch(scores: Tensor, k: int, lengths: Tensor | None) -> Tensor:
    rows, length = scores.shape
    # + 0.0 turns −0 into +0: one key for zero, as in the Triton kernel
    masked = torch.where(selectable(scores, lengths), scores.float() + 0.0, float("-inf"))
    picked = min(k, length)
    # A stable sort keeps equal scores in position order, so ties go to the lowest positions whatever the row length
    # (torch.topk leaves that order unspecified, and it does change with the length).
    values, positions = masked.sort(dim=-1, descending=True, stable=True)
    values, positions = values[:, :picked], positions[:, :picked]
    positions = torch.where(values > float("-inf"), positions, length)  # unpickable sorts last
    positions = positions.sort(dim=-1).values
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :picked] = torch.where(positions < length, positions, -1).to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------- Triton

_TILE = 4096  # items the select kernel holds in registers (a short row, or the candidates); the group-max tile
_MAX_GROUPS = 16384  # group maxima per row that the threshold kernel holds in registers at once


@triton.jit
def _order_key(x, valid, LOW_BIT: tl.constexpr):
    """Score → uint32 whose unsigned order is the float order (−0 = +0); 0 marks an entry that cannot be chosen.

    Bits below LOW_BIT are cleared: a bf16/fp16 score widened to fp32 has zeros there, but a negative score's key
    is its inverted bits (ones there), and the radix searches, which stop at LOW_BIT, must see equal scores as equal
    keys for the tie cut to work."""
    x = x.to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)
    key = key >> LOW_BIT << LOW_BIT
    return tl.where(valid & (x > float("-inf")), key, tl.zeros_like(key))


@triton.jit
def _row_length(len_ptr, r, L, HAS_LENGTHS: tl.constexpr):
    if HAS_LENGTHS:
        return tl.maximum(tl.minimum(tl.load(len_ptr + r), L), 0)
    return L


@triton.jit
def _row_keys(x_row, length, start, TILE: tl.constexpr, LOW_BIT: tl.constexpr):
    pos = start + tl.arange(0, TILE)
    x = tl.load(x_row + pos, mask=pos < length, other=float("-inf"))
    return _order_key(x, pos < length, LOW_BIT), pos


@triton.jit
def _kth_largest_key(keys, k, LOW_BIT: tl.constexpr):
    """Bitwise radix search: the largest T with #(keys ≥ T) ≥ k (k ≥ 1), the k-th largest key (bits below LOW_BIT
    are zero in every key)."""
    return _radix_search(keys, k, tl.zeros((), dtype=tl.uint32), tl.full((), 1 << 31, tl.uint32), 32 - LOW_BIT)


@triton.jit
def _radix_search(keys, k, threshold, step, steps):
    """Sets the bits step, step / 2, … (`steps` of them) of threshold, each where ≥ k keys stay at or above it."""
    for _bit in range(steps):
        trial = threshold | step
        threshold = tl.where(tl.sum((keys >= trial).to(tl.int32), axis=0) >= k, trial, threshold)
        step = step >> 1
    return threshold


@triton.jit
def _highest_bit(x):
    """floor(log2(x)) for x ≥ 1, or one more (fp32 may round x up to the next power of two: one harmless extra radix
    step), at most 31; −1 for x = 0."""
    exponent = ((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 255) - 127
    return tl.where(x == 0, -1, tl.minimum(exponent, 31))


@triton.jit
def _shared_prefix(lo, hi, LOW_BIT: tl.constexpr):
    """Where the search for the k-th largest key T, known to lie in [lo, hi], starts: every value in that range has
    the bits where lo and hi agree, so T has them too → (those bits, the first bit to try, how many bits remain)."""
    lo = lo >> LOW_BIT << LOW_BIT  # still ≤ T, whose low bits are zero
    top = _highest_bit(lo ^ hi)
    step = tl.full((), 1, tl.uint32) << tl.maximum(top, 0).to(tl.uint32)
    prefix = lo - (lo & (step - 1))  # lo's bits above `top` (its bit `top` is 0: lo < hi, and they differ there)
    return prefix, step, tl.maximum(top - LOW_BIT + 1, 0)


@triton.jit
def _group_max_kernel(
    x_ptr, len_ptr, gmax_ptr, L, NG, tiles,
    HAS_LENGTHS: tl.constexpr, TILE: tl.constexpr, GS: tl.constexpr, LOW_BIT: tl.constexpr,
):  # fmt: skip
    """gmax[r, g] = max key of positions [g·GS, (g+1)·GS) of row r; one TILE of one row per program."""
    r = (tl.program_id(0) // tiles).to(tl.int64)
    t = tl.program_id(0) % tiles
    key, _pos = _row_keys(x_ptr + r * L, _row_length(len_ptr, r, L, HAS_LENGTHS), t * TILE, TILE, LOW_BIT)
    g = t * (TILE // GS) + tl.arange(0, TILE // GS)
    tl.store(gmax_ptr + r * NG + g, tl.max(tl.reshape(key, (TILE // GS, GS)), axis=1), mask=g < NG)


@triton.jit
def _threshold_kernel(
    gmax_ptr, glist_ptr, thr_ptr, ngroups_ptr, NG, k, NGP: tl.constexpr, LOW_BIT: tl.constexpr,
):  # fmt: skip
    """Row r's candidate threshold T and the ids of the groups that reach it, ascending.

    T = the k-th largest group maximum: k groups hold a score ≥ T, so the k-th largest score is ≥ T, and every
    score ≥ T lies in a group whose maximum is ≥ T — about k of them on ordinary rows. Only those groups are read."""
    r = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, NGP)
    gmax = tl.load(gmax_ptr + r * NG + g, mask=g < NG, other=0)
    occupied = tl.sum((gmax > 0).to(tl.int32), axis=0)
    threshold = tl.where(occupied > k, _kth_largest_key(gmax, k, LOW_BIT), 1)  # 1: every selectable score
    passed = gmax >= threshold
    tl.store(glist_ptr + r * NGP + tl.cumsum(passed.to(tl.int32), axis=0) - 1, g, mask=passed)
    tl.store(thr_ptr + r, threshold)
    tl.store(ngroups_ptr + r, tl.sum(passed.to(tl.int32), axis=0))


@triton.jit
def _gather_kernel(
    x_ptr, len_ptr, glist_ptr, thr_ptr, ngroups_ptr, ckey_ptr, cpos_ptr, count_ptr, L, NGP, SEG,
    HAS_LENGTHS: tl.constexpr, P: tl.constexpr, GS: tl.constexpr, LOW_BIT: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """Program (r, p) reads the p-th of P equal slices of row r's passing groups and appends their scores ≥ T, in
    position order, to segment p of the row's candidate buffer (SEG slots) → count[r, p] (> SEG: it overflowed).

    One program per row gathered serially before (≈ 3 µs per chunk, 50–80 % of a row's select time on the H200);
    P small programs per row overlap their loads."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    x_row, segment = x_ptr + r * L, r * P + p
    length = _row_length(len_ptr, r, L, HAS_LENGTHS)
    threshold = tl.load(thr_ptr + r)
    n_groups = tl.load(ngroups_ptr + r)
    span = tl.cdiv(n_groups, P)
    first = p * span
    last = tl.minimum(first + span, n_groups)
    n = 0
    if n_groups <= P * SEG:  # each passing group holds at least one candidate: more groups than slots overflow anyway
        CG: tl.constexpr = GATHER // GS
        for start in range(first, last, CG):
            i = start + tl.arange(0, CG)
            group = tl.load(glist_ptr + r * NGP + i, mask=i < last, other=0)
            pos = tl.reshape(group[:, None] * GS + tl.arange(0, GS)[None, :], (GATHER,))
            ok = tl.reshape(tl.broadcast_to((i < last)[:, None], (CG, GS)), (GATHER,)) & (pos < length)
            key = _order_key(tl.load(x_row + pos, mask=ok, other=float("-inf")), ok, LOW_BIT)
            keep = key >= threshold
            slot = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(ckey_ptr + segment * SEG + slot, key, mask=keep & (slot < SEG))
            tl.store(cpos_ptr + segment * SEG + slot, pos, mask=keep & (slot < SEG))
            n += tl.sum(keep.to(tl.int32), axis=0)
    else:
        n = SEG + 1
    tl.store(count_ptr + segment, n)


@triton.jit
def _items(
    x_row, length, ckey_row, cpos_row, count_row, n, start, from_row,
    P: tl.constexpr, SEG, TILE: tl.constexpr, LOW_BIT: tl.constexpr,
):  # fmt: skip
    """Tile of (key, position) items in ascending position order: from the scores, or the candidates' items
    start … start + TILE − 1 counted across the P segments in order."""
    if from_row:
        key, pos = _row_keys(x_row, length, start, TILE, LOW_BIT)
    else:
        i = start + tl.arange(0, TILE)
        segment = tl.zeros_like(i)  # the segment holding item i, and where that segment begins (in items)
        begin = tl.zeros_like(i)
        end = 0
        for s in tl.static_range(P):
            end += tl.load(count_row + s)
            segment += (i >= end).to(tl.int32)
            begin = tl.where(i >= end, end, begin)
        slot = segment * SEG + i - begin
        key = tl.load(ckey_row + slot, mask=i < n, other=0)
        pos = tl.load(cpos_row + slot, mask=i < n, other=0)
    return key, pos


@triton.jit
def _write_chosen(out_row, key, pos, threshold, missing, ties_before, written, k):
    """Append the chosen items of one tile (in position order) to the output: keys above T, and the first
    `missing` keys equal to T (the lowest positions); returns the updated (ties seen, written) counts."""
    tie = key == threshold
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0)
    chosen = (key > threshold) | (tie & (tie_rank <= missing))
    slot = written + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, pos, mask=chosen & (slot < k))  # never past the row, whatever the keys
    return ties_before + tl.sum(tie.to(tl.int32), axis=0), written + tl.sum(chosen.to(tl.int32), axis=0)


@triton.jit
def _select_kernel(
    x_ptr, len_ptr, thr_ptr, ckey_ptr, cpos_ptr, count_ptr, out_ptr, L, SEG, k,
    HAS_LENGTHS: tl.constexpr, DIRECT: tl.constexpr, P: tl.constexpr, LOW_BIT: tl.constexpr,
    TILE: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """One row: the exact selection among its candidates (or, if DIRECT or a segment overflowed, its scores),
    written in position order and −1 padded. The k-th largest key is searched below the bits that its bounds
    share: every chosen key is ≥ lo (the candidates' threshold) and ≤ the row's maximum key."""
    r = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + r * L, out_ptr + r * k
    ckey_row, cpos_row, count_row = ckey_ptr + r * P * SEG, cpos_ptr + r * P * SEG, count_ptr + r * P
    length = _row_length(len_ptr, r, L, HAS_LENGTHS)
    n = length
    from_row = DIRECT
    lo = tl.full((), 1, tl.uint32)  # every chosen key is ≥ lo: 1 (selectable), or the candidates' threshold
    if not DIRECT:
        counts = tl.load(count_row + tl.arange(0, P))
        from_row = tl.max(counts, axis=0) > SEG  # a segment overflowed (adversarial ties): select from the scores
        n = tl.where(from_row, length, tl.sum(counts, axis=0))
        lo = tl.where(from_row, 1, tl.load(thr_ptr + r))

    if n <= TILE:  # everything in registers
        key, pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, 0, from_row, P, SEG, TILE, LOW_BIT)
        kk = tl.minimum(k, tl.sum((key > 0).to(tl.int32), axis=0))
        prefix, step, steps = _shared_prefix(lo, tl.max(key, axis=0), LOW_BIT)
        threshold = _radix_search(key, kk, prefix, step, steps)
        missing = kk - tl.sum((key > threshold).to(tl.int32), axis=0)
        _write_chosen(out_row, key, pos, threshold, missing, 0, 0, k)
    else:  # streamed in tiles: the same steps, each a pass over the items
        selectable = 0
        hi = tl.zeros((), dtype=tl.uint32)
        for start in range(0, n, TILE):
            key, _pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE,
                               LOW_BIT)  # fmt: skip
            selectable += tl.sum((key > 0).to(tl.int32), axis=0)
            hi = tl.maximum(hi, tl.max(key, axis=0))
        kk = tl.minimum(k, selectable)
        threshold, step, steps = _shared_prefix(lo, hi, LOW_BIT)
        for _bit in range(steps):
            trial = threshold | step
            count = 0
            for start in range(0, n, TILE):
                key, _pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE,
                                   LOW_BIT)  # fmt: skip
                count += tl.sum((key >= trial).to(tl.int32), axis=0)
            threshold = tl.where(count >= kk, trial, threshold)
            step = step >> 1
        above = 0
        for start in range(0, n, TILE):
            key, _pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE,
                               LOW_BIT)  # fmt: skip
            above += tl.sum((key > threshold).to(tl.int32), axis=0)
        ties, written = 0, 0
        for start in range(0, n, TILE):
            key, pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE,
                              LOW_BIT)  # fmt: skip
            ties, written = _write_chosen(out_row, key, pos, threshold, kk - above, ties, written, k)
    i = tl.arange(0, KP)
    tl.store(out_row + i, tl.full((KP,), -1, tl.int32), mask=(i >= kk) & (i < k))


def _low_bit(dtype: torch.dtype) -> int:
    """Low key bits without information: a bf16 / fp16 score widened to fp32 has 16 / 13 trailing zero bits (the
    radix searches skip them; `_order_key` clears them)."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def _group_size(L: int, k: int, max_groups: int) -> int:
    """Positions per group: at most `max_groups` groups (the threshold kernel holds them in registers), at least 16
    positions (the group maxima stay a small fraction of the scores' bytes), but at least 4k groups when the row
    allows (so that few groups beyond the k best pass the threshold)."""
    size = max(16, triton.next_power_of_2(triton.cdiv(L, max_groups)))
    while size > 1 and L // size < 4 * k:
        size //= 2
    return size


def _select_shape(R: int, L: int) -> tuple[int, int]:
    """(register tile, most groups) by default. With more rows than multiprocessors and rows of 32 K–256 K scores,
    half the tile and 8 K groups (groups of 16 / 32 at 64 K / 256 K): on the H200 (tune-topk, 2026-11-30, fifth
    session) 256 × 256 K took 0.107 ms against 0.117 with 4 K groups and 0.116 with the full tile and 16 K groups;
    256 × 64 K 0.044 either way (groups of 16 at most 4 K: the floor), 0.047 with the full tile. With 256 rows of 1 M
    the full tile is faster (0.275 against 0.314 with the half tile and 8 K groups). One row of 1 M took 0.034 with
    the half tile and 8 K groups against 0.040 (not adopted: batch 1–6 was measured at that one shape only)."""
    if multiprocessors() < R and 32_768 < L <= 262_144:
        return _TILE // 2, 8192
    return _TILE, _MAX_GROUPS


def _gather_programs(R: int) -> int:
    """Programs per row that gather candidates. On the H200: 8 while the rows leave SMs idle (1 × 1 M 0.064 →
    0.040 ms, 6 × 1 M 0.067 → 0.044), 2 once more rows than SMs fill it (256 × 64 K / 256 K / 1 M: 0.0442 / 0.1165 /
    0.2740 ms with 2, 0.0469 / 0.1199 / 0.2913 with 8, 0.0438 / 0.122 / 0.301 with the single select program)."""
    return 2 if multiprocessors() < R else 8


def topk_indices_triton(
    scores: Tensor,
    k: int,
    lengths: Tensor | None,
    direct_max: int = _TILE,
    group_size: int | None = None,
    capacity: int | None = None,
    tile: int | None = None,
    max_groups: int | None = None,
    gather: int | None = None,
    gather_programs: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Rows longer than `direct_max` take the group-max path with groups of `group_size` positions (a power of two;
    default: at most `max_groups` groups); `gather_programs` programs per row (a power of two; by default from the
    batch) gather the candidates, `gather` scores per step, into `capacity` slots per row (split evenly among them);
    `tile` is the select kernel's register tile, `num_warps` the threshold and select kernels' warps. The defaults
    suit k ≤ 4096; tests shrink them to reach every path, bench/kernels.py tunes them."""
    R, L = scores.shape
    default_tile, default_groups = _select_shape(R, L)
    tile, max_groups = tile or default_tile, max_groups or default_groups
    gather_programs = gather_programs or _gather_programs(R)
    if gather_programs & (gather_programs - 1):
        raise ValueError(f"gather_programs must be a power of two, got {gather_programs}")
    device = scores.device
    out = torch.empty((R, k), dtype=torch.int32, device=device)
    if R == 0 or k == 0:
        return out
    x = scores.contiguous()
    has_lengths = lengths is not None
    lengths = lengths.to(torch.int32).contiguous() if has_lengths else out  # out: an unread placeholder
    KP, low_bit, P = triton.next_power_of_2(k), _low_bit(scores.dtype), gather_programs
    direct = scores.shape[1] <= direct_max
    GS = 1 if direct else (group_size or _group_size(L, k, max_groups))
    NG = triton.cdiv(L, GS)
    NGP = 1 if direct else triton.next_power_of_2(NG)
    SEG = 0 if direct else triton.cdiv(capacity or max(2 * tile, 4 * KP), P)  # candidate slots per segment
    gather = max(gather or min(tile, 2048), GS)

    def per_row(*shape: int, dtype: torch.dtype) -> Tensor:
        """A buffer of the group path (nothing for direct rows)."""
        return torch.empty((R, *shape) if not direct else (0,), dtype=dtype, device=device)

    gmax, glist = per_row(NG, dtype=torch.uint32), per_row(NGP, dtype=torch.int32)
    threshold, n_groups = per_row(dtype=torch.uint32), per_row(dtype=torch.int32)
    ckey, cpos = per_row(P * SEG, dtype=torch.uint32), per_row(P * SEG, dtype=torch.int32)
    counts = per_row(P, dtype=torch.int32)
    warps = num_warps or (16 if NGP >= 8192 else 8)
    if not direct:
        group_tile = max(tile, GS)
        tiles = triton.cdiv(L, group_tile)
        _group_max_kernel[(R * tiles,)](x, lengths, gmax, L, NG, tiles, has_lengths, group_tile, GS, low_bit,
                                        num_warps=4)  # fmt: skip
        _threshold_kernel[(R,)](gmax, glist, threshold, n_groups, NG, k, NGP, low_bit, num_warps=warps)
        _gather_kernel[(R, P)](x, lengths, glist, threshold, n_groups, ckey, cpos, counts, L, NGP, SEG,
                               has_lengths, P, GS, low_bit, gather, num_warps=4)  # fmt: skip
    _select_kernel[(R,)](x, lengths, threshold, ckey, cpos, counts, out, L, SEG, k,
                         has_lengths, direct, P, low_bit, tile, KP, num_warps=num_warps or 8)  # fmt: skip
    return out
