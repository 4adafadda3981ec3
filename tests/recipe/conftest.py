"""Shared fixtures of the recipe tests: hypothesis profiles and the (patched) tokenizer, loaded once."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from recipe import Tokenizer, load_tokenizer
from recipe.tokens import RECIPE_IMAGE_TOKEN

# Property tests are the bulk of the suite: "ci" keeps the whole recipe suite around a minute on 2 cores;
# HYPOTHESIS_PROFILE=deep runs ten times more examples.
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "deep", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def recipe_tokenizer() -> Tokenizer:
    """The tokenizer with deepseek-recipe's image spelling (`<｜image｜>`)."""
    return load_tokenizer(image_token=RECIPE_IMAGE_TOKEN)
