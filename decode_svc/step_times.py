"""What the engine's forwards cost on this machine, measured online: the SPS(B) of DSpark's scheduler (scheduler.py).

Three forwards, each keyed by the tokens it runs:
- PLAIN: `decode_step`, one token per row (R tokens; logits of the last position only);
- DRAFT: DSpark's blocks over γ positions per row and its Markov chain (keyed by the R rows);
- VERIFY: the target over [pending, drafts] of every row, a rectangle of R·(1 + W) tokens with logits everywhere.

Each (forward, tokens) keeps its latest WINDOW samples and answers their median: a step slowed by another process or
a page fault does not move it, and a machine that gets slower (longer contexts, a busier host) is followed within
WINDOW/2 steps. A size never measured is read off the measured ones: linearly between the nearest two, past the
largest along the last segment's slope (never falling: a forward over more tokens costs no less), below the smallest
as the smallest (a bound that never reaches 0). With one measured size every size costs the same until others are.

`profile()` seeds the table at start with a few forwards of a scratch batch; from then on every step the engine runs
adds a sample. On a GPU the verify column is nearly flat in the token count, on a CPU it climbs about linearly: the
scheduler reads which from here rather than being told.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import statistics
import time
from collections import deque
from collections.abc import Iterator

from model import DecodeBatch, SamplingParams, Transformer, encode_prefill

WINDOW = 15
PROFILE_ROWS = (1, 2)
PROFILE_REPEATS = 3
PROFILE_PROMPT = list(range(16))


class Forward(enum.Enum):
    PLAIN = "plain"
    DRAFT = "draft"
    VERIFY = "verify"


class StepTimes:
    """Seconds per forward by token count: the medians of recent samples, read between and beyond the sizes seen."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._samples: dict[Forward, dict[int, deque[float]]] = {f: {} for f in Forward}
        self._medians: dict[Forward, dict[int, float]] = {f: {} for f in Forward}
        self._sizes: dict[Forward, list[int]] = {f: [] for f in Forward}  # sorted

    def observe(self, forward: Forward, tokens: int, seconds: float) -> None:
        samples = self._samples[forward].get(tokens)
        if samples is None:
            samples = self._samples[forward][tokens] = deque(maxlen=self._window)
            bisect.insort(self._sizes[forward], tokens)
        samples.append(seconds)
        self._medians[forward][tokens] = statistics.median(samples)

    @contextlib.contextmanager
    def timed(self, forward: Forward, tokens: int) -> Iterator[None]:
        """Observe the seconds the block takes (a block that raises is not observed). It must end by reading a result
        on the host: on a GPU the kernels are queued, only then have they run."""
        started = time.perf_counter()
        yield
        self.observe(forward, tokens, time.perf_counter() - started)

    def known(self, forward: Forward) -> dict[int, float]:
        """{tokens: median seconds} of the sizes measured, by size."""
        return {n: self._medians[forward][n] for n in self._sizes[forward]}

    def measured(self, *forwards: Forward) -> bool:
        """Whether every one of `forwards` has been measured at some size."""
        return all(self._sizes[f] for f in forwards)

    def seconds(self, forward: Forward, tokens: int) -> float:
        """The expected seconds of `forward` over `tokens` tokens (it must have been measured at some size)."""
        known, sizes = self._medians[forward], self._sizes[forward]
        if tokens in known:
            return known[tokens]
        if not sizes:
            raise ValueError(f"no {forward.value} forward has been measured yet")
        if tokens < sizes[0] or len(sizes) == 1:
            return known[sizes[0]]
        j = min(bisect.bisect(sizes, tokens), len(sizes) - 1)
        lo, hi = sizes[j - 1], sizes[j]  # the segment around `tokens`, or the last one
        slope = (known[hi] - known[lo]) / (hi - lo)
        if tokens < hi:
            return known[lo] + slope * (tokens - lo)
        return known[hi] + max(slope, 0.0) * (tokens - hi)  # past the largest size: never cheaper for more tokens


def profile(model: Transformer, times: StepTimes, max_draft: int) -> None:
    """Seed `times`: plain, draft and verify forwards (the narrowest and the widest verify) of a short prompt at 1 and
    2 rows, PROFILE_REPEATS times each, on a scratch batch the engine then drops. Each timing ends when the host has
    read the result (on a GPU the kernels are queued: only then have they run)."""
    prompt = encode_prefill(model, PROFILE_PROMPT)
    batch = DecodeBatch(model, max(PROFILE_ROWS))
    for rows in PROFILE_ROWS:
        while len(batch) < rows:
            batch.join(prompt.blocks, prompt.encoder_state)
        pending, greedy = [0] * rows, SamplingParams.uniform(rows)
        for _ in range(PROFILE_REPEATS):
            with times.timed(Forward.PLAIN, rows):
                batch.decode_step(pending).argmax(-1).tolist()
            with times.timed(Forward.DRAFT, rows):
                draft = batch.dspark_draft(pending, greedy)
                draft.confidence.tolist()
            for width in sorted({1, max_draft}):
                with times.timed(Forward.VERIFY, rows * (1 + width)):
                    batch.verify(pending, draft.trim(width), greedy)  # reads its acceptance on the host
