"""The token masks of one forward's rows, applied to the logits before anything samples from them.

Each row masks by its sequence's guide (guide.py); a row without one, or whose guide allows everything next (it is
reasoning), is left alone. Two kinds of forward are masked:

- a plain step or a first token: logits [B, V] at the guides' current state;
- a DSpark verify: logits [B, 1+W, V], position j at the state after the pending token and the row's drafts 1..j,
  so the target distribution the drafts are judged against is the constrained one and verification stays lossless.

A DSpark draft chain masks its first link only, at the guides' current state: the masks of link k > 1 depend on the
drafts before it, and filling them would make the host wait for the device at every link. The grammar judges the
chain once it has run instead (`admitted`): a row verifies only the drafts its guide takes, and the verify's masks
are filled beside its forward. A draft the constraint refuses costs its row the drafts after it, never a token of
the output; the first link's mask keeps most of the acceptance of a chain masked throughout (docs/benchmarks.md).

Masks are int32 bitmasks filled on the host by xgrammar and applied where the logits are, by xgrammar's CPU kernel
or its Triton kernel on a GPU (the bitmask copied there on a side stream, beside the forward still running). A
position's rows are filled in shares on a pool of threads kept for the process (xgrammar lets go of the GIL while it
fills), each share one call of xgrammar's batch fill on its thread: xgrammar's own threaded fill starts a fresh pool
per call, which costs more than a batch's fill on some hosts. A fill first lets each guide's matcher take the tokens
its sequence emitted since (`Guide.follow`), so that work overlaps the forward too.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import numpy as np
import torch
import xgrammar as xgr
from torch import Tensor

from decode_svc.guide import Guide

SHARE_ROWS = 8  # the fewest rows a fill thread takes: a hand-off costs about what a few rows' fill does


class Masks:
    """The masks of one forward over rows whose guides are `guides` (None: an unconstrained row); `drafts`: a
    verify's, per row the drafts it verifies (each taken by the row's guide: `admitted`)."""

    def __init__(self, guides: Sequence[Guide | None], drafts: Sequence[Sequence[int]] | None = None) -> None:
        self.guides = guides
        self.drafts = drafts if drafts is not None else [()] * len(guides)
        self._applied = False

    def apply(self, logits: Tensor) -> None:
        """Mask logits [B, V] (the next position) or [B, 1+W, V] (a verify over W ≥ every row's drafts) in place —
        the first logits given only: the later links of a draft chain stay unmasked."""
        if self._applied:
            return
        self._applied = True
        T = logits.shape[1] if logits.dim() == 3 else 1
        widest = max(map(len, self.drafts), default=0)
        if widest >= T:
            raise ValueError(f"a verify over {T - 1} drafts cannot mask a row of {widest}")
        flat = logits.view(-1, logits.shape[-1])
        _apply(flat, *self.fill(T, flat.shape[1], pinned=logits.is_cuda))

    def fill(self, T: int, vocab: int, pinned: bool) -> tuple[Tensor, list[int]]:
        """The host half of `apply`: the bitmask [B·T, ⌈vocab/32⌉] of T positions per row (row b·T + j: row b's
        position j; `pinned`: page-locked, in this thread's buffer until its next fill, copied to a GPU without a
        wait) and the rows of it that restrict anything — the only rows written (the others are never applied)."""
        shape = (len(self.guides) * T, -(-vocab // 32))
        words = _staging().rows(*shape) if pinned else torch.empty(shape, dtype=torch.int32)
        masked: list[int] = []

        def fill(j: int, rows: list[int]) -> None:
            masked.extend(_fill(words, {b * T + j: self.guides[b] for b in rows}))  # type: ignore[misc]

        _walk(self.guides, self.drafts, fill)
        return words, masked


def admitted(guides: Sequence[Guide | None], drafts: Sequence[Sequence[int]]) -> list[int]:
    """How many leading drafts of each row its guide takes (all of an unconstrained row's); the guides are left where
    they were."""
    return _walk(guides, drafts)


def set_fill_threads(threads: int) -> int:
    """The threads a fill spreads a position's rows over, its own included (0: half the cores); returns the count. A
    share whose thread waits for a core holds up the whole fill: a host whose cores other work shares may fill sooner
    on fewer."""
    global _threads
    if threads < 0:
        raise ValueError(f"fill threads must be >= 0, got {threads}")
    _threads = threads or _half_the_cores()
    return _threads


def _half_the_cores() -> int:
    """Half the cores this process may use, as xgrammar advises for its own fill threads."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


_threads = _half_the_cores()  # set_fill_threads


Visit = Callable[[int, list[int]], None]


def _walk(guides: Sequence[Guide | None], drafts: Sequence[Sequence[int]], visit: Visit | None = None) -> list[int]:
    """Move every guide along its row's drafts, one position at a time for the whole batch, until it refuses one or
    they run out; `visit(j, rows)` sees the rows whose guides stand after their j-th draft. Every guide ends where it
    started. Returns the drafts each row's guide took."""
    taken = [len(d) if g is None else 0 for g, d in zip(guides, drafts, strict=True)]
    rows = [b for b, g in enumerate(guides) if g is not None]
    j = 0
    while rows:
        if visit is not None:
            visit(j, rows)
        rows = [b for b in rows if j < len(drafts[b]) and guides[b].accept(drafts[b][j])]  # type: ignore[union-attr]
        for b in rows:
            taken[b] += 1
        j += 1
    for guide, n in zip(guides, taken, strict=True):
        if guide is not None:
            guide.rollback(n)
    return taken


def _fill(bitmask: Tensor, guides: dict[int, Guide]) -> list[int]:
    """Fill bitmask row i with what guides[i] allows next, for each row of `guides`; returns the rows restricted."""
    live = {i: g for i, g in guides.items() if g.restricts}
    grammar: list[int] = []
    banned_only: list[int] = []
    banned: dict[int, list[int]] = {}  # token → the rows that ban it (every row bans the same few, usually)
    for i, guide in live.items():
        (grammar if guide.grammar_active else banned_only).append(i)
        for token in guide.banned_now:
            banned.setdefault(token, []).append(i)
    if grammar:
        _fill_grammar(bitmask, [live[i].matcher for i in grammar], grammar)  # type: ignore[misc]
    words = bitmask.numpy()
    words[banned_only] = -1  # every token, less the banned ones below
    for token, rows in banned.items():
        words[rows, token // 32] &= np.int32(_int32(~(1 << (token % 32))))
    return list(live)


def _fill_grammar(bitmask: Tensor, matchers: list[xgr.GrammarMatcher], rows: list[int]) -> None:
    """Fill bitmask row rows[k] with what matchers[k] allows next, in interleaved shares of at least SHARE_ROWS rows,
    one per fill thread (the first share on this one)."""
    shares = max(1, min(_threads, len(rows) // SHARE_ROWS))
    pool = _pool(_threads)
    others = [pool.submit(_batch_fill, bitmask, matchers[k::shares], rows[k::shares]) for k in range(1, shares)]
    try:
        _batch_fill(bitmask, matchers[::shares], rows[::shares])
    finally:
        futures.wait(others)
    for other in others:
        other.result()


def _batch_fill(bitmask: Tensor, matchers: list[xgr.GrammarMatcher], rows: list[int]) -> None:
    """xgrammar's batch fill on this thread alone (its batch fill object is the thread's own)."""
    if not hasattr(_LOCAL, "filler"):
        _LOCAL.filler = xgr.BatchGrammarMatcher(1)
    _LOCAL.filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def _int32(value: int) -> int:
    """A Python int's low 32 bits as a signed int32 (the bitmask's element type)."""
    return (value + 2**31) % 2**32 - 2**31


def _apply(logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
    """Set the logits of every disallowed token of `rows` to −inf."""
    if not rows:
        return
    if logits.device.type == "cuda":
        bitmask = _to_gpu(bitmask, logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def _to_gpu(bitmask: Tensor, device: torch.device) -> Tensor:
    """This thread's page-locked bitmask copied to `device` on a side stream: the copy runs while the forward that
    makes the logits is still on the current stream (not queued behind it), which waits for the copy only where it
    applies."""
    current, side = torch.cuda.current_stream(device), _copy_stream(device)
    with torch.cuda.stream(side):  # its destination comes from the side stream's own pool
        copied = bitmask.to(device, non_blocking=True)
        _staging().copied()
    current.wait_stream(side)
    copied.record_stream(current)  # reused only once the current stream's work on it is done
    return copied


_LOCAL = threading.local()  # per thread: its batch fill object and page-locked bitmask buffer


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def _pool(threads: int) -> futures.ThreadPoolExecutor:
    """The fill threads besides the filling one, kept for the process."""
    return futures.ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="mask-fill")


class _Staging:
    """A page-locked bitmask buffer, reused by every fill of its thread's forwards: a fresh pinned allocation per step
    would cost more than the fill it serves. A fill waits for the copy from the buffer issued before it (long done by
    then: it ran beside the forward that came before)."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.done: torch.cuda.Event | None = None  # the last copy from the buffer

    def rows(self, n: int, words: int) -> Tensor:
        """The buffer's first n rows of `words` int32 each (grown, never shrunk)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if self.buffer is None or self.buffer.shape[0] < n or self.buffer.shape[1] != words:
            rows = max(n, 0 if self.buffer is None else self.buffer.shape[0])
            self.buffer = torch.empty((rows, words), dtype=torch.int32, pin_memory=True)
        return self.buffer[:n]

    def copied(self) -> None:
        """On the stream that copied from the buffer: note the copy."""
        self.done = torch.cuda.Event()
        self.done.record()


def _staging() -> _Staging:
    """This thread's page-locked bitmask buffer."""
    if not hasattr(_LOCAL, "staging"):
        _LOCAL.staging = _Staging()
    return _LOCAL.staging
