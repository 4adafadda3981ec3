"""On a GPU (skipped without one): the keyed race of sampled rows compiled at start-up, once for every row count."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from decode_svc.sampler import warm_race
from model.sampling import keyed_race

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_after_the_warm_up_races_of_any_row_count_compile_nothing() -> None:
    """A plain step races B rows, a verify B·(1 + w): after `warm_race`, none of those counts compiles again (the
    first sampled request of a replica would wait ≈ 1 s for it)."""
    vocab = 4099
    warm_race(torch.device("cuda"), vocab)
    compiled = counters["stats"]["unique_graphs"]
    for rows in (1, 5, 64, 7, 1280, 2, 129):
        probs = torch.rand(rows, vocab, device="cuda")
        seeds, positions = torch.arange(rows, device="cuda") * 7919, torch.arange(rows, device="cuda")
        assert keyed_race(probs, seeds, positions).shape == (rows,)
    assert counters["stats"]["unique_graphs"] == compiled
