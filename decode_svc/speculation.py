"""What a sequence's DSpark drafts are worth, and which of them it may verify at all.

The confidence head estimates cₖ = P(draft k accepted | drafts before it accepted), so Π_{i≤k} cᵢ is the chance draft
k is accepted at all; the scheduler (scheduler.py) weighs aₖ = s·Π_{i≤k} cᵢ of a draft in hand against what verifying
it costs.

s calibrates the head online, per sequence: (accepted + s₀) / (Σ Π cᵢ promised for the drafts verified + 1), the ratio
of what verification accepted to what the head promised (the paper calibrates offline, by Sequential Temperature
Scaling). The prior s₀ is the replica's own ratio over recent verifications of rows drawn alike (`Calibration`, one for
greedy rows and one for sampled rows, whose drafts are accepted less often), so a new sequence starts from what the
drafter has been worth lately to rows like it. A calibrated head keeps s ≈ 1; a drafter that is confidently wrong — an
untrained DSpark — drives s towards 0 within a step or two, and its drafts are then worth nothing to the scheduler.

Whether to draft at all is decided before the draft exists, on a forecast of its aₖ: what the sequence's recent
verifies accepted at each draft position (a verify that rejects draft j accepted none after it), decayed per verify
(OUTCOME_HALF_LIFE). A draft's outcome foretells the next draft's better than its confidences do: runs of accepted
drafts (a loop, a quoted span) and of rejected ones come in stretches. While a sequence does not verify, its forecast
relaxes towards the replica's typical outcome (RELAX_HALF_LIFE plain steps), so a stretch of rejected drafts pauses
its drafting, which resumes by itself where drafts typically pay. A replica that never verified forecasts hopefully
(every draft accepted). The replica's figures forget (a half-life in engine steps).

Two caps keep what verification commits equal to what the stream emits: a row never verifies beyond its output
budget, nor past its first draft that is a stop token (so the cache never holds tokens the client did not get).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

OUTCOME_HALF_LIFE = 1.0  # verifies: a sequence's forecast follows its latest outcomes closely
RELAX_HALF_LIFE = 4.0  # plain steps: a sequence's stale forecast gives way to the replica's typical outcome


def outcome(drafts: int, proposed: int, accepted: int) -> list[float]:
    """What a verify tells of each of a draft's positions: 1 accepted, 0 not. Positions past the `proposed` ones are
    known only after a rejection (no draft after a rejected one is accepted); after a verify that accepted all it was
    shown, they are left out."""
    known = drafts if accepted < proposed else proposed
    return [1.0 if k < accepted else 0.0 for k in range(known)]


def stretch(values: Sequence[float], n: int) -> list[float]:
    """`values` cut or extended to n positions, a position past the known ones taking the last known value."""
    return [*values[:n], *[values[-1]] * (n - len(values))]


@dataclass
class DraftRecord:
    """One sequence's DSpark history: drafts verified, accepted and promised, its last draft's confidences, and what
    its recent verifies accepted by draft position."""

    prior: float = 1.0  # the replica's calibration when the sequence joined
    proposed: int = 0
    accepted: int = 0
    promised: float = 0.0  # Σ Π cᵢ the head promised for the drafts verified
    last: list[float] | None = None  # Π_{i≤k} cᵢ of its latest draft
    outcomes: list[float] | None = None  # by draft position: the recent verifies' acceptance, decayed per verify
    idle: int = 0  # steps since its last verify

    @property
    def calibration(self) -> float:
        """s: accepted over promised drafts, starting from the prior."""
        return (self.accepted + self.prior) / (self.promised + 1.0)

    def drafted(self, confidence: Sequence[float]) -> list[float]:
        """A new draft's confidences cₖ → its aₖ = s·Π_{i≤k} cᵢ (at most 1)."""
        self.last = list(itertools.accumulate(confidence, lambda p, c: p * c))
        s = self.calibration
        return [min(1.0, s * p) for p in self.last]

    def forecast(self, drafts: int, typical: Sequence[float] | None) -> list[float]:
        """aₖ expected of the next draft, before it exists: the sequence's recent outcomes, relaxed towards the
        replica's `typical` ones by the steps since its last verify (`typical` None: a replica that never verified —
        every draft accepted)."""
        base = stretch(typical, drafts) if typical else [1.0] * drafts
        if self.outcomes is None:
            return base
        w = 0.5 ** (self.idle / RELAX_HALF_LIFE)
        return [w * o + (1.0 - w) * b for o, b in zip(stretch(self.outcomes, drafts), base, strict=True)]

    def waited(self) -> None:
        """A step of its lane verified none of its drafts."""
        self.idle += 1

    def record(self, proposed: int, accepted: int) -> tuple[float, list[float]]:
        """After a verify: `proposed` of the latest draft's drafts were verified and `accepted` of them accepted.
        Returns what the head promised for them and what the verify told of each position (`outcome`)."""
        assert self.last is not None
        promised = sum(self.last[:proposed])
        self.proposed += proposed
        self.accepted += accepted
        self.promised += promised
        seen = outcome(len(self.last), proposed, accepted)
        if seen:
            old = seen if self.outcomes is None else stretch(self.outcomes, max(len(seen), len(self.outcomes)))
            d = 0.5 ** (1.0 / OUTCOME_HALF_LIFE)
            renewed = [d * o + (1.0 - d) * x for o, x in zip(old[: len(seen)], seen, strict=True)]
            self.outcomes = renewed + old[len(seen) :]
            self.idle = 0
        return promised, seen


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
    """The replica's accepted and promised drafts, and its verifies' outcomes by draft position, decayed every engine
    step: what a new sequence starts from, and what a sequence's stale forecast relaxes to."""

    def __init__(self, half_life_steps: float = 64.0) -> None:
        self.accepted = 0.0
        self.promised = 0.0
        self._hits: list[float] = []  # drafts accepted, by position k
        self._trials: list[float] = []  # verifies that tell of position k (speculation.outcome)
        self._decay = 0.5 ** (1.0 / half_life_steps)

    @property
    def ratio(self) -> float:
        return (self.accepted + 1.0) / (self.promised + 1.0)

    @property
    def typical(self) -> list[float] | None:
        """The share of recent verifies that accepted each draft position, up to the last one known (None before
        any)."""
        return [h / t for h, t in zip(self._hits, self._trials, strict=True)] or None

    def add(self, accepted: float, promised: float, seen: Sequence[float]) -> None:
        """A row's verify: drafts accepted, what the head promised for them, and its `outcome`."""
        self.accepted += accepted
        self.promised += promised
        for k, x in enumerate(seen):
            if k == len(self._trials):
                self._hits.append(0.0)
                self._trials.append(0.0)
            self._hits[k] += x
            self._trials[k] += 1.0

    def tick(self) -> None:
        self.accepted *= self._decay
        self.promised *= self._decay
        self._hits = [h * self._decay for h in self._hits]
        self._trials = [t * self._decay for t in self._trials]
