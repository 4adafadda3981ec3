"""`render_history` for training: the whole conversation, and which tokens the assistant produced."""

from __future__ import annotations

from recipe import Assistant, Conversation, Tokenizer, Tool, ToolCall, ToolResult, User, render_history

EOS = "<｜end▁of▁sentence｜>"


def test_assistant_spans_cover_exactly_the_generated_tokens(tokenizer: Tokenizer) -> None:
    conversation = Conversation(
        [
            User("Weather in Paris?"),
            Assistant("", reasoning="need the tool", tool_calls=[ToolCall("c1", "get_weather", '{"city": "Paris"}')]),
            ToolResult("sunny", "c1"),
            Assistant("It is sunny.", reasoning="the tool said sunny"),
        ],
        tools=[Tool("get_weather", parameters={"type": "object"})],
    )
    rendered = render_history(conversation, tokenizer=tokenizer)
    assert rendered.token_ids is not None
    assert rendered.assistant_spans is not None
    completions = [tokenizer.decode(rendered.token_ids[start:end]) for start, end in rendered.assistant_spans]
    assert completions[0].startswith("need the tool</think>\n\n<｜DSML｜ calls>")
    assert completions[0].endswith(f"</｜DSML｜ calls>{EOS}")
    assert completions[1] == f"the tool said sunny</think>It is sunny.{EOS}"
    # Outside the spans: the prompt side, ending each time with the assistant header.
    before = tokenizer.decode(rendered.token_ids[: rendered.assistant_spans[0][0]])
    assert before.endswith("<｜Assistant｜><think>")
    assert rendered.token_ids[-1] == tokenizer.eos_id
    assert not rendered.text.endswith("<｜Assistant｜><think>")  # no generation header


def test_history_drops_reasoning_before_the_last_user_message() -> None:
    conversation = Conversation(
        [User("q1"), Assistant("a1", reasoning="old"), User("q2"), Assistant("a2", reasoning="new")]
    )
    rendered = render_history(conversation)
    assert "old" not in rendered.text
    assert rendered.text.endswith(f"<｜User｜>q2<｜Assistant｜><think>new</think>a2{EOS}")
    spans = [rendered.text[start:end] for start, end in rendered.assistant_spans or ()]
    assert spans == [f"a1{EOS}", f"new</think>a2{EOS}"]
