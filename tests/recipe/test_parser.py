"""The output parser on its own: the same items for any chunking; the fast path keeps sentinels out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from recipe_strategies import cuts, examples, outputs, parse_requests

from recipe import APIS, ParsingOptions, convert
from recipe.parser import Out, Parser
from recipe.stream import DSML_SENTINEL, THINK_END_SENTINEL, TOKEN_MARKERS

RESTORE = {THINK_END_SENTINEL: "</think>", DSML_SENTINEL: "｜DSML｜"}


def coalesced(items: list[tuple[Out, str]]) -> list[tuple[Out, str]]:
    """Items with consecutive text of one kind joined (how many pieces a chunking gives does not matter)."""
    joined: list[tuple[Out, str]] = []
    for kind, text in items:
        if joined and joined[-1][0] is kind and kind in (Out.REASONING, Out.CONTENT, Out.ARGS):
            joined[-1] = (kind, joined[-1][1] + text)
        else:
            joined.append((kind, text))
    return joined


def parse(options: ParsingOptions, chunks: list[str]) -> list[tuple[Out, str]]:
    """Items of `chunks`, each tried on `feed_plain` first, as the stream processor does."""
    parser = Parser(options)
    items: list[tuple[Out, str]] = []
    for chunk in chunks:
        kind = parser.feed_plain(chunk)
        items += [(kind, chunk)] if kind is not None else parser.feed(chunk)
    return coalesced(items + parser.finish())


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(40)
def test_any_chunking_gives_the_whole_texts_items(api: str, data: st.DataObject) -> None:
    """Markers cut anywhere (held back until they complete or fail), one character at a time included."""
    options = convert(api, data.draw(parse_requests(api))).parsing
    output = data.draw(outputs(stops=options.stop_sequences, json_mode=options.parse_json_output))
    assert parse(options, data.draw(cuts(output))) == parse(options, [output])


def test_fast_path_never_passes_a_token_mode_sentinel() -> None:
    parser = Parser(ParsingOptions(thinking_stage="reasoning_start"), TOKEN_MARKERS, RESTORE)
    assert parser.feed_plain("thinking ") is Out.REASONING
    assert parser.feed_plain(f"a {DSML_SENTINEL} b") is None  # not a marker (no `<`), but spelled out
    assert parser.feed(f"a {DSML_SENTINEL} b") == [(Out.REASONING, "a ｜DSML｜ b")]
    assert parser.feed_plain(THINK_END_SENTINEL) is None
    assert parser.feed(THINK_END_SENTINEL + "answer") == [(Out.CONTENT, "answer")]
    assert parser.fed == len("thinking ") + len(f"a {DSML_SENTINEL} b") + 1 + len("answer")
