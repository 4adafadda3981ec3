"""DSpark: semi-autoregressive drafting with a Markov head and a confidence head (reference §4.4).

Three SWA-only blocks (`mtp.0..2`, mHC + attention + MoE) draft γ = dspark_block_size tokens in one forward:

    context   main_x = main_norm(main_proj([h_l₁; h_l₂; h_l₃]))   h_l = hc-mean of the stream entering target layer l
    ring      each block's window holds K=V of main_x at the real (committed) positions — target-feature injection
    block     inputs [y, noise × (γ−1)] at positions p+1 … p+γ (y: the last sampled, not yet committed token);
              rows attend the ring (positions ≤ p) and every row of the block (bidirectional)
    logits    Uₖ = head(norm(collapse(X)))   (the target's embedding and head are shared)
    Markov    p_k(v) ∝ exp(Uₖ(v) + W2 · W1[x_{k−1}]),  x₀ = y, sampled left to right
    confidence cₖ = σ(w · [collapse(X)ₖ; W1[x_{k−1}]] / Tₖ) — the probability that draft k is accepted given its prefix
              is; Tₖ: Sequential Temperature Scaling, fitted after training (train.calibrate), 1 = identity

The decode engine may truncate a row's drafts where the running product of confidences falls (adaptive length);
`DecodeBatch.verify` checks them losslessly (model.sampling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model import kernels
from model.attention import dense_attention
from model.block import Block
from model.cache import KVCache, Step
from model.config import ModelArgs
from model.fused import fused
from model.linear import Embedding, Fp8Act, Linear, param_dtype, quantize_input
from model.mhc import hc_collapse
from model.norm import RMSNorm
from model.parallel import SINGLE, Parallel
from model.sampling import keyed_link, race_elements

if TYPE_CHECKING:
    from model.transformer import Transformer


@dataclass
class Draft:
    """γ draft tokens per row, the distributions they were sampled from, and their acceptance confidences."""

    tokens: Tensor  # int64 [B, γ]
    probs: Tensor | None  # fp32 [B, γ, V]; None: one-hot on the tokens (a keyed chain's, never made)
    confidence: Tensor  # fp32 [B, γ]

    def proposal(self, vocab: int) -> Tensor:
        """The distributions the drafts were drawn from, fp32 [B, γ, V]."""
        return self.probs if self.probs is not None else nn.functional.one_hot(self.tokens, vocab).float()

    def trim(self, width: int) -> Draft:
        """The first `width` drafts of every row (a prefix of a draft chain is itself a valid draft chain)."""
        probs = self.probs[:, :width] if self.probs is not None else None
        return Draft(self.tokens[:, :width], probs, self.confidence[:, :width])


class MarkovHead(nn.Module):
    """Rank-r bigram bias B(x_{k−1}, ·) = W1[x_{k−1}] W2ᵀ on the draft logits."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed = Embedding(args.vocab_size, args.dspark_markov_rank, dtype)
        self.head = Linear(args.dspark_markov_rank, args.vocab_size, "bf16", dtype)


class ConfidenceHead(nn.Module):
    """Raw confidence logits zₖ = w · [xₖ; eₖ], and the per-draft-position temperatures Tₖ that calibrate them."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = Linear(args.hidden_size + args.dspark_markov_rank, 1, "bf16", dtype)
        # A calibration, not a learned weight: checkpoints from before calibration lack it and keep T = 1.
        fp32 = param_dtype("fp32", dtype or torch.get_default_dtype())
        self.register_buffer("temperature", torch.ones(args.dspark_block_size, dtype=fp32))

    def forward(self, x: Tensor, e: Tensor) -> Tensor:
        """fp32 raw logits [..., 1] of collapsed draft rows x [..., C] and Markov embeddings e [..., r]."""
        return self.proj(torch.cat((x, e.to(x.dtype)), -1)).float()

    def confidence(self, x: Tensor, e: Tensor) -> Tensor:
        """Calibrated confidences σ(zₖ / Tₖ) [B, γ] of a draft's rows x [B, γ, C] and embeddings e [B, γ, r]."""
        return _calibrated(self(x, e).squeeze(-1), self.temperature)

    def check(self) -> None:
        """ValueError unless every temperature is positive and finite (a loaded checkpoint's may not be)."""
        t = self.temperature
        if not bool((t.isfinite() & (t > 0)).all()):
            raise ValueError(f"confidence_head.temperature must be positive and finite, got {t.tolist()}")

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        state_dict.setdefault(f"{prefix}temperature", torch.ones_like(self.temperature))  # absent = identity
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@fused
def _calibrated(z: Tensor, temperature: Tensor) -> Tensor:
    return torch.sigmoid(z / temperature.to(z.dtype))  # fp32, as the logits


class DSparkBlock(Block):
    """mtp.{stage}: an SWA-only block; the first also builds the context, the last holds the heads."""

    def __init__(
        self, args: ModelArgs, stage: int, dtype: torch.dtype | None = None, parallel: Parallel = SINGLE
    ) -> None:
        super().__init__(args, args.num_hidden_layers + stage, dtype=dtype, parallel=parallel)
        C = args.hidden_size
        if stage == 0:
            fp8 = "fp8" if args.quantization_config else "bf16"
            self.main_proj = Linear(len(args.dspark_target_layer_ids) * C, C, fp8, dtype)
            self.main_norm = RMSNorm(C, args.rms_norm_eps, dtype)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(C, args.rms_norm_eps, dtype)
            self.markov_head = MarkovHead(args, dtype)
            self.confidence_head = ConfidenceHead(args, dtype)

    def block_attention(self, x: Tensor, xq: Tensor | Fp8Act, cache: KVCache, positions: Tensor) -> Tensor:
        """Draft rows x [B, γ, C] (xq: their cast) at positions p+1…: attend the ring at ≤ p and every row of the
        block."""
        attn, W = self.attn, self.args.sliding_window
        q_latent, kv = attn.input_latents(xq)
        q, _ = attn.heads(q_latent)  # q rotates in the attention kernel
        data, scale = attn.window_entries(kv, positions)
        ring, B, g = cache.rings[self.layer], x.shape[0], x.shape[1]
        window = (ring.data[:B], ring.scale[:B], data, scale, block_keys(ring.pos[:B], positions, W, g))
        return attn.attend_packed(q, positions, window, None)

    def dense_block_attention(
        self, x: Tensor, xq: Tensor, positions: Tensor, ring: Tensor, ring_mask: Tensor
    ) -> Tensor:
        """Dense, differentiable form of `block_attention`: ring keys [N, W, D] (fake-quantised) with their mask."""
        attn = self.attn
        _, q, kv = attn.query_window(xq, positions)
        kv = quantize_input(kv)
        block = torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        o = dense_attention(q, [(ring, ring_mask.unsqueeze(1).expand(-1, x.shape[1], -1)), (kv, block)],
                            attn.attn_sink, attn.softmax_scale)  # fmt: skip
        return attn.project_out(o, positions)


@fused
def block_keys(ring_pos: Tensor, positions: Tensor, W: int, g: int) -> Tensor:
    """The keys of a block of g draft rows at positions p+1… (positions [B, g]) → every row's slot ids [B, g, W + g]
    (int32, contiguous, as the attention kernel reads them) over [ring ‖ block rows]: the ring slots holding a
    position in (p − W, p] (−1 for the others: never read), then every row of the block."""
    anchor = positions[:, :1] - 1  # the newest committed position p
    in_ring = (ring_pos >= 0) & (ring_pos <= anchor) & (ring_pos > anchor - W)
    slots = torch.arange(W + g, dtype=torch.int32, device=ring_pos.device)
    keys = torch.cat((torch.where(in_ring, slots[:W], -1), slots[W:].expand(ring_pos.shape[0], g)), dim=1)
    return keys.unsqueeze(1).expand(-1, g, -1).contiguous()


def context(mtp: nn.ModuleList, taps: list[Tensor] | Tensor) -> Tensor:
    """main_x = main_norm(main_proj([h_l₁; h_l₂; h_l₃])) from the target features."""
    first = mtp[0]
    return first.main_norm(first.main_proj(torch.cat(taps, dim=-1) if isinstance(taps, list) else taps))


def absorb(mtp: nn.ModuleList, step: Step, taps: list[Tensor]) -> None:
    """Stage every DSpark ring's entries for the step's real positions from the target features `taps`."""
    main_x = context(mtp, taps)
    xq = mtp[0].attn.cast_input(main_x)  # one FP8 cast of main_x serves every block's wkv (same format)
    for block in mtp:
        kv = block.attn.window_kv(xq, step.positions)
        step.rings[block.layer] = kernels.quantize_swa_fp8(kv, backend=kernels.backend_for(kv))


@fused
def block_inputs(y: Tensor, start: Tensor, noise: int, g: int) -> tuple[Tensor, Tensor]:
    """A draft block's token ids [B, g] = [y, noise × (g−1)] (y [B]) and their positions start + 0 … g−1 (start
    [B]: each row's next position)."""
    ids = torch.cat((y.unsqueeze(1), torch.full((y.shape[0], g - 1), noise, dtype=y.dtype, device=y.device)), dim=1)
    return ids, start.unsqueeze(1) + torch.arange(g, device=y.device)


def draft_features(model: Transformer, cache: KVCache, y: Tensor) -> tuple[Tensor, Tensor]:
    """The DSpark blocks over [y, noise × (γ−1)] (y [B]: the pending tokens, at each cache row's next position)
    → (collapse(X) [B, γ, C], the head's logits Uₖ [B, γ, V] in fp32): the part of a draft that does not depend on
    the drafted tokens, so one forward (or one captured graph) serves every link of the Markov chain."""
    a = model.args
    start = cache.next_positions(slice(0, y.shape[0]))
    ids, positions = block_inputs(y, start, a.dspark_noise_token_id, a.dspark_block_size)
    X, pre = model.embed_stream(ids)
    update = None
    for block in model.mtp:
        X, pre, update = block(
            X, pre, lambda x, xq, block=block: block.block_attention(x, xq, cache, positions), update
        )
    last = model.mtp[-1]
    x = hc_collapse(update.apply(X), pre)
    return x, model.head(last.norm(x)).float()


# link k's head logits Uₖ and Markov bias, k → (its tokens, their distribution)
Link = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor | None]]


def markov_chain(model: Transformer, x: Tensor, base: Tensor, y: Tensor, link: Link) -> Draft:
    """The draft's links left to right over `draft_features`' (x, base) after the pending tokens y [B]: link k's
    tokens are `link` of its logits Uₖ + the Markov bias of the token before it, its confidence the head's, calibrated
    by the link's temperature. A `link` that keeps no distribution (None) gives a draft without any."""
    last = model.mtp[-1]
    tokens, dists, embedded, prev = [], [], [], y
    for k in range(x.shape[1]):
        e = last.markov_head.embed(prev)
        prev, q = link(base[:, k], last.markov_head.head(e), k)
        tokens.append(prev)
        dists.append(q)
        embedded.append(e)
    confidence = last.confidence_head.confidence(x, torch.stack(embedded, 1))  # every link's at once
    probs = torch.stack(dists, 1) if all(q is not None for q in dists) else None
    return Draft(torch.stack(tokens, 1), probs, confidence)


def keyed_links(temperature: Tensor, seeds: Tensor, cursor: Tensor) -> Link:
    """The links of a chain whose rows race on keyed noise (`model.sampling.keyed_link`): link k of row b is output
    position cursor[b] + k of seed seeds[b] (device tensors [B]); no distribution kept (one-hot on the tokens). The
    race's element counters are made once, for every link."""
    elements: list[Tensor] = []

    def link(base: Tensor, bias: Tensor, k: int) -> tuple[Tensor, None]:
        if not elements:
            elements.append(race_elements(base))
        return keyed_link(base, temperature, seeds, cursor, k, elements[0], bias), None

    return link


def draft_logits(model: Transformer, tokens: Tensor, taps: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor]:
    """Dense, differentiable DSpark forward for training, teacher-forced.

    tokens [B, T] and the frozen target's `taps` [B, T, n·C] (`model.features(tokens)`); anchors: last committed
    positions p (p + γ < T), [A] shared by every row or [B, A] per row. Row k of anchor p drafts token p+2+k from the
    block [tokens[p+1], noise…], the ring of main_x at positions (p−W, p], and the Markov bias of its true
    predecessor tokens[p+1+k]. Returns (logits [B, A, γ, V] with the Markov bias, raw confidence logits [B, A, γ] —
    before the temperatures, which calibration fits on them); the greedy drafts of `Transformer.dspark_draft` are the
    arg-maxes when the drafts are right.
    """
    a = model.args
    B, T = tokens.shape
    anchors = anchors.expand(B, -1)  # [B, A]: a shared row of anchors serves every sequence
    g, W, A = a.dspark_block_size, a.sliding_window, anchors.shape[1]
    if bool(((anchors < 0) | (anchors + g >= T)).any()):
        raise ValueError(f"anchors must satisfy 0 ≤ p and p + {g} < {T}")
    main_x = context(model.mtp, taps)
    dev = tokens.device
    steps = torch.arange(g, device=dev)
    block_pos = anchors.unsqueeze(-1) + 1 + steps  # [B, A, γ]: positions p+1 … p+γ
    ids = torch.full((B, A, g), a.dspark_noise_token_id, device=dev)
    ids[..., 0] = tokens.gather(1, anchors + 1)
    ring_pos = (anchors.unsqueeze(-1) - W + 1 + torch.arange(W, device=dev)).flatten(1)  # [B, A·W]
    ring_mask = (ring_pos >= 0).view(B * A, W)
    X, pre = model.embed_stream(ids.view(B * A, g))
    every = torch.arange(T, device=dev).expand(B, T)
    rows = ring_pos.clamp_min(0).unsqueeze(-1)
    main_xq = model.mtp[0].attn.cast_input(main_x)  # one FP8 cast for every block's wkv, as in `absorb`
    update = None
    for block in model.mtp:
        ring_kv = quantize_input(block.attn.window_kv(main_xq, every))  # [B, T, D]
        ring = ring_kv.gather(1, rows.expand(-1, -1, ring_kv.shape[-1])).view(B * A, W, -1)
        attend = functools.partial(block.dense_block_attention, positions=block_pos.view(B * A, g), ring=ring,
                                   ring_mask=ring_mask)  # fmt: skip
        X, pre, update = block(X, pre, attend, update)
    last = model.mtp[-1]
    x = hc_collapse(update.apply(X), pre)
    prev = tokens.gather(1, block_pos.flatten(1)).view(B * A, g)  # true predecessors
    e = last.markov_head.embed(prev)
    logits = model.head(last.norm(x)).float() + last.markov_head.head(e).float()
    confidence = last.confidence_head(x, e).squeeze(-1)
    return logits.view(B, A, g, -1), confidence.view(B, A, g)
