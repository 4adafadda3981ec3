"""DSpark speculation: greedy speculative decoding emits exactly plain greedy decoding; sampled speculative decoding
emits the target distribution (statistical tests, with a fixed 1e-6 false-alarm level)."""

from __future__ import annotations

import math

import pytest
import torch

from model import DecodeBatch, SamplingParams, encode_prefill, sample, speculative_accept
from model.dspark import draft_logits
from model.sampling import (
    ARGMAX_CHUNK,
    argmax_accept,
    chunked_argmax,
    greedy_accept,
    keyed_race,
    nucleus,
    open_unit,
)


def chi2_threshold(dof: int, z: float = 4.75) -> float:
    """Upper 1e-6 quantile of χ²(dof) (Wilson–Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson χ² of counts against probabilities, categories with expected count < 5 pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum().view(1)))
    exp = torch.cat((expected[big], expected[~big].sum().view(1)))
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_speculative_accept_matches_the_target(gen):
    """Accept/resample from many (p, q) pairs: the first emitted token is distributed as p (the lossless property)."""
    V, K, B = 6, 3, 40000
    p = torch.softmax(2 * torch.randn(V, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(V, generator=gen), -1)
    target = p.expand(B, K + 1, V).contiguous()
    draft_probs = q.expand(B, K, V).contiguous()
    drafts = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=gen).view(B, K)
    accepted, nxt = speculative_accept(target, draft_probs, drafts, torch.full((B,), K), gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    stat, dof = chi2(torch.bincount(first, minlength=V).double(), p.double())
    assert stat < chi2_threshold(dof), (stat, dof)
    # Acceptance rate of a draft = Σ min(p, q) (the overlap of the two distributions).
    rate = float((accepted > 0).double().mean())
    assert abs(rate - float(torch.minimum(p, q).sum())) < 5 * math.sqrt(0.25 / B)


@pytest.mark.parametrize("rule", ["full", "one-hot targets", "arg-max", "chunked arg-max"])
def test_one_hot_distributions_are_greedy(gen, rule: str):
    """Greedy is the temperature-0 case: one-hot target and draft accept exactly the arg-max prefix, whether the rule
    runs in full, reads the one-hot targets' arg-maxes (no noise drawn) or the logits' arg-maxes alone
    (`argmax_accept`, no distribution made; `greedy_accept`, a replayed verify's, by chunks of the vocabulary),
    within each row's length."""
    V, K, B = ARGMAX_CHUNK + 50, 4, 64
    logits = torch.randn(B, K + 1, V, generator=gen)
    greedy = SamplingParams.uniform(B)
    assert greedy.one_hot()
    assert not SamplingParams.uniform(B, temperature=0.5).one_hot()
    target = greedy.probs(logits)
    drafts = torch.where(
        torch.rand(B, K, generator=gen) < 0.7, logits[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=gen)
    )
    lengths = torch.randint(0, K + 1, (B,), generator=gen)
    proposal = greedy.probs(torch.randn(B, K, V, generator=gen)).scatter(-1, drafts.unsqueeze(-1), 2.0).clamp(max=1)
    if rule == "full":
        accepted, nxt = speculative_accept(target, proposal, drafts, lengths, gen)
    elif rule == "chunked arg-max":
        accepted, nxt = greedy_accept(logits, drafts, lengths)
    else:
        accepted, nxt = argmax_accept(logits if rule == "arg-max" else target, drafts, lengths)
    matches = (drafts == logits[:, :K].argmax(-1)).long().cumprod(-1).sum(-1).minimum(lengths)
    assert torch.equal(accepted, matches)
    assert torch.equal(nxt, logits[torch.arange(B), accepted].argmax(-1))


def test_sampling_params_filters(gen):
    logits = torch.randn(3, 100, generator=gen)
    probs = SamplingParams(torch.tensor([0.0, 1.0, 0.7]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.5])).probs(
        logits
    )
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 100).float())
    assert int((probs[1] > 0).sum()) == 5
    assert torch.equal((probs[1] > 0), logits[1] >= logits[1].topk(5).values[-1])
    kept = probs[2] > 0  # smallest set of the most likely tokens reaching 0.5 of the tempered mass
    full = torch.softmax(logits[2] / 0.7, -1)
    assert float(full[kept].sum()) >= 0.5 > float(full[kept].sum() - full[kept].min())
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_a_nucleus_keeps_the_tokens_whose_likelier_ones_fall_short_of_top_p(gen):
    """Against the definition, token by token: a token is kept when the tokens strictly likelier than it hold less
    than top_p. Rows: peaked, nearly flat, a tie across the cut, top_p 1 (every token kept), a plateau of 1,500 —
    at a [B, T, V] shape as a verify samples; a row's nucleus is the same alone as in its batch."""
    V = 5000
    logits = torch.randn(5, 2, V, generator=gen, dtype=torch.float64) * 4
    logits[1] = torch.rand(2, V, generator=gen, dtype=torch.float64) * 0.01  # nearly flat: 0.9 needs ~4,500 tokens
    logits[2] = torch.randn(2, V, generator=gen, dtype=torch.float64) * 0.5
    logits[2, :, :4] = torch.tensor([10.0, 9.0, 9.0, 9.0], dtype=torch.float64)  # 0.42 alone, 0.89 with the tie
    logits[4] = torch.rand(2, V, generator=gen, dtype=torch.float64) * 0.01
    logits[4, :, :1500] += 8.0  # 0.8 needs ~1,200 tokens
    probs = logits.float().softmax(-1)
    top_p = torch.tensor([0.8, 0.9, 0.5, 1.0, 0.8]).view(-1, 1, 1)
    got = nucleus(probs, top_p)
    ascending = probs.double().sort(-1).values  # the mass strictly above each token, in fp64: a suffix sum
    above = torch.cat((ascending.flip(-1).cumsum(-1).flip(-1), ascending.new_zeros(5, 2, 1)), -1)
    likelier = above.gather(-1, torch.searchsorted(ascending, probs.double(), right=True))
    margin = 1e-5  # the cumulative sums' rounding: a token this close to the cut may go either way
    assert torch.all((got > 0) | (likelier >= top_p - margin))
    assert torch.all((got == 0) | (likelier < top_p + margin))
    assert int((got[1] > 0).sum(-1).min()) > 4000
    assert torch.all(got[2, :, 1:4] > 0)  # the three tied at the cut all kept
    assert torch.all(got[2, :, 4:] == 0)
    assert torch.all(got[3] > 0)
    assert 1000 < int((got[4] > 0).sum(-1).min()) <= int((got[4] > 0).sum(-1).max()) < 1500
    torch.testing.assert_close(got.sum(-1), torch.ones(5, 2))
    assert torch.equal(nucleus(probs[4:], top_p[4:]), got[4:])
    kept = got > 0
    torch.testing.assert_close(got, torch.where(kept, probs, 0) / (probs * kept).sum(-1, keepdim=True))


def test_an_all_greedy_batch_gives_the_one_hots_of_a_mixed_one(gen):
    """A batch of greedy rows alone (which skips the tempered distribution) gives, in fp32 whatever the logits'
    dtype, the one-hot rows a mixed batch gives its greedy rows, ties to the lower id."""
    logits = torch.randn(3, 2, 100, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    logits[0, 0, 7] = logits[0, 0, 9] = logits[0, 0].max() + 1  # a tie
    greedy = SamplingParams.uniform(3).probs(logits)
    mixed = SamplingParams(torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.long), torch.ones(3)).probs(logits)
    assert greedy.dtype == torch.float32
    assert torch.equal(greedy[[0, 2]], mixed[[0, 2]])
    assert torch.equal(greedy, torch.nn.functional.one_hot(logits.float().argmax(-1), 100).float())
    assert greedy[0, 0, 7] == 1


def test_greedy_speculation_emits_plain_greedy_tokens(tiny, tokens, gen):
    out = encode_prefill(tiny, tokens(23))
    greedy = SamplingParams.uniform(1)
    V, steps = tiny.args.vocab_size, 10

    plain_batch = DecodeBatch(tiny)
    _plain_seq, logits = plain_batch.join(out.blocks, out.encoder_state)
    plain = [int(logits.argmax())]
    while len(plain) < steps + tiny.args.dspark_block_size:  # the last verify may run up to γ tokens past `steps`
        plain.append(int(plain_batch.decode_step(plain[-1:])[0].argmax()))

    batch = DecodeBatch(tiny)
    seq, logits = batch.join(out.blocks, out.encoder_state)
    emitted, pending, accepted = [], int(logits.argmax()), 0
    while len(emitted) + 1 < steps - 4:
        draft = batch.dspark_draft([pending], greedy)
        assert draft.tokens.shape == (1, tiny.args.dspark_block_size)
        assert bool(((draft.confidence > 0) & (draft.confidence < 1)).all())
        # Adaptive length from the confidence head: cut where the running product falls below 1/2 (≥ 1 draft).
        length = max(1, int((draft.confidence[0].cumprod(0) >= 0.5).sum()))
        # A random DSpark is almost never right: teacher-force a random number of correct drafts so that acceptance
        # of several tokens, and the rejection after them, are both exercised — at least one until a draft has been
        # accepted (with 0 … length each round, ≈ 4 % of seeds accepted nothing, e.g. MODEL_TEST_SEED=1330761001).
        right = int(torch.randint(0 if accepted else 1, length + 1, (1,), generator=gen))
        forced = draft.tokens.clone()
        done = len(emitted) + 1
        forced[0, :right] = torch.tensor(plain[done : done + right])
        one_hot = torch.nn.functional.one_hot(forced, V).float()  # greedy drafts: q is one-hot
        result = batch.verify([pending], type(draft)(forced, one_hot, draft.confidence), greedy, torch.tensor([length]))
        assert int(result.accepted[0]) >= right
        accepted += int(result.accepted[0])
        emitted += [pending, *result.tokens[0][:-1]]
        pending = result.tokens[0][-1]
    assert [*emitted, pending] == plain[: len(emitted) + 1]
    assert accepted > 0

    # Verification committed exactly the emitted tokens: same state as plain decoding of them, same next draft.
    check = DecodeBatch(tiny)
    check_seq, _ = check.join(out.blocks, out.encoder_state)
    for t in emitted:
        check.decode_step([t])
    again, expected = batch.dspark_draft([pending], greedy), check.dspark_draft([pending], greedy)
    assert torch.equal(again.tokens, expected.tokens)
    torch.testing.assert_close(again.confidence, expected.confidence, rtol=1e-9, atol=1e-9)
    a, b = batch.leave(seq), check.leave(check_seq)
    assert a.encoder_state.to_bytes()[:64] == b.encoder_state.to_bytes()[:64]
    assert torch.equal(a.encoder_state.ring_data, b.encoder_state.ring_data)
    assert [x.to_bytes() for x in a.blocks] == [x.to_bytes() for x in b.blocks]


def test_confidence_temperatures_scale_the_confidence_logits(tiny, tokens, gen):
    """Sequential Temperature Scaling: draft k's confidence is σ(zₖ / Tₖ) with the head's temperature of position k;
    the drafts and their distributions do not change."""
    out = encode_prefill(tiny, tokens(17))
    batch = DecodeBatch(tiny)
    _, logits = batch.join(out.blocks, out.encoder_state)
    greedy, y = SamplingParams.uniform(1), [int(logits.argmax())]
    raw = batch.dspark_draft(y, greedy)  # T = 1 (the seeded model's default)
    head = tiny.mtp[-1].confidence_head
    temperature = 0.25 + 3.75 * torch.rand(tiny.args.dspark_block_size, generator=gen, dtype=torch.float64)
    head.temperature.copy_(temperature)
    try:
        scaled = batch.dspark_draft(y, greedy)
    finally:
        head.temperature.fill_(1.0)  # the shared model's default again
    assert torch.equal(scaled.tokens, raw.tokens)
    V = tiny.args.vocab_size
    assert torch.equal(scaled.proposal(V), raw.proposal(V))
    z = torch.logit(raw.confidence.double())
    torch.testing.assert_close(scaled.confidence.double(), torch.sigmoid(z / temperature), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(scaled.confidence, raw.confidence)


def test_sampled_speculation_emits_the_target_distribution(tiny, tokens, gen):
    """Forks of one sequence each verify one draft: the first emitted token follows the target distribution (from
    decode_step), whether the draft was accepted or rejected and resampled. top_k = 4 keeps the target on four tokens
    (a random tiny model's raw distribution is nearly uniform over the whole vocabulary)."""
    out = encode_prefill(tiny, tokens(19))
    B = 96
    batch = DecodeBatch(tiny, capacity=B)
    seq, logits = batch.join(out.blocks, out.encoder_state)
    pending = int(logits.argmax())
    for _ in range(B - 1):
        batch.fork(seq)
    probe = DecodeBatch(tiny)
    probe.join(out.blocks, out.encoder_state)
    raw = probe.decode_step([pending])[0]
    warm = SamplingParams.uniform(B, temperature=1.0, top_k=4)
    target = warm.probs(raw.expand(B, -1))[0]
    assert int((target > 0).sum()) == 4
    # DSpark's own drafts (sampled from its distribution) must be proper samples of it …
    drafts = probe.dspark_draft([pending], SamplingParams.uniform(1, temperature=0.5), gen)
    # (fp32 probabilities over 129,280 tokens: their sum is 1 to ~1e-5)
    torch.testing.assert_close(drafts.probs.sum(-1), torch.ones(1, tiny.args.dspark_block_size), rtol=0, atol=1e-4)
    assert bool((drafts.probs.gather(-1, drafts.tokens.unsqueeze(-1)) > 0).all())
    # … but a random DSpark never agrees with the target; a draft distribution that overlaps it half-way makes both
    # acceptance and rejection happen.
    q = 0.5 * target + 0.5 * torch.softmax(torch.randn(target.shape, generator=gen) * 8, -1)
    proposal = torch.multinomial(q, B, replacement=True, generator=gen).view(B, 1)
    draft = type(drafts)(proposal, q.expand(B, 1, -1), drafts.confidence[:, :1].expand(B, 1))
    result = batch.verify([pending] * B, draft, warm, generator=gen)
    first = torch.tensor([row[0] for row in result.tokens])
    stat, dof = chi2(torch.bincount(first, minlength=target.shape[0]).double(), target.double())
    print(f"accepted {int(result.accepted.sum())}/{B}; chi2 {stat:.1f} on {dof} dof")
    assert 0 < int(result.accepted.sum()) < B
    assert dof == 3
    assert stat < chi2_threshold(dof)


def test_dense_draft_forward_matches_the_packed_draft(tiny, tokens):
    """The differentiable DSpark forward (training) gives the packed path's drafts and confidences, teacher-forced
    on those drafts, with target features from the dense forward under the same bounded-replay truncation."""
    W, prompt = tiny.args.sliding_window, 13
    ids = tokens(prompt + 3)
    out = encode_prefill(tiny, ids[:prompt])
    batch = DecodeBatch(tiny)
    batch.join(out.blocks, out.encoder_state)
    for t in ids[prompt : prompt + 2].tolist():
        batch.decode_step([t])
    y = int(ids[prompt + 2])
    draft = batch.dspark_draft([y], SamplingParams.uniform(1))
    sequence = torch.cat((ids, draft.tokens[0, :-1]))[None]  # committed ‖ y ‖ drafts as the Markov predecessors
    with torch.no_grad():
        _, taps = tiny(sequence, replay_start=prompt - W, return_taps=True)
        logits, confidence = draft_logits(tiny, sequence, taps, torch.tensor([prompt + 1]))
    assert torch.equal(logits[0, 0].argmax(-1), draft.tokens[0])
    torch.testing.assert_close(torch.sigmoid(confidence[0, 0]), draft.confidence[0], rtol=1e-5, atol=1e-6)


def test_per_row_generators_draw_the_same_whatever_the_neighbours(gen, seed):
    """A row with its own generator draws the same numbers alone and in a batch, also when the batch verifies more
    drafts than the row (the engine trims drafts to the longest row): same accepted count, token and generator state."""
    V, K, n = 40, 4, 2

    def dists(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.softmax(torch.randn(*shape, V, generator=gen), -1)  # overlapping p and q: some drafts pass

    target, proposal = dists((3, K + 1)), dists((3, K))
    drafts = torch.multinomial(proposal.view(-1, V), 1, generator=gen).view(3, K)
    mine = torch.Generator().manual_seed(seed)
    gens = [torch.Generator().manual_seed(seed + 1), mine, None]
    accepted, token = speculative_accept(target, proposal, drafts, torch.tensor([K, n, 3]), gens)
    alone = torch.Generator().manual_seed(seed)
    accepted_alone, token_alone = speculative_accept(
        target[1:2, : n + 1], proposal[1:2, :n], drafts[1:2, :n], torch.tensor([n]), [alone]
    )
    assert (int(accepted[1]), int(token[1])) == (int(accepted_alone[0]), int(token_alone[0]))
    assert torch.equal(mine.get_state(), alone.get_state())
    assert torch.equal(sample(target[:, 0], gens)[1], sample(target[1:2, 0], [alone])[0])
    assert torch.equal(mine.get_state(), alone.get_state())
    with pytest.raises(ValueError, match="2 generators for a batch of 3 rows"):
        sample(target[:, 0], gens[:2])


def test_a_seeded_row_samples_the_same_tokens_whatever_its_neighbours(tiny, tokens, seed):
    """Sampled decoding, plain and speculative: a row seeded alone emits exactly what it emits between two other rows
    (one greedy, one on the default generator) that verify more drafts than it does — and what it emits when the
    verify runs over every draft and only the acceptance stops at its length (the engine's verify launched ahead)."""
    outs = [encode_prefill(tiny, tokens(n)) for n in (13, 20, 9)]
    g, mine = tiny.args.dspark_block_size, 2

    def decode(
        rows: list[int], temperatures: list[float], lengths: list[int], speculative: bool, ahead: bool = False
    ) -> list[int]:
        """Tokens of the seeded row (prompt 0) decoded in a batch of `rows` (prompt indices)."""
        batch = DecodeBatch(tiny)
        firsts = [batch.join(outs[i].blocks, outs[i].encoder_state)[1] for i in rows]
        gens = [torch.Generator().manual_seed(seed) if i == 0 else None for i in rows]
        sampling = SamplingParams(torch.tensor(temperatures), torch.zeros(len(rows)), torch.ones(len(rows)))
        pending = sample(sampling.probs(torch.stack(firsts)), gens).tolist()
        out = [pending[rows.index(0)]]
        for _ in range(3):
            if speculative:
                draft = batch.dspark_draft(pending, sampling, gens)
                width = g if ahead else max(lengths)  # the engine verifies the longest row's drafts, or all
                forward = batch.verify_forward(pending, draft.trim(width))
                emitted = batch.accept(forward, sampling, torch.tensor(lengths), gens).tokens
            else:
                emitted = [[t] for t in sample(sampling.probs(batch.decode_step(pending)), gens).tolist()]
            out += emitted[rows.index(0)]
            pending = [row[-1] for row in emitted]
        return out

    for speculative in (False, True):
        alone = decode([0], [1.0], [mine], speculative)
        crowd = decode([1, 0, 2], [1.0, 1.0, 0.0], [g, mine, g - 1], speculative)
        print(f"speculative={speculative}: {alone}")
        assert crowd == alone
    assert decode([0], [1.0], [mine], True, ahead=True) == alone


def test_keyed_race_samples_each_rows_distribution_from_its_seed_and_position_alone() -> None:
    """`keyed_race`: over the positions of one seed, and over many seeds at one position, the tokens follow the row's
    distribution and consecutive positions are independent (each count, and each pair's, within 5 σ); a (seed,
    position) always gives the same token, whatever rows share its launch; a one-hot row gives its token."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    n = 100_000
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(3))
    for seed, position in ((seeds, torch.full((n,), 4)), (torch.full((n,), 11), torch.arange(n))):
        tokens = keyed_race(p.expand(n, -1), seed, position)
        counts = torch.bincount(tokens, minlength=5).double()
        assert ((counts - n * p).abs() < 5 * (n * p * (1 - p)).sqrt()).all(), counts / n
    pairs = torch.bincount(tokens[0::2] * 5 + tokens[1::2], minlength=25).double()  # the one seed's positions 2i, 2i+1
    joint = (p[:, None] * p[None, :]).flatten()
    assert ((pairs - n / 2 * joint).abs() < 5 * (n / 2 * joint * (1 - joint)).sqrt()).all()
    seeds, positions = torch.tensor([5, -9, 2**40]), torch.tensor([0, 7, 7])
    probs = torch.rand(3, 64, generator=torch.Generator().manual_seed(4)).softmax(-1)
    alone = torch.cat([keyed_race(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]) for i in range(3)])
    assert torch.equal(keyed_race(probs, seeds, positions), alone)
    other = keyed_race(probs[:1].expand(64, -1), torch.full((64,), 5), torch.arange(64))
    assert other.unique().numel() > 8  # other positions, other draws
    one_hot = torch.nn.functional.one_hot(torch.tensor([7, 0, 63]), 64).float()
    assert keyed_race(one_hot, seeds, positions).tolist() == [7, 0, 63]


@pytest.mark.parametrize("width", [1, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, 3 * ARGMAX_CHUNK + 5])
def test_the_chunked_argmax_is_argmax_ties_and_padding_included(width: int) -> None:
    """`chunked_argmax` gives `argmax`'s index on rows of few distinct values (ties within and across chunks), rows
    of −inf alone (the padding is −inf too: the row's own first index wins) and rows whose maximum sits in the
    last, padded chunk."""
    g = torch.Generator().manual_seed(width)
    scores = torch.randint(0, 3, (6, width), generator=g).float()
    scores[1] = -torch.inf
    scores[2, :-1] = 0.0
    scores[2, -1] = 1.0
    scores[3] = torch.randn(width, generator=g)
    assert torch.equal(chunked_argmax(scores), scores.argmax(-1))


def test_the_races_uniforms_stay_inside_the_open_unit_interval() -> None:
    """The extreme bit patterns give uniforms strictly between 0 and 1: a uniform of 1 is an exponential of 0, which
    would win its race whatever its token's probability (a zero-probability token included)."""
    extremes = torch.tensor([-1, 0, 2**63 - 1, -(2**63), 1 << 40, -(1 << 41)], dtype=torch.int64)
    u = open_unit(extremes)
    assert bool(((u > 0) & (u < 1)).all()), u
    assert torch.isfinite(-torch.log(u)).all()
