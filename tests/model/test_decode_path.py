"""The decode path's host-side bookkeeping: MoE token grouping, device positions, writes without host syncs.

These parts were rewritten to avoid per-row / per-expert Python work and device waits; each test checks one of
them against the plain computation it replaces.
"""

from __future__ import annotations

import torch

from model import Transformer
from model.cache import _kept, _write_kept
from model.linear import quantize_input


def test_moe_sums_each_tokens_chosen_experts(tiny: Transformer, gen):
    """y[n] = shared(x[n]) + Σ over n's chosen experts, ascending id, of w · expert(x[n]) — token by token."""
    moe = tiny.layers[1].ffn
    x = torch.randn(2, 7, tiny.args.hidden_size, generator=gen, dtype=torch.float64)
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = moe.gate(flat)
    xq = quantize_input(flat) if moe.shared_experts.w1.quantized else flat
    expected = []
    for n in range(flat.shape[0]):
        y = moe.shared_experts(xq[n : n + 1])
        for slot in ids[n].argsort().tolist():  # index_add_ adds the experts in ascending id
            y = y + moe.experts[int(ids[n, slot])](xq[n : n + 1], weights[n : n + 1, slot])
        expected.append(y[0])
    torch.testing.assert_close(moe(x), torch.stack(expected).view_as(x), rtol=1e-12, atol=1e-12)


def test_device_positions_follow_joins_forks_leaves_and_direct_sets(tiny: Transformer, tokens):
    """`next_positions` (what steps read) always equals the host `pos`, however it changed."""
    batch = tiny.new_decode_batch(capacity=2)
    cache = batch.cache

    def check() -> None:
        assert cache.next_positions(slice(0, cache.n_rows)).tolist() == cache.pos

    a, _ = batch.join(*_prefill(tiny, tokens(21)))
    check()
    b = batch.fork(a)
    tiny.decode_step(batch, [3, 4])
    check()
    batch.join(*_prefill(tiny, tokens(9)))  # grows the capacity
    check()
    batch.leave(b)
    tiny.decode_step(batch, [5, 6])
    check()
    cache.pos[0] += 4  # a caller (a benchmark, a restore) may set positions directly
    check()
    step = cache.step(torch.tensor([[1], [2]]))
    assert step.positions[:, 0].tolist() == step.start == cache.pos


def _prefill(model: Transformer, ids: torch.Tensor):
    out = model.encode_prefill(ids, chunk_tokens=8)
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
