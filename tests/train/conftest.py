"""The training tests share one tiny model in float64, in the float form training uses (exact comparisons between
the dense and serving paths)."""

from __future__ import annotations

import pytest
import torch

from model import Transformer, build_model, preset

torch.set_num_threads(1)  # one thread per xdist worker: tiny tensors, two cores


@pytest.fixture(scope="session")
def tiny() -> Transformer:
    return build_model(preset("tiny"), seed=0, dtype=torch.float64, packed=False)
