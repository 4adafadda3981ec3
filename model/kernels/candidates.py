"""Level-1 candidate pool of the hierarchical indexer (model-architecture.md §2.5).

Block score = max over `block_size` consecutive positions (the tail padded with −inf); the block holding the
newest visible position is pinned to +inf; the top `topk_blocks` blocks are kept, except picks scoring −inf; the
kept blocks expand to a position mask that is False from n_visible on.

Triton: a block-max kernel, the top-k select of model/kernels/topk.py over the block scores, and a scatter + expand
kernel pair that turns the picked block ids into the position mask.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.formats import interpreting
from model.kernels.launch import dependent_launch, follow
from model.kernels.topk import topk_indices_torch, topk_indices_triton


def block_scores_torch(scores: Tensor, n_visible: Tensor, block_size: int) -> Tensor:
    """[B, T, S] → [B, T, ceil(S / block_size)] block maxima over visible positions, newest block pinned to +inf."""
    S = scores.shape[-1]
    positions = torch.arange(S, device=scores.device)
    visible = torch.where(positions < n_visible[..., None], scores.float(), float("-inf"))
    padded = F.pad(visible, (0, -S % block_size), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (n_visible.long() - 1).clamp(min=0)[..., None] // block_size
    pinned = (n_visible[..., None] > 0) & (torch.arange(blocks.shape[-1], device=scores.device) == newest)
    return blocks.masked_fill(pinned, float("inf"))


def expand_blocks(picked: Tensor, n_visible: Tensor, block_size: int, S: int) -> Tensor:
    """Picked block ids [B, T, K] (−1 = none) → bool [B, T, S], False from n_visible on."""
    n_blocks = -(-S // block_size)
    kept = torch.zeros((*picked.shape[:-1], n_blocks + 1), dtype=torch.bool, device=picked.device)
    kept.scatter_(-1, torch.where(picked >= 0, picked, n_blocks).long(), True)
    mask = kept[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :S]
    return mask & (torch.arange(S, device=picked.device) < n_visible[..., None])


def candidate_mask_torch(scores: Tensor, n_visible: Tensor, block_size: int, topk_blocks: int) -> Tensor:
    blocks = block_scores_torch(scores, n_visible, block_size)
    picked = topk_indices_torch(blocks.flatten(0, -2), topk_blocks, None).unflatten(0, blocks.shape[:-1])
    return expand_blocks(picked, n_visible, block_size, scores.shape[-1])


@triton.jit
def _block_max_kernel(
    scores_ptr, nv_ptr, out_ptr, S, NB, BS: tl.constexpr, BSP: tl.constexpr, TILE: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)  # rows on axis 0: up to 2³¹ − 1 programs (axis 1 stops at 65,535)
    blocks = tl.program_id(1) * TILE + tl.arange(0, TILE)
    n_visible = tl.load(nv_ptr + r)
    pos = blocks[:, None] * BS + tl.arange(0, BSP)[None, :]
    visible = (pos < n_visible) & (pos < S) & (tl.arange(0, BSP)[None, :] < BS)
    x = tl.load(scores_ptr + r * S + pos, mask=visible, other=float("-inf")).to(tl.float32)
    block = tl.max(x, axis=1)
    block = tl.where((n_visible > 0) & (blocks == (n_visible - 1) // BS), float("inf"), block)
    tl.store(out_ptr + r * NB + blocks, block, mask=blocks < NB)


@triton.jit
def _keep_blocks_kernel(picked_ptr, kept_ptr, K, NB, TILE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)
    for start in range(0, K, TILE):
        i = start + tl.arange(0, TILE)
        block = tl.load(picked_ptr + r * K + i, mask=i < K, other=-1)
        tl.store(kept_ptr + r * NB + block, tl.full((TILE,), 1, tl.int8), mask=block >= 0)


@triton.jit
def _expand_kernel(
    kept_ptr, nv_ptr, mask_ptr, S, NB, BS: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr
):
    follow(PDL, EARLY)
    r = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * TILE + tl.arange(0, TILE)
    kept = tl.load(kept_ptr + r * NB + pos // BS, mask=pos < S, other=0)
    tl.store(mask_ptr + r * S + pos, (kept != 0) & (pos < tl.load(nv_ptr + r)), mask=pos < S)


def candidate_mask_triton(scores: Tensor, n_visible: Tensor, block_size: int, topk_blocks: int) -> Tensor:
    B, T, S = scores.shape
    R, NB = B * T, triton.cdiv(S, block_size)
    mask = torch.empty((B, T, S), dtype=torch.bool, device=scores.device)
    if R == 0 or S == 0:
        return mask
    tile = 64 if interpreting() else 1024
    nv = n_visible.contiguous()  # int32 or int64: the kernels only compare with it
    blocks = torch.empty((R, NB), dtype=torch.float32, device=scores.device)
    block_tile = max(1, tile // triton.next_power_of_2(block_size))
    grid = (R, triton.cdiv(NB, block_tile))
    _block_max_kernel[grid](
        scores.contiguous(), nv, blocks, S, NB, block_size, triton.next_power_of_2(block_size), block_tile,
        **dependent_launch(scores.device, grid),
    )  # fmt: skip
    picked = topk_indices_triton(blocks, topk_blocks, None)
    kept = torch.zeros((R, NB), dtype=torch.int8, device=scores.device)
    _keep_blocks_kernel[(R,)](picked, kept, topk_blocks, NB, tile, **dependent_launch(scores.device, (R,)))
    grid = (R, triton.cdiv(S, tile))
    _expand_kernel[grid](kept, nv, mask, S, NB, block_size, tile, **dependent_launch(scores.device, grid))
    return mask
