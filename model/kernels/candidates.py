"""Level-1 candidate pool of the hierarchical indexer (model-architecture.md §2.5).

Block score = max over `block_size` consecutive positions (the tail padded with −inf); the block holding the
newest visible position is pinned to +inf; the top `topk_blocks` blocks are kept, except picks scoring −inf; the
kept blocks expand to a position mask that is False from n_visible on.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from model.kernels.topk import topk_indices_torch


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
