"""Per-row sampling over a batch and the logprobs the API reports.

Every sampled row's randomness is fixed per output position: its token at output index i is the model's own
exponential race over noise keyed by (its seed, i) (`model.sampling.keyed_race`), and `StepSampling.probs` collapses
its distribution onto that token. A request's seed is its own, or one drawn at random when it gives none
(`Sequence.noise_seed`). Every sampler downstream then takes exactly that token — a one-hot row is its token for
`sample`, and for lossless verification a one-hot target accepts a draft exactly when it is that token and otherwise
emits it (greedy decoding is the same case). Each token is still an exact sample of the target (fresh noise per
position, drawn independently of the model), and it depends on the seed, the prompt and the model only: not on the
batch, the drafts, the verify widths, or whether speculation is on.

Why per position, not a stream per row: speculative sampling emits a sample of the target's distribution whatever
the drafts, but *which* sample depends on how many drafts were verified at each step, and that is the scheduler's
call. And why for every sampled row, not only seeded ones: a forward's noise is then one keyed launch, with no
generator and nothing drawn per row, so the sampled draft chain and its acceptance are pure functions of the logits
and the rows' (seed, position) keys, as a greedy batch's are; and DSpark's chain, collapsed with the noise of the same
positions, picks the target's token wherever draft and target agree under that noise (Gumbel-max coupling) — on the
demo checkpoint as many drafts pass as when they are sampled independently and tested by min(1, p/q)
(`docs/benchmarks.md`).

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before temperature, top-k and
top-p), as the OpenAI API reports them; under an output constraint, of the masked logits (masking.py), which every
sampler downstream reads first.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from decode_svc.masking import Masks
from decode_svc.sequence import Sequence, TokenLogprob
from model import SamplingParams
from model.sampling import keyed_race, raced_tokens


@dataclass(frozen=True)
class StepSampling(SamplingParams):
    """The sampling of one forward's rows, every sampled row collapsed onto the token its position's noise picks.

    Each call of `probs` covers the next positions of every row, from `cursor` on (then advanced): [B, V] logits are
    one position per row (a plain step, the first token, one link of DSpark's left-to-right draft chain), [B, T, V]
    are T consecutive positions (a verify over [pending, drafts])."""

    seeds: Tensor | None = None  # [B] int64 (host): each row's noise seed (None: zeros — greedy rows need none)
    cursor: Tensor | None = None  # [B] int64 (host): each row's output index of the next position (None: zeros)
    masks: Masks | None = None  # the rows' output constraints (None: no row has one)
    logprobs: tuple[bool, ...] | None = None  # per row: whether its logprobs are reported (None: every row's)

    def __post_init__(self) -> None:
        for name in ("seeds", "cursor"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.zeros(self.temperature.shape[0], dtype=torch.int64))

    def one_hot(self) -> bool:
        """Every row is: greedy, or collapsed onto its positions' keyed tokens."""
        return True

    def argmax_only(self) -> bool:
        """Greedy rows alone and no output constraint (its masks are filled on the host, link by link)."""
        return SamplingParams.one_hot(self) and self.masks is None

    def race_keys(self) -> tuple[Tensor, Tensor] | None:
        """(seeds, cursor) where no row is cut by top-k, top-p or an output constraint (its greedy rows' settings
        aside): each row's token is then the keyed race of its tempered logits alone."""
        sampled = self.temperature > 0
        cut = ((self.top_k > 0) | (self.top_p < 1)) & sampled
        return None if self.masks is not None or bool(cut.any()) else (self.seeds, self.cursor)

    def probs(self, logits: Tensor) -> Tensor:
        if self.masks is not None:
            self.masks.apply(logits)
        probs = super().probs(logits)
        B, V = probs.shape[0], probs.shape[-1]
        T = probs.numel() // (B * V)  # positions a row
        if not SamplingParams.one_hot(self):  # a row samples: every row raced at once (a greedy row to its arg-max)
            seeds, cursor = (keys.to(probs.device, non_blocking=True) for keys in (self.seeds, self.cursor))
            tokens = raced_tokens(probs.view(B, T, V), seeds, cursor)
            probs = torch.nn.functional.one_hot(tokens, V).to(probs.dtype).view(probs.shape)
        self.cursor.add_(T)
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
        seeds=torch.tensor([row.noise_seed for row in rows], dtype=torch.int64),
        cursor=torch.tensor([len(row.output) for row in rows], dtype=torch.int64),
        masks=Masks(guides, drafts) if any(g is not None for g in guides) else None,
        logprobs=tuple(row.params.logprobs for row in rows),
    )


WARM_ROWS = (1, 2)  # one row (its own case), then another count: the compiled race's row count turns dynamic


def warm_race(device: torch.device, vocab: int) -> None:
    """Compile the keyed race before the first request, for every row count a forward may bring it (model.fused:
    one row, and a dynamic count once another is seen), so a replica's first sampled requests do not wait for
    the compiler (≈ 1 s on a GPU); on a CPU, where the race runs uncompiled, a few races of no consequence. Seeds and
    positions are separate tensors, as a forward's are: the compiled race is specialised to its inputs' aliasing."""
    for rows in WARM_ROWS:
        seeds, positions = (torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(2))
        keyed_race(torch.full((rows, vocab), 1.0 / vocab, device=device), seeds, positions)


def sample_rows(logits: Tensor, rows: Seq[Sequence]) -> list[int]:
    """One token per row of logits [B, V], sampled as `batch_sampling(rows)` says: the arg-maxes alone for a greedy
    batch (no distribution made), else those of its collapsed distributions (`StepSampling.probs`)."""
    sampling = batch_sampling(rows)
    if sampling.argmax_only():
        return logits.argmax(-1).tolist()
    return sampling.probs(logits).argmax(-1).tolist()


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
