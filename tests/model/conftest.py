"""Shared fixtures of the model tests: the tiny preset in float64 (packed, as served, and in the float form training
uses), fresh random inputs with a printed seed.

float64 makes the equivalence tests exact up to the quantisers: a reduction-order difference of one fp64 ulp almost
never moves an FP8/FP4 code, so two paths that must agree produce the same packed bytes.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from model import ModelArgs, Transformer, build_model, preset

# Tiny tensors: one thread per xdist worker is much faster than two threads fighting over two cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_args() -> ModelArgs:
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_args: ModelArgs) -> Transformer:
    return build_model(tiny_args, seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def narrow_args(tiny_args: ModelArgs) -> ModelArgs:
    """`tiny` with a 2,048-token vocabulary: for what does not depend on it (weight formats, checkpoints), whose
    embedding, head and Markov head would otherwise be 90 % of the bytes. No forward: Engram needs the real one."""
    return tiny_args.replace(vocab_size=2048, dspark_noise_token_id=2000)


@pytest.fixture(scope="session")
def narrow(narrow_args: ModelArgs) -> Transformer:
    return build_model(narrow_args, seed=0)


@pytest.fixture(scope="session")
def tiny_float(tiny_args: ModelArgs) -> Transformer:
    """The same weights as `tiny`, as float tensors (the training form)."""
    return build_model(tiny_args, seed=0, dtype=torch.float64, packed=False)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_args: ModelArgs) -> Transformer:
    return build_model(tiny_args, part="encoder", seed=0, dtype=torch.float64)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (MODEL_TEST_SEED pins it); printed, so a failure shows how to reproduce it."""
    value = int(os.environ.get("MODEL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"MODEL_TEST_SEED={value}")
    return value


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def tokens(gen: torch.Generator, tiny_args: ModelArgs):
    """tokens(n) → n fresh random token ids."""
    return lambda n: torch.randint(0, tiny_args.vocab_size, (n,), generator=gen)
