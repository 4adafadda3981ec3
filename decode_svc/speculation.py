"""How many DSpark drafts each row verifies (reference §4.4).

The confidence head estimates cₖ = P(draft k accepted | drafts before it accepted), so aₖ = Π_{i≤k} cᵢ is the chance
draft k is accepted at all and Σ aₖ the expected accepted length. A row keeps its drafts while s·aₖ ≥ threshold: each
verified draft costs one more target position and is worth aₖ tokens.

s calibrates the head online, per sequence: (accepted + s₀) / (Σ aₖ promised for the drafts verified + 1), the ratio
of what verification accepted to what the head promised (the paper calibrates offline, by Sequential Temperature
Scaling). The prior s₀ is the replica's own ratio over recent verifications (`Calibration`), so a new sequence starts
from what the drafter has been worth lately. A calibrated head keeps s ≈ 1; a drafter that is confidently wrong — an
untrained DSpark — drives s towards 0 within a step or two, and sequences then decode one token per step instead of
paying for rejected drafts. The replica's ratio forgets (a half-life in engine steps), so it tries again now and then.

A row whose drafts were all cut (the head not confident enough) waits before it asks for a draft again, doubling the
wait each time up to MAX_BACKOFF steps: the lane runs the DSpark forward only when some row is due, and otherwise
steps one token at a time.

Two caps keep what verification commits equal to what the stream emits: a row never verifies beyond its output
budget, nor past its first draft that is a stop token (so the cache never holds tokens the client did not get). The
batch verifies max ℓ positions; rows with a smaller ℓ see the rest as rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model import Draft

MAX_BACKOFF = 32


@dataclass
class DraftRecord:
    """One sequence's DSpark history: drafts verified, accepted and promised, and when it asks for a draft again."""

    prior: float = 1.0  # the replica's calibration when the sequence joined
    proposed: int = 0
    accepted: int = 0
    promised: float = 0.0  # Σ aₖ the head promised for the drafts verified
    wait: int = 0  # steps before it is due again
    backoff: int = 1

    @property
    def calibration(self) -> float:
        """s: accepted over promised drafts, starting from the prior."""
        return (self.accepted + self.prior) / (self.promised + 1.0)

    def due(self, threshold: float) -> bool:
        """Whether a draft could pay for this row now (s·aₖ ≤ s, so s < threshold rules every draft out)."""
        return self.wait == 0 and self.calibration >= threshold

    def record(self, proposed: int, accepted: int, promised: float) -> None:
        """After a step that drafted: a row that kept no draft backs off."""
        self.proposed += proposed
        self.accepted += accepted
        self.promised += promised
        self.backoff = 1 if proposed else min(2 * self.backoff, MAX_BACKOFF)
        self.wait = 0 if proposed else self.backoff

    def skip(self) -> None:
        """After a step that did not draft."""
        self.wait = max(0, self.wait - 1)


def draft_lengths(
    draft: Draft,
    threshold: float,
    max_draft: int,
    budgets: Sequence[int],
    stop_ids: Sequence[frozenset[int]],
    calibration: Sequence[float],
) -> Tensor:
    """int64 [B]: the drafts row b verifies. `budgets[b]`: tokens it may still emit (≥ 1); `calibration[b]`: its s."""
    s = torch.tensor(calibration, dtype=draft.confidence.dtype, device=draft.confidence.device).unsqueeze(1)
    kept = (s * draft.confidence.cumprod(-1) >= threshold).sum(-1).clamp(max=max_draft).tolist()
    tokens = draft.tokens.tolist()
    for b, (budget, stops) in enumerate(zip(budgets, stop_ids, strict=True)):
        cap = budget - 1  # a step emits the accepted drafts plus one token
        stop_at = next((k for k, t in enumerate(tokens[b]) if t in stops), None)
        if stop_at is not None:
            cap = min(cap, stop_at + 1)
        kept[b] = min(kept[b], cap)
    return torch.tensor(kept, dtype=torch.int64)


def predicted(draft: Draft, lengths: Tensor) -> list[float]:
    """Σ_{k<ℓ_b} a_k per row: the accepted length the head promised for the drafts verified."""
    a = draft.confidence.cumprod(-1)
    verified = torch.arange(a.shape[1], device=a.device) < lengths.to(a.device).unsqueeze(1)
    return (a * verified).sum(-1).tolist()


class Calibration:
    """The replica's accepted and promised drafts, decayed every engine step: the prior of new sequences."""

    def __init__(self, half_life_steps: float = 64.0) -> None:
        self.accepted = 0.0
        self.promised = 0.0
        self._decay = 0.5 ** (1.0 / half_life_steps)

    @property
    def ratio(self) -> float:
        return (self.accepted + 1.0) / (self.promised + 1.0)

    def add(self, accepted: float, promised: float) -> None:
        self.accepted += accepted
        self.promised += promised

    def tick(self) -> None:
        self.accepted *= self._decay
        self.promised *= self._decay


def trim(draft: Draft, width: int) -> Draft:
    """The first `width` drafts of every row (a prefix of a draft chain is itself a valid draft chain)."""
    return Draft(draft.tokens[:, :width], draft.probs[:, :width], draft.confidence[:, :width])
