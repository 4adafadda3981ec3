"""What a sequence's DSpark drafts are worth, and which of them it may verify at all.

The confidence head estimates cₖ = P(draft k accepted | drafts before it accepted), so Π_{i≤k} cᵢ is the chance draft
k is accepted at all; the scheduler (scheduler.py) weighs aₖ = s·Π_{i≤k} cᵢ against what verifying costs.

s calibrates the head online, per sequence: (accepted + s₀) / (Σ Π cᵢ promised for the drafts verified + 1), the ratio
of what verification accepted to what the head promised (the paper calibrates offline, by Sequential Temperature
Scaling). The prior s₀ is the replica's own ratio over recent verifications (`Calibration`), so a new sequence starts
from what the drafter has been worth lately. A calibrated head keeps s ≈ 1; a drafter that is confidently wrong — an
untrained DSpark — drives s towards 0 within a step or two, and its drafts are then worth nothing to the scheduler.
Before its first draft a sequence is forecast from the replica's typical draft (Π cᵢ per position, averaged over
recent drafts), and hopefully (Π cᵢ = 1) only before the replica has drafted at all. The replica's figures forget (a
half-life in engine steps).

Two caps keep what verification commits equal to what the stream emits: a row never verifies beyond its output
budget, nor past its first draft that is a stop token (so the cache never holds tokens the client did not get).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class DraftRecord:
    """One sequence's DSpark history: drafts verified, accepted and promised, and its last draft's confidences."""

    prior: float = 1.0  # the replica's calibration when the sequence joined
    proposed: int = 0
    accepted: int = 0
    promised: float = 0.0  # Σ Π cᵢ the head promised for the drafts verified
    last: list[float] | None = None  # Π_{i≤k} cᵢ of its latest draft (the replica's typical one before its first)

    @property
    def calibration(self) -> float:
        """s: accepted over promised drafts, starting from the prior."""
        return (self.accepted + self.prior) / (self.promised + 1.0)

    def drafted(self, confidence: Sequence[float]) -> list[float]:
        """A new draft's confidences cₖ → its aₖ = s·Π_{i≤k} cᵢ (at most 1); remembered as the next draft's forecast."""
        self.last = list(itertools.accumulate(confidence, lambda p, c: p * c))
        return self.forecast(len(confidence))

    def forecast(self, drafts: int) -> list[float]:
        """aₖ expected of the next draft: the latest draft's, recalibrated (s for every k without one)."""
        s = self.calibration
        products = self.last if self.last is not None else [1.0] * drafts
        return [min(1.0, s * p) for p in products[:drafts]]

    def record(self, proposed: int, accepted: int) -> float:
        """After a verify: `proposed` of the latest draft's drafts were verified and `accepted` of them accepted.
        Returns what the head promised for them."""
        assert self.last is not None
        promised = sum(self.last[:proposed])
        self.proposed += proposed
        self.accepted += accepted
        self.promised += promised
        return promised


def draft_caps(
    tokens: Sequence[Sequence[int]], budgets: Sequence[int], stop_ids: Sequence[frozenset[int]]
) -> list[int]:
    """The most drafts each row may verify: its budget cap, cut after its first draft that is a stop token."""
    caps = []
    for row, budget, stops in zip(tokens, budgets, stop_ids, strict=True):
        stop_at = next((k for k, t in enumerate(row) if t in stops), None)
        caps.append(budget if stop_at is None else min(budget, stop_at + 1))
    return caps


class Calibration:
    """The replica's accepted and promised drafts, and its drafts' Π cᵢ by position, decayed every engine step: what
    a new sequence starts from."""

    def __init__(self, half_life_steps: float = 64.0) -> None:
        self.accepted = 0.0
        self.promised = 0.0
        self._products: list[float] = []  # Σ Π_{i≤k} cᵢ of recent drafts, by position k
        self._drafts = 0.0
        self._decay = 0.5 ** (1.0 / half_life_steps)

    @property
    def ratio(self) -> float:
        return (self.accepted + 1.0) / (self.promised + 1.0)

    @property
    def typical(self) -> list[float] | None:
        """The mean Π_{i≤k} cᵢ of recent drafts by position (None before any)."""
        return [p / self._drafts for p in self._products] if self._drafts else None

    def add(self, accepted: float, promised: float) -> None:
        self.accepted += accepted
        self.promised += promised

    def drafted(self, products: Sequence[float]) -> None:
        """A row's new draft, its Π_{i≤k} cᵢ."""
        self._products = [a + b for a, b in itertools.zip_longest(self._products, products, fillvalue=0.0)]
        self._drafts += 1.0

    def tick(self) -> None:
        self.accepted *= self._decay
        self.promised *= self._decay
        self._products = [p * self._decay for p in self._products]
        self._drafts *= self._decay
