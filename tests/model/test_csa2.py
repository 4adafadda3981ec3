"""CSA2 sharing on `tiny`: Reuse layers attend with exactly their source's indices, Reindex layers select only inside
the candidate pool. (The selection rule itself, ties included, is tested with the kernels: tests/model/kernels.)"""

from __future__ import annotations

import pytest
import torch

import model.kernels as kernels
from model import serving
from model.config import Mode


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
        calls.append(args[8].clone())
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
