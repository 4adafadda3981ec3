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


def _reasoning(*parts: str) -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t} for t in parts]}


def _answer(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


@pytest.mark.parametrize(
    "items",
    [
        [_reasoning(""), _answer(""), _reasoning("0"), _answer("")],  # hypothesis found it: "\n0" against "0"
        [_reasoning(""), _reasoning("b")],
        [_reasoning("", "b")],  # parts of one item: joined even when empty
        [_reasoning("a", ""), _reasoning("b")],
        [_reasoning("a"), _reasoning(""), _reasoning("b")],
    ],
)
def test_reasoning_items_of_a_turn_join_as_the_reference_joins_them(items: list[dict]) -> None:
    tools = [{"type": "function", "name": "a", "parameters": {"type": "object", "properties": {}}}]
    _expect_same("responses", {"model": "DeepSeek-V4.1-Flash", "input": [*items, {"role": "user", "content": "q"}],
                               "tools": tools})  # fmt: skip
