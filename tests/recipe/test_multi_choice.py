"""Chat Completions `n > 1`: one parser per choice, output routed by choice index."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from recipe import DONE, MultiChoiceProcessor, RecipeError, convert

BODY = {
    "model": "DeepSeek-V4.1-Flash",
    "messages": [{"role": "user", "content": "Say hi"}],
    "n": 3,
    "stream": True,
    "tools": [{"type": "function", "function": {"name": "wave", "parameters": {"type": "object"}}}],
}


def test_choices_are_parsed_independently() -> None:
    processor = MultiChoiceProcessor(convert("chat.completions", BODY), id="chatcmpl-1")
    events = processor.start(9, 0, "fp")
    outputs = [
        ["thinking a</think>", "Hi!"],
        ["thinking b</think>", '<｜DSML｜ calls><｜DSML｜ invoke name="wave"></｜DSML｜ invoke></｜DSML｜ calls>'],
        ["thinking c", "</think>Hel", "lo"],
    ]
    for step in range(3):
        for choice, chunks in enumerate(outputs):
            if step < len(chunks):
                events += processor.push_text(choice, chunks[step], 1)
    events += processor.finish(0, "stop") + processor.finish(2, "length")
    assert events[-1].data != DONE  # choice 1 has not finished
    events += processor.finish(1, "stop")
    assert processor.finished
    assert events[-1].data == DONE
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    completion = ChatCompletion.model_validate(processor.response())
    assert [c.finish_reason for c in completion.choices] == ["stop", "tool_calls", "length"]
    assert [c.message.content for c in completion.choices] == ["Hi!", "", "Hello"]
    assert completion.choices[1].message.tool_calls is not None
    assert completion.choices[1].message.tool_calls[0].function.arguments == "{}"


def test_n_is_bounded() -> None:
    with pytest.raises(RecipeError) as rejected:
        convert("chat.completions", {**BODY, "n": 1000})
    assert rejected.value.param == "n"
    with pytest.raises(ValueError, match="Chat Completions"):
        MultiChoiceProcessor(convert("responses", {"model": "DeepSeek-V4.1-Flash", "input": "x"}))
