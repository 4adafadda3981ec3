"""How many DSpark drafts each row verifies (reference §4.4).

The confidence head estimates cₖ = P(draft k accepted | drafts before it accepted), so aₖ = Π_{i≤k} cᵢ is the chance
draft k is accepted at all and Σ aₖ the expected accepted length. A row keeps its drafts while aₖ ≥ threshold: each
verified draft costs one more target position and is worth aₖ tokens. Two caps keep what verification commits equal
to what the stream emits: a row never verifies beyond its output budget, nor past its first draft that is a stop
token (so the cache never holds tokens the client did not get). The batch verifies max ℓ positions; rows with a
smaller ℓ see the rest as rejected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model import Draft


def draft_lengths(
    draft: Draft, threshold: float, max_draft: int, budgets: Sequence[int], stop_ids: Sequence[frozenset[int]]
) -> Tensor:
    """int64 [B]: the drafts row b verifies. `budgets[b]`: tokens it may still emit (≥ 1)."""
    kept = (draft.confidence.cumprod(-1) >= threshold).sum(-1).clamp(max=max_draft).tolist()
    tokens = draft.tokens.tolist()
    for b, (budget, stops) in enumerate(zip(budgets, stop_ids, strict=True)):
        cap = budget - 1  # a step emits the accepted drafts plus one token
        stop_at = next((k for k, t in enumerate(tokens[b]) if t in stops), None)
        if stop_at is not None:
            cap = min(cap, stop_at + 1)
        kept[b] = min(kept[b], cap)
    return torch.tensor(kept, dtype=torch.int64)


def trim(draft: Draft, width: int) -> Draft:
    """The first `width` drafts of every row (a prefix of a draft chain is itself a valid draft chain)."""
    return Draft(draft.tokens[:, :width], draft.probs[:, :width], draft.confidence[:, :width])
