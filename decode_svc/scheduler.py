"""DSpark's hardware-aware prefix scheduler (reference §4.4): whether a step of the speculative lane drafts, and how
many drafts it verifies.

a_{r,j} = s_r·Π_{i≤j} c_{r,i} is the chance row r's draft j is accepted (speculation.DraftRecord). Verifying ℓ_r
drafts of every row is expected to emit τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}) tokens and costs one forward over the verify
batch B, so the step's throughput is Θ = τ·SPS(B), with SPS(B) = 1 / seconds(B) from the engine's own measured step
times (step_times.StepTimes): on a CPU a verify column costs about a plain step, on a GPU it is nearly free, and the
rule reads which from the measurements.

Our verify forward is a rectangle, R rows × (1 + W) tokens for the widest ℓ_r = W: drafts of a row up to the batch's
width cost nothing more, and widening costs a whole column, B = R·(1 + W). The paper admits (row, position) pairs in
descending a and stops at the first that does not raise Θ; over a rectangle the pairs that cost something are the
columns, and what a column adds, Σ_r a_{r,W+1}, falls as W grows (a falls along each row). So the greedy widens W one
column at a time while Θ(W) = τ(W) / seconds(R·(1 + W)) rises, and stops at the first column that does not raise it;
every row then verifies min(W, cap_r) drafts (speculation.draft_caps). W = 0 is a plain step (R tokens).

Before drafting, the step would also pay the DSpark forward, and its confidences are not known yet: the lane drafts when
the best plan on each row's forecast beats a plain step, the draft's seconds counted. A row's forecast is what its
recent verifies accepted by draft position, relaxing towards the replica's typical outcome while it does not verify
(speculation.DraftRecord.forecast): a stretch of rejected drafts pauses a row's drafting, and the drafting resumes by
itself where drafts typically pay. Where they do not, nothing would renew the forecast, so after PROBE_MIN plain steps
in a row the lane drafts once anyway (a probe), doubling the wait after each probe up to PROBE_MAX; a step that drafts
on its forecast resets the wait.

The forecast can be wrong in ways the outcomes do not see: a step drafts where its rows' outcomes were best, which
regress; step times are read off sizes never measured (a batch wider than the start-up profile's); a width that the
real confidences then cut to 0. So the scheduler calibrates its own forecasts: after each drafted step it compares the
throughput gain the step realised (its tokens over its forwards' measured seconds, against a plain step's rate) with
the gain its forecast promised, and `trust` — realised over promised, over recent drafted steps (a half-life of
TRUST_HALF_LIFE of them, starting from 1) — scales every forecast. Drafts that keep losing to plain steps thus stop
after a step or two, and a probe that wins earns trust back. Those errors depend on the batch (a width of 24 rows
read off a profile of 2, a harness that waits between wide steps) and on how its tokens are drawn (a greedy row keeps
a draft that is its target's arg-max, a sampled row one that is the token its sampling draws there: fewer, and a
forecast built on the other kind's outcomes misleads), so each batch bucket (rows rounded up to a power of two, as
the step graphs' buckets) keeps two trusts, one for all-greedy batches and one for batches with a sampled row: a
wide batch's losses do not silence a lone row's drafts, nor sampled rows' losses a greedy row's.

Where verifying is free of its width (the verify's measured seconds flat in W within FLAT, a GPU at small batches),
the engine launches the widest verify right behind the draft, before the host has read the confidences (`ahead`):
the device does not idle while the host decides, and the verify accepts every draft the caps allow — the forward has
run over all of them, so a narrower width would only drop tokens already paid for. Such a step is planned as what it
will be, the widest verify behind the draft; the verify table's narrow widths, which such steps no longer measure,
do not weigh on it.

`full=True` verifies every draft the caps allow, on every step: what the rule does when verification is free, kept as
a policy for measuring acceptance and for tests.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence

from decode_svc.step_times import Forward, StepTimes

PROBE_MIN = 8
PROBE_MAX = 256
TRUST_HALF_LIFE = 8.0  # drafted steps
FLAT = 0.05  # a verify at most this much dearer than the narrowest costs nothing for its width

Rows = Sequence[Sequence[float]]  # a_{r,j}: rows × draft positions


class Plan(enum.Enum):
    PLAIN = "plain"  # no draft: one token per row
    DRAFT = "draft"  # the forecast says drafting pays
    PROBE = "probe"  # it does not, but the forecast is stale: draft to renew it


def bucket(rows: int) -> int:
    """The batch bucket of `rows` rows: the least power of two at least as large."""
    return 1 << max(0, rows - 1).bit_length()


def expected_tokens(a: Rows, caps: Sequence[int], width: int) -> float:
    """τ(W): the tokens a verify of width W is expected to emit (each row min(W, cap_r) drafts + one token)."""
    return sum(1.0 + sum(row[: min(width, cap)]) for row, cap in zip(a, caps, strict=True))


def widen(a: Rows, caps: Sequence[int], seconds: Callable[[int], float], width: int) -> tuple[int, float]:
    """From `width`, add columns while the throughput τ(W) / seconds(W) rises → (the width, its throughput)."""
    best = expected_tokens(a, caps, width) / seconds(width)
    while width < max(caps, default=0):
        rate = expected_tokens(a, caps, width + 1) / seconds(width + 1)
        if rate <= best:
            break
        width, best = width + 1, rate
    return width, best


class DraftScheduler:
    """The speculative lane's decisions: `plan()` before a step (draft or not), `width()` once drafted, `realised()`
    after a drafted step."""

    def __init__(self, times: StepTimes, *, full: bool = False) -> None:
        self.times = times
        self.full = full
        self._idle = 0  # plain steps since the lane last drafted
        self._wait = PROBE_MIN  # plain steps before the next probe
        self._promised = 0.0  # the forecast gain of the drafted step under way
        self._key = (1, False)  # the trust it answers to: its (batch bucket, greedy)
        self._gains: dict[tuple[int, bool], list[float]] = {}  # decayed realised and promised gains, by key
        self._decay = 0.5 ** (1.0 / TRUST_HALF_LIFE)

    def trust(self, rows: int, greedy: bool = False) -> float:
        """Realised over promised throughput gain of recent drafted steps of `rows`' bucket, all-greedy batches or
        those with a sampled row (1 before any)."""
        realised, promised = self._gains.get((bucket(rows), greedy), (0.0, 0.0))
        return (realised + 1.0) / (promised + 1.0)

    def plan(self, forecasts: Rows, caps: Sequence[int], chained: bool = False, greedy: bool = False) -> Plan:
        """Whether this step drafts, given each row's forecast a and its cap (budget and --max-draft); `chained`: the
        batch can take a verify launched behind its draft (`ahead`); `greedy`: every row decodes greedily."""
        if max(caps, default=0) == 0:
            return Plan.PLAIN
        self._promised = self._gain(forecasts, caps, chained)
        self._key = (bucket(len(caps)), greedy)
        if self.full or self._promised * self.trust(len(caps), greedy) > 1.0:
            self._idle, self._wait = 0, PROBE_MIN
            return Plan.DRAFT
        self._idle += 1
        if self._idle < self._wait:
            return Plan.PLAIN
        self._idle, self._wait = 0, min(2 * self._wait, PROBE_MAX)
        return Plan.PROBE

    def ahead(self, rows: int, width: int) -> bool:
        """Whether a drafted step's verify may be launched at `width` columns right behind the draft, before its
        confidences are seen (it then judges every draft the caps allow): where every draft is verified anyway (`full`,
        or a forward still to measure), or where a verify that wide costs within FLAT of one column's — the forward
        is bound by the weights it reads, not its tokens, and choosing the width would save nothing."""
        if self.full or not self.times.measured(*Forward):
            return True
        verify = self._verify(rows)
        return verify(width) <= (1.0 + FLAT) * verify(1)

    def width(self, a: Rows, caps: Sequence[int]) -> int:
        """How many drafts the drafted step verifies (0: none, a plain step), on the draft's own a."""
        if self.full or not self.times.measured(*Forward):  # a forward never measured: measure it
            return max(caps, default=0)
        plain, verify = self.times.seconds(Forward.PLAIN, len(caps)), self._verify(len(caps))
        return widen(a, caps, lambda w: verify(w) if w else plain, 0)[0]

    def realised(self, rows: int, tokens: int, width: int) -> None:
        """The drafted step last planned emitted `tokens` verifying `width` columns (0: a plain step after the draft):
        its gain over a plain step, on the measured seconds of its forwards, against the gain its forecast promised."""
        if not self.times.measured(*Forward) or self._promised == math.inf:
            return
        seconds = self.times.seconds(Forward.DRAFT, rows) + (
            self._verify(rows)(width) if width else self.times.seconds(Forward.PLAIN, rows)
        )
        gain = tokens / seconds * self.times.seconds(Forward.PLAIN, rows) / rows
        realised, promised = self._gains.get(self._key, (0.0, 0.0))
        self._gains[self._key] = [realised * self._decay + gain, promised * self._decay + self._promised]

    def _gain(self, forecasts: Rows, caps: Sequence[int], chained: bool) -> float:
        """The throughput of drafting on the forecast over a plain step's, the draft's own seconds counted (∞ while a
        forward was never measured: measure it): at the widest width where the verify will go ahead, else at the
        width the rule would choose."""
        if not self.times.measured(*Forward):
            return math.inf
        rows, widest = len(caps), max(caps)
        draft, verify = self.times.seconds(Forward.DRAFT, rows), self._verify(rows)
        if chained and self.ahead(rows, widest):
            rate = expected_tokens(forecasts, caps, widest) / (draft + verify(widest))
        else:
            _, rate = widen(forecasts, caps, lambda w: draft + verify(w), 1)
        return rate * self.times.seconds(Forward.PLAIN, rows) / rows

    def _verify(self, rows: int) -> Callable[[int], float]:
        """seconds(W) of a verify of width W over `rows` rows: a forward over the rectangle's R·(1 + W) tokens."""
        return lambda w: self.times.seconds(Forward.VERIFY, rows * (1 + w))
