"""train.eval: the tool-call verdicts on answers rendered by recipe (right, wrong tool, wrong values, broken), and
the DSpark figures on the committed demo checkpoint (served acceptance equals the teacher-forced walk)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from model import Transformer, load_checkpoint
from recipe import Assistant, Conversation, ToolCall, render_history
from train import data
from train.eval import (
    DecodeStats,
    chat_prompts,
    confidence_calibration,
    generate,
    judge_call,
    teacher_forced_acceptance,
    walk,
)

CHECKPOINT = Path(__file__).resolve().parents[2] / "model" / "checkpoints" / "v41-demo"


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


@pytest.fixture(scope="module")
def demo() -> Transformer:
    return load_checkpoint(CHECKPOINT, device=torch.device("cpu"))


@pytest.mark.parametrize(("prompt", "max_new"), [(6, 48), (9, 20)])
def test_served_drafts_accept_what_the_teacher_forced_drafts_do(demo: Transformer, prompt: int, max_new: int) -> None:
    """On the model's own greedy answer to a held-out chat prompt, greedy speculation through the serving path
    (draft + verify, rollback of rejected drafts) keeps per step exactly what the training form of the draft,
    teacher-forced at every anchor, accepts along the walk; every kept token is counted once (none past EOS or the
    budget), so the per-step figure is the output's length over the steps."""
    p = chat_prompts(0, prompt + 1)[prompt]
    (plain,), _ = generate(demo, [p], max_new)
    (spec,), stats = generate(demo, [p], max_new, speculative=True)
    assert spec == plain
    assert sum(stats.emitted_per_step) == len(plain) - 1  # the first token comes from the prompt's logits
    assert stats.final_steps == [False] * (stats.steps - 1) + [True]
    accepted = teacher_forced_acceptance(demo, p, plain)
    assert stats.emitted_per_step == walk(accepted)
    assert max(accepted) >= 2  # the checkpoint drafts this answer well: the comparison covers accepted runs


def test_accepted_length_per_row_and_without_the_final_step() -> None:
    stats = DecodeStats(emitted_per_step=[6, 2, 6, 1, 3], step_prompts=[0, 1, 0, 0, 1],
                        final_steps=[False, False, False, True, True])  # fmt: skip
    assert stats.accepted_length() == pytest.approx(18 / 5)
    assert stats.accepted_length({0}) == pytest.approx(13 / 3)
    assert stats.accepted_length({0}, final=False) == pytest.approx(6.0)
    assert stats.accepted_length({1}, final=False) == pytest.approx(2.0)


def test_walk_visits_the_anchor_after_each_steps_tokens() -> None:
    # anchors 0…6 accept 2, 0, 0, 1, 0, 3, 0 drafts: steps at 0 (3 tokens), 3 (2), 5 (1: only one token follows)
    assert walk([2, 0, 0, 1, 0, 3, 0]) == [3, 2, 1]
    assert walk([2, 1, 0]) == [2]  # both tokens after the first accepted: no token left for a bonus
    assert walk([0]) == []
