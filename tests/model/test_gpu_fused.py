"""On a GPU (skipped without one): every function `model.fused.fused` compiles gives its plain torch form's values
on CUDA inputs of a `small` step's shapes — integer results exactly, floats to the rounding of a reordered sum."""

from __future__ import annotations

import pytest
import torch

from model import kernels, preset, quant
from model.activation import swiglu
from model.cache import _open_group, _window_slots
from model.compressor import _aligned
from model.engram import NgramHash, gated_add, ngram_rows
from model.indexer import _scaled_weights
from model.kernels.route import moe_route_torch
from model.linear import _fp8_row_values
from model.mhc import hc_collapse, hc_expand, hc_mixes, hc_split_sinkhorn
from model.moe import combine
from model.norm import collapse_norm, rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

A = preset("small")
N, n, C = 24, A.hc_mult, A.hidden_size


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def cases():
    X, mix = rand(N, n, C), rand(N, n, seed=1, dtype=torch.float32).softmax(-1)
    comb = rand(N, n, n, seed=2, dtype=torch.float32).softmax(-1)
    ring = torch.randint(-1, 300, (N, A.sliding_window), device="cuda")
    yield "rms_norm", rms_norm, (rand(N, C), rand(C, seed=3), A.rms_norm_eps)
    yield "hc_mixes", hc_mixes, (X, rand((2 + n) * n, n * C, seed=4, dtype=torch.float32), A.rms_norm_eps)
    yield "hc_collapse", hc_collapse, (X, mix)
    yield "hc_expand", hc_expand, (rand(N, C, seed=5), X, mix, comb)
    f32 = torch.float32
    gate = rand(64, C, seed=7, dtype=f32), rand(64, seed=8, dtype=f32)
    yield "moe_route_torch", moe_route_torch, (rand(N, C, seed=6), *gate, 6, True, 2.5)
    yield "swiglu", swiglu, (rand(N, 256, seed=9) * 8, rand(N, 256, seed=10) * 8, A.swiglu_limit)
    yield "combine", combine, (rand(N, C, seed=11), rand(N, 6, C, seed=12))
    yield "gated_add", gated_add, (X, rand(N, (n + 1) * C, seed=13), rand(n, C, seed=14), rand(n, C, seed=15), 1e-6)
    new_pos = torch.arange(300, 300 + N, device="cuda").unsqueeze(1)
    yield "_window_slots", _window_slots, (torch.stack((ring, ring.roll(1, 1))), new_pos)  # two layers' rings
    yield "collapse_norm", collapse_norm, (X, mix, rand(C, seed=16), A.rms_norm_eps)
    ngram, layer = NgramHash(A).cuda(), A.engram_layer_ids[0]
    tokens = torch.randint(0, A.vocab_size, (N, 6), device="cuda")
    history = torch.randint(-1, A.vocab_size, (N, ngram.history_len), device="cuda")  # −1: before the start
    tables = (getattr(ngram, f"{name}_{layer}") for name in ("mult", "primes", "offsets"))
    yield "ngram_rows", ngram_rows, (tokens, history, ngram.vocab_map, *tables, ngram.pad, len(A.engram_orders),
                                     A.engram_n_heads)  # fmt: skip
    rows = quant.fp8_quant(rand(N * 8, A.engram_head_dim, seed=17, dtype=f32) * 30)
    yield "_fp8_row_values", _fp8_row_values, (*rows, torch.bfloat16)
    f32, D = torch.float32, A.head_dim  # a verify of 3 positions over rows with 0 or 1 pending tokens (m = 2)
    pending = rand(N, 1, D, seed=18, dtype=f32), rand(N, 1, D, seed=19, dtype=f32)
    new = rand(N, 3, D, seed=20, dtype=f32), rand(N, 3, D, seed=21, dtype=f32)
    yield "_aligned", _aligned, (*pending, *new, torch.arange(N, device="cuda") % 2, 2)
    m = 4  # a step's group-aligned kv and scores [N, 8, D] after 0–3 open tokens; 1–4 kept, or all 3
    aligned, opened = (rand(N, 8, D, seed=22, dtype=f32), rand(N, 8, D, seed=23, dtype=f32)), rand(N, m - 1, D, seed=24)
    n_open, kept = torch.arange(N, device="cuda") % m, torch.arange(N, device="cuda") % 4 + 1
    yield "_open_group", _open_group, (*aligned, n_open, kept, opened.float(), opened.float() * 2, m)
    yield "_open_group all", _open_group, (*aligned, n_open, 3, opened.float(), opened.float() * 2, m)
    yield "_scaled_weights", _scaled_weights, (rand(N, C, seed=25), rand(A.index_n_heads, C, seed=26), 0.05)


NAMES = ["rms_norm", "hc_mixes", "hc_collapse", "hc_expand", "moe_route_torch", "swiglu", "combine", "gated_add",
         "_window_slots", "collapse_norm", "ngram_rows", "_fp8_row_values", "_aligned", "_open_group",
         "_open_group all", "_scaled_weights"]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_compiled_equals_plain(name: str) -> None:
    _, fn, args = next(case for case in cases() if case[0] == name)
    with torch.no_grad():
        got, want = fn(*args), fn.__wrapped__(*args)
    for g, w in zip(*(r if isinstance(r, tuple) else (r,) for r in (got, want)), strict=True):
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * float(w.float().abs().max()))
        else:
            assert torch.equal(g, w), name


def test_mhc_coefficient_kernels_equal_the_torch_form() -> None:
    """A site's coefficients on the step's path (split-K projection + Sinkhorn, two Triton launches) against the
    compiled mixes and the torch split, at a decode batch and a verify's rows."""
    fn = rand((2 + n) * n, n * C, seed=4, dtype=torch.float32) / (n * C) ** 0.5
    scale, base = rand(3, seed=22, dtype=torch.float32).abs() + 0.5, rand((2 + n) * n, seed=23, dtype=torch.float32)
    for rows in (1, 64, 64 * 6):
        X = rand(rows, n, C, seed=rows) * 4
        with torch.no_grad():
            got = kernels.hc_coefficients(X, fn, scale, base, n, A.hc_sinkhorn_iters, A.rms_norm_eps, A.hc_eps,
                                          backend="triton")  # fmt: skip
            mixes = hc_mixes(X, fn, A.rms_norm_eps)
            want = hc_split_sinkhorn(mixes, scale, base, n, A.hc_sinkhorn_iters, A.hc_eps)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
