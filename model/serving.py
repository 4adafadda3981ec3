"""The service split over packed caches: prefill (encoder half) and bounded replay; decoding is `model.decode`.

Semantics (DESIGN §3–4, reference §7.1). A *cold run* of a token sequence is: the encoder over every token with
exact SWA windows, layer L/2's global KV projected from H^{L/2} for every token, then the decoder's **bounded
replay** over the last W = sliding_window tokens from H^{L/2}, each decoder window truncated at the replay start
(a query at i sees [max(s, i−W+1), i]). Decoder SWA state is never stored; it is always rebuilt this way, so:

- `encode_prefill(tokens, past)` with past = (cached blocks of a prefix, the encoder state at the prefix end)
  equals `encode_prefill(tokens)`: the encoder state is exact, and the uncached suffix continues it.
- Without the encoder state (SWA record expired), the encoder rings are rebuilt by an encoder bounded replay of
  the W tokens before the prefix end — the approximate path the paper accepts (results depend on the hit position).
- `DecodeBatch.join(blocks, state)` (model.decode) restores a sequence and runs the decoder bounded replay here
  (→ first logits); its `decode_step` / `verify` then advance every layer exactly, and its `leave` exports the new
  complete blocks and the end-of-sequence encoder state, so a next turn with that record equals a cold run of the
  whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm

from model.cache import KVCache, Step
from model.dspark import absorb
from model.kv import EncoderState, GlobalKVBlock, export_blocks, export_state, restore

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


def _history(tokens: Tensor, end: int, n: int) -> Tensor:
    """The n token ids before position `end` (−1 before the sequence start) → [1, n]."""
    before = tokens[max(0, end - n) : end]
    pad = torch.full((n - before.shape[0],), -1, dtype=torch.int64, device=tokens.device)
    return torch.cat((pad, before)).unsqueeze(0)


# -------------------------------------------------------------------------------------------------- forward
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
    model: Transformer,
    tokens: Tensor | Sequence[int],
    past: Past | None = None,
    *,
    chunk_tokens: int = 512,
    progress: bool = False,
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
