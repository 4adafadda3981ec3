"""The service split over packed caches: prefill (encoder half), bounded replay, decode, DSpark draft and verify.

Semantics (DESIGN §3–4, reference §7.1). A *cold run* of a token sequence is: the encoder over every token with
exact SWA windows, layer L/2's global KV projected from H^{L/2} for every token, then the decoder's **bounded
replay** over the last W = sliding_window tokens from H^{L/2}, each decoder window truncated at the replay start
(a query at i sees [max(s, i−W+1), i]). Decoder SWA state is never stored; it is always rebuilt this way, so:

- `encode_prefill(tokens, past)` with past = (cached blocks of a prefix, the encoder state at the prefix end)
  equals `encode_prefill(tokens)`: the encoder state is exact, and the uncached suffix continues it.
- Without the encoder state (SWA record expired), the encoder rings are rebuilt by an encoder bounded replay of
  the W tokens before the prefix end — the approximate path the paper accepts (results depend on the hit position).
- `DecodeBatch.join(blocks, state)` restores a sequence and runs the decoder bounded replay (→ first logits);
  `join_many` does it for several sequences in one replay forward;
  `decode_step` / `verify` then advance every layer exactly, and `DecodeBatch.leave` exports the new complete blocks
  and the end-of-sequence encoder state, so a next turn with that record equals a cold run of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm

from model.cache import KVCache, Step
from model.dspark import Draft, absorb
from model.kv import EncoderState, GlobalKVBlock, export_blocks, export_state, restore
from model.mhc import hc_collapse
from model.sampling import Generators, SamplingParams, sample, speculative_accept

if TYPE_CHECKING:
    from collections.abc import Sequence

    from model.transformer import Transformer


@dataclass
class Past:
    """What the cache holds for a prefix: its complete global KV blocks and, if still pooled, its encoder state."""

    blocks: list[GlobalKVBlock]
    encoder_state: EncoderState | None = None


@dataclass
class PrefillOutput:
    blocks: list[GlobalKVBlock]  # new complete blocks (indices from len(past.blocks))
    encoder_state: EncoderState  # the handoff record at the end of the tokens
    cached_tokens: int  # prefix tokens covered by cached complete blocks (a multiple of kv_block_tokens)
    resumed_at: int  # the position encoding resumed from (the SWA record's position when it was present)
    swa_restored: bool  # the encoder rings came from past.encoder_state (exact)
    bounded_replay: bool  # the encoder rings were rebuilt by bounded replay (approximate)


@dataclass
class SequenceExport:
    """What a finished sequence writes back: new complete blocks and its end-of-sequence encoder state."""

    blocks: list[GlobalKVBlock]
    encoder_state: EncoderState


@dataclass
class VerifyResult:
    accepted: Tensor  # int64 [B] drafts accepted per sequence
    tokens: list[list[int]]  # per sequence: the accepted drafts + one corrected or bonus token (the next input)
    logits: Tensor  # fp32 [B, 1+γ, V] target logits; emitted token j of a row was drawn from logits[:, j]


def _history(tokens: Tensor, end: int, n: int) -> Tensor:
    """The n token ids before position `end` (−1 before the sequence start) → [1, n]."""
    before = tokens[max(0, end - n) : end]
    pad = torch.full((n - before.shape[0],), -1, dtype=torch.int64, device=tokens.device)
    return torch.cat((pad, before)).unsqueeze(0)


# -------------------------------------------------------------------------------------------------- prefill
def encode_chunk(model: Transformer, step: Step) -> None:
    """Encoder layers over a step, H^{L/2} staged, and layer L/2's global KV projected from it."""
    L2 = model.args.n_encoder_layers
    X, pre = model.embed_stream(step.tokens)
    X, pre = model.step_layers(step, X, pre, range(L2))
    step.hidden = (X, pre)
    if not step.replay:
        projection = model.layers[L2]
        projection.attn.write_entries(projection.attention_input(X, pre), step)


class PrefillRun:
    """The encoder half over `tokens` (the whole sequence; `past` covers a prefix of it), a chunk at a time.

    Construction restores the cached prefix; `advance()` encodes the next `chunk_tokens` (the first chunk also
    bounded-replays the W positions before it when the prefix has no SWA record: one forward, not two); `output()`
    exports the new blocks and the encoder state. One cache row lives across the chunks, so a caller that interleaves
    other work between them (decode's local prefill) pays the restore once. ValueError when `past` does not fit
    `tokens`."""

    def __init__(self, model: Transformer, tokens: Tensor | Sequence[int], past: Past | None, chunk_tokens: int = 512):
        self.cache = model.new_cache(encoder_only=True)
        self.tokens = model.check_tokens(tokens, host=self.cache.host_history is not None).flatten()
        if self.tokens.shape[0] == 0:
            raise ValueError("encode_prefill needs at least one token")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.model, self.past, self.chunk_tokens = model, past, chunk_tokens
        self.row = self.cache.add_row()
        self.bounded_replay = False
        self._replay_from: int | None = None  # where the first chunk starts its bounded replay, if it owes one
        if past is not None:
            with torch.no_grad():
                self._restore(past)
        self.resumed_at = self.position

    @property
    def position(self) -> int:
        """Tokens encoded so far (the cached prefix included)."""
        return self.cache.pos[self.row]

    @property
    def done(self) -> bool:
        return self.position == self.tokens.shape[0]

    @property
    def chunks_left(self) -> int:
        return -(-(self.tokens.shape[0] - self.position) // self.chunk_tokens)

    def advance(self) -> bool:
        """Encode the next chunk; True once every token is encoded."""
        a, cache = self.position, self.cache
        end = a + self.chunk_tokens
        if self._replay_from is None:
            step = cache.step(self.tokens[None, a:end])
        else:  # the bounded replay rides in the first chunk's forward: its positions rebuild the windows only
            s, self._replay_from = self._replay_from, None
            positions = torch.arange(s, min(end, self.tokens.shape[0]), device=cache.device).unsqueeze(0)
            history = _history(self.tokens, s, cache.history.shape[1])
            rows = slice(self.row, self.row + 1)
            step = cache.step(self.tokens[None, s:end], rows, positions, history=history, replayed=a - s)
        with torch.no_grad():
            encode_chunk(self.model, step)
        step.commit()
        return self.done

    def finish(self, progress: bool = False) -> PrefillOutput:
        """Encode every chunk left and export the result."""
        for _ in tqdm(range(self.chunks_left), desc="prefill", unit="chunk", disable=not progress):
            self.advance()
        return self.output()

    def output(self) -> PrefillOutput:
        cache, row, Bt = self.cache, self.row, self.model.args.kv_block_tokens
        first = len(self.past.blocks) if self.past is not None else 0
        return PrefillOutput(
            blocks=export_blocks(cache, row, first, self.position // Bt, self.model.fingerprint),
            encoder_state=export_state(cache, row, self.model.fingerprint),
            cached_tokens=first * Bt,
            resumed_at=self.resumed_at,
            swa_restored=self.past is not None and self.past.encoder_state is not None,
            bounded_replay=self.bounded_replay,
        )

    def _restore(self, past: Past) -> None:
        cache, row, tokens = self.cache, self.row, self.tokens
        restore(cache, row, past.blocks, past.encoder_state)
        start = cache.pos[row]
        if start > tokens.shape[0]:
            raise ValueError(f"the cached prefix covers {start} tokens but the sequence has only {tokens.shape[0]}")
        if past.encoder_state is not None:
            expected = _history(tokens, start, cache.history.shape[1])[0]
            if not torch.equal(past.encoder_state.history.to(tokens.device), expected):
                raise ValueError("the encoder state does not belong to this token sequence (look-back ids differ)")
        elif start > 0:
            self.bounded_replay = True
            if start == tokens.shape[0]:  # nothing to encode: the replay runs alone
                bounded_replay(self.model, cache, row, "encoder", tokens)
            else:  # one forward instead of two: the first chunk replays the W positions before it
                self._replay_from = max(0, start - self.model.args.sliding_window)


def encode_prefill(
    model: Transformer, tokens: Tensor | Sequence[int], past: Past | None, chunk_tokens: int = 512, progress=False
) -> PrefillOutput:
    """Run the encoder half over `tokens` (the whole sequence; `past` covers a prefix of it)."""
    return PrefillRun(model, tokens, past, chunk_tokens).finish(progress)


# ---------------------------------------------------------------------------------------------------- replay
def bounded_replay(model: Transformer, cache: KVCache, row: int, side: str, tokens: Tensor | None = None):
    """Rebuild one row's SWA rings from its last W positions, each window truncated at the replay start.

    `encoder`: recompute tokens [h−W, h) through the encoder (global KV stays the cached one); needs `tokens`.
    `decoder`: run layers L/2..L−1 from the stored H^{L/2} rows, filling the decoder and DSpark rings; returns the
    next-token logits [V] of the last position.
    """
    if side == "decoder":
        return decoder_replay(model, cache, slice(row, row + 1))[0]
    if side != "encoder":
        raise ValueError(f"bounded_replay side must be 'encoder' or 'decoder', got {side!r}")
    if tokens is None:
        raise ValueError("the encoder bounded replay needs the token ids")
    n, h = cache.pos[row], cache.history.shape[1]
    s = max(0, n - model.args.sliding_window)
    positions = torch.arange(s, n, device=cache.device).unsqueeze(0)
    step = cache.step(tokens[None, s:n], slice(row, row + 1), positions, replay=True, history=_history(tokens, s, h))
    with torch.no_grad():
        encode_chunk(model, step)
    step.commit()
    cache.set_history(row, _history(tokens, n, h)[0])
    return None


def replay_length(model: Transformer, position: int) -> int:
    """Positions a decoder bounded replay runs for a sequence of `position` tokens: its last W (all, if fewer)."""
    return min(position, model.args.sliding_window)


def decoder_replay(model: Transformer, cache: KVCache, rows: slice) -> Tensor:
    """The decoder bounded replay of several rows in one forward → their next-token logits [B, V].

    Layers L/2..L−1 run from the stored H^{L/2} rows of each row's last T = min(n, W) positions (T must be the same
    for every row; their positions may differ), filling the decoder and DSpark rings. A row's result is its own
    replay's: the rows of a step never see each other.
    """
    a = model.args
    W, L2, ends = a.sliding_window, a.n_encoder_layers, cache.pos[rows]
    lengths = {replay_length(model, n) for n in ends}
    if 0 in lengths:
        raise ValueError("nothing to replay: the sequence is empty")
    if len(lengths) != 1:
        raise ValueError(f"the rows of one decoder replay must replay as many positions, got {sorted(lengths)}")
    T = lengths.pop()
    device = cache.device
    positions = torch.tensor(ends, device=device).unsqueeze(1) - T + torch.arange(T, device=device)
    step = cache.step(None, rows, positions, replay=True)
    at = (torch.arange(rows.start, rows.stop, device=device).unsqueeze(1), positions % W)
    X, pre = cache.hidden[at], cache.hidden_pre[at]
    with torch.no_grad():
        taps: list[Tensor] = []
        X, pre = model.step_layers(step, X, pre, range(L2, a.num_hidden_layers), taps)
        absorb(model.mtp, step, taps)
        logits = model.logits(X[:, -1:], pre[:, -1:])
    step.commit()
    return logits[:, -1]


# ---------------------------------------------------------------------------------------------------- decode
class DecodeBatch:
    """Sequences decoded together by the full model (continuous batching: they join and leave between steps).

    Rows of `seq_ids` order every batched argument and result; a leave moves the last row into the freed one.
    """

    def __init__(self, model: Transformer, capacity: int = 8) -> None:
        if model.part != "full":
            raise ValueError("decoding needs the full model (part='full')")
        self.model, self.cache = model, model.new_cache(capacity)
        self.seq_ids: list[int] = []
        self._written: list[int] = []  # per row: complete blocks the cache service already holds
        self._next = 0

    def __len__(self) -> int:
        return len(self.seq_ids)

    def positions(self) -> list[int]:
        return list(self.cache.pos)

    def join(self, blocks: list[GlobalKVBlock], state: EncoderState) -> tuple[int, Tensor]:
        """Restore a prefilled sequence, replay the decoder over its last W positions → (seq id, next logits [V])."""
        (joined,) = self.join_many([(blocks, state)])
        return joined

    def join_many(self, prompts: Sequence[tuple[list[GlobalKVBlock], EncoderState]]) -> list[tuple[int, Tensor]]:
        """`join` for several prefilled sequences at once, in one decoder replay forward → (seq id, next logits [V])
        per prompt, in order. The forward's fixed cost (most of a replay's, on a small batch) is paid once, not per
        sequence; prompts of fewer than W tokens replay all of theirs, one forward per such length.

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


def _batch_tokens(model: Transformer, batch: DecodeBatch, tokens, T: int | None = None, host: bool = False) -> Tensor:
    """tokens as [B, T] for the batch; `host`: ids given on the host stay there where the cache mirrors the Engram
    look-back (its step then hashes them without waiting for the device)."""
    tokens = model.check_tokens(tokens, host=host and batch.cache.host_history is not None)
    tokens = tokens.view(len(batch), -1) if tokens.numel() else tokens
    if len(batch) == 0 or tokens.shape[0] != len(batch) or (T is not None and tokens.shape[1] != T):
        raise ValueError(
            f"expected {T or 1} token(s) for each of the {len(batch)} sequences, got {tuple(tokens.shape)}"
        )
    return tokens


def forward_full(model: Transformer, step: Step, last_only: bool = False) -> Tensor:
    """Every layer over a step (H^{L/2} and DSpark rings staged) → fp32 logits [B, T, V] ([B, 1, V]: last_only)."""
    a = model.args
    X, pre = model.embed_stream(step.tokens)
    X, pre = model.step_layers(step, X, pre, range(a.n_encoder_layers))
    step.hidden = (X, pre)
    taps: list[Tensor] = []
    X, pre = model.step_layers(step, X, pre, range(a.n_encoder_layers, a.num_hidden_layers), taps)
    absorb(model.mtp, step, taps)
    return model.logits(X[:, -1:], pre[:, -1:]) if last_only else model.logits(X, pre)


@torch.no_grad()
def decode_step(model: Transformer, batch: DecodeBatch, tokens) -> Tensor:
    """Process one pending token per sequence; returns the next-token logits [B, V] (sampling is the caller's)."""
    step = batch.cache.step(_batch_tokens(model, batch, tokens, 1, host=True))
    logits = forward_full(model, step, last_only=True)
    step.commit()
    return logits[:, -1]


@torch.no_grad()
def dspark_draft(
    model: Transformer, batch: DecodeBatch, tokens, sampling: SamplingParams, generator: Generators = None
) -> Draft:
    """γ drafts per sequence after its pending token y (not yet committed): one forward of the DSpark blocks over
    [y, noise…] at positions p+1…, then the Markov chain left to right: each link's distribution is `sampling.probs`
    of its logits, and `sampling.sampled` sees each link's draws before the next link (a grammar masks each link by
    the drafts before it). Confidences are calibrated by the head's per-position temperatures; `generator`: one for
    the batch or one per row (model.sampling)."""
    a = model.args
    y = _batch_tokens(model, batch, tokens, 1)[:, 0]
    B, g = y.shape[0], a.dspark_block_size
    ids = torch.cat((y.unsqueeze(1), torch.full((B, g - 1), a.dspark_noise_token_id, device=y.device)), dim=1)
    positions = batch.cache.next_positions(slice(0, B)).unsqueeze(1) + torch.arange(g, device=y.device)
    X, pre = model.embed_stream(ids)
    for block in model.mtp:
        X, pre = block(X, pre, lambda x, block=block: block.block_attention(x, batch.cache, positions))
    last = model.mtp[-1]
    x = hc_collapse(X, pre)
    base = model.head(last.norm(x)).float()
    head = last.confidence_head
    tokens_out, probs, confidence, prev = [], [], [], y
    for k in range(g):
        e = last.markov_head.embed(prev)
        q = sampling.probs(base[:, k] + last.markov_head.head(e).float())
        confidence.append(torch.sigmoid(head(x[:, k], e) / head.temperature[k]))
        prev = sample(q, generator)
        sampling.sampled(prev)
        tokens_out.append(prev)
        probs.append(q)
    return Draft(torch.stack(tokens_out, 1), torch.stack(probs, 1), torch.cat(confidence, -1))


@torch.no_grad()
def verify(
    model: Transformer,
    batch: DecodeBatch,
    tokens,
    draft: Draft,
    sampling: SamplingParams,
    lengths: Tensor | None = None,
    generator: Generators = None,
) -> VerifyResult:
    """Target forward over [y, drafts] of every sequence, lossless acceptance, commit of y + accepted drafts.

    `lengths` [B] (≤ γ, default γ) lets the engine verify fewer drafts per row, e.g. cut where the running product
    of confidences drops. The returned tokens of a row are its accepted drafts plus the next pending token. With one
    generator per row, a row's draws depend on its own lengths[b] only, not on the batch's draft width.
    """
    y = _batch_tokens(model, batch, tokens, 1, host=True)
    B, g = draft.tokens.shape
    lengths = torch.full((B,), g, dtype=torch.int64) if lengths is None else lengths.to(torch.int64).cpu()
    if len(batch) != B or bool(((lengths < 0) | (lengths > g)).any()):
        raise ValueError(
            f"draft for {B} sequences with lengths {lengths.tolist()} does not fit this batch of {len(batch)}"
        )
    step = batch.cache.step(torch.cat((y, draft.tokens.to(y.device)), dim=1))
    logits = forward_full(model, step)
    device = logits.device
    target, proposal = sampling.probs(logits), draft.probs.to(device)
    accepted, nxt = speculative_accept(target, proposal, draft.tokens.to(device), lengths.to(device), generator)
    n = accepted.tolist()  # the one wait for the device: the host needs the accepted tokens
    step.commit([k + 1 for k in n])
    emitted = [[*row[:k], t] for row, k, t in zip(draft.tokens.tolist(), n, nxt.tolist(), strict=True)]
    return VerifyResult(accepted.cpu(), emitted, logits)
