"""Token sampling and lossless speculative acceptance (DSpark verification, reference §4.4).

Greedy decoding is the temperature-0 case of the same rule: its "distribution" is one-hot on the arg-max (ties to
the lower id), so speculative verification with one-hot target and draft distributions accepts a draft exactly when
it is the target's arg-max and otherwise emits that arg-max — plain greedy decoding, token for token.

Acceptance (Leviathan et al. / Chen et al.): accept draft dₖ with probability min(1, p(dₖ)/q(dₖ)); at the first
rejection emit a sample of norm(max(0, p − q)); when all ℓ drafts pass, emit a bonus sample of p_{ℓ+1}. The emitted
tokens are distributed exactly as sampling the target autoregressively.

Randomness: one generator for the whole batch (or None: torch's default), or one per row (`Generators`; a None entry
is the default). Per row, a row draws only from its own generator and always the same count — V exponentials per
sampled token, and as many uniforms as drafts it verifies — so a seeded request gets the same tokens whatever its
batch neighbours, with or without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.fused import fused

Generators = torch.Generator | Sequence[torch.Generator | None] | None
ARGMAX_CHUNK = 1024  # elements of a row one program of a keyed race reduces (`chunked_argmax`)


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling: temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: Tensor  # [B]
    top_k: Tensor  # [B] int
    top_p: Tensor  # [B]

    @classmethod
    def uniform(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
        return cls(torch.full((batch,), temperature), torch.full((batch,), top_k), torch.full((batch,), top_p))

    def one_hot(self) -> bool:
        """Whether `probs` gives every row a one-hot distribution (every row greedy), asked on the host: a sample of
        it is then its arg-max, and no noise need be drawn."""
        return not bool((self.temperature > 0).any())

    def argmax_only(self) -> bool:
        """Whether `probs` is every row's arg-max, one-hot (every row greedy), whatever the logits' history: a
        sample is then a pure function of the logits, which a captured graph can take."""
        return SamplingParams.one_hot(self)

    def race_keys(self) -> tuple[Tensor, Tensor] | None:
        """Where each row's next token is a pure function of its tempered logits and a key — (seed, output index) per
        row, int64 [B] on the host —, those keys: a draft chain's links are then `keyed_link`s, and a verify's
        targets the `raced_tokens` of its `tempered_probs`, both capturable. Here: only where every row is greedy
        (keys unused), else None (the rows draw from generators)."""
        if not SamplingParams.one_hot(self):
            return None
        zeros = torch.zeros(self.temperature.shape[0], dtype=torch.int64)
        return zeros, zeros

    def probs(self, logits: Tensor) -> Tensor:
        """logits [B, ..., V] → fp32 probabilities [B, ..., V] after temperature, top-k and top-p."""
        if SamplingParams.one_hot(self):  # every row greedy: nothing to scale (this class's rule, not an override's)
            return argmax_one_hot(logits)
        shape = (-1,) + (1,) * (logits.dim() - 1)
        cut, top_p = None, None
        if bool((self.top_k > 0).any()):  # asked of the parameters where they live (the host), not of the device
            widest = int(self.top_k.clamp(0, logits.shape[-1]).max())  # the host's copy: no wait for the device
            k = self.top_k.to(logits.device, non_blocking=True).view(shape).clamp(0, logits.shape[-1])

            def cut(scaled: Tensor) -> Tensor:
                k_b = k.expand(*scaled.shape[:-1], 1)
                kth = scaled.topk(widest, dim=-1).values.gather(-1, (k_b - 1).clamp_min(0))
                return torch.where((k_b > 0) & (scaled < kth), -torch.inf, scaled)

        if bool((self.top_p < 1).any()):
            top_p = self.top_p.to(logits.device, non_blocking=True).view(shape)
        return tempered_probs(logits, self.temperature.to(logits.device, non_blocking=True).view(shape), cut, top_p)


def tempered_probs(
    logits: Tensor, t: Tensor, cut: Callable[[Tensor], Tensor] | None = None, top_p: Tensor | None = None
) -> Tensor:
    """logits [B, ..., V], temperatures t broadcast against them (on their device) → fp32 probabilities: the softmax
    of logits / t (after `cut` of the scaled logits, then cut to the `top_p` nucleus where given) where t > 0, the
    one-hot arg-max where t = 0 — `SamplingParams.probs`, device tensors only (capturable without cuts)."""
    scaled = logits.float() / t.clamp_min(1e-6)
    probs = (scaled if cut is None else cut(scaled)).softmax(-1)
    if top_p is not None:
        probs = nucleus(probs, top_p)
    return torch.where(t > 0, probs, argmax_one_hot(logits))


def argmax_one_hot(logits: Tensor) -> Tensor:
    """fp32 [..., V]: 1 at each row's arg-max (ties to the lower id), 0 elsewhere — greedy decoding's distribution."""
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def nucleus(probs: Tensor, top_p: Tensor) -> Tensor:
    """probs [..., V] cut to each row's nucleus and renormalised: the tokens at least as likely as the one whose
    inclusion brings the mass of the likelier ones to top_p (broadcast against probs; ties at the cut all kept, so
    the set depends on no sort order; rows with top_p ≥ 1 keep every token): a sort of the values alone, a cumulative
    sum and a comparison with the cut's value, with no host read."""
    largest = probs.sort(-1, descending=True).values
    at = (largest.cumsum(-1) < top_p).sum(-1, keepdim=True).clamp_max(probs.shape[-1] - 1)
    kept = torch.where((probs >= largest.gather(-1, at)) | (top_p >= 1), probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _per_row(generator: Generators, rows: int) -> Sequence[torch.Generator | None] | None:
    """The per-row generators of a `Generators` argument (checked against the batch), None for a single one."""
    if generator is None or isinstance(generator, torch.Generator):
        return None
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for a batch of {rows} rows")
    return generator


def sample(probs: Tensor, generator: Generators = None) -> Tensor:
    """probs [B, V] → token ids [B]: the exponential race argmax(p / Exp(1)) (as the reference samples), one pass
    over the vocabulary; a one-hot row always gives its token."""
    race = torch.empty_like(probs, dtype=torch.float32)
    rows = _per_row(generator, probs.shape[0])
    if rows is None:
        race.exponential_(generator=generator)
    for r, g in enumerate(rows or ()):
        race[r].exponential_(generator=g)
    return (probs.float() / race).argmax(-1)


# SplitMix64 (Steele et al.): the golden-ratio increment and the finaliser's multipliers, as signed int64.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(z: Tensor, s: int) -> Tensor:
    """A logical right shift of int64 lanes (torch's `>>` keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _finalise(z: Tensor) -> Tensor:
    """SplitMix64's output function of int64 states (a bijection that mixes every bit into every other)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def raced_tokens(probs: Tensor, seeds: Tensor, cursor: Tensor) -> Tensor:
    """probs [B, T, V] of T consecutive positions per row, seeds and cursor [B] (int64, on probs' device) → tokens
    [B, T]: position t of row b races (`keyed_race`) at (seeds[b], cursor[b] + t) — a row's tokens at its output
    indices cursor[b] … cursor[b] + T − 1."""
    B, T, V = probs.shape
    positions = cursor.unsqueeze(1) + torch.arange(T, device=cursor.device)
    tokens = keyed_race(probs.reshape(B * T, V), seeds.unsqueeze(1).expand(B, T).reshape(-1), positions.flatten())
    return tokens.view(B, T)


def keyed_race(probs: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """probs [N, V], seeds and positions [N] (int64) → token ids [N]: the exponential race argmax(p / Exp(1)) of
    `sample`, its noise a pure function of the row's (seed, position) (`race_uniforms`), −log u the exponential. A
    request's positions race from noise of their own in one launch for the whole forward (a generator per row and
    position takes a few launches each), reproducible from the seed alone."""
    return _keyed_race(probs, seeds, positions, race_elements(probs))


def keyed_link(
    logits: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    offset: int = 0,
    v: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """logits [N, V], temperature [N], seeds and positions [N] → token ids [N]: `keyed_race` of the tempered
    softmax in its Gumbel-max form — argmax(logits / t − log(−log u)) over the same uniforms —, no distribution
    made; a row of temperature 0 takes its arg-max. A draft chain's link, capturable with it: link k races at
    positions + k (`offset`), from the element counters `v` (`race_elements`) the chain makes once, over logits +
    `bias` (its Markov bias, added in fp32 inside the race)."""
    v = race_elements(logits) if v is None else v
    return _keyed_link(logits, bias, temperature, seeds, positions, v, offset)


def race_elements(scores: Tensor) -> Tensor:
    """1 … V, int64, on the scores' device: the race's element counters, read from memory by the fused kernels
    (an index generated inside one is int32, which the int64 hash arithmetic overflows)."""
    return torch.arange(1, scores.shape[-1] + 1, device=scores.device, dtype=torch.int64)


@fused
def _keyed_race(probs: Tensor, seeds: Tensor, positions: Tensor, v: Tensor) -> Tensor:
    return chunked_argmax(probs.float() / -torch.log(race_uniforms(seeds, positions, v)))


@fused
def _keyed_link(
    logits: Tensor, bias: Tensor | None, temperature: Tensor, seeds: Tensor, positions: Tensor, v: Tensor, offset: int
) -> Tensor:
    scores = logits.float() if bias is None else logits.float() + bias.float()
    u, t = race_uniforms(seeds, positions + offset, v), temperature.unsqueeze(-1)
    return chunked_argmax(torch.where(t > 0, scores / t.clamp_min(1e-6) - torch.log(-torch.log(u)), scores))


def chunked_argmax(scores: Tensor) -> Tensor:
    """scores [N, V] → argmax(-1) [N] (ties to the lower id), in two reductions: the arg-max of each chunk of
    ARGMAX_CHUNK elements, then the first chunk holding the row's maximum. Compiled with the race that computes the
    scores, a row's hashing and comparing is spread over ⌈V / ARGMAX_CHUNK⌉ programs instead of one: a batch of one
    row — the draft chain's links at batch 1 — would otherwise leave all but one of the GPU's SMs idle."""
    N, V = scores.shape
    chunks = -(-V // ARGMAX_CHUNK)
    padded = nn.functional.pad(scores, (0, chunks * ARGMAX_CHUNK - V), value=-torch.inf)
    padded = padded.view(N, chunks, ARGMAX_CHUNK)
    within = padded.argmax(-1, keepdim=True)  # [N, chunks, 1]
    chunk = padded.gather(-1, within).squeeze(-1).argmax(-1, keepdim=True)  # [N, 1]
    return (chunk * ARGMAX_CHUNK + within.squeeze(-1).gather(-1, chunk)).squeeze(-1)


def race_uniforms(seeds: Tensor, positions: Tensor, v: Tensor) -> Tensor:
    """The race's uniforms [N, V] of rows keyed by (seed, position) [N]: the row's key is the SplitMix64 output of
    (its seed's output) ^ position, element v's uniform (`open_unit`) the v-th output from that key (v: 1 … V)."""
    key = _finalise(_finalise(seeds) ^ positions).unsqueeze(-1)
    return open_unit(_finalise(key + v * _GOLDEN))


def open_unit(z: Tensor) -> Tensor:
    """int64 random bits → fp32 uniforms strictly inside (0, 1): the top 23 bits and a half, every value exact in
    fp32 (with 24 bits the largest rounds up to 1, whose exponential 0 would win any race: p / 0 = inf, 0 / 0 = NaN)."""
    return (_shift_right(z, 41).float() + 0.5) * 2.0**-23


def _uniforms(lengths: Tensor, K: int, generator: Generators, device: torch.device) -> Tensor:
    """u [B, K] on `device` for the acceptance tests; per row, only its first lengths[b] are drawn (the others are
    never used), so what a row consumes does not depend on how many drafts its neighbours verify."""
    B = lengths.shape[0]
    rows = _per_row(generator, B)
    if rows is None:
        return torch.rand(B, K, generator=generator, device=device)
    u = torch.ones(B, K, device=device)
    for r, (g, n) in enumerate(zip(rows, lengths.tolist(), strict=True)):
        u[r, :n].uniform_(generator=g)
    return u


def argmax_accept(scores: Tensor, drafts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """`speculative_accept` of one-hot targets, read off scores [B, K+1, V] whose arg-maxes (ties to the lower id) are
    the targets' tokens — a greedy batch's logits themselves, with no distribution made."""
    return accept_targets(scores.argmax(-1), drafts, lengths)


@fused
def greedy_accept(logits: Tensor, drafts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """`argmax_accept` of a verify's logits [B, K+1, V] as one compiled function (a replayed verify's acceptance,
    captured with its commit): the arg-maxes by `chunked_argmax`, spread over the vocabulary's chunks — a verify at
    batch 1 has a handful of rows, which one program each would leave most of the GPU idle over."""
    B, T, V = logits.shape
    return accept_targets(chunked_argmax(logits.reshape(B * T, V)).view(B, T), drafts, lengths)


def accept_targets(targets: Tensor, drafts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The acceptance of drafts [B, K] by one-hot targets, given as their tokens [B, K+1]: row b accepts its leading
    drafts (of its first lengths[b]) equal to the targets' and emits the target after them → (accepted count [B],
    the token emitted after them [B])."""
    K = drafts.shape[1]
    within = torch.arange(K, device=targets.device) < lengths.to(targets.device, non_blocking=True).unsqueeze(1)
    n = ((targets[:, :K] == drafts) & within).long().cumprod(-1).sum(-1)
    return n, targets.gather(1, n.unsqueeze(1)).squeeze(1)


def speculative_accept(
    target: Tensor,
    draft: Tensor,
    drafts: Tensor,
    lengths: Tensor,
    generator: Generators = None,
) -> tuple[Tensor, Tensor]:
    """Lossless verification of drafts [B, K] (row b uses the first lengths[b]).

    target [B, K+1, V]: target distribution of the position after the anchor and after each draft; draft [B, K, V]:
    the distribution each draft was sampled from. Returns (accepted count [B], the token emitted after them [B]).
    `lengths` is best given on the host: with one generator per row, each row's draws are sized from it there.
    Where every target row is one-hot (greedy or keyed rows, `SamplingParams.one_hot`) the rule accepts a draft
    exactly where the target gives it probability 1 and emits the target's token after the accepted ones:
    `argmax_accept` of the targets, with no noise drawn.
    """
    B, K = drafts.shape
    p_d = target[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    limits = lengths.to(target.device, non_blocking=True)
    within = torch.arange(K, device=target.device) < limits.unsqueeze(1)
    rows = torch.arange(B, device=target.device)
    q_d = draft.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = _uniforms(lengths, K, generator, target.device)
    ok = (u * q_d < p_d) & within
    n = ok.long().cumprod(-1).sum(-1)  # leading accepted drafts
    p_next = target[rows, n]
    residual = (p_next - draft[rows, n.clamp(max=K - 1)]).clamp_min(0) if K else p_next
    rejected = (n < limits).unsqueeze(-1)
    fallback = residual.sum(-1, keepdim=True) <= 0  # only when p = q up to rounding
    dist = torch.where(rejected & ~fallback, residual, p_next)
    return n, sample(dist / dist.sum(-1, keepdim=True), generator)
