"""The tool-call verdicts of train.eval, on answers rendered by recipe (right, wrong tool, wrong values, broken)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from recipe import Assistant, Conversation, ToolCall, render_history
from train import data
from train.eval import DecodeStats, confidence_calibration, judge_call


def _answer_text(conv: Conversation, reply: Assistant) -> str:
    """What a model emitting `reply` after `conv`'s prompt would output (recipe renders it; EOS dropped)."""
    full = msgspec.structs.replace(conv, messages=[*conv.messages, reply])
    rendered = render_history(full, tokenizer=data.tokenizer())
    start, end = rendered.assistant_spans[-1]
    return data.tokenizer().decode(rendered.token_ids[start : end - 1])


@pytest.mark.parametrize("tool", ["get_weather", "calculator", "convert_units", "search"])
def test_verdicts(tool: str) -> None:
    conv, request = data.tool_prompt(0, 3, tool)
    reasoning = "Let me call a tool." if conv.thinking else None

    def verdict(call: ToolCall | None) -> dict[str, bool]:
        reply = Assistant(
            content="" if call else "No tool needed.", reasoning=reasoning, tool_calls=[call] if call else []
        )
        return judge_call(_answer_text(conv, reply), conv, request.call)

    assert all(verdict(request.call).values())
    other = next(name for name in data.TOOL_REQUESTS if name != tool)
    wrong_tool = verdict(ToolCall("c", other, request.call.arguments))
    assert wrong_tool["parsed_call"]
    assert not wrong_tool["right_tool"]
    args = msgspec.json.decode(request.call.arguments)
    key = next(k for k, v in args.items() if isinstance(v, str))
    wrong_value = verdict(ToolCall("c", tool, msgspec.json.encode(args | {key: "Atlantis"}).decode()))
    assert wrong_value["schema_valid"] != (key.endswith("unit"))  # an enum value outside the schema is invalid
    assert not wrong_value["right_values"]
    missing = verdict(ToolCall("c", tool, "{}"))
    assert missing["right_tool"]
    assert not missing["schema_valid"]
    assert not any(verdict(None).values())


def test_confidence_calibration_scores_the_raw_and_the_calibrated_confidences() -> None:
    """The serving draft's confidences carry the temperatures: raw is σ(z), calibrated σ(z/T), whatever T is stored."""
    g = torch.Generator().manual_seed(2)
    z = 3 * torch.randn(20000, 1, generator=g)
    accepted = torch.rand(20000, generator=g) < torch.sigmoid(z[:, 0] / 2.0)  # the head is over-confident by 2
    stats = DecodeStats(confidences=torch.sigmoid(z / 2.0).tolist(), accepted=accepted.long().tolist())
    figures = confidence_calibration(stats, [2.0])
    assert figures["ece_calibrated"][0] < 0.01  # σ(z/2) is the truth
    assert figures["ece_raw"][0] > 0.05  # σ(z) is not
    assert figures["ece_raw"][0] == pytest.approx(
        confidence_calibration(DecodeStats(confidences=torch.sigmoid(z).tolist(), accepted=stats.accepted), [1.0])[
            "ece_raw"
        ][0],
        abs=1e-4,
    )
