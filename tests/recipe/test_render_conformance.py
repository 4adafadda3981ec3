"""Random requests of the three APIs render byte-identical prompts and identical token ids as deepseek-recipe."""

from __future__ import annotations

import pytest
import recipe_oracle as oracle
from hypothesis import given
from hypothesis import strategies as st
from recipe_strategies import REQUESTS, examples

from recipe import APIS, RecipeError, Tokenizer, convert, render
from recipe.tokens import RECIPE_IMAGE_TOKEN, SpecialTokens


def _expect_same(api: str, body: dict, image_token: str | None = None) -> None:
    kwargs = {"image_token": image_token} if image_token else {}
    try:
        expected = oracle.prompt(api, body, **kwargs)
    except oracle.RejectedError:
        with pytest.raises(RecipeError) as rejected:
            convert(api, body)
        assert 400 <= rejected.value.status < 500
        return
    converted = convert(api, body)
    tokens = SpecialTokens(image=image_token) if image_token else None
    assert render(converted.conversation, converted.version, tokens=tokens).text == expected


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(60)
def test_prompt_text_matches_reference(api: str, data: st.DataObject) -> None:
    _expect_same(api, data.draw(REQUESTS[api]()))


@given(body=REQUESTS["chat.completions"]())
@examples(20)
def test_recipe_image_spelling_matches_reference(body: dict) -> None:
    _expect_same("chat.completions", body, image_token=RECIPE_IMAGE_TOKEN)


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(15)
def test_token_ids_match_reference(api: str, data: st.DataObject, tokenizer: Tokenizer) -> None:
    body = data.draw(REQUESTS[api]())
    try:
        expected = oracle.token_ids(api, body, oracle.tokenizer_json(tokenizer))
    except oracle.RejectedError:
        return
    converted = convert(api, body)
    assert render(converted.conversation, converted.version, tokenizer).token_ids == expected
