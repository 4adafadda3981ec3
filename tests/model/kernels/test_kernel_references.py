"""The torch references of model.kernels against naive per-element oracles written from the definitions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    attention_case,
    candidate_case,
    generator,
    indexer_case,
    lowest_position_topk,
    tied_topk_case,
    topk_case,
)

from model import kernels, quant


def test_indexer_scores_matches_the_definition() -> None:
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(0), B=2, T=3, H=4, Di=64, S=20)
    got = kernels.indexer_scores(q_data, q_scale, w, k_data, k_scale, n_visible)
    q = quant.fp4_dequant_ue8m0(q_data, q_scale).double()
    k = quant.fp4_dequant_ue8m0(k_data, k_scale).double()
    for b in range(2):
        for t in range(3):
            for s in range(20):
                if s >= n_visible[b, t]:
                    assert got[b, t, s] == float("-inf")
                    continue
                want = sum(float(w[b, t, h]) * max(0.0, float(q[b, t, h] @ k[b, s])) for h in range(4))
                assert got[b, t, s].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_topk_hand_example() -> None:
    scores = torch.tensor([[0.5, 3.0, -1.0, 2.0, float("-inf"), 7.0], [1.0, 1.0, 1.0, 9.0, 9.0, 9.0]])
    got = kernels.topk_indices(scores, 3, torch.tensor([4, 6])).tolist()
    assert got[0] == [0, 1, 3]  # 3.0, 2.0, 0.5 among the first 4; 7.0 lies beyond the length
    assert got[1] == [3, 4, 5]
    assert kernels.topk_indices(scores, 8, torch.tensor([6, 2])).tolist() == [
        [0, 1, 2, 3, 5, -1, -1, -1],  # the −inf entry is never chosen
        [0, 1, -1, -1, -1, -1, -1, -1],
    ]


@pytest.mark.parametrize(("R", "L", "k"), [(5, 50, 8), (3, 7, 16), (4, 300, 0)])
def test_topk_reference_matches_the_definition(R: int, L: int, k: int) -> None:
    scores, lengths = topk_case(generator(R * L), R, L)
    assert torch.equal(kernels.topk_indices(scores, k, lengths), lowest_position_topk(scores, k, lengths))
    assert torch.equal(kernels.topk_indices(scores, k), lowest_position_topk(scores, k, None))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 60), st.integers(0, 12), st.integers(0, 2**31 - 1))
def test_topk_ties_go_to_the_lowest_positions(R: int, L: int, k: int, seed: int) -> None:
    """Equal scores (±0 alike) are taken in position order, so the choice never depends on the row length: a row cut
    at its length, or padded with −inf, selects the same positions."""
    scores, lengths = tied_topk_case(generator(seed), R, L)
    want = lowest_position_topk(scores, k, lengths)
    assert torch.equal(kernels.topk_indices(scores, k, lengths), want)
    padded = torch.cat((scores, torch.full((R, 7), float("-inf"))), dim=1)
    assert torch.equal(kernels.topk_indices(padded, k, lengths), want)
    for r in range(R):
        n = int(lengths[r])
        assert torch.equal(kernels.topk_indices(scores[r : r + 1, :n], k), want[r : r + 1])


def naive_candidate_mask(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, topk_blocks: int):
    B, T, S = scores.shape
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            nv = int(n_visible[b, t])
            n_blocks = math.ceil(S / block_size)
            visible = [float(x) if s < nv else -math.inf for s, x in enumerate(scores[b, t])]
            block = [max(visible[j * block_size : (j + 1) * block_size]) for j in range(n_blocks)]
            if nv > 0:
                block[(nv - 1) // block_size] = math.inf
            ranked = sorted(range(n_blocks), key=lambda j: (-block[j], j))[:topk_blocks]  # ties: lower block
            for j in ranked:
                if block[j] > -math.inf:
                    mask[b, t, j * block_size : min(nv, (j + 1) * block_size)] = True
    return mask


@pytest.mark.parametrize(("S", "block_size", "topk_blocks"), [(37, 8, 2), (64, 8, 3), (20, 4, 10), (9, 8, 1)])
@pytest.mark.parametrize("tied", [False, True])
def test_candidate_mask_matches_the_definition(S: int, block_size: int, topk_blocks: int, tied: bool) -> None:
    scores, n_visible = candidate_case(generator(S), S, tied)
    got = kernels.candidate_mask(scores, n_visible, block_size, topk_blocks)
    assert torch.equal(got, naive_candidate_mask(scores, n_visible, block_size, topk_blocks))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_sparse_attention_matches_the_definition(dtype: torch.dtype, tolerance: float) -> None:
    """fp32 queries are computed in fp32; fp64 ones (a float64 model's) in fp64, to fp64 accuracy."""
    B, T, H, D, W, N, K = 2, 2, 3, 64, 5, 9, 4
    q, swa_data, swa_scale, new_data, new_scale, swa_idx, kv_data, kv_scale, idx, sink, scale = attention_case(
        generator(1), B, T, H, D, W, N, K
    )
    q, sink = q.to(dtype), sink.to(dtype)
    got = kernels.sparse_attention(
        q, swa_data, swa_scale, new_data, new_scale, swa_idx, kv_data, kv_scale, idx, sink, scale
    )
    assert got.dtype == dtype
    ring = quant.fp8_dequant(torch.cat((swa_data, new_data), 1), torch.cat((swa_scale, new_scale), 1)).double()
    entries = quant.fp4_dequant_e4m3(kv_data, kv_scale).double()
    for b in range(B):
        for t in range(T):
            keys = [ring[b, w] for w in swa_idx[b, t] if w >= 0] + [entries[b, i] for i in idx[b, t] if i >= 0]
            for h in range(H):
                logits = [float(q[b, t, h].double() @ key) * scale for key in keys]
                denom = sum(math.exp(s) for s in logits) + math.exp(float(sink[h]))
                want = sum((math.exp(s) / denom) * key for s, key in zip(logits, keys, strict=True))
                want = want if keys else torch.zeros(D, dtype=torch.float64)
                torch.testing.assert_close(got[b, t, h].double(), want, rtol=tolerance, atol=tolerance / 10)
    assert got[0, 0].abs().max() == 0  # only the sink: nothing attended


def test_sparse_attention_with_no_entries_stored() -> None:
    """N = 0 (before a layer's first compressed entry) with K slots, all −1: the ring alone, as with K = 0."""
    case = list(attention_case(generator(4), 2, 3, 2, 32, 6, 5, 4))
    case[6:9] = case[6][:, :0], case[7][:, :0], torch.full_like(case[8], -1)
    got = kernels.sparse_attention(*case)
    case[8] = case[8][..., :0]
    torch.testing.assert_close(got, kernels.sparse_attention(*case), rtol=1e-6, atol=1e-7)
    assert got[0, 0].abs().max() == 0  # the query without a ring slot sees only its sink


def test_bad_arguments_are_named() -> None:
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(0), B=1, T=1, H=2, Di=32, S=4)
    with pytest.raises(ValueError, match=r"k_scale: expected shape \[1, 4, 1\]"):
        kernels.indexer_scores(q_data, q_scale, w, k_data, k_scale[:, :, :0], n_visible)
    with pytest.raises(ValueError, match="n_visible: expected dtype"):
        kernels.indexer_scores(q_data, q_scale, w, k_data, k_scale, n_visible.float())
    with pytest.raises(ValueError, match="backend must be"):
        kernels.topk_indices(torch.randn(2, 4), 2, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be"):
        kernels.topk_indices(torch.randn(2, 4), -1)
    with pytest.raises(ValueError, match="multiple of block=16"):
        kernels.quantize_kv_fp4(torch.randn(3, 24))
    case = attention_case(generator(2), 1, 1, 2, 32, 3, 4, 2)
    with pytest.raises(ValueError, match="swa_idx: expected shape"):
        kernels.sparse_attention(*case[:5], case[5][0], *case[6:])
