"""Prompt encoding: a long run of text is cut where the DeepSeek pre-tokenizer splits anyway and encoded in slices,
to exactly the ids of the whole; with a token limit, a prompt over it is refused as soon as that is known, with a
count that never overstates it."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from recipe_strategies import ALPHABET, examples

import recipe.tokenizer
from recipe import PromptTooLongError, Tokenizer, load_tokenizer
from recipe.render import Special

LINE = "The build failed in tests/test_io.py::test_roundtrip after the 42nd retry; see the log below.\n"
# Text with many cut points and every kind of neighbour the pre-tokenizer treats apart: letters, digits, runs of
# spaces and newlines, punctuation, CJK and kana, accents and combining marks, emoji.
WORDS = st.lists(
    st.one_of(
        st.text(st.sampled_from("abcXYZ"), min_size=1, max_size=6),
        st.sampled_from([" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", ".", "_", "-", "'s", "!?", "123", "4567", "0"]),
        st.text(ALPHABET, max_size=4),
        st.sampled_from(["日本語", "ひらがな", "カタカナ", "é", "e\u0301", "😀", "x\u0301y", "ß"]),
    ),
    max_size=60,
).map("".join)


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of `text` encoded in one piece (no added-token spelling in it, so the full vocabulary agrees)."""
    return tokenizer.hf.encode(text, add_special_tokens=False).ids


@given(text=WORDS)
@examples(300)
def test_text_cut_into_slices_encodes_to_the_ids_of_the_whole(text: str, tokenizer: Tokenizer) -> None:
    assume("｜" not in text)
    with mock.patch.object(recipe.tokenizer, "CHUNK_CHARS", 3), mock.patch.object(recipe.tokenizer, "BATCH_CHARS", 7):
        ids, offsets = tokenizer.encode_pieces([text])
    assert ids == whole(tokenizer, text)
    assert offsets == [0, len(ids)]


def test_a_long_prompt_encodes_to_the_ids_of_its_runs_encoded_whole(tokenizer: Tokenizer) -> None:
    """At the real sizes: runs of hundreds of kilobytes around template tokens, cut and batched."""
    code = "def f(x):\n    return {'key': x * 2, \"other\": [1, 2.5, None]}  # note\n" * 3000
    pieces = [Special("<｜begin▁of▁sentence｜>"), LINE * 4000, "日本語のテキスト。" * 9000, Special("<｜User｜>"), code]
    ids, offsets = tokenizer.encode_pieces(pieces)
    first = whole(tokenizer, pieces[1] + pieces[2])
    assert ids == [0, *first, tokenizer.special_id("<｜User｜>"), *whole(tokenizer, code)]
    assert offsets == [0, 1, 1, 1 + len(first), 2 + len(first), len(ids)]


def test_another_tokenizer_is_never_cut(tmp_path, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The cuts are only known to be exact for the DeepSeek pre-tokenizer: any other encodes each run whole."""
    config = tokenizer.hf.to_str().replace("\\\\p{N}{1,3}", "\\\\p{N}{1,2}")
    (tmp_path / "tokenizer.json").write_text(config)
    other = load_tokenizer(tmp_path / "tokenizer.json")
    text = "word12345 " * 20_000
    assert other.encode_pieces([text])[0] == other.hf.encode(text, add_special_tokens=False).ids
    assert other.encode_pieces([text])[0] != whole(tokenizer, text)


@pytest.mark.parametrize("limit", [100, 40_000])
def test_a_prompt_over_the_limit_is_refused_with_a_count_that_never_overstates_it(
    limit: int, tokenizer: Tokenizer
) -> None:
    """A 3 MB prompt: under a limit its length alone rules out, before any encoding; under a larger one, after the
    first slice of text that passes it (the whole would be about 770,000 tokens)."""
    lines = 3_000_000 // len(LINE)
    total = lines * len(whole(tokenizer, LINE))  # each line ends where the pre-tokenizer splits
    with pytest.raises(PromptTooLongError) as over:
        tokenizer.encode_pieces([LINE * lines], limit)
    assert limit < over.value.tokens <= total
    assert over.value.tokens < total // 2  # stopped early
    assert over.value.limit == limit
    assert f"more than {limit} tokens" in over.value.message


@given(text=WORDS)
@examples(100)
def test_a_prompt_within_the_limit_encodes_as_without_one(text: str, tokenizer: Tokenizer) -> None:
    pieces = [Special("<｜begin▁of▁sentence｜>"), text, Special("<｜User｜>")]
    ids, offsets = tokenizer.encode_pieces(pieces)
    assert tokenizer.encode_pieces(pieces, len(ids)) == (ids, offsets)
    with pytest.raises(PromptTooLongError):
        tokenizer.encode_pieces(pieces, len(ids) - 1)
