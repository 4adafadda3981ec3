"""Top-k positions of score rows, returned sorted by position and −1 padded (model-architecture.md §2.5, §5.1)."""

import torch
from torch import Tensor


def selectable(scores: Tensor, lengths: Tensor | None) -> Tensor:
    """Entries that may be chosen: inside the row's length and above −inf (NaN counts as −inf)."""
    valid = scores > float("-inf")
    if lengths is not None:
        valid &= torch.arange(scores.shape[-1], device=scores.device) < lengths[..., None]
    return valid


def topk_indices_torch(scores: Tensor, k: int, lengths: Tensor | None) -> Tensor:
    rows, length = scores.shape
    valid = selectable(scores, lengths)
    masked = torch.where(valid, scores.float(), float("-inf"))
    picked = min(k, length)
    values, positions = masked.topk(picked, dim=-1)
    positions = torch.where(values > float("-inf"), positions, length)  # unpickable sorts last
    positions = positions.sort(dim=-1).values
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :picked] = torch.where(positions < length, positions, -1).to(torch.int32)
    return out
