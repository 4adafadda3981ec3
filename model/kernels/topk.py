"""Top-k positions of score rows, returned sorted by position and −1 padded (model-architecture.md §2.5, §5.1).

Ties go to the lowest positions, in both backends: the chosen set is then a function of the scores alone, never of
the row length or the batch, so chunked prefill, batching and verification select exactly as one-shot runs do.
The torch reference is a stable descending sort.

Triton: a threshold select in the spirit of DeepSelect, reading each score twice at most.

1. Group maxima. Positions are dealt into G groups (position mod G); any T such that k groups have a maximum ≥ T
   bounds the k-th largest score from below (those k maxima are k distinct scores ≥ T). The best such T is the
   k-th largest group maximum, and every score ≥ T lies in one of those k groups, so only about k(1 + ε) scores
   pass it on ordinary rows (striding the groups keeps sorted or trending rows cheap too).
2. Threshold: per row, the k-th largest of the G maxima by a bitwise radix search on order-preserving uint32 keys.
3. Gather: one more pass appends every score ≥ T with its position to a per-row candidate buffer (an atomic
   counter hands out slots, a prefix sum places them).
4. Select: exact radix select on the candidates (bitwise search for the k-th key, then for the position cut among
   keys equal to it, so ties go to the lowest positions), compaction, and a sort of the k positions. A row whose
   candidates overflow the buffer (adversarial ties) is selected the same way straight from its scores.

Rows of at most `_DIRECT_MAX` scores skip steps 1–3: one program selects straight from the row.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import interpreting, multiprocessors


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

_DIRECT_MAX = 4096  # rows this short are selected in one pass of one program
_SELECT_TILE = 4096  # items the select kernel holds per step
_CHUNK = 8192  # scores per step of a streaming pass (16–32 KiB in flight per program)


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
def _row_keys(x_row, length, start, TILE: tl.constexpr, LOW_BIT: tl.constexpr):
    pos = start + tl.arange(0, TILE)
    x = tl.load(x_row + pos, mask=pos < length, other=float("-inf"))
    return _order_key(x, pos < length, LOW_BIT), pos


@triton.jit
def _group_max_kernel(x_ptr, len_ptr, part_ptr, L, P, G: tl.constexpr, U: tl.constexpr, LOW_BIT: tl.constexpr):
    """part[r, p, g] = max key over positions ≡ g (mod G) of the chunks p, p + P, … (U·G positions each) of row r."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    length = tl.minimum(tl.load(len_ptr + r), L)
    running = tl.zeros((G,), dtype=tl.uint32)
    for chunk in range(p, tl.cdiv(length, U * G), P):  # U tiles per step: more bytes in flight per program
        key, _pos = _row_keys(x_ptr + r * L, length, chunk * U * G, U * G, LOW_BIT)
        running = tl.maximum(running, tl.max(tl.reshape(key, (U, G)), axis=0))
    tl.store(part_ptr + (r * P + p) * G + tl.arange(0, G), running)


@triton.jit
def _kth_largest_key(keys, k, LOW_BIT: tl.constexpr):
    """Bitwise radix search: the largest T with #(keys ≥ T) ≥ k (k ≥ 1); keys below bit LOW_BIT are all zero."""
    threshold = tl.zeros((), dtype=tl.uint32)
    step = tl.full((), 1 << 31, tl.uint32)
    for _bit in range(32 - LOW_BIT):
        trial = threshold | step
        threshold = tl.where(tl.sum((keys >= trial).to(tl.int32), axis=0) >= k, trial, threshold)
        step = step >> 1
    return threshold


@triton.jit
def _threshold_kernel(part_ptr, thr_ptr, P, k, G: tl.constexpr, LOW_BIT: tl.constexpr):
    """thr[r] = the k-th largest group maximum of row r (1 when fewer than k groups hold a selectable score)."""
    r = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, G)
    maxima = tl.zeros((G,), dtype=tl.uint32)
    for p in range(P):
        maxima = tl.maximum(maxima, tl.load(part_ptr + (r * P + p) * G + groups))
    occupied = tl.sum((maxima > 0).to(tl.int32), axis=0)
    threshold = tl.where(occupied > k, _kth_largest_key(maxima, k, LOW_BIT), 1)
    tl.store(thr_ptr + r, threshold.to(tl.uint32))


@triton.jit
def _gather_kernel(
    x_ptr, len_ptr, thr_ptr, count_ptr, ckey_ptr, cpos_ptr, L, P, C, CHUNK: tl.constexpr, LOW_BIT: tl.constexpr
):
    """Append every (key, position) of row r with key ≥ thr[r] to the row's candidate buffer (slots < C kept)."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    length = tl.minimum(tl.load(len_ptr + r), L)
    threshold = tl.load(thr_ptr + r)
    for chunk in range(p, tl.cdiv(length, CHUNK), P):
        key, pos = _row_keys(x_ptr + r * L, length, chunk * CHUNK, CHUNK, LOW_BIT)
        passed = key >= threshold
        n = tl.sum(passed.to(tl.int32), axis=0)
        if n > 0:
            slot = tl.atomic_add(count_ptr + r, n) + tl.cumsum(passed.to(tl.int32), axis=0) - 1
            kept = passed & (slot < C)
            tl.store(ckey_ptr + r * C + slot, key, mask=kept)
            tl.store(cpos_ptr + r * C + slot, pos, mask=kept)


@triton.jit
def _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE: tl.constexpr, LOW_BIT: tl.constexpr):
    """Tile of (key, position) items: straight from the scores, or from the candidate buffer."""
    if from_row:
        key, pos = _row_keys(x_row, length, start, TILE, LOW_BIT)
    else:
        i = start + tl.arange(0, TILE)
        key = tl.load(ckey_row + i, mask=i < n, other=0)
        pos = tl.load(cpos_row + i, mask=i < n, other=0)
    return key, pos


@triton.jit
def _select_kernel(
    x_ptr, len_ptr, count_ptr, ckey_ptr, cpos_ptr, out_ptr, L, C, k,
    pos_bits, DIRECT: tl.constexpr, LOW_BIT: tl.constexpr, TILE: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    x_row, ckey_row, cpos_row = x_ptr + r * L, ckey_ptr + r * C, cpos_ptr + r * C
    length = tl.minimum(tl.load(len_ptr + r), L)
    n = length
    from_row = DIRECT
    if not DIRECT:
        n = tl.load(count_ptr + r)
        from_row = n > C  # the buffer overflowed: select from the scores themselves
        n = tl.where(from_row, length, n)

    # how many can be chosen, then the k-th largest key T (all passes below stream the items in tiles)
    selectable = 0
    for start in range(0, n, TILE):
        key, _pos = _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE, LOW_BIT)
        selectable += tl.sum((key > 0).to(tl.int32), axis=0)
    kk = tl.minimum(k, selectable)
    threshold = tl.zeros((), dtype=tl.uint32)
    step = tl.full((), 1 << 31, tl.uint32)
    for _bit in range(32 - LOW_BIT):
        trial = threshold | step
        count = 0
        for start in range(0, n, TILE):
            key, _pos = _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE, LOW_BIT)
            count += tl.sum((key >= trial).to(tl.int32), axis=0)
        threshold = tl.where(count >= kk, trial, threshold)
        step = step >> 1

    # keys equal to T: keep the lowest positions, as many as are still missing (cut = the last one kept)
    above = 0
    equal = 0
    for start in range(0, n, TILE):
        key, _pos = _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE, LOW_BIT)
        above += tl.sum((key > threshold).to(tl.int32), axis=0)
        equal += tl.sum((key == threshold).to(tl.int32), axis=0)
    missing = kk - above
    cut = tl.full((), 2147483647, tl.int32)
    if equal > missing:
        cut = 0
        for bit in range(pos_bits - 1, -1, -1):
            trial = cut | (1 << bit)
            count = 0
            for start in range(0, n, TILE):
                key, pos = _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE, LOW_BIT)
                count += tl.sum(((key == threshold) & (pos < trial)).to(tl.int32), axis=0)
            cut = tl.where(count < missing, trial, cut)

    # write the kk chosen positions, then sort them (the buffer holds them in arrival order)
    out_row = out_ptr + r * k
    written = 0
    for start in range(0, n, TILE):
        key, pos = _items(x_row, length, ckey_row, cpos_row, n, start, from_row, TILE, LOW_BIT)
        chosen = ((key > threshold) | ((key == threshold) & (pos <= cut))) & (kk > 0)
        slot = written + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, pos, mask=chosen & (slot < k))  # never past the row, whatever the keys
        written += tl.sum(chosen.to(tl.int32), axis=0)
    tl.debug_barrier()
    i = tl.arange(0, KP)
    positions = tl.sort(tl.load(out_row + i, mask=i < kk, other=2147483647))
    tl.store(out_row + i, tl.where(i < kk, positions, -1), mask=i < k)


def _low_bit(dtype: torch.dtype) -> int:
    """Low key bits without information: a bf16 / fp16 score widened to fp32 has 16 / 13 trailing zero bits (the
    radix searches skip them; `_order_key` clears them)."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def _programs_per_row(rows: int, chunks: int) -> int:
    """Programs per row for a streaming pass: about eight per multiprocessor in all."""
    return max(1, min(chunks, triton.cdiv(8 * multiprocessors(), rows)))


def topk_indices_triton(
    scores: Tensor,
    k: int,
    lengths: Tensor | None,
    direct_max: int = _DIRECT_MAX,
    groups: int | None = None,
    capacity: int | None = None,
) -> Tensor:
    """Rows longer than `direct_max` take the group-max / gather path with G = `groups` (a power of two) and
    `capacity` candidate slots per row; the defaults suit k ≤ 4096 (tests shrink them to reach every path)."""
    R, L = scores.shape
    device = scores.device
    out = torch.empty((R, k), dtype=torch.int32, device=device)
    if R == 0 or k == 0:
        return out
    x = scores.contiguous()
    lengths = torch.full((R,), L, device=device) if lengths is None else lengths
    lengths = lengths.to(torch.int32).contiguous()
    KP = triton.next_power_of_2(k)
    low_bit, pos_bits = _low_bit(scores.dtype), max(1, (L - 1).bit_length())
    tile = 256 if interpreting() else _SELECT_TILE
    count = torch.zeros(R, dtype=torch.int32, device=device)
    if scores.shape[1] <= direct_max:
        no_keys, no_positions = torch.empty(0, dtype=torch.uint32, device=device), count[:0]
        _select_kernel[(R,)](x, lengths, count, no_keys, no_positions, out, L, 0, k, pos_bits, True, low_bit, tile, KP,
                             num_warps=8)  # fmt: skip
        return out
    G = groups or max(1024, triton.next_power_of_2(4 * k))
    C = capacity or 8 * KP
    U = max(1, (64 if interpreting() else _CHUNK) // G)
    chunks = triton.cdiv(L, U * G)
    # the group-max pass writes P·G partial maxima per row that one program then reads: keep them ≤ L/8
    P = min(_programs_per_row(R, chunks), max(1, L // (8 * G)))
    P_gather = _programs_per_row(R, chunks)
    part = torch.empty((R, P, G), dtype=torch.uint32, device=device)
    threshold = torch.empty(R, dtype=torch.uint32, device=device)
    ckey = torch.empty((R, C), dtype=torch.uint32, device=device)
    cpos = torch.empty((R, C), dtype=torch.int32, device=device)
    _group_max_kernel[(R, P)](x, lengths, part, L, P, G, U, low_bit, num_warps=8)
    _threshold_kernel[(R,)](part, threshold, P, k, G, low_bit, num_warps=8)
    _gather_kernel[(R, P_gather)](x, lengths, threshold, count, ckey, cpos, L, P_gather, C, U * G, low_bit,
                                  num_warps=8)  # fmt: skip
    _select_kernel[(R,)](x, lengths, count, ckey, cpos, out, L, C, k, pos_bits, False, low_bit, tile, KP, num_warps=8)
    return out
