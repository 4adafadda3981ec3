"""Per-row sampling over a batch and the logprobs the API reports.

The rows of a forward draw from one generator, seeded at random (`random_generator`): one launch of noise for the
whole batch, not one per row. An unseeded sampled row needs noise of its own, not a stream of its own: every element
of the batch's draw is independent of every other, so no two rows share randomness.

A **seeded** sampled row needs more than a stream of its own to be reproducible. Speculative sampling emits a sample of
the target's distribution whatever the drafts, but *which* sample depends on how many drafts were verified at each step
— and that is the scheduler's call, made on the whole batch and on measured step times. So a seeded row's randomness is
fixed per output position instead: its token at output index i is the model's own exponential race over noise keyed by
(seed, i) (`model.sampling.keyed_race`), and `StepSampling.probs` collapses its distribution onto that token. Every
sampler downstream then takes exactly it — a one-hot row is its token for `sample`, and for lossless verification a
one-hot target accepts a draft exactly when it is that token and otherwise emits it (greedy decoding is the same case).
DSpark's draft chain is collapsed with the same noise of the same positions, so a draft that follows the target's
distribution picks the target's token (Gumbel-max coupling) and is accepted. Each token is still an exact sample of the
target (fresh noise per position, drawn independently of the model); it depends on the seed, the prompt and the model
only: not on the batch, the drafts, the verify widths, or whether speculation is on.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before temperature, top-k and
top-p), as the OpenAI API reports them; under an output constraint, of the masked logits (masking.py), which every
sampler downstream reads first.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decode_svc.masking import Masks
from decode_svc.sequence import Sequence, TokenLogprob
from model import SamplingParams, sample
from model.sampling import keyed_race


@dataclass(frozen=True)
class StepSampling(SamplingParams):
    """The sampling of one forward's rows, seeded rows collapsed onto the tokens their positions' noise picks.

    Each call of `probs` covers the next positions of every row, from `cursor` on (then advanced): [B, V] logits are
    one position per row (a plain step, the first token, one link of DSpark's left-to-right draft chain), [B, T, V]
    are T consecutive positions (a verify over [pending, drafts])."""

    seeds: tuple[int | None, ...] = ()  # per row: the seed of a seeded sampled row, else None
    cursor: list[int] = field(default_factory=list)  # per row: the output index of the next position covered
    masks: Masks | None = None  # the rows' output constraints (None: no row has one)
    logprobs: tuple[bool, ...] | None = None  # per row: whether its logprobs are reported (None: every row's)

    def one_hot(self) -> bool:
        """Greedy rows and seeded ones (collapsed onto their positions' tokens) only (no `seeds`: none seeded)."""
        seeded = [seed is not None for seed in self.seeds] or [False] * len(self.temperature)
        return all(t <= 0 or s for t, s in zip(self.temperature.tolist(), seeded, strict=True))

    def argmax_only(self) -> bool:
        """Greedy rows alone and no output constraint (its masks are filled on the host, link by link)."""
        return SamplingParams.one_hot(self) and self.masks is None

    def probs(self, logits: Tensor) -> Tensor:
        if self.masks is not None:
            self.masks.apply(logits)
        probs = super().probs(logits)
        positions = probs.view(probs.shape[0], -1, probs.shape[-1])  # [B, T, V], a view: collapsed in place
        T = positions.shape[1]
        seeded = [(b, t) for b, seed in enumerate(self.seeds) if seed is not None for t in range(T)]
        if seeded:  # every seeded row's positions raced at once, on the device: nothing waits for it
            keys = [position_key(self.seeds[b], self.cursor[b] + t) for b, t in seeded]  # type: ignore[arg-type]
            at = torch.tensor(seeded, device=probs.device).unbind(-1)
            tokens = keyed_race(positions[at], torch.tensor(keys, device=probs.device))
            positions[at] = torch.nn.functional.one_hot(tokens, positions.shape[-1]).to(positions.dtype)
        self.cursor[:] = [c + T for c in self.cursor]
        return probs


def batch_sampling(rows: Seq[Sequence], drafts: Seq[Seq[int]] | None = None) -> StepSampling:
    """The sampling parameters of a lane's rows, in row order, each from its next output position on (a fresh object
    per forward: its cursor advances); `drafts`: a verify's, per row (its masks follow them: masking.py)."""
    s = [row.params.sampling for row in rows]
    guides = [row.guide for row in rows]
    return StepSampling(
        torch.tensor([x.temperature for x in s]),
        torch.tensor([x.top_k for x in s]),
        torch.tensor([x.top_p for x in s]),
        seeds=tuple(x.seed if x.seeded else None for x in s),
        cursor=[len(row.output) for row in rows],
        masks=Masks(guides, drafts) if any(g is not None for g in guides) else None,
        logprobs=tuple(row.params.logprobs for row in rows),
    )


def position_key(seed: int, index: int) -> int:
    """The noise key of a seeded row's output position `index` (`keyed_race`): its own stream, not the next draws of
    one shared by every position (those would shift whenever a step verified a different number of drafts)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, index), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def random_generator(device: torch.device) -> torch.Generator:
    """A generator on `device` seeded at random: the noise of unseeded sampled rows."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def sample_rows(logits: Tensor, rows: Seq[Sequence], generator: torch.Generator) -> list[int]:
    """One token per row of logits [B, V], sampled as `batch_sampling(rows)` says: the arg-maxes alone for a greedy
    batch (no distribution made); else its distributions (`StepSampling.probs`) and one exponential race over the
    batch, which gives a one-hot row (greedy or seeded) its token — or their arg-max where every row is one-hot."""
    sampling = batch_sampling(rows)
    if sampling.argmax_only():
        return logits.argmax(-1).tolist()
    probs = sampling.probs(logits)
    if sampling.one_hot():
        return probs.argmax(-1).tolist()
    return sample(probs, generator).tolist()


def token_logprobs(logits: Tensor, tokens: Seq[int], top: int) -> list[TokenLogprob]:
    """(logprob of tokens[t], the `top` most likely (id, logprob)) for each row t of logits [T, V]."""
    logp = logits[: len(tokens)].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if top <= 0:
        return [(lp, []) for lp in chosen]
    values, ids = logp.topk(top, dim=-1)
    return [
        (lp, list(zip(row_ids, row_values, strict=True)))
        for lp, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]
