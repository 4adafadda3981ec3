"""Data-parallel attention in a decode rank group: each rank decodes its own sequences, so a group of W ranks holds
W times the rows of one.

    rank 0   engine ─▶ SpreadBatch (a lane's rows, the engine's DecodeBatch)
                         │ one `spread` plan per call: each rank its own rows' arguments (model_service.ranks)
    rank r   RankRows: its own DecodeBatch; runs its rows' part of the call (none when it holds none), then answers
             the other ranks' MoE rounds until every rank is done (`Transformer.serve_idle`); its logits reach rank 0
             by one gather on the device, the rest of its result with its report on the plan (`gather_object`)

A joining sequence goes to the rank holding the fewest rows over the engine's lanes, counting the local prefills
running there (the lowest rank on a tie). A token-ids prompt decode prefills itself is placed when its prefill starts:
its chunks run on that rank only, the others answering their MoE rounds (`SpreadPrefill`), and it joins that rank.
Rows are ordered rank by rank, each rank's in its own batch's order; batched arguments and results follow that order,
so the engine calls a `SpreadBatch` as it calls a `DecodeBatch`. Sampling stays where it is at W = 1: rank 0 samples a
plain step's logits (a row under a grammar decodes in plain steps: its masks live in rank 0's grammar matcher),
while DSpark's draft and verify sample inside the model, on the rank holding the row (a row's noise is keyed by its
seed and output positions, which travel with the plan: sampler.py), masked there by a copy of the row's guide when
it bans tokens only (it travels with the plan). A draft's distributions stay on the ranks that drew them, for their
verify; a verify's accepted tokens come back with the plan's report, and its logits only for the rows whose requests
report logprobs (rank 0 reads them for nothing else).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import Gauge
from torch import Tensor

from decode_svc.local_prefill import LocalPrefill, OnRank, Prefill, Restorable
from decode_svc.masking import Masks
from model import DecodeBatch, Past, PrefillOutput, SamplingParams, Transformer
from model.decode import SequenceExport, VerifyResult
from model.dspark import Draft
from model_service.ranks import GroupCalls, ModelCalls, Outcome

Part = tuple[Any, list[Tensor] | None, list[int]]  # a rank's part of a call: small results, gathered logits, row order
Lanes = Callable[[], Iterable[Any]]  # every lane's batch of the engine
Prefills = Callable[[], Iterable[Any]]  # the engine's local prefills (SpreadPrefills)


def new_batch(
    calls: ModelCalls, capacity: int, lanes: Lanes, prefills: Prefills, rows: Gauge
) -> DecodeBatch | SpreadBatch:
    """A lane's batch of `capacity` rows per rank: one process's DecodeBatch, or spread over a rank group (`lanes`
    and `prefills`: where the group's rows are, and those about to join; `rows`: the gauge of each rank's, labelled
    by rank)."""
    if isinstance(calls, GroupCalls):
        return SpreadBatch(calls, capacity, lanes, prefills, rows)
    return calls.new(DecodeBatch, capacity=capacity)


def new_prefill(
    calls: ModelCalls, batch: DecodeBatch | SpreadBatch, token_ids: list[int], past: Past | None, chunk_tokens: int
) -> Prefill:
    """A token-ids prompt's local prefill, to join `batch` (its lane's): in this process, or on the rank of a group
    the prompt will join."""
    if isinstance(batch, SpreadBatch):
        return batch.prefill(token_ids, past, chunk_tokens)
    return calls.new(LocalPrefill, token_ids, past, chunk_tokens)


class RankPrefill:
    """One rank's part of a local prefill that rank `rank` runs: there, the prompt's next chunk; on every rank, then,
    the other ranks' MoE rounds until all are done."""

    def __init__(
        self, model: Transformer, rank: int, token_ids: list[int], past: Past | None, chunk_tokens: int
    ) -> None:
        self.model = model
        self.prefill = LocalPrefill(model, token_ids, past, chunk_tokens) if model.parallel.rank == rank else None

    def advance(self) -> tuple[int, PrefillOutput | None] | None:
        """→ (tokens encoded, the output once done) on the rank running it; None elsewhere."""
        try:
            if self.prefill is None:
                return None
            self.prefill.advance()
            return self.prefill.position, self.prefill.output
        finally:
            self.model.serve_idle()


class SpreadPrefill(Prefill):
    """Rank 0's side of a local prefill in a rank group: its chunks run on `rank` alone, the rank its sequence will
    join, so a group does one prefill's work, not W. That rank reports its position after each chunk and its output
    after the last (the blocks rank 0 writes back to the cache); the sequence then joins it (`OnRank`)."""

    def __init__(
        self, calls: GroupCalls, rank: int, token_ids: list[int], past: Past | None, chunk_tokens: int
    ) -> None:
        super().__init__(past)
        self.calls, self.rank = calls, rank
        self.ranks = calls.new(RankPrefill, rank, token_ids, past, chunk_tokens)
        self._position = 0

    @property
    def position(self) -> int:
        return self._position

    @property
    def restorable(self) -> OnRank:
        """The prefilled prompt, to join the rank that prefilled it."""
        return OnRank(self.rank, self._prompt())

    def _chunk(self) -> None:
        outcomes = self.calls.spread(self.ranks, "advance", [()] * self.calls.world_size)
        self._position, self.output = _values(outcomes)[self.rank]


class RankRows:
    """One rank's rows of a lane. Each call runs this rank's part; its small results go back to rank 0 with the plan's
    report (`Part`), its logits by one gather on the device (rank 0 gets every rank's, padded to `rows`)."""

    def __init__(self, model: Transformer, capacity: int) -> None:
        self.model, self.batch = model, DecodeBatch(model, capacity)
        self.draft: Draft | None = None  # the last draft of these rows, for their verify

    def join_many(self, prompts: list[Restorable], rows: int) -> Part:
        """→ (the joined seq ids, in prompt order; their first logits gathered)."""

        def join() -> tuple[list[int], Tensor]:
            joined = self.batch.join_many(prompts)
            return [s for s, _ in joined], torch.stack([logits for _, logits in joined])

        return self._forward(join, bool(prompts), rows, ())

    def leave(self, seq_ids: list[int]) -> Part:
        return [self.batch.leave(s) for s in seq_ids], None, self.batch.seq_ids

    def decode_step(self, tokens: list[int], rows: int) -> Part:
        return self._forward(lambda: (None, self.batch.decode_step(tokens)), bool(tokens), rows, ())

    def dspark_draft(self, tokens: list[int], sampling: SamplingParams) -> Part:
        """→ ((draft tokens, confidences), nothing gathered)."""

        def draft() -> tuple[tuple[Tensor, Tensor], None]:
            self.draft = self.batch.dspark_draft(tokens, sampling)
            return (self.draft.tokens, self.draft.confidence), None

        return self._forward(draft, bool(tokens))

    def verify(
        self,
        tokens: list[int],
        width: int,
        sampling: SamplingParams,
        lengths: Tensor,
        kept: list[int],
        rows: int,
    ) -> Part:
        """Verify the first `width` drafts of this rank's last draft → ((accepted, tokens), the target logits of its
        rows `kept` gathered: none gathered when no rank keeps any)."""

        def verify() -> tuple[tuple[Tensor, list[list[int]]], Tensor]:
            assert self.draft is not None
            result = self.batch.verify(tokens, self.draft.trim(width), sampling, lengths)
            return (result.accepted, result.tokens), result.logits[kept]

        return self._forward(verify, bool(tokens), rows, (1 + width,))

    def _forward(
        self, part: Callable[[], tuple[Any, Tensor | None]], mine: bool, rows: int = 0, shape: tuple[int, ...] = ()
    ) -> Part:
        """This rank's forwards (if it has rows in the call), the others' MoE rounds until all are done, then (`rows`)
        every rank's logits [n, *shape, V] gathered on rank 0 — a rank that failed sends zeros, then raises."""
        small, logits, error = None, None, None
        try:
            if mine:
                small, logits = part()
        except Exception as exc:
            error = exc
        self.model.serve_idle()
        gathered = self._gather(logits, rows, (*shape, self.model.args.vocab_size)) if rows else None
        if error is not None:
            raise error
        return small, gathered, self.batch.seq_ids

    def _gather(self, logits: Tensor | None, rows: int, shape: tuple[int, ...]) -> list[Tensor] | None:
        parallel = self.model.parallel
        padded = torch.zeros(rows, *shape, dtype=torch.float32, device=self.model.device)
        if logits is not None:
            padded[: logits.shape[0]] = logits
        every = [torch.empty_like(padded) for _ in range(parallel.world_size)] if parallel.rank == 0 else None
        dist.gather(padded, every, dst=0, group=parallel.group)
        return every


class SpreadBatch:
    """Rank 0's view of a lane spread over a data-parallel rank group, called as a `DecodeBatch` is."""

    def __init__(self, calls: GroupCalls, capacity: int, lanes: Lanes, prefills: Prefills, rows: Gauge) -> None:
        self.calls, self.world, self.lanes, self.prefills, self.rows = calls, calls.world_size, lanes, prefills, rows
        self.ranks = calls.new(RankRows, capacity)
        self.held: list[list[int]] = [[] for _ in range(self.world)]  # per rank: its rows' group seq ids, in order
        self.local: dict[int, tuple[int, int]] = {}  # group seq id → (rank, the rank's seq id)
        self.group_id: dict[tuple[int, int], int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.local)

    @property
    def seq_ids(self) -> list[int]:
        return [s for held in self.held for s in held]

    @property
    def rows_by_rank(self) -> list[int]:
        return [len(held) for held in self.held]

    def chains(self) -> bool:
        """Never: each rank verifies in a call of its own, the drafts' width already chosen."""
        return False

    # ---------------------------------------------------------------------------------------------- membership
    def join_many(self, prompts: list[Restorable | OnRank]) -> list[tuple[int, Tensor]]:
        """Each prompt joins the least loaded rank, or the rank that prefilled it (`OnRank`) → (group seq id, next
        logits [V]) per prompt, in order. All or none: if a rank cannot restore its prompts, those that joined other
        ranks leave again and the error is raised."""
        ranks = self._assign(prompts)
        restorables = [p.prompt if isinstance(p, OnRank) else p for p in prompts]
        mine = [[p for p, r in zip(restorables, ranks, strict=True) if r == rank] for rank in range(self.world)]
        rows = max(len(m) for m in mine)
        outcomes = self.calls.spread(self.ranks, "join_many", [(m, rows) for m in mine])
        failed = next((o.error for o in outcomes if o.error is not None), None)
        joined = [(o.value[0] or []) if o.error is None else [] for o in outcomes]
        for rank, outcome in enumerate(outcomes):
            if outcome.error is None:
                self._order(rank, outcome.value[2], joined[rank])
        if failed is not None:
            for rank, seq_ids in enumerate(joined):
                for local in seq_ids:
                    self.leave(self.group_id[rank, local])
            raise failed
        gathered = outcomes[0].value[1]
        rows_of = [zip(ids, logits[: len(ids)], strict=True) for ids, logits in zip(joined, gathered, strict=True)]
        taken = [iter(rows) for rows in rows_of]
        return [self._group_row(r, next(taken[r])) for r in ranks]

    def leave(self, seq_id: int) -> SequenceExport:
        rank, local = self.local.pop(seq_id)
        del self.group_id[rank, local]
        by_rank = [([local] if r == rank else [],) for r in range(self.world)]
        exports = self._each("leave", by_rank)[0][rank]
        return exports[0]

    def prefill(self, token_ids: list[int], past: Past | None, chunk_tokens: int) -> SpreadPrefill:
        """A local prefill on the rank its prompt will join: the least loaded now. Until it joins, it counts as a row
        of that rank (`_load`), so that no join meanwhile fills the rank beyond its capacity."""
        return SpreadPrefill(self.calls, self._least(self._load()), token_ids, past, chunk_tokens)

    def group_rows(self) -> list[int]:
        """The rows each rank holds in every lane."""
        return [sum(held) for held in zip(*(lane.rows_by_rank for lane in self.lanes()), strict=True)]

    def _load(self) -> list[int]:
        """The rows each rank holds in every lane, and those its local prefills will join."""
        load = self.group_rows()
        for prefill in self.prefills():
            load[prefill.rank] += 1
        return load

    def _assign(self, prompts: list[Restorable | OnRank]) -> list[int]:
        """The rank each joining prompt goes to: the one that prefilled it, or the least loaded at the time."""
        load = self._load()
        for prompt in prompts:
            if isinstance(prompt, OnRank):
                load[prompt.rank] += 1
        return [p.rank if isinstance(p, OnRank) else self._least(load) for p in prompts]

    @staticmethod
    def _least(load: list[int]) -> int:
        """The rank holding the fewest rows (the lowest on a tie), counted as holding one more."""
        rank = load.index(min(load))
        load[rank] += 1
        return rank

    def _order(self, rank: int, order: list[int], joined: list[int] = ()) -> None:
        """A rank's rows after a call, in its batch's order (`joined`: its seq ids new to the group)."""
        for local in joined:
            self.local[self._next], self.group_id[rank, local] = (rank, local), self._next
            self._next += 1
        changed = len(order) != len(self.held[rank])
        self.held[rank] = [self.group_id[rank, local] for local in order]
        if changed:
            self.rows.labels(str(rank)).set(self.group_rows()[rank])

    def _group_row(self, rank: int, row: tuple[int, Tensor]) -> tuple[int, Tensor]:
        return self.group_id[rank, row[0]], row[1]

    # --------------------------------------------------------------------------------------------------- steps
    def decode_step(self, tokens: list[int]) -> Tensor:
        """One pending token per row → next-token logits [B, V], every rank its own rows."""
        counts = self.rows_by_rank
        _, gathered = self._each("decode_step", [(t, max(counts)) for (t,) in self._by_rank(list(tokens))])
        return _cat(gathered, counts)

    def dspark_draft(self, tokens: list[int], sampling: SamplingParams) -> Draft:
        """Each rank drafts for its rows; the distributions stay there (the returned draft's are empty)."""
        args = self._by_rank(list(tokens), sampling)
        results = [r for r in self._each("dspark_draft", args)[0] if r is not None]
        drafts, confidence = torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
        return Draft(drafts, drafts.new_empty(*drafts.shape, 0, dtype=torch.float32), confidence)

    def verify(
        self,
        tokens: list[int],
        draft: Draft,
        sampling: SamplingParams,
        lengths: Tensor | None = None,
    ) -> VerifyResult:
        """Each rank verifies the first `draft`-width drafts of its own last draft (`draft` is this batch's). The
        ranks accept and sample the tokens themselves; rank 0
        reads a row's logits only for the logprobs its request reports (`StepSampling.logprobs`), so only those rows'
        logits are gathered — none when no row reports logprobs — and the others' are NaN."""
        B, width = draft.tokens.shape
        lengths = torch.full((B,), width, dtype=torch.int64) if lengths is None else lengths
        reported = getattr(sampling, "logprobs", None) or (True,) * B
        parts = self._by_rank(list(tokens), sampling, lengths, list(reported))
        kept = [[i for i, report in enumerate(r) if report] for *_, r in parts]
        rows = max(len(k) for k in kept)
        args = [(t, width, s, n, k, rows) for (t, s, n, _), k in zip(parts, kept, strict=True)]
        small, gathered = self._each("verify", args)
        results = [r for r in small if r is not None]
        emitted = [row for r in results for row in r[1]]
        model = self.calls.model
        logits = _kept(gathered, kept, self.rows_by_rank, (1 + width, model.args.vocab_size), model.device)
        return VerifyResult(torch.cat([r[0] for r in results]), emitted, logits)

    def _each(self, method: str, by_rank: list[tuple[Any, ...]]) -> tuple[list[Any], list[Tensor] | None]:
        """A spread call of the rows' method → (each rank's small results, None where it held no rows; the logits
        gathered on rank 0)."""
        parts = _values(self.calls.spread(self.ranks, method, by_rank))
        for rank, (_, _, order) in enumerate(parts):
            self._order(rank, order)
        return [small for small, _, _ in parts], parts[0][1]

    def _by_rank(self, *batched: Any) -> list[tuple[Any, ...]]:
        """Batched arguments (rows in this batch's order) → each rank's rows of them."""
        starts = [0, *itertools.accumulate(self.rows_by_rank)]
        return [tuple(_rows(b, slice(a, z)) for b in batched) for a, z in itertools.pairwise(starts)]


def _rows(batched: Any, rows: slice) -> Any:
    """Some rows of a batched argument: a list, a tensor, sampling parameters (every per-row field sliced) or their
    masks (the rows' guides travel; a guide with a grammar matcher cannot, and the engine keeps its row in a plain
    step, whose masks rank 0 applies)."""
    if batched is None:
        return None
    if isinstance(batched, SamplingParams):
        fields = {f.name: getattr(batched, f.name) for f in dataclasses.fields(batched)}
        return dataclasses.replace(batched, **{name: _rows(v, rows) for name, v in fields.items() if v is not None})
    if isinstance(batched, Masks):
        guides = batched.guides[rows]
        if any(g is not None and not g.portable for g in guides):
            raise ValueError("a grammar's matcher cannot leave rank 0")
        return Masks(guides, batched.drafts[rows])
    return batched[rows]


def _cat(gathered: list[Tensor] | None, counts: list[int]) -> Tensor:
    """Every rank's gathered rows (padded) → the batch's, rank by rank."""
    assert gathered is not None
    return torch.cat([rows[:n] for rows, n in zip(gathered, counts, strict=True)])


def _kept(
    gathered: list[Tensor] | None,
    kept: list[list[int]],
    counts: list[int],
    shape: tuple[int, ...],
    device: torch.device,
) -> Tensor:
    """The batch's fp32 logits [B, *shape] from the rows each rank kept (`gathered`, padded; in rank order), NaN in
    every other row, which nothing reads — with no row kept, a single NaN seen as the whole tensor (no memory)."""
    B = sum(counts)
    if gathered is None:
        return torch.full((), math.nan, dtype=torch.float32, device=device).expand(B, *shape)
    starts = itertools.accumulate(counts[:-1], initial=0)
    rows = [start + i for start, k in zip(starts, kept, strict=True) for i in k]
    logits = torch.full((B, *shape), math.nan, dtype=torch.float32, device=device)
    logits[rows] = torch.cat([g[: len(k)] for g, k in zip(gathered, kept, strict=True)])
    return logits


def _values(outcomes: list[Outcome]) -> list[Any]:
    """The ranks' values; the first rank's error raised."""
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
    return [o.value for o in outcomes]
