"""The torch references of model.kernels against naive per-element oracles written from the definitions."""

import math

import pytest
import torch
from kernel_cases import attention_case, candidate_case, check_topk, generator, indexer_case, topk_case

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
def test_topk_reference_is_a_valid_topk(R: int, L: int, k: int) -> None:
    scores, lengths = topk_case(generator(R * L), R, L)
    check_topk(scores, lengths, k, kernels.topk_indices(scores, k, lengths))
    check_topk(scores, None, k, kernels.topk_indices(scores, k))


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
            ranked = sorted(range(n_blocks), key=lambda j: -block[j])[:topk_blocks]
            for j in ranked:
                if block[j] > -math.inf:
                    mask[b, t, j * block_size : min(nv, (j + 1) * block_size)] = True
    return mask


@pytest.mark.parametrize(("S", "block_size", "topk_blocks"), [(37, 8, 2), (64, 8, 3), (20, 4, 10), (9, 8, 1)])
def test_candidate_mask_matches_the_definition(S: int, block_size: int, topk_blocks: int) -> None:
    scores, n_visible = candidate_case(generator(S), S)
    got = kernels.candidate_mask(scores, n_visible, block_size, topk_blocks)
    assert torch.equal(got, naive_candidate_mask(scores, n_visible, block_size, topk_blocks))


def test_sparse_attention_matches_the_definition() -> None:
    B, T, H, D, W, N, K = 2, 2, 3, 64, 5, 9, 4
    q, swa_data, swa_scale, swa_mask, kv_data, kv_scale, idx, sink, scale = attention_case(
        generator(1), B, T, H, D, W, N, K
    )
    got = kernels.sparse_attention(q, swa_data, swa_scale, swa_mask, kv_data, kv_scale, idx, sink, scale)
    ring = quant.fp8_dequant(swa_data, swa_scale).double()
    entries = quant.fp4_dequant_e4m3(kv_data, kv_scale).double()
    for b in range(B):
        for t in range(T):
            keys = [ring[b, w] for w in range(W) if swa_mask[b, t, w]] + [entries[b, i] for i in idx[b, t] if i >= 0]
            for h in range(H):
                logits = [float(q[b, t, h].double() @ key) * scale for key in keys]
                denom = sum(math.exp(s) for s in logits) + math.exp(float(sink[h]))
                want = sum((math.exp(s) / denom) * key for s, key in zip(logits, keys, strict=True))
                want = want if keys else torch.zeros(D, dtype=torch.float64)
                torch.testing.assert_close(got[b, t, h].double(), want, rtol=1e-5, atol=1e-6)
    assert got[0, 0].abs().max() == 0  # only the sink: nothing attended


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
    with pytest.raises(ValueError, match="swa_mask: expected shape"):
        kernels.sparse_attention(case[0], case[1], case[2], case[3][:, :, :2], *case[4:])
