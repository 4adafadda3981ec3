"""The token masks of one forward's rows, applied to the logits before anything samples from them.

Each row masks by its sequence's guide (guide.py); a row without one, or whose guide allows everything next (it is
reasoning), is left alone. Three uses, one per kind of forward:

- a plain step or a first token: logits [B, V] at the guides' current state;
- a DSpark draft chain: link k's logits [B, V] at the state after the pending token and drafts 1..k — `follow` moves
  the guides along each link's samples, and `close` adds the mask after the last draft, undoes the drafts and returns
  the chain's masks (`Chain`): one per position, and how many drafts of each row the grammar took;
- the verify forward: logits [B, 1+W, V], position j masked as link j of the chain was, so the target distribution
  the drafts are judged against is the constrained one and verification stays lossless.

Masks are int32 bitmasks filled on the host by xgrammar (one thread pool for the whole batch) and applied where the
logits are, by xgrammar's CPU kernel or its Triton kernel on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr
from torch import Tensor

from decode_svc.guide import Guide


@dataclass(frozen=True)
class Chain:
    """A draft chain's masks: bitmask [B, γ+1, words] (position j: after the pending token and drafts 1..j), the
    positions each row masks (`masked[b][j]`), and how many drafts of each row the grammar accepted."""

    bitmask: Tensor
    masked: list[list[bool]]
    valid: list[int]

    def trim(self, width: int) -> Chain:
        """The masks of a verify over the first `width` drafts."""
        return Chain(self.bitmask[:, : width + 1], [row[: width + 1] for row in self.masked], self.valid)


@functools.cache
def _filler() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher()


class Masks:
    """The masks of one forward over rows whose guides are `guides` (None: an unconstrained row)."""

    def __init__(self, guides: Sequence[Guide | None], chain: Chain | None = None) -> None:
        self.guides = guides
        self.chain = chain
        self._vocab, self._pinned = 0, False  # the logits' width and whether they live on a GPU, from the first apply
        self._links: list[Tensor] = []  # the bitmask of each link so far (a draft chain)
        self._masked: list[list[bool]] = []
        self._drafted = [0] * len(guides)  # drafts each guide followed
        self._refused: set[int] = set()  # rows whose guide refused a draft: the chain is cut there

    def apply(self, logits: Tensor) -> None:
        """Mask logits [B, V] (the next position) or [B, T, V] (a verify, from the chain) in place."""
        if logits.dim() == 3:
            assert self.chain is not None, "a verify's masks come from its draft chain"
            bitmask, masked = self.chain.bitmask[:, : logits.shape[1]], self.chain.masked
            rows = [b * logits.shape[1] + j for b, row in enumerate(masked) for j in range(logits.shape[1]) if row[j]]
            _apply(logits.view(-1, logits.shape[-1]), bitmask.reshape(-1, bitmask.shape[-1]), rows)
            return
        self._vocab, self._pinned = logits.shape[-1], logits.device.type == "cuda"
        bitmask, masked = self._fill()
        self._links.append(bitmask)
        self._masked.append(masked)
        _apply(logits, bitmask, [b for b, m in enumerate(masked) if m])

    def follow(self, tokens: Tensor) -> None:
        """The tokens [B] sampled from the last link: every guide follows its row's, until one refuses. Only guides
        whose masks depend on the tokens read them (reading them waits for the device)."""
        if all(g is None or g.static for g in self.guides):
            return
        for b, token in enumerate(tokens.tolist()):
            guide = self.guides[b]
            if guide is None or guide.static or b in self._refused:
                continue
            if guide.accept(token):
                self._drafted[b] += 1
            else:
                self._refused.add(b)

    def close(self) -> Chain:
        """After a draft chain: the mask past its last draft, then every guide back where the step started."""
        bitmask, masked = self._fill()
        self._links.append(bitmask)
        self._masked.append(masked)
        for guide, drafted in zip(self.guides, self._drafted, strict=True):
            if guide is not None:
                guide.rollback(drafted)
        drafts = len(self._links) - 1
        valid = [self._drafted[b] if b in self._refused else drafts for b in range(len(self.guides))]
        per_row = [list(row) for row in zip(*self._masked, strict=True)]
        stacked = torch.empty((len(self.guides), len(self._links), self._links[0].shape[-1]), dtype=torch.int32,
                              pin_memory=self._pinned)  # fmt: skip
        return Chain(torch.stack(self._links, 1, out=stacked), per_row, valid)

    def _fill(self) -> tuple[Tensor, list[bool]]:
        """The bitmask [B, words] of the next position (in pinned memory for a GPU's logits: copied without a wait),
        and which rows it restricts."""
        words = -(-self._vocab // 32)
        bitmask = torch.full((len(self.guides), words), -1, dtype=torch.int32, pin_memory=self._pinned)
        live = [
            g if g is not None and b not in self._refused and g.restricts else None for b, g in enumerate(self.guides)
        ]
        grammar = [b for b, g in enumerate(live) if g is not None and g.grammar_active]
        if grammar:
            _filler().batch_fill_next_token_bitmask([live[b].matcher for b in grammar], bitmask, grammar)  # type: ignore[union-attr]
        banned: dict[int, list[int]] = {}  # token → the rows that ban it (every row bans the same few, usually)
        for b, guide in enumerate(live):
            for token in guide.banned_now if guide is not None else ():
                banned.setdefault(token, []).append(b)
        for token, rows in banned.items():
            bitmask[rows, token // 32] &= _int32(~(1 << (token % 32)))
        return bitmask, [g is not None for g in live]


def _int32(value: int) -> int:
    """A Python int's low 32 bits as a signed int32 (the bitmask's element type)."""
    return (value + 2**31) % 2**32 - 2**31


def _apply(logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
    """Set the logits of every disallowed token of `rows` to −inf."""
    if not rows:
        return
    if logits.device.type == "cuda":
        bitmask = (bitmask if bitmask.is_pinned() else bitmask.pin_memory()).to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
