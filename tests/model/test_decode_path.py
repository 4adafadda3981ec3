"""The decode path's host-side bookkeeping: MoE token grouping, device positions, writes without host syncs, and
the op-count rewrites (batched MoE dispatch, in-place Sinkhorn, one RoPE for q and the window latent).

These parts were rewritten to avoid per-row / per-expert Python work, device waits and small ops; each test checks
one of them against the plain computation it replaces (bit for bit where the rewrite claims so).
"""

from __future__ import annotations

import copy

import torch

from model import DecodeBatch, Transformer, encode_prefill, serving
from model.cache import _kept, _write_kept
from model.dspark import Draft
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
    last W kept; both give the bytes of writing the kept columns one by one."""
    W, B = 8, 3
    for T in (1, 5, 8, 13):
        pos = torch.randint(0, 50, (B, 1), generator=gen) + torch.arange(T)
        src = torch.randint(0, 255, (B, T, 4), generator=gen, dtype=torch.uint8)
        for keep in (None, torch.randint(0, T + 1, (B,), generator=gen)):
            dst = torch.randint(0, 255, (B + 2, W, 4), generator=gen, dtype=torch.uint8)
            expected = dst.clone()
            for b in range(B):
                k = T if keep is None else int(keep[b])
                for t in range(max(0, k - W), k):
                    expected[1 + b, int(pos[b, t]) % W] = src[b, t]
            _write_kept(((dst, src),), slice(1, 1 + B), pos, keep, W)
            assert torch.equal(dst, expected), (T, keep)
    b, t = _kept(torch.tensor([0, 3, 20]), 20, W)
    assert list(zip(b.tolist(), t.tolist(), strict=True)) == [(1, 0), (1, 1), (1, 2), *((2, c) for c in range(12, 20))]


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
    qr, q, kv = attn.query_window(x, positions)
    qr_alone, q_alone = attn.query(x, positions)
    assert torch.equal(qr, qr_alone)
    assert torch.equal(q, q_alone)
    assert torch.equal(kv, attn.window_kv(x, positions))


def _static_forward(batch: DecodeBatch, tokens: torch.Tensor, bucket: int, last_only: bool):
    """A graph's forward (model.graphs) run eagerly over `batch`: rows padded to `bucket`, every reserved entry in
    view → (the real rows' logits, the step)."""
    cache, n = batch.cache, tokens.shape[0]
    cache.reserve(bucket, 4096)
    cache.next_positions(slice(0, bucket))  # in sync with the host; padding rows at position 0
    padded = torch.cat((tokens, torch.zeros(bucket - n, tokens.shape[1], dtype=torch.int64)))
    step = cache.step(padded, slice(0, bucket), static=True)
    return serving.forward_full(batch.model, step, last_only=last_only)[:n], step


def _commit_static(batch: DecodeBatch, step, keep: list[int]) -> None:
    """A graph's commit: the device half for every padded row (padding rows keep nothing), then the host follows."""
    bucket, n = step.batch, len(keep)
    kept = torch.tensor(keep + [0] * (bucket - n))
    step.write(kept)
    batch.cache.advance_device(slice(0, bucket), kept)
    batch.cache.advanced(keep)
    assert batch.cache.next_positions(slice(0, bucket)).tolist() == batch.cache.pos + [0] * (bucket - n)


def _assert_same_state(plain: DecodeBatch, static: DecodeBatch, n: int) -> None:
    assert static.positions() == plain.positions()
    for a, b in zip(plain.cache._row_tensors(), static.cache._row_tensors(), strict=True):
        x, y = getattr(*a)[:n], getattr(*b)[:n]
        if x.dim() > 1 and x.shape[1] != y.shape[1]:  # entries: the static cache reserved more
            y = y[:, : x.shape[1]]
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=a[1])


def _twin_batches(model: Transformer, tokens) -> tuple[DecodeBatch, DecodeBatch]:
    prompts = [_prefill(model, tokens(n)) for n in (23, 9, 40)]
    plain, static = DecodeBatch(model, capacity=8), DecodeBatch(model, capacity=8)
    for batch in (plain, static):
        for prompt in prompts:
            batch.join(*prompt)
    return plain, static


def test_a_static_step_over_padded_rows_equals_a_plain_step(tiny: Transformer, tokens):
    """The step a CUDA graph captures (model.graphs), run eagerly: rows padded to a bucket, every reserved entry in
    view, the device half of the commit and the positions advanced on the device for the real rows only. The real
    rows' logits and the state they leave equal a plain step's, step after step, to fp64 rounding (a matmul over 4
    rows may round a row's last bit unlike one over 3)."""
    plain, static = _twin_batches(tiny, tokens)
    n = 3
    for _ in range(6):
        pending = torch.tensor([[t] for t in tokens(n).tolist()])
        expected = plain.decode_step(pending)
        logits, step = _static_forward(static, pending, 4, last_only=True)
        _commit_static(static, step, [1] * n)
        torch.testing.assert_close(logits[:, -1], expected, rtol=1e-6, atol=1e-7)  # fp32 logits: an ulp may flip
    _assert_same_state(plain, static, n)


def _target_drafts(batch: DecodeBatch, pending: list[int], bucket: int) -> torch.Tensor:
    """γ drafts per row that the target accepts greedily, all of them: its own greedy continuation, found by γ
    static forwards (their write-ahead entries are rewritten by the next forward at the same positions)."""
    drafts = torch.zeros(len(pending), batch.model.args.dspark_block_size, dtype=torch.int64)
    for k in range(drafts.shape[1]):
        both = torch.cat((torch.tensor(pending).unsqueeze(1), drafts), dim=1)
        drafts[:, k] = _static_forward(batch, both, bucket, last_only=False)[0][:, k].argmax(-1)
    return drafts


def test_a_static_verify_over_padded_rows_equals_a_plain_verify(tiny: Transformer, tokens):
    """The verify a CUDA graph captures, run eagerly the same way, then its commit graph's work: the padded rows'
    keep counts forced to 0, the real rows' device positions moved by their kept tokens. With drafts the target
    accepts none of, one of and all of, the logits and the state left equal a plain verify's, verify after verify."""
    plain, static = _twin_batches(tiny, tokens)
    n, V, greedy = 3, tiny.args.vocab_size, SamplingParams.uniform(3)
    pending = tokens(n).tolist()
    for _ in range(3):
        drafts = _target_drafts(static, pending, 4)
        g = drafts.shape[1]
        drafts[0, 0], drafts[1, 1] = (drafts[0, 0] + 1) % V, (drafts[1, 1] + 1) % V  # rejected there
        draft = Draft(drafts, torch.nn.functional.one_hot(drafts, V).float(), torch.zeros(n, g))
        result = plain.verify(pending, draft, greedy)
        assert result.accepted.tolist() == [0, 1, g]
        both = torch.cat((torch.tensor(pending).unsqueeze(1), drafts), dim=1)
        logits, step = _static_forward(static, both, 4, last_only=False)
        _commit_static(static, step, [k + 1 for k in result.accepted.tolist()])
        torch.testing.assert_close(logits, result.logits, rtol=1e-6, atol=1e-7)
        pending = [row[-1] for row in result.tokens]
    _assert_same_state(plain, static, n)
