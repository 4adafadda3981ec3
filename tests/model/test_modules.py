"""Module math against hand computations: mHC/Sinkhorn, CSA2 compressor, RoPE/YaRN, attention sink, MoE routing,
the dense path's main-KV rounding."""

from __future__ import annotations

import math

import pytest
import torch

from model import preset, quant
from model.attention import SharedEntries, dense_attention, main_kv
from model.compressor import Compressor
from model.mhc import hc_collapse, hc_expand, hc_split_sinkhorn
from model.moe import Gate
from model.rope import Rope, inverse_frequencies


def test_sinkhorn_is_doubly_stochastic_ending_on_columns(gen):
    n = 4
    mixes = torch.randn(64, (2 + n) * n, generator=gen, dtype=torch.float64) * 3
    pre, post, comb = hc_split_sinkhorn(
        mixes, torch.ones(3, dtype=torch.float64), torch.zeros(24, dtype=torch.float64), n, 20, 1e-6
    )
    col, row = (comb.sum(-2) - 1).abs().max(), (comb.sum(-1) - 1).abs().max()
    assert col < 1e-5  # rows converge slower: the reference measured a layer-0 row error of 8.5e-2
    assert row < 0.1
    assert col < row  # the last normalisation is over columns (reference §4.1)
    assert bool((pre > 1e-6).all() and (pre < 1 + 1e-6).all() and (post > 0).all() and (post < 2).all())
    # combᵀ mixes copies: with out = 0 a convex mix of the stream keeps the per-channel total Σₖ Xₖ (columns sum 1).
    X = torch.randn(64, n, 8, generator=gen, dtype=torch.float64)
    Y = hc_expand(torch.zeros(64, 8, dtype=torch.float64), X, post, comb)
    torch.testing.assert_close(Y.sum(-2), torch.einsum("bjk,bjc->bc", comb, X))
    torch.testing.assert_close(hc_collapse(X, pre), (pre.unsqueeze(-1) * X).sum(-2))


def test_compressor_pools_pairs_with_a_per_channel_softmax(gen):
    a = preset("tiny")
    comp = Compressor(a, 2, torch.float64)
    for p in comp.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) / 8
    x = torch.randn(1, 7, a.hidden_size, generator=gen, dtype=torch.float64)
    latents = comp(x)
    assert latents.shape == (1, 3, a.head_dim)  # 7 tokens → 3 complete groups; the 7th stays open
    kv, z = x @ comp.wkv.weight.T, x @ comp.wgate.weight.T
    j = 1
    w = torch.softmax(z[0, 2 * j : 2 * j + 2], dim=0)  # over the two tokens, per channel
    pooled = (w * kv[0, 2 * j : 2 * j + 2]).sum(0)
    want = comp.norm.weight * pooled / pooled.square().mean().add(a.rms_norm_eps).sqrt()
    torch.testing.assert_close(latents[0, j], want)


def test_rope_rotates_only_the_rope_dims_and_inverts():
    a = preset("v41-flash")
    for yarn in (False, True):
        rope = Rope(a, yarn)
        x = torch.randn(2, 5, 3, a.head_dim, dtype=torch.float64)
        pos = torch.tensor([[0, 1, 2, 65536, 1048575]] * 2)
        y = rope.rotate(x, pos)
        rd = a.qk_rope_head_dim
        assert torch.equal(y[..., :-rd], x[..., :-rd])
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
        torch.testing.assert_close(rope.rotate(y, pos, inverse=True), x)
        # Adjacent pairs rotate by position·θᵢ (interleaved layout).
        theta = inverse_frequencies(a, yarn)[0] * 3
        pair = x[0, 1, 0, -rd : -rd + 2]
        c, s = math.cos(float(theta) / 3), math.sin(float(theta) / 3)
        torch.testing.assert_close(
            y[0, 1, 0, -rd : -rd + 2], torch.stack((pair[0] * c - pair[1] * s, pair[0] * s + pair[1] * c))
        )
    plain, yarn = inverse_frequencies(a, False), inverse_frequencies(a, True)
    assert plain[0] == 1.0  # θ = 10000 without YaRN in ratio-0 layers
    base = 1.0 / (a.compress_rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    assert yarn[0] == base[0]
    assert torch.isclose(yarn[-1], base[-1] / a.rope_scaling.factor)


def test_attention_sink_joins_the_denominator_only(gen):
    q = torch.randn(1, 2, 3, 16, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, 5, 16, generator=gen, dtype=torch.float64)
    mask = torch.ones(1, 2, 5, dtype=torch.bool)
    sink = torch.tensor([0.0, -math.inf, 2.0], dtype=torch.float64)
    o = dense_attention(q, [(keys, mask)], sink, 0.25)
    logits = torch.einsum("bthd,bsd->bths", q, keys) * 0.25
    p = logits.exp() / (logits.exp().sum(-1, keepdim=True) + sink.exp().view(1, 1, 3, 1))
    torch.testing.assert_close(o, torch.einsum("bths,bsd->bthd", p, keys))
    nothing = dense_attention(q, [(keys, torch.zeros_like(mask))], sink[:1].expand(3), 0.25)
    assert torch.equal(nothing, torch.zeros_like(nothing))  # no visible key: the sink takes all the mass


def test_gate_routes_by_biased_scores_and_weights_by_raw_ones(gen):
    a = preset("tiny")
    gate = Gate(a, 4, 2, torch.float64)
    gate.weight.data = torch.randn(4, a.hidden_size, generator=gen, dtype=torch.float64)
    gate.bias.data = torch.tensor([0.0, 0.0, 0.0, 100.0], dtype=torch.float64)  # expert 3 always chosen
    x = torch.randn(10, a.hidden_size, generator=gen, dtype=torch.float64)
    weights, ids = gate(x)
    scores = torch.nn.functional.softplus(x @ gate.weight.T).sqrt()
    assert bool((ids == 3).any(-1).all())
    torch.testing.assert_close(weights, scores.gather(-1, ids) / scores.gather(-1, ids).sum(-1, keepdim=True) * 1.5)


def test_main_kv_switch_rounds_the_dense_main_kv(tiny, gen):
    """The dense path's main KV is FP4 (E2M1 + E4M3 per 16) by default and bf16 inside `main_kv("bf16")`; blocks nest
    and restore the format around them; the indexer keys are FP4 either way."""
    attn = tiny.layers[2].attn  # a Full m=2 owner
    x = torch.randn(1, 9, tiny.args.hidden_size, generator=gen, dtype=torch.float64)
    kv, _ = attn.entry_latents(attn.compressor(x), torch.zeros(1, dtype=torch.int64))

    def main_kv_values() -> torch.Tensor:
        shared = SharedEntries()
        attn.dense_entries(x, shared)
        return shared.kv[2]

    fp4 = main_kv_values()
    assert torch.equal(fp4, quant.fake_quant_fp4_e4m3(kv))
    bf16 = kv.to(torch.bfloat16).to(torch.float64)
    assert not torch.equal(fp4, bf16)
    with main_kv("bf16"):
        assert torch.equal(main_kv_values(), bf16)
        with main_kv("fp4"):
            assert torch.equal(main_kv_values(), fp4)
        assert torch.equal(main_kv_values(), bf16)
    assert torch.equal(main_kv_values(), fp4)
    with pytest.raises(ValueError, match="got 'fp8'"), main_kv("fp8"):  # type: ignore[arg-type]
        pass
