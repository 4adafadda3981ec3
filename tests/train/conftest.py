"""Shared fixtures of the training tests: the tiny preset in float64 (exact comparisons), one thread per worker."""

from __future__ import annotations

import pytest
import torch

from model import ModelArgs, Transformer, build_model, preset

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_args() -> ModelArgs:
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_args: ModelArgs) -> Transformer:
    return build_model(tiny_args, seed=0, dtype=torch.float64)
