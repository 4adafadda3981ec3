"""Top-k positions of score rows, returned sorted by position and −1 padded (model-architecture.md §2.5, §5.1).

Ties go to the lowest positions, in both backends: the chosen set is then a function of the scores alone, never of
the row length or the batch, so chunked prefill, batching and verification select exactly as one-shot runs do.
The torch reference is a stable descending sort.

Triton: a threshold select in the spirit of DeepSelect, each score read once, on order-preserving uint32 keys.

1. Group maxima (a streaming kernel over every row): the maximum key of each group of GS consecutive positions.
2. Threshold (a kernel, one program per row): T = the k-th largest group maximum. k groups reach T, so the k-th
   largest score is ≥ T; and a score ≥ T lies in a group whose maximum is ≥ T — about k groups on ordinary rows, and
   never more than k·GS scores whatever the row (ties at T aside). The passing groups' ids are listed, ascending.
   T is bisected (`_bisect`) between a cheap lower bound and the largest maximum.
3. Gather (a kernel, P programs per row, one pass each by default): program p takes the p-th span of that list
   and writes every score ≥ T of its groups, in position order, to its own segment of the row's candidate buffer.
   The programs cover k + k/4 + 8 passing groups; a row with more (ties at T) is selected from its scores.
4. Select (a kernel, one program per row): exact select among the candidates, the P segments read in order, held
   in registers when they fit: the k-th largest key is searched between T and the row's maximum key (`_trisect`:
   ≈ 5 steps on Gaussian bf16 rows of 64 K–1 M at k = 512), and keys equal to it are taken in position order, so
   ties go to the lowest positions. The candidates are in position order, so the chosen ones are written sorted.
   A row whose candidates overflow a segment (adversarial ties) is selected the same way straight from its scores.

Rows of at most `_TILE` scores skip steps 1–3: the row itself is the candidate set.

On sm_90 every kernel is a programmatic dependent launch (model.kernels.launch): it is scheduled while its
predecessor still runs and waits for its writes, and one whose programs all fit on the GPU at once (`_RESIDENT` per
SM) lets its successor launch as it starts. With these launches and `_trisect`, 1 × 64 K takes 10.0 µs on the H200
instead of 12.2.

The group maxima are bound by the scores' bandwidth; the other three kernels are chains of block-wide sums and
dependent loads, which is why their steps are counted and cut (`_search_range`, one pass per gathering program).
docs/kernels.md has where the time goes and the variants measured against this design.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.launch import dependent_launch, follow


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

_TILE = 4096  # scores of a short row, held in the select kernel's registers; a group-max program's (`_group_tile`)
_MAX_TILE = 32768  # the select kernel's register tile at most (`_trisect` counts a tile's keys in 16 bits)
_MAX_GROUPS = 8192  # group maxima per row that the threshold kernel holds in registers at once
_FEW_ROWS = 8  # batches of at most this many rows take fewer groups (`_max_groups`)
_GATHER = 2048  # scores per gathering program's pass, by default (`_gather_scores`)
_MAX_SEGMENTS = 32  # gathering programs per row at most (the select kernel maps its items to their segments)
# programs per SM of the group-max, threshold and gather kernels that surely fit at once at the default launches
# (sm_90 registers by `bench/sass.py topk`: 27–30 → 16 by threads, 124–255 → 2, 128–219 → 2)
_RESIDENT = (16, 2, 2)


@triton.jit
def _order_key(x, valid, LOW_BIT: tl.constexpr):
    """Score → uint32 whose unsigned order is the float order (−0 = +0); 0 marks an entry that cannot be chosen.

    Bits below LOW_BIT are cleared: a bf16/fp16 score widened to fp32 has zeros there, but a negative score's key
    is its inverted bits (ones there), and the searches, which stop at LOW_BIT, must see equal scores as equal
    keys for the tie cut to work."""
    x = x.to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)
    key = key >> LOW_BIT << LOW_BIT
    return tl.where(valid & (x > float("-inf")), key, tl.zeros_like(key))


@triton.jit
def _row_length(len_ptr, r, L, HAS_LENGTHS: tl.constexpr):
    """Row r's length clamped to [0, L], as int32 whether the lengths come int32 or int64 (no cast launch)."""
    if HAS_LENGTHS:
        return tl.maximum(tl.minimum(tl.load(len_ptr + r), L), 0).to(tl.int32)
    return L


@triton.jit
def _row_keys(x_row, length, start, TILE: tl.constexpr, LOW_BIT: tl.constexpr):
    """Keys of positions start … start + TILE − 1 of a row (and those positions). The scores stream: their lines
    leave L2 first, which keeps the small per-row buffers there (256 × 256 K: 73.6 µs against 75.9–76.8 without the
    hint)."""
    pos = start + tl.arange(0, TILE)
    x = tl.load(x_row + pos, mask=pos < length, other=float("-inf"), eviction_policy="evict_first")
    return _order_key(x, pos < length, LOW_BIT), pos


@triton.jit
def _search_range(lo, hi, LOW_BIT: tl.constexpr):
    """The k-th largest key T is known to lie in [lo, hi] → that range in units of 2^LOW_BIT, [a, b], and how many
    halvings (`_halve`) narrow it to T. Bisecting the range itself, not T's bits one by one, takes log2 of its
    width: on Gaussian bf16 rows ≈ 8 halvings for the group threshold and 7 for the select instead of 16 and 8."""
    a = lo >> LOW_BIT  # still ≤ T, whose low bits are zero
    b = tl.maximum(hi >> LOW_BIT, a)  # hi < lo only where nothing is selectable (k = 0): any key serves
    return a, b, _highest_bit(b - a) + 1


@triton.jit
def _midpoint(a, b):
    """The upper middle of [a, b] (a ≤ b, no overflow for any uint32 pair)."""
    return a + ((b - a) >> 1) + ((b - a) & 1)


@triton.jit
def _halve(a, b, mid, count, k):
    """[a, b] → its half holding T, given count = #(keys ≥ mid): T ≥ mid iff count ≥ k. [a, a] stays (count ≥ k
    holds at a throughout)."""
    return tl.where(count >= k, mid, a), tl.where(count >= k, b, mid - 1)


@triton.jit
def _bisect(keys, k, lo, hi, LOW_BIT: tl.constexpr):
    """The largest T in [lo, hi] with #(keys ≥ T) ≥ k: the k-th largest key (k ≥ 1, or k = 0: some key), given
    that it lies in [lo, hi]; bits below LOW_BIT are zero in every key. One block-wide count per halving."""
    a, b, steps = _search_range(lo, hi, LOW_BIT)
    for _step in range(steps):
        mid = _midpoint(a, b)
        a, b = _halve(a, b, mid, tl.sum((keys >= (mid << LOW_BIT)).to(tl.int32), axis=0), k)
    return a << LOW_BIT


@triton.jit
def _trisect(keys, k, lo, hi, LOW_BIT: tl.constexpr):
    """`_bisect` with two pivots a step, both counted in one int32 sum (a count per half: fewer than 2^16 keys), so
    that each step keeps a third of the range: ≈ 5 block-wide sums instead of 7 on the select's 2k candidates (the
    select 4.52 → 4.14 µs at 256 × 64 K on the H200). The threshold kernel keeps halvings: at 32 keys per thread its
    second compare costs more than the step it saves."""
    a, b, _steps = _search_range(lo, hi, LOW_BIT)
    while a < b:
        low = a + (b - a) // 3 + ((b - a) % 3 != 0).to(tl.uint32)  # a + ⌈(b − a) / 3⌉: above a
        high = b - (b - a) // 3  # at or above low
        both = (keys >= (low << LOW_BIT)).to(tl.int32) | ((keys >= (high << LOW_BIT)).to(tl.int32) << 16)
        counts = tl.sum(both, axis=0)
        at_low, at_high = (counts & 0xFFFF) >= k, (counts >> 16) >= k  # T ≥ low, T ≥ high
        a, b = (
            tl.where(at_high, high, tl.where(at_low, low, a)),
            tl.where(at_high, b, tl.where(at_low, high - 1, low - 1)),
        )
    return a << LOW_BIT


@triton.jit
def _highest_bit(x):
    """floor(log2(x)) for x ≥ 1, or one more (fp32 may round x up to the next power of two: one harmless extra
    halving), at most 31; −1 for x = 0."""
    exponent = ((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 255) - 127
    return tl.where(x == 0, -1, tl.minimum(exponent, 31))


@triton.jit
def _group_max_kernel(
    x_ptr, len_ptr, gmax_ptr, L, NG, tiles, HAS_LENGTHS: tl.constexpr, TILE: tl.constexpr, GS: tl.constexpr,
    LOW_BIT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """gmax[r, g] = max key of positions [g·GS, (g+1)·GS) of row r; one TILE of one row per program."""
    follow(PDL, EARLY)
    r = (tl.program_id(0) // tiles).to(tl.int64)
    t = tl.program_id(0) % tiles
    key, _pos = _row_keys(x_ptr + r * L, _row_length(len_ptr, r, L, HAS_LENGTHS), t * TILE, TILE, LOW_BIT)
    g = t * (TILE // GS) + tl.arange(0, TILE // GS)
    tl.store(gmax_ptr + r * NG + g, tl.max(tl.reshape(key, (TILE // GS, GS)), axis=1), mask=g < NG)


@triton.jit
def _threshold_kernel(
    gmax_ptr,
    glist_ptr,
    thr_ptr,
    ngroups_ptr,
    NG,
    k,
    NGP: tl.constexpr,
    KP: tl.constexpr,
    LOW_BIT: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Row r's candidate threshold T and the ids of the groups that reach it, ascending.

    T = the k-th largest group maximum: k groups hold a score ≥ T, so the k-th largest score is ≥ T, and every
    score ≥ T lies in a group whose maximum is ≥ T — about k of them on ordinary rows. Only those groups are read.
    T is bisected between the largest maximum and a lower bound: the least of the maxima of KP ≥ k disjoint
    subsets (strided, so that a row whose scores trend with position still gives a tight bound) — KP maxima reach
    it, so the k-th largest does."""
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, NGP)
    gmax = tl.load(gmax_ptr + r * NG + g, mask=g < NG, other=0)
    if NGP >= KP:
        lo = tl.min(tl.max(tl.reshape(gmax, (NGP // KP, KP)), axis=0), axis=0)
    else:  # fewer groups than k: the bisection stays at 0
        lo = tl.zeros((), dtype=tl.uint32)
    # fewer than k selectable groups: their k-th largest maximum is 0, and T = 1 passes every selectable score
    threshold = tl.maximum(_bisect(gmax, k, lo, tl.max(gmax, axis=0), LOW_BIT), 1)
    passed = gmax >= threshold
    tl.store(glist_ptr + r * NGP + tl.cumsum(passed.to(tl.int32), axis=0) - 1, g, mask=passed)
    tl.store(thr_ptr + r, threshold)
    tl.store(ngroups_ptr + r, tl.sum(passed.to(tl.int32), axis=0))


@triton.jit
def _gather_pass(
    x_row, length, glist_row, ckey_seg, cpos_seg, threshold, start, last, n, SEG, CG: tl.constexpr, GS: tl.constexpr,
    LOW_BIT: tl.constexpr,
):  # fmt: skip
    """Passing groups start … start + CG − 1 (those before `last`): their scores ≥ T appended, in position order,
    after the segment's first n candidates → the new count. [groups, positions] throughout: the slots are a scan
    over the groups' counts and one inside each group (a scan over the flattened scores, and the reshapes to it,
    cost more than the loads)."""
    i = start + tl.arange(0, CG)
    group = tl.load(glist_row + i, mask=i < last, other=0)
    pos = group[:, None] * GS + tl.arange(0, GS)[None, :]
    ok = (i < last)[:, None] & (pos < length)
    key = _order_key(tl.load(x_row + pos, mask=ok, other=float("-inf"), eviction_policy="evict_first"), ok, LOW_BIT)
    keep = (key >= threshold).to(tl.int32)
    per_group = tl.sum(keep, axis=1)
    slot = n + (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(keep, axis=1) - 1
    stored = (keep > 0) & (slot < SEG)
    tl.store(ckey_seg + slot, key, mask=stored)
    tl.store(cpos_seg + slot, pos, mask=stored)
    return n + tl.sum(per_group, axis=0)


@triton.jit
def _gather_kernel(
    x_ptr, len_ptr, glist_ptr, thr_ptr, ngroups_ptr, ckey_ptr, cpos_ptr, count_ptr, L, NGP, SEG,
    HAS_LENGTHS: tl.constexpr, P: tl.constexpr, SPAN: tl.constexpr, CG: tl.constexpr, GS: tl.constexpr,
    LOW_BIT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Program (r, p) takes row r's passing groups p·SPAN … (p + 1)·SPAN − 1 (in list order: ascending), CG per
    pass, and writes their scores ≥ T, in position order, to segment p of the row's candidate buffer (SEG slots)
    → count[r, p]. The P programs of a row cover P·SPAN passing groups; a row with more (ties at T), or a segment
    with more candidates than slots, is marked overflowing (a count above SEG) and selected from its scores.

    By default SPAN ≤ CG: one pass per program, with no loop — a loop costs registers (fewer programs per SM), and
    each of its passes is a chain of dependent loads and scans (≈ 2–3 µs on the H200)."""
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    segment = r * P + p
    x_row, glist_row = x_ptr + r * L, glist_ptr + r * NGP
    ckey_seg, cpos_seg = ckey_ptr + segment * SEG, cpos_ptr + segment * SEG
    length = _row_length(len_ptr, r, L, HAS_LENGTHS)
    n_groups = tl.load(ngroups_ptr + r)
    first = p * SPAN
    last = tl.minimum(first + SPAN, n_groups)
    threshold = tl.load(thr_ptr + r)
    n = 0
    if SPAN <= CG:
        if first < last:
            n = _gather_pass(
                x_row, length, glist_row, ckey_seg, cpos_seg, threshold, first, last, n, SEG, CG, GS, LOW_BIT
            )
    else:
        for start in range(first, last, CG):
            n = _gather_pass(
                x_row, length, glist_row, ckey_seg, cpos_seg, threshold, start, last, n, SEG, CG, GS, LOW_BIT
            )
    tl.store(count_ptr + segment, tl.where((p == P - 1) & (n_groups > P * SPAN), SEG + 1, n))


@triton.jit
def _items(
    x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P: tl.constexpr, SEG, TILE: tl.constexpr,
    LOW_BIT: tl.constexpr,
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
    `missing` keys equal to T (the lowest positions); returns the updated (ties seen, written) counts.

    One scan counts both kinds, packed as (above << 16) | tie (a tile holds fewer than 2^16 items): an item's slot
    is the aboves and the chosen ties up to it."""
    tie = key == threshold
    above = key > threshold
    through = tl.cumsum((above.to(tl.int32) << 16) | tie.to(tl.int32), axis=0)
    tie_rank = ties_before + (through & 0xFFFF)  # ties up to and including this item, earlier tiles' too
    chosen_ties = tl.minimum(tie_rank, missing) - tl.minimum(ties_before, missing)
    chosen = above | (tie & (tie_rank <= missing))
    slot = written + (through >> 16) + chosen_ties - 1
    tl.store(out_row + slot, pos, mask=chosen & (slot < k))  # never past the row, whatever the keys
    total = tl.max(through, axis=0)  # the scan's last item
    ties = ties_before + (total & 0xFFFF)
    return ties, written + (total >> 16) + tl.minimum(ties, missing) - tl.minimum(ties_before, missing)


@triton.jit
def _select_kernel(
    x_ptr, len_ptr, thr_ptr, ckey_ptr, cpos_ptr, count_ptr, out_ptr, L, SEG, k, HAS_LENGTHS: tl.constexpr,
    DIRECT: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, LOW_BIT: tl.constexpr, TILE: tl.constexpr,
    KP: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """One row: the exact selection among its candidates (or, if DIRECT or a segment overflowed, its scores),
    written in position order and −1 padded. The k-th largest key is bisected between its bounds: every chosen key
    is ≥ lo (the candidates' threshold) and ≤ the row's maximum key."""
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + r * L, out_ptr + r * k
    ckey_row, cpos_row, count_row = ckey_ptr + r * P * SEG, cpos_ptr + r * P * SEG, count_ptr + r * P
    length = _row_length(len_ptr, r, L, HAS_LENGTHS)
    n = length
    from_row = DIRECT
    lo = tl.full((), 1, tl.uint32)  # every chosen key is ≥ lo: 1 (selectable), or the candidates' threshold
    if not DIRECT:
        counts = tl.load(count_row + tl.arange(0, PP), mask=tl.arange(0, PP) < P, other=0)  # PP: P padded
        from_row = tl.max(counts, axis=0) > SEG  # a segment overflowed (adversarial ties): select from the scores
        n = tl.where(from_row, length, tl.sum(counts, axis=0))
        lo = tl.where(from_row, 1, tl.load(thr_ptr + r))

    if n <= TILE:  # everything in registers
        key, pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, 0, from_row, P, SEG, TILE, LOW_BIT)
        kk = k  # above a threshold T > 1 lie at least k candidates: no count needed
        if lo <= 1:
            kk = tl.minimum(k, tl.sum((key > 0).to(tl.int32), axis=0))
        threshold = _trisect(key, kk, lo, tl.max(key, axis=0), LOW_BIT)
        missing = kk - tl.sum((key > threshold).to(tl.int32), axis=0)
        _write_chosen(out_row, key, pos, threshold, missing, 0, 0, k)
    else:  # streamed in tiles: the same steps, each a pass over the items
        selectable = 0
        hi = tl.zeros((), dtype=tl.uint32)
        for start in range(0, n, TILE):
            key, _pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE, LOW_BIT)
            selectable += tl.sum((key > 0).to(tl.int32), axis=0)
            hi = tl.maximum(hi, tl.max(key, axis=0))
        kk = tl.minimum(k, selectable)
        a, b, steps = _search_range(lo, hi, LOW_BIT)
        for _step in range(steps):
            mid = _midpoint(a, b)
            count = 0
            for start in range(0, n, TILE):
                key, _pos = _items(
                    x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE, LOW_BIT
                )
                count += tl.sum((key >= (mid << LOW_BIT)).to(tl.int32), axis=0)
            a, b = _halve(a, b, mid, count, kk)
        threshold = a << LOW_BIT
        above = 0
        for start in range(0, n, TILE):
            key, _pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE, LOW_BIT)
            above += tl.sum((key > threshold).to(tl.int32), axis=0)
        ties, written = 0, 0
        for start in range(0, n, TILE):
            key, pos = _items(x_row, length, ckey_row, cpos_row, count_row, n, start, from_row, P, SEG, TILE, LOW_BIT)
            ties, written = _write_chosen(out_row, key, pos, threshold, kk - above, ties, written, k)
    i = tl.arange(0, KP)
    tl.store(out_row + i, tl.full((KP,), -1, tl.int32), mask=(i >= kk) & (i < k))


def _low_bit(dtype: torch.dtype) -> int:
    """Low key bits without information: a bf16 / fp16 score widened to fp32 has 16 / 13 trailing zero bits (the
    searches skip them; `_order_key` clears them)."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def _max_groups(R: int, L: int) -> int:
    """Group maxima per row by default: `_MAX_GROUPS`, but 2 K for batches of at most `_FEW_ROWS` rows of up to 256 K
    scores — a few rows leave most of the GPU idle, so work moves from the threshold (one program per row, a chain
    over its maxima) to the gather (many programs per row): 1 × 256 K 14.4 µs against 17.2 on the H200. Rows of 1 M
    and batches of 32 rows gain nothing (docs/kernels.md)."""
    return 2048 if R <= _FEW_ROWS and L <= 262_144 else _MAX_GROUPS


def _group_size(L: int, k: int, max_groups: int) -> int:
    """Positions per group: at most `max_groups` groups (the threshold kernel holds them in registers), at least 16
    positions (the group maxima stay a small fraction of the scores' bytes), but at least 4k groups when the row
    allows (so that few groups beyond the k best pass the threshold)."""
    size = max(16, triton.next_power_of_2(triton.cdiv(L, max_groups)))
    while size > 1 and L // size < 4 * k:
        size //= 2
    return size


def _threshold_warps(NGP: int) -> int:
    """Warps of the threshold kernel, by group maxima per row: 4 (8.0 µs at 4 K maxima on the H200, 8.9 with 8
    warps), 16 from 16 K maxima (rows of 1 M), which 4 warps hold in too few registers."""
    return 16 if NGP >= 16384 else 4


def _group_tile(L: int) -> int:
    """Scores per group-max program: 8 K for rows of 256 K and more, else 4 K (the faster of the two at each length
    on the H200: docs/kernels.md)."""
    return 2 * _TILE if L >= 262_144 else _TILE


def _gather_scores(GS: int) -> int:
    """Scores per gathering pass: 2 K, or 4 K for groups of more than 64 (rows of 1 M). One pass covers a program's
    share of the passing groups wherever the programs do not hit `_MAX_SEGMENTS`: 64 K rows take 6 programs of 128
    groups of 16, 256 K rows 11 of 64 × 32, 1 M rows 21 of 32 × 128 (k = 512)."""
    return _GATHER if GS <= 64 else 2 * _GATHER


def _select_tile(k: int) -> int:
    """The select kernel's register tile on the group path: 2k candidates, at least 1 K (1 × 64 K 0.0150 ms against
    0.0200 with 2 K on the H200), at most `_TILE`."""
    return min(_TILE, max(1024, 2 * triton.next_power_of_2(k)))


@dataclass(frozen=True)
class TopKTuning:
    """Launch shape of `topk_indices_triton` (None: chosen per call). The defaults suit k ≤ 4096; the tests shrink
    them to reach every path, `bench/kernels.py --bench tune-topk` times others.

    - `direct_max`: rows of at most this many scores skip the group path (the row is the candidate set);
    - `group_size`: positions per group, a power of two (None: `_group_size`, at most `max_groups` groups);
    - `max_groups`: group maxima per row at most (None: `_max_groups`);
    - `group_tile`: scores per group-max program (None: `_group_tile`; at least one group);
    - `threshold_warps`: the threshold kernel's warps (None: `_threshold_warps`);
    - `gather`: scores per pass of a gathering program, a power of two (None: `_gather_scores`);
    - `covered_groups`: passing groups per row that the gathering programs cover, as many programs as take one pass
      each, at most `_MAX_SEGMENTS` (None: k + k/4 + 8, as k reach T and bf16 rows tie a few more at it; a row with
      more is selected from its scores);
    - `tile`: the select kernel's register tile, a power of two up to `_MAX_TILE` (None: a direct row whole, else
      `_select_tile`);
    - `num_warps`: the select kernel's warps."""

    direct_max: int = _TILE
    group_size: int | None = None
    max_groups: int | None = None
    group_tile: int | None = None
    threshold_warps: int | None = None
    gather: int | None = None
    covered_groups: int | None = None
    tile: int | None = None
    num_warps: int = 8

    def __post_init__(self) -> None:
        if self.gather is not None and (self.gather < 1 or self.gather & (self.gather - 1)):
            raise ValueError(f"gather must be a power of two, got {self.gather}")
        if self.tile is not None and not (0 < self.tile <= _MAX_TILE and self.tile & (self.tile - 1) == 0):
            raise ValueError(f"tile must be a power of two up to {_MAX_TILE}, got {self.tile}")

    def direct(self, L: int) -> bool:
        """Whether rows of L scores skip the group path."""
        return self.direct_max >= L

    def resolved(self, R: int, L: int, k: int) -> "TopKTuning":
        """These settings with the defaults for R rows of L scores and k filled in (a direct row needs only `tile`)."""
        if self.direct(L):
            return replace(self, tile=self.tile or _TILE)
        GS = self.group_size or _group_size(L, k, self.max_groups or _max_groups(R, L))
        return replace(
            self,
            group_size=GS,
            group_tile=max(self.group_tile or _group_tile(L), GS),
            threshold_warps=self.threshold_warps or _threshold_warps(triton.next_power_of_2(triton.cdiv(L, GS))),
            gather=self.gather or _gather_scores(GS),
            covered_groups=self.covered_groups or k + k // 4 + 8,
            tile=self.tile or _select_tile(k),
        )

    def gather_shape(self, k: int) -> tuple[int, int, int, int]:
        """Of resolved settings on the group path: (passing groups per gathering pass CG, gathering programs per row
        P, passing groups per program, candidate slots per segment). A segment holds 2k candidates at most — all of a
        row's, ties at T aside."""
        if self.group_size is None or self.gather is None or self.covered_groups is None:
            raise ValueError("gather_shape needs resolved settings (TopKTuning.resolved)")
        CG = max(self.gather // self.group_size, 1)
        P = min(triton.cdiv(self.covered_groups, CG), _MAX_SEGMENTS)
        span = triton.cdiv(self.covered_groups, P)
        return CG, P, span, min(span * self.group_size, 2 * triton.next_power_of_2(k))


def topk_indices_triton(scores: Tensor, k: int, lengths: Tensor | None, tuning: TopKTuning = TopKTuning()) -> Tensor:
    """The kernels (module docstring) at the launch shape `tuning`."""
    R, L = scores.shape
    device = scores.device
    out = torch.empty((R, k), dtype=torch.int32, device=device)
    if R == 0 or k == 0:
        return out
    x = scores.contiguous()
    has_lengths = lengths is not None
    lengths = lengths.contiguous() if has_lengths else out  # out: an unread placeholder
    KP, low_bit = triton.next_power_of_2(k), _low_bit(scores.dtype)
    t = tuning.resolved(R, L, k)
    direct = t.direct(L)
    GS = 1 if direct else t.group_size
    NG = triton.cdiv(L, GS)
    NGP = 1 if direct else triton.next_power_of_2(NG)
    CG, P, span, SEG = (1, 1, 1, 1) if direct else t.gather_shape(k)

    def per_row(*shape: int, dtype: torch.dtype) -> Tensor:
        """A buffer of the group path (nothing for direct rows)."""
        return torch.empty((R, *shape) if not direct else (0,), dtype=dtype, device=device)

    gmax, glist = per_row(NG, dtype=torch.uint32), per_row(NGP, dtype=torch.int32)
    threshold, n_groups = per_row(dtype=torch.uint32), per_row(dtype=torch.int32)
    ckey, cpos = per_row(P * SEG, dtype=torch.uint32), per_row(P * SEG, dtype=torch.int32)
    counts = per_row(P, dtype=torch.int32)
    if not direct:
        tiles = triton.cdiv(L, t.group_tile)
        _group_max_kernel[(R * tiles,)](
            x,
            lengths,
            gmax,
            L,
            NG,
            tiles,
            has_lengths,
            t.group_tile,
            GS,
            low_bit,
            num_warps=4,
            **dependent_launch(device, (R * tiles,), _RESIDENT[0]),
        )
        _threshold_kernel[(R,)](
            gmax,
            glist,
            threshold,
            n_groups,
            NG,
            k,
            NGP,
            KP,
            low_bit,
            num_warps=t.threshold_warps,
            **dependent_launch(device, (R,), _RESIDENT[1]),
        )
        _gather_kernel[(R, P)](
            x, lengths, glist, threshold, n_groups, ckey, cpos, counts, L, NGP, SEG, has_lengths, P, span, CG, GS,
            low_bit, num_warps=4, **dependent_launch(device, (R, P), _RESIDENT[2])
        )  # fmt: skip
    _select_kernel[(R,)](
        x, lengths, threshold, ckey, cpos, counts, out, L, SEG, k, has_lengths, direct, P, triton.next_power_of_2(P),
        low_bit, t.tile, KP, num_warps=t.num_warps, **dependent_launch(device, (R,))
    )  # fmt: skip
    return out
