"""The decode path's host-side bookkeeping: MoE token grouping, device positions, writes without host syncs, and
the op-count rewrites (batched MoE dispatch, in-place Sinkhorn, one RoPE for q and the window latent).

These parts were rewritten to avoid per-row / per-expert Python work, device waits and small ops; each test checks
one of them against the plain computation it replaces (bit for bit where the rewrite claims so).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from decode_svc.sampler import StepSampling
from model import DecodeBatch, Transformer, encode_prefill, serving
from model.cache import _kept, _window_slots, _write_kept, counting
from model.dspark import Draft, draft_features, markov_chain
from model.graphs import StepGraphs
from model.linear import quantize_input
from model.mhc import hc_split_sinkhorn
from model.sampling import SamplingParams


def test_moe_sums_each_tokens_chosen_experts(tiny: Transformer, tiny_float: Transformer, gen):
    """y[n] = shared(x[n]) + Σ over n's chosen experts, ascending id, of w · expert(x[n]) — token by token, on the
    float form; the packed form (grouped GEMMs over the expert-sorted pairs) gives the same values."""
    moe, packed = tiny_float.layers[1].ffn, tiny.layers[1].ffn
    x = torch.randn(2, 7, tiny.args.hidden_size, generator=gen, dtype=torch.float64)
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = moe.gate(flat)
    assert torch.equal(ids, ids.sort(-1).values)  # each token's slots in ascending expert id
    xq = quantize_input(flat)
    expected = []
    for n in range(flat.shape[0]):
        y = moe.shared_experts(xq[n : n + 1])
        for slot in range(ids.shape[1]):
            y = y + moe.experts[int(ids[n, slot])](xq[n : n + 1], weights[n : n + 1, slot])
        expected.append(y[0])
    torch.testing.assert_close(moe(x), torch.stack(expected).view_as(x), rtol=1e-12, atol=1e-12)
    assert torch.equal(packed(x), moe(x))


def test_device_positions_follow_joins_forks_leaves_and_direct_sets(tiny: Transformer, tokens):
    """`next_positions` (what steps read) always equals the host `pos`, however it changed."""
    batch = DecodeBatch(tiny, capacity=2)
    cache = batch.cache

    def check() -> None:
        assert cache.next_positions(slice(0, cache.n_rows)).tolist() == cache.pos

    a, _ = batch.join(*_prefill(tiny, tokens(21)))
    check()
    b = batch.fork(a)
    batch.decode_step([3, 4])
    check()
    batch.join(*_prefill(tiny, tokens(9)))  # grows the capacity
    check()
    batch.leave(b)
    batch.decode_step([5, 6])
    check()
    cache.pos[0] += 4  # a caller (a benchmark, a restore) may set positions directly
    check()
    step = cache.step(torch.tensor([[1], [2]]))
    assert step.positions[:, 0].tolist() == step.start == cache.pos


def _prefill(model: Transformer, ids: torch.Tensor):
    out = encode_prefill(model, ids, chunk_tokens=8)
    return out.blocks, out.encoder_state


def test_kept_writes_equal_writing_only_the_kept_columns(gen):
    """A step no longer than the ring writes every column (dropped ones rewrite their old value); a longer one the
    last W kept; both give the bytes of writing the kept columns one by one, in every layer of the field."""
    W, B, L = 8, 3, 2
    for T in (1, 5, 8, 13):
        pos = torch.randint(0, 50, (B, 1), generator=gen) + torch.arange(T)
        src = torch.randint(0, 255, (L, B, T, 4), generator=gen, dtype=torch.uint8)
        for keep in (None, torch.randint(0, T + 1, (B,), generator=gen)):
            dst = torch.randint(0, 255, (L, B + 2, W, 4), generator=gen, dtype=torch.uint8)
            expected = dst.clone()
            for b in range(B):
                k = T if keep is None else int(keep[b])
                for t in range(max(0, k - W), k):
                    expected[:, 1 + b, int(pos[b, t]) % W] = src[:, b, t]
            _write_kept(((dst, src),), slice(1, 1 + B), pos, keep, W)
            assert torch.equal(dst, expected), (T, keep)
    b, t = _kept(torch.tensor([0, 3, 20]), 20, W)
    assert list(zip(b.tolist(), t.tolist(), strict=True)) == [(1, 0), (1, 1), (1, 2), *((2, c) for c in range(12, 20))]


def test_window_slots_of_stacked_rings_equal_each_rings(gen):
    """A step computes the window slots of every ring layer at once: each layer's equal its own ring's, whatever
    the layers hold (committed positions, gaps, rings of other layers' contents)."""
    W, B, L, T = 8, 3, 4, 5
    new_pos = torch.tensor([[3], [20], [40]]) + torch.arange(T)
    pos = torch.randint(-1, 45, (L, B, W), generator=gen)
    pos[0] = torch.stack([torch.arange(p - W, p).roll(p % W) for p in (3, 20, 40)])  # a full ring before the step
    stacked = _window_slots(pos, new_pos)
    assert stacked.shape == (L, B, T, W)
    for layer in range(L):
        assert torch.equal(stacked[layer], _window_slots(pos[layer], new_pos))
    assert bool((stacked[0, 1, 0, :-1] >= 0).all())  # the full ring's earlier positions are found


def test_moe_equals_the_per_expert_loop_bit_for_bit(tiny_float: Transformer, gen):
    """The batched dispatch (matmuls per expert, everything else once over all pairs) gives the bits of running each
    expert on its tokens and index_add_-ing its weighted output, expert by expert in ascending id. Off-grid weights,
    so that every rounding shows (on the checkpoint's FP4/FP8 grid most fp64 sums are exact in any order)."""
    moe = copy.deepcopy(tiny_float.layers[3].ffn)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=p.dtype) / 4
    x = torch.randn(3, 9, tiny_float.args.hidden_size, generator=gen, dtype=torch.float64)
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = moe.gate(flat)
    xq = quantize_input(flat)
    y = moe.shared_experts(xq)
    for e, expert in enumerate(moe.experts):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            y.index_add_(0, token, expert(xq[token], weights[token, slot]))
    assert torch.equal(moe(x), y.view_as(x))


def test_sinkhorn_in_place_equals_the_recorded_form(gen):
    """Without autograd the normalisations run in place; with it, out of place: the same bits, and a gradient."""
    n = 4
    mixes = torch.randn(5, 3, (2 + n) * n, generator=gen, dtype=torch.float64, requires_grad=True)
    scale, base = torch.rand(3, generator=gen, dtype=torch.float64), torch.randn(24, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        fast = hc_split_sinkhorn(mixes, scale, base, n, 20, 1e-6)
    recorded = hc_split_sinkhorn(mixes, scale, base, n, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(fast, recorded, strict=True))
    recorded[2].square().sum().backward()
    assert mixes.grad is not None
    assert bool(mixes.grad.isfinite().all())
    assert bool(mixes.grad.abs().sum() > 0)


def test_query_window_equals_query_and_window_kv(tiny: Transformer, gen):
    """q and the window latent rotated together equal each rotated alone, bit for bit."""
    attn = tiny.layers[4].attn
    x = quantize_input(torch.randn(2, 5, tiny.args.hidden_size, generator=gen, dtype=torch.float64))
    positions = torch.randint(0, 10_000, (2, 5), generator=gen)
    index_q, q, kv = attn.query_window(x, positions)
    index_q_alone, q_alone = attn.query(x, positions)
    assert attn.role.owns_index_query  # the indexer's query heads, from the same c^Q
    assert torch.equal(index_q, index_q_alone)
    assert torch.equal(q, q_alone)
    assert torch.equal(kv, attn.window_kv(x, positions))


def _commit_free_drafts(
    batch: DecodeBatch, pending: list[int], targets: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.argmax(-1)
) -> torch.Tensor:
    """γ drafts per row that the target accepts, all of them: its own continuation — the `targets`' tokens of its
    logits [B, 1 + γ, V] (greedy: their arg-maxes) —, found by γ uncommitted forwards (their write-ahead entries are
    rewritten by the verify at the same positions)."""
    drafts = torch.zeros(len(pending), batch.model.args.dspark_block_size, dtype=torch.int64)
    for k in range(drafts.shape[1]):
        step = batch.cache.step(torch.cat((torch.tensor(pending).unsqueeze(1), drafts), dim=1))
        drafts[:, k] = targets(serving.forward_full(batch.model, step))[:, k]
    return drafts


def _twin_batches(model: Transformer, tokens, capacity: int = 8) -> tuple[DecodeBatch, DecodeBatch]:
    """Two batches of the same three prompts: one plain, one running the static forwards the graphs capture
    (model.graphs, uncaptured: rows padded to a bucket of 4, every reserved entry in view, the commit's device half
    and the positions advanced on the device for the real rows only, the host following)."""
    prompts = [_prefill(model, tokens(n)) for n in (23, 9, 40)]
    plain, static = DecodeBatch(model, capacity=capacity), DecodeBatch(model, capacity=capacity)
    static.graphs = StepGraphs(model, static.cache, buckets=(4, 8), capture=False)
    for batch in (plain, static):
        for prompt in prompts:
            batch.join(*prompt)
    return plain, static


def _assert_same_state(plain: DecodeBatch, static: DecodeBatch) -> None:
    n = len(plain)
    assert static.positions() == plain.positions()
    assert static.cache.next_positions(slice(0, 4)).tolist() == static.cache.pos + [0] * (4 - n)
    for (owner, name, dim), (twin, _, _) in zip(plain.cache._row_tensors(), static.cache._row_tensors(), strict=True):
        x, y = getattr(owner, name).narrow(dim, 0, n), getattr(twin, name).narrow(dim, 0, n)
        if dim == 0 and x.dim() > 1 and x.shape[1] != y.shape[1]:  # entries: the static cache reserved more
            y = y[:, : x.shape[1]]
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=name)


def test_static_steps_over_padded_rows_equal_plain_steps(tiny: Transformer, tokens):
    """The real rows' logits and the state they leave equal a plain step's, step after step, to fp64 rounding (a
    matmul over 4 rows may round a row's last bit unlike one over 3)."""
    plain, static = _twin_batches(tiny, tokens)
    for _ in range(6):
        pending = torch.tensor([[t] for t in tokens(3).tolist()])
        expected = plain.decode_step(pending)
        torch.testing.assert_close(static.decode_step(pending), expected, rtol=1e-6, atol=1e-7)  # an ulp may flip
    _assert_same_state(plain, static)


def test_static_verifies_over_padded_rows_equal_plain_verifies(tiny: Transformer, tokens):
    """With drafts the target accepts none of, one of and all of, a static verify's logits, its commit (padding rows
    keep nothing) and the state left equal a plain verify's, verify after verify; so do the drafts before them."""
    plain, static = _twin_batches(tiny, tokens)
    n, V, greedy = 3, tiny.args.vocab_size, SamplingParams.uniform(3)
    pending = tokens(n).tolist()
    for _ in range(3):
        expected, chained = plain.dspark_draft(pending, greedy), static.dspark_draft(pending, greedy)  # one "graph"
        assert torch.equal(chained.tokens, expected.tokens)
        assert chained.probs is None  # a greedy chain's: one-hot on its tokens, never made
        torch.testing.assert_close(chained.proposal(V), expected.proposal(V), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(chained.confidence, expected.confidence, rtol=1e-6, atol=1e-7)
        drafts = _commit_free_drafts(plain, pending)
        g = drafts.shape[1]
        drafts[0, 0], drafts[1, 1] = (drafts[0, 0] + 1) % V, (drafts[1, 1] + 1) % V  # rejected there
        draft = Draft(drafts, torch.nn.functional.one_hot(drafts, V).float(), torch.zeros(n, g))
        result, mirrored = plain.verify(pending, draft, greedy), static.verify(pending, draft, greedy)
        assert result.accepted.tolist() == [0, 1, g]
        assert mirrored.tokens == result.tokens
        torch.testing.assert_close(mirrored.logits, result.logits, rtol=1e-6, atol=1e-7)
        pending = [row[-1] for row in result.tokens]
    _assert_same_state(plain, static)


def test_a_raced_verify_accepts_and_commits_in_its_static_step_as_the_eager_acceptance_does(tiny: Transformer, tokens):
    """A sampled batch (rows at T = 1, greedy and T = 0.7, keyed noise) whose drafts the targets accept in full, in
    part and not at all: the static forwards' acceptance (`StepGraphs.accept` with raced targets: what the
    `raced_accept` graph captures) accepts, emits and commits what the eager acceptance of `StepSampling.probs`'
    races does, verify after verify."""
    plain, static = _twin_batches(tiny, tokens)
    n, V = 3, tiny.args.vocab_size
    cursor = torch.tensor([10, 0, 7])

    def sampling() -> StepSampling:
        return StepSampling(
            torch.tensor([1.0, 0.0, 0.7]), torch.zeros(n, dtype=torch.int64), torch.ones(n),
            seeds=torch.tensor([3, 4, 5]), cursor=cursor.clone(),
        )  # fmt: skip

    pending, accepted = tokens(n).tolist(), []
    for _ in range(3):
        drafts = _commit_free_drafts(plain, pending, lambda logits: sampling().probs(logits).argmax(-1))
        g = drafts.shape[1]
        drafts[0, 0], drafts[1, 1] = (drafts[0, 0] + 1) % V, (drafts[1, 1] + 1) % V  # rejected there
        draft = Draft(drafts, None, torch.zeros(n, g))
        lengths = torch.tensor([g, g, g - 1])
        result, mirrored = (
            plain.verify(pending, draft, sampling(), lengths),
            static.verify(pending, draft, sampling(), lengths),
        )
        assert mirrored.tokens == result.tokens
        assert torch.equal(mirrored.accepted, result.accepted)
        accepted.append(result.accepted.tolist())
        cursor += result.accepted + 1
        pending = [row[-1] for row in result.tokens]
    assert accepted == [[0, 1, g - 1]] * 3
    _assert_same_state(plain, static)


def test_a_keyed_draft_replays_its_chain_and_races_as_the_targets_do(tiny: Transformer, tokens):
    """A sampled batch's draft (rows at T = 1, greedy and T = 0.7, keyed noise): the static forward's chain — what
    `keyed_draft` captures — gives the eager chain's tokens, and each link's token is the one `StepSampling.probs`
    collapses that link's distribution onto: the race a target runs at the same position (what couples the two)."""
    plain, static = _twin_batches(tiny, tokens)

    def sampling() -> StepSampling:
        return StepSampling(
            torch.tensor([1.0, 0.0, 0.7]), torch.zeros(3, dtype=torch.int64), torch.ones(3),
            seeds=torch.tensor([3, 4, 5]), cursor=torch.tensor([10, 0, 7]),
        )  # fmt: skip

    y = tokens(3)
    chained, eager = static.dspark_draft(y.tolist(), sampling()), plain.dspark_draft(y.tolist(), sampling())
    assert chained.probs is None
    assert torch.equal(chained.tokens, eager.tokens)
    raced = sampling()
    x, base = draft_features(tiny, plain.cache, y)
    expected = markov_chain(tiny, x, base, y, lambda u, bias, k: (raced.probs(u + bias.float()).argmax(-1), None))
    assert torch.equal(eager.tokens, expected.tokens)


def test_a_start_up_capture_runs_without_autograd(tiny: Transformer, tokens):
    """`DecodeBatch.capture` (the engine's start-up, outside any `no_grad`) records its forwards without autograd: a
    forward recording a graph for the parameters would take the kernels' torch forms (their autograd path), and every
    replay would run those."""
    assert torch.is_grad_enabled()
    assert any(p.requires_grad for p in tiny.parameters())  # a model built for training asks for gradients
    batch = DecodeBatch(tiny, capacity=4)
    batch.graphs = StepGraphs(tiny, batch.cache, buckets=(4,), capture=False)
    batch.join(*_prefill(tiny, tokens(9)))
    grad_modes: list[bool] = []
    hook = tiny.layers[0].register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    try:
        batch.capture(widths=(2,))
    finally:
        hook.remove()
    assert grad_modes  # the decode and verify forwards ran
    assert not any(grad_modes)


def test_the_device_positions_stay_in_place_until_the_cache_grows(tiny: Transformer, tokens):
    """Captured graphs read and advance the cache's device positions in place: a row joining or leaving rewrites the
    same tensor; only a growth (which drops the graphs) replaces it."""
    batch = DecodeBatch(tiny, capacity=2)
    first = batch.join(*_prefill(tiny, tokens(9)))[0]
    batch.join(*_prefill(tiny, tokens(23)))
    held = batch.cache.next_positions(slice(0, 2))
    batch.leave(first)
    assert batch.cache.next_positions(slice(0, 2)).data_ptr() == held.data_ptr()
    assert held.tolist() == [*batch.cache.pos, 0]
    batch.join(*_prefill(tiny, tokens(5)))
    batch.join(*_prefill(tiny, tokens(7)))  # a third row: the cache grows
    assert batch.cache.next_positions(slice(0, 3)).tolist() == batch.cache.pos
    assert batch.cache.next_positions(slice(0, 3)).data_ptr() != held.data_ptr()


def test_counting_views_one_range_per_power_of_two_and_keeps_it():
    """A step's index ranges are views of ranges made once (no launch, and memory a captured graph may go on
    reading): lengths up to the same power of two share one, each view its own length."""
    cpu = torch.device("cpu")
    for n in (0, 1, 2, 3, 5, 8, 9, 33):
        assert torch.equal(counting(n, cpu), torch.arange(n))
    assert counting(5, cpu).data_ptr() == counting(8, cpu).data_ptr() != counting(9, cpu).data_ptr()
    assert counting(9, cpu).untyped_storage().nbytes() == 16 * 8


def test_capturing_every_bucket_ahead_commits_nothing(tiny: Transformer, tokens):
    """A start-up capture (`DecodeBatch.capture`; uncaptured here: the warm-up forwards a capture runs) reports each
    bucket, moves no position, and the steps after it give the plain twin's logits. The capacity lies between two
    buckets: the last one grows the cache, its device positions with it."""
    plain, static = _twin_batches(tiny, tokens, capacity=6)
    reported: list[tuple[int, int]] = []
    static.capture((1, 3), lambda done, total: reported.append((done, total)))
    assert reported == [(1, 2), (2, 2)]  # buckets 4 and 8, the first past the capacity
    assert static.positions() == plain.positions()
    greedy, pending = SamplingParams.uniform(3), tokens(3).tolist()
    for batch_logits in zip(plain.decode_step(pending), static.decode_step(pending), strict=True):
        torch.testing.assert_close(*batch_logits, rtol=1e-6, atol=1e-7)
    draft = plain.dspark_draft(pending, greedy)
    result, mirrored = plain.verify(pending, draft, greedy), static.verify(pending, draft, greedy)
    assert mirrored.tokens == result.tokens
    torch.testing.assert_close(mirrored.logits, result.logits, rtol=1e-6, atol=1e-7)
    assert static.positions() == plain.positions()
