"""Decoding: `DecodeBatch` owns the sequences decoded together, their packed cache and the step over them.

Sequences join from a prefill record (the decoder bounded replay of model.serving gives their first logits) and
leave with their new complete blocks and end-of-sequence encoder state; between, every step advances each of them:

    decode_step   one pending token per sequence → next-token logits
    dspark_draft  γ drafts per sequence after its pending token (the DSpark blocks, one forward)
    verify        target forward over [pending, drafts], lossless acceptance, commit of what was accepted
                  (in two halves where the caller has work between: `verify_forward` launches the forward,
                  `accept` accepts and commits)

On a GPU the three forwards replay graphs captured once per batch bucket (model.graphs), so the host launches a
graph instead of a few thousand kernels (Engram tables in host memory too: their rows are gathered inside the graph);
elsewhere, and where a graph cannot serve them (an expert-parallel group), they run eagerly. Both run the same
modules in the same order. A step waits for the device at most once, at its end: verify reads its acceptance back
then (the host needs the tokens). A verify whose forward needs no host copy of the drafts (`chains`) is queued right
behind the draft, before the host has seen it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.dspark import Draft, draft_features, keyed_links, markov_chain
from model.graphs import StepGraphs, Verified
from model.kv import EncoderState, GlobalKVBlock, export_blocks, export_state, restore
from model.sampling import Generators, SamplingParams, argmax_accept, sample, speculative_accept
from model.serving import decoder_replay, forward_full, replay_length

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from model.cache import Step
    from model.transformer import Transformer


@dataclass
class SequenceExport:
    """What a finished sequence writes back: new complete blocks and its end-of-sequence encoder state."""

    blocks: list[GlobalKVBlock]
    encoder_state: EncoderState


@dataclass
class VerifyForward:
    """A verify's target forward, launched and not yet accepted (`DecodeBatch.accept` finishes it)."""

    draft: Draft  # the drafts it verifies, [B, γ]
    logits: Tensor  # fp32 [B, 1+γ, V], being computed
    step: Step | Verified  # its writes, staged until the acceptance commits them


@dataclass
class VerifyResult:
    accepted: Tensor  # int64 [B] drafts accepted per sequence
    tokens: list[list[int]]  # per sequence: the accepted drafts + one corrected or bonus token (the next input)
    logits: Tensor  # fp32 [B, 1+γ, V] target logits; emitted token j of a row was drawn from logits[:, j]


class DecodeBatch:
    """Sequences decoded together by the full model (continuous batching: they join and leave between steps).

    Rows of `seq_ids` order every batched argument and result; a leave moves the last row into the freed one.
    `capacity`: rows held without growing (a growth reallocates the cache, and captured graphs with it); `graphs`:
    replay the forwards as CUDA graphs (default: on a GPU, when they can be captured).
    """

    def __init__(self, model: Transformer, capacity: int = 8, graphs: bool | None = None) -> None:
        if model.part != "full":
            raise ValueError("decoding needs the full model (part='full')")
        self.model, self.cache = model, model.new_cache(capacity)
        self.seq_ids: list[int] = []
        self._written: list[int] = []  # per row: complete blocks the cache service already holds
        self._next = 0
        capturable = StepGraphs.supported(model)
        if graphs and not capturable:
            raise ValueError(
                "this model's forwards cannot be captured (a CUDA device and a single expert-parallel rank are needed)"
            )
        self.graphs = StepGraphs(model, self.cache) if (capturable if graphs is None else graphs) else None

    def __len__(self) -> int:
        return len(self.seq_ids)

    def positions(self) -> list[int]:
        return list(self.cache.pos)

    # ------------------------------------------------------------------------------------------ membership
    def join(self, blocks: list[GlobalKVBlock], state: EncoderState) -> tuple[int, Tensor]:
        """Restore a prefilled sequence, replay the decoder over its last W positions → (seq id, next logits [V])."""
        (joined,) = self.join_many([(blocks, state)])
        return joined

    def join_many(self, prompts: Sequence[tuple[list[GlobalKVBlock], EncoderState]]) -> list[tuple[int, Tensor]]:
        """`join` for several prefilled sequences at once, in one decoder replay forward → (seq id, next logits [V])
        per prompt, in order. The forward's fixed cost (most of a replay's, on a small batch) is paid once, not per
        sequence; prompts of fewer than W tokens replay all of theirs, one forward per such length. The new rows
        (`seq_ids`, the order of every later step's tokens and results) follow replay length, not the prompts: map
        by seq id.

        All or none: if any prompt cannot be restored, none joins and the error is raised."""
        if any(state.position == 0 for _, state in prompts):
            raise ValueError("cannot decode after an empty prompt")
        # Rows in order of replay length, so each length's rows form the slice one forward runs.
        length = [replay_length(self.model, state.position) for _, state in prompts]
        order = sorted(range(len(prompts)), key=length.__getitem__)
        first = self.cache.n_rows
        logits: list[Tensor] = []
        try:
            for i in order:
                restore(self.cache, self.cache.add_row(), *prompts[i])
            for _, run in groupby(range(len(order)), key=lambda r: length[order[r]]):
                rows = list(run)
                logits += decoder_replay(self.model, self.cache, slice(first + rows[0], first + rows[-1] + 1))
        except Exception:
            while self.cache.n_rows > first:
                self.cache.remove_row(self.cache.n_rows - 1)
            raise
        seq_ids = list(range(self._next, self._next + len(order)))  # in row order
        self._next += len(order)
        self.seq_ids += seq_ids
        self._written += [len(prompts[i][0]) for i in order]
        return [(seq_id, row) for _, seq_id, row in sorted(zip(order, seq_ids, logits, strict=True))]

    def fork(self, seq_id: int) -> int:
        """A new sequence continuing from a copy of `seq_id`'s state (e.g. n samples of one prompt)."""
        row = self.row(seq_id)
        self.cache.copy_row(row)
        new, self._next = self._next, self._next + 1
        self.seq_ids.append(new)
        self._written.append(self._written[row])
        return new

    def leave(self, seq_id: int) -> SequenceExport:
        """Remove a sequence; return its new complete blocks and its end-of-sequence encoder state."""
        row = self.row(seq_id)
        fp, Bt = self.model.fingerprint, self.model.args.kv_block_tokens
        export = SequenceExport(
            export_blocks(self.cache, row, self._written[row], self.cache.pos[row] // Bt, fp),
            export_state(self.cache, row, fp),
        )
        self.cache.remove_row(row)
        for lst in (self.seq_ids, self._written):
            lst[row] = lst[-1]
            lst.pop()
        return export

    def row(self, seq_id: int) -> int:
        try:
            return self.seq_ids.index(seq_id)
        except ValueError:
            raise KeyError(f"sequence {seq_id} is not in this batch") from None

    # ------------------------------------------------------------------------------------------------ steps
    def tokens(self, tokens: Tensor | Sequence[int], T: int | None = None, host: bool = False) -> Tensor:
        """tokens as [B, T] for the batch; `host`: ids given on the host stay there where the cache mirrors the Engram
        look-back (its step then hashes them without waiting for the device)."""
        tokens = self.model.check_tokens(tokens, host=host and self.cache.host_history is not None)
        tokens = tokens.view(len(self), -1) if tokens.numel() else tokens
        if len(self) == 0 or tokens.shape[0] != len(self) or (T is not None and tokens.shape[1] != T):
            raise ValueError(
                f"expected {T or 1} token(s) for each of the {len(self)} sequences, got {tuple(tokens.shape)}"
            )
        return tokens

    @torch.no_grad()
    def decode_step(self, tokens: Tensor | Sequence[int]) -> Tensor:
        """Process one pending token per sequence → the next-token logits [B, V] (sampling is the caller's)."""
        tokens = self.tokens(tokens, 1, host=True)
        if self._graphed():
            return self.graphs.decode(tokens)
        step = self.cache.step(tokens)
        logits = forward_full(self.model, step, last_only=True)
        step.commit()
        return logits[:, -1]

    @torch.no_grad()
    def dspark_draft(
        self, tokens: Tensor | Sequence[int], sampling: SamplingParams, generator: Generators = None
    ) -> Draft:
        """γ drafts per sequence after its pending token y (not yet committed): one forward of the DSpark blocks over
        [y, noise…] at positions p+1…, then the Markov chain left to right: each link's token is a keyed race of its
        tempered logits where `sampling.race_keys` gives keys (one graph with the blocks), else a sample of
        `sampling.probs` of them. Confidences are calibrated by the head's per-position temperatures; `generator`:
        one for the batch or one per row (model.sampling)."""
        y = self.tokens(tokens, 1)[:, 0]
        keys = sampling.race_keys()
        if keys is not None:  # the links are keyed races: no host work, captured with the blocks
            if self._graphed():
                return self.graphs.keyed_draft(y, sampling.temperature, *keys)
            x, base = draft_features(self.model, self.cache, y)
            moved = (t.to(y.device, non_blocking=True) for t in (sampling.temperature, *keys))
            return markov_chain(self.model, x, base, y, keyed_links(*moved))
        x, base = self.graphs.draft(y) if self._graphed() else draft_features(self.model, self.cache, y)
        one_hot = sampling.one_hot()

        def link(base: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
            q = sampling.probs(base + bias.float())
            return (q.argmax(-1) if one_hot else sample(q, generator)), q

        return markov_chain(self.model, x, base, y, link)

    @torch.no_grad()
    def verify(
        self,
        tokens: Tensor | Sequence[int],
        draft: Draft,
        sampling: SamplingParams,
        lengths: Tensor | None = None,
        generator: Generators = None,
    ) -> VerifyResult:
        """Target forward over [y, drafts] of every sequence, lossless acceptance, commit of y + accepted drafts.

        `lengths` [B] (≤ γ, default γ) lets the engine verify fewer drafts per row, e.g. cut where the running product
        of confidences drops. The returned tokens of a row are its accepted drafts plus the next pending token. With
        one generator per row, a row's draws depend on its own lengths[b] only, not on the batch's draft width.
        """
        return self.accept(self.verify_forward(tokens, draft), sampling, lengths, generator)

    def chains(self) -> bool:
        """Whether a verify's forward takes drafts left on the device without waiting for them (`verify_forward`):
        one whose Engram rows are hashed where its tokens are (a CPU model's, a replayed graph's whose tables are
        in place or on the device)."""
        if self.model.device.type != "cuda":
            return True
        return self._graphed() and self.graphs.hashes_on_device()

    @torch.no_grad()
    def verify_forward(self, tokens: Tensor | Sequence[int], draft: Draft) -> VerifyForward:
        """Launch the target forward over [y, drafts] of every sequence (y: the pending tokens); nothing is kept
        until `accept`, which must follow before any other forward of this batch. Drafts on the device wait for
        nothing where the batch `chains` (the forward is queued behind the draft); elsewhere they are read to the
        host first (the eager step hashes its Engram rows there)."""
        y = self.tokens(tokens, 1, host=True)
        if draft.tokens.shape[0] != len(self):
            raise ValueError(f"draft for {draft.tokens.shape[0]} sequences does not fit this batch of {len(self)}")
        if self.chains():
            drafted = torch.cat((y.to(draft.tokens.device, non_blocking=True), draft.tokens), dim=1)
        else:  # y on the host and drafts on the device: waits for the draft
            drafted = torch.cat((y, draft.tokens.to(y.device, non_blocking=y.is_cuda)), dim=1)
        if self._graphed():
            logits, step = self.graphs.verify(drafted)
        else:
            step = self.cache.step(drafted)
            logits = forward_full(self.model, step)
        return VerifyForward(draft, logits, step)

    @torch.no_grad()
    def accept(
        self,
        forward: VerifyForward,
        sampling: SamplingParams,
        lengths: Tensor | None = None,
        generator: Generators = None,
    ) -> VerifyResult:
        """Accept the drafts of a launched verify (up to lengths[b] of row b: `verify`'s) and commit y + the accepted
        drafts; waits for the forward once, at the end. A replayed verify whose targets are a pure function of its
        logits (`race_rows`) accepts and commits in one graph (`Verified.accept`)."""
        draft, logits, step = forward.draft, forward.logits, forward.step
        B, g = draft.tokens.shape
        lengths = torch.full((B,), g, dtype=torch.int64) if lengths is None else lengths.to(torch.int64).cpu()
        if lengths.shape != (B,) or bool(((lengths < 0) | (lengths > g)).any()):
            raise ValueError(f"lengths {lengths.tolist()} do not fit a draft of {g} tokens for {B} sequences")
        keep = None  # the pending token and the accepted drafts, where the host launched their commit
        raced = race_rows(sampling)
        if isinstance(step, Verified) and (raced is not None or sampling.argmax_only()):
            accepted, nxt = step.accept(lengths, raced)
        else:
            accepted, nxt = self._acceptance(forward, sampling, lengths, generator)
            keep = accepted + 1
            step.write(keep)
        n, next_tokens, drafted = read_back(accepted, nxt, draft.tokens)  # the step's one wait for the device
        step.advance([k + 1 for k in n], keep)
        emitted = [[*row[:k], t] for row, k, t in zip(drafted, n, next_tokens, strict=True)]
        return VerifyResult(torch.tensor(n), emitted, logits)

    def _acceptance(
        self, forward: VerifyForward, sampling: SamplingParams, lengths: Tensor, generator: Generators
    ) -> tuple[Tensor, Tensor]:
        """(accepted drafts [B], the token after them [B]) of a launched verify, on the device, as every rank of a
        replicated group commits them."""
        draft, logits = forward.draft, forward.logits
        proposed = draft.tokens.to(logits.device, non_blocking=True)  # from the host: no wait for the forward
        if sampling.argmax_only():  # greedy: the targets' tokens are the logits' arg-maxes
            accepted, nxt = argmax_accept(logits, proposed, lengths)
        elif sampling.one_hot():  # the targets' distributions collapse onto their tokens: no proposal needed
            accepted, nxt = argmax_accept(sampling.probs(logits), proposed, lengths)
        else:
            target, proposal = sampling.probs(logits), draft.proposal(logits.shape[-1]).to(logits.device)
            accepted, nxt = speculative_accept(target, proposal, proposed, lengths, generator)
        if self.model.parallel.replicated:  # ranks running the same batch commit rank 0's acceptance on every rank
            self.model.parallel.broadcast(accepted, nxt)
        return accepted, nxt

    @torch.no_grad()
    def capture(self, widths: Sequence[int] = (), progress: Callable[[int, int], None] | None = None) -> None:
        """Capture the graphs of every batch size up to the capacity now (decode; with verify `widths`, draft, verify
        and commit too), not on first use; nothing when the forwards run eagerly. `progress(done, total)` per
        bucket (model.graphs.StepGraphs.capture_all)."""
        if self.graphs is not None:
            self.graphs.capture_all(self.cache.capacity, widths, progress)

    def _graphed(self) -> bool:
        """Whether this batch's forwards replay captured graphs."""
        return self.graphs is not None and self.graphs.covers(len(self))


def race_rows(sampling: SamplingParams) -> tuple[Tensor, Tensor, Tensor] | None:
    """(temperature, seed, output index) per row (host [B]) of a batch whose targets' tokens are keyed races — a row
    samples, and every row collapses onto its position's raced token (`SamplingParams.race_keys`) —, else None."""
    keys = sampling.race_keys() if sampling.one_hot() and not sampling.argmax_only() else None
    return None if keys is None else (sampling.temperature, *keys)


def read_back(*tensors: Tensor) -> list[list]:
    """Device tensors → Python lists, waiting for the device once."""
    return ReadBack(*tensors).lists()


class ReadBack:
    """Device tensors on their way to the host: non-blocking copies into pinned host memory queued behind the work
    queued so far, and one event after them; `lists()` waits for that event alone — not for what is queued later —
    instead of a stream synchronisation per tensor."""

    def __init__(self, *tensors: Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if not tensors[0].is_cuda:  # on the host already: their values now
            self.values = [t.tolist() for t in tensors]
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(self.host, tensors, strict=True):
            h.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def lists(self) -> list[list]:
        if self.done is None:
            return self.values
        self.done.synchronize()
        return [h.tolist() for h in self.host]
