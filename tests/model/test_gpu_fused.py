"""On a GPU (skipped without one): every function `model.fused.fused` compiles gives its plain torch form's values
on CUDA inputs of a `small` step's shapes — integer results exactly, floats to the rounding of a reordered sum."""

from __future__ import annotations

import pytest
import torch

from model import preset, quant
from model.block import collapse_norm
from model.cache import _window_slots
from model.compressor import _aligned
from model.engram import NgramHash, gated_add, ngram_rows
from model.linear import _fp8_row_values, rms_norm
from model.mhc import hc_collapse, hc_expand, hc_mixes
from model.moe import combine, route, swiglu

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
    yield "route", route, (rand(N, C, seed=6), *gate, 6, True, 2.5)
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


NAMES = ["rms_norm", "hc_mixes", "hc_collapse", "hc_expand", "route", "swiglu", "combine", "gated_add", "_window_slots",
         "collapse_norm", "ngram_rows", "_fp8_row_values", "_aligned"]  # fmt: skip


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
