"""Shared fixtures of the recipe tests: the (patched) tokenizers, loaded once per worker.

Property tests set their example counts with `recipe_strategies.examples`; RECIPE_DEEP=1 runs ten times more."""

from __future__ import annotations

import pytest

from recipe import Tokenizer, load_tokenizer
from recipe.tokens import RECIPE_IMAGE_TOKEN


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def recipe_tokenizer() -> Tokenizer:
    """The tokenizer with deepseek-recipe's image spelling (`<｜image｜>`)."""
    return load_tokenizer(image_token=RECIPE_IMAGE_TOKEN)
