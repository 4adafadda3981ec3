"""CSA2 sharing on `tiny`: Reuse layers attend with exactly their source's indices, Reindex layers select only inside
the candidate pool, and the tie-stable top-k / candidate pool agree with a stable-sort oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model.kernels as kernels
from model import serving
from model.config import Mode
from model.indexer import candidate_pool, stable_topk


@pytest.fixture
def step_of(tiny, tokens):
    """A full-model step over a fresh sequence that already has some prefix in the cache."""

    def run(prefix: int, new: int):
        cache = tiny.new_cache()
        cache.add_row()
        ids = tokens(prefix + new)
        if prefix:
            first = cache.step(ids[None, :prefix])
            serving.forward_full(tiny, first)
            first.commit()
        return cache.step(ids[None, prefix:])

    return run


def test_reuse_layers_attend_with_their_sources_indices(tiny, step_of, monkeypatch):
    calls: list[torch.Tensor] = []
    real = kernels.sparse_attention

    def spy(*args, **kwargs):  # the real kernel runs; the spy only records each layer's indices
        calls.append(args[6].clone())
        return real(*args, **kwargs)

    step = step_of(prefix=21, new=9)
    monkeypatch.setattr(kernels, "sparse_attention", spy)
    serving.forward_full(tiny, step)
    roles = tiny.args.layer_roles[: tiny.args.num_hidden_layers]
    assert len(calls) == len(roles)
    reuse = [r for r in roles if r.mode is Mode.REUSE]
    assert reuse
    for r in reuse:
        assert torch.equal(calls[r.layer_id], calls[r.index_source]), r.layer_id
        assert torch.equal(calls[r.layer_id], step.selection.topk[r.index_source])
    assert int((calls[2] >= 0).sum()) > 0  # indices were actually selected


def test_reindex_selects_only_inside_the_candidate_pool(tiny, step_of):
    step = step_of(prefix=40, new=6)
    serving.forward_full(tiny, step)
    a = tiny.args
    pool = step.selection.candidates  # [B, T, N] of the candidate source (layer L/2)
    n_visible = step.n_visible(1)
    # Level 1 keeps at most candidate_topk_blocks blocks, always the block of the newest visible position.
    padded = torch.nn.functional.pad(pool, (0, -pool.shape[-1] % a.candidate_block_size))
    blocks = padded.unflatten(-1, (-1, a.candidate_block_size)).any(-1)
    assert int(blocks.sum(-1).max()) <= a.candidate_topk_blocks
    assert bool(pool.gather(-1, (n_visible - 1).unsqueeze(-1)).all())
    for r in a.layer_roles:
        if r.mode is Mode.REINDEX:
            idx = step.selection.topk[r.layer_id].long()
            chosen = idx >= 0
            assert int(chosen.sum()) > 0
            assert bool(pool.gather(-1, idx.clamp_min(0))[chosen].all()), r.layer_id
    # The candidate source itself scores the whole visible range: its picks may lie outside the pool.
    assert int((step.selection.topk[a.candidate_source_layer_id] >= 0).sum()) > 0


def stable_reference(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """Top-k by a stable descending sort (ties → lower position), −∞ never, sorted by position, −1 padded."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for r, row in enumerate(scores):
        row = row[: int(lengths[r])]
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        keep = order[row[order] > -math.inf].sort().values
        out[r, : len(keep)] = keep.to(torch.int32)
    return out


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_stable_topk_breaks_ties_toward_the_lower_position(rows, length, k, seed):
    g = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are everywhere (as with ReLU zeros); some −∞ (invisible / outside the pool).
    scores = torch.randint(-2, 3, (rows, length), generator=g).float()
    scores[torch.rand(rows, length, generator=g) < 0.2] = -math.inf
    lengths = torch.randint(0, length + 1, (rows,), generator=g)
    assert torch.equal(stable_topk(scores, k, lengths), stable_reference(scores, k, lengths))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 50), st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_candidate_pool_matches_its_definition(S, block, top, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-1, 2, (1, 3, S), generator=g).float()
    n_visible = torch.randint(0, S + 1, (1, 3), generator=g)
    pool = candidate_pool(scores, n_visible, block, top)
    for t in range(3):
        n = int(n_visible[0, t])
        nb = -(-S // block)
        best = torch.full((nb,), -math.inf)
        for j in range(nb):
            seg = scores[0, t, j * block : min((j + 1) * block, n)]
            best[j] = seg.max() if seg.numel() else -math.inf
        if n:
            best[(n - 1) // block] = math.inf
        keep = [j for j in torch.sort(best, descending=True, stable=True).indices[:top].tolist() if best[j] > -math.inf]
        want = torch.zeros(S, dtype=torch.bool)
        for j in keep:
            want[j * block : (j + 1) * block] = True
        want[n:] = False
        assert torch.equal(pool[0, t], want)
