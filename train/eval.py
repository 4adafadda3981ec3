"""Evaluate a demo checkpoint: `python -m train.eval --checkpoint DIR [--out FILE.json]`.

Figures (docs/benchmarks.md "demo checkpoint"), all on held-out data of `train.data`:

- tool calls: per tool, greedy answers to `--prompts` held-out requests through the serving path (prefill →
  bounded replay → decode); the share that parses (through recipe) into a call of the right tool, the share whose
  arguments are valid against the tool's JSON Schema, and the share with the right argument values;
- QAT: held-out next-token loss with FP4 vs bf16 main KV, with and without QAT (the twin trained by `python -m
  train`; its figures are read from the checkpoint's training.json);
- bounded replay: loss of the last answer of long held-out conversations with the decoder window truncated where a
  decode of that answer starts (reference §7.1) vs exact SWA;
- DSpark: mean tokens per verification step (accepted drafts + 1) and decode tokens/s against plain decoding, at
  batch 1 and batched, greedy (outputs must equal plain greedy) and at T = 1; the calibration of the confidences.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from tqdm.auto import tqdm

from model import DecodeBatch, SamplingParams, Transformer, draft_logits, encode_prefill, load_checkpoint, sample
from recipe import Assistant, Conversation, ToolCall, render, render_history
from train import batches as batching
from train import calibrate, data, tools
from train.export import REPORT_FILE
from train.loss import learned_token_loss
from train.parse import parse_assistant


# ---------------------------------------------------------------------------------------------- losses
def heldout_losses(model: Transformer, sets: dict[str, list[batching.Batch]]) -> dict[str, float]:
    """Token-weighted mean next-token loss over the learned tokens of each set of batches."""
    out = {}
    for kind, batches in sets.items():
        total, count = 0.0, 0
        for batch in batches:
            loss, n = learned_token_loss(model, batch.to(model.device))
            total, count = total + float(loss), count + n
        out[kind] = total / count if count else math.nan  # a set may hold no learned token (truncation)
    return out


def bounded_replay_gap(model: Transformer, seed: int, count: int) -> dict[str, float]:
    """Loss of the last answer of long held-out tool conversations: exact SWA vs bounded replay from its start."""
    W = model.args.sliding_window
    exact, bounded, n_tokens = 0.0, 0.0, 0
    for index in range(count):
        s = data.sample(seed, index, "tool", held_out=True)
        rendered = render_history(s.conversation, tokenizer=data.tokenizer())
        start, end = rendered.assistant_spans[-1]
        tokens = torch.tensor([s.tokens], device=model.device)
        labels = tokens[0, start:end]
        for replay_start, acc in ((0, "exact"), (max(0, start - W), "bounded")):
            logits = model(tokens, replay_start=replay_start)[0, start - 1 : end - 1]
            loss = float(F.cross_entropy(logits.float(), labels, reduction="sum"))
            exact, bounded = (exact + loss, bounded) if acc == "exact" else (exact, bounded + loss)
        n_tokens += end - start
    e, b = exact / n_tokens, bounded / n_tokens
    return {"conversations": count, "tokens": n_tokens, "exact_loss": e, "bounded_loss": b,
            "difference": b - e, "relative_percent": 100 * (b / e - 1)}  # fmt: skip


# ------------------------------------------------------------------------------------------ generation
@dataclass
class Generation:
    """One sequence being decoded: emitted tokens (the last one pending), and whether it is done."""

    tokens: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class DecodeStats:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # verification steps (speculative) or decode steps
    emitted_per_step: list[int] = field(default_factory=list)  # per (row, step): tokens kept (to EOS / max_new)
    step_prompts: list[int] = field(default_factory=list)  # per (row, step): the row's prompt index
    final_steps: list[bool] = field(default_factory=list)  # per (row, step): the row's last step (EOS / max_new)
    confidences: list[list[float]] = field(default_factory=list)  # per step: the drafts' confidences
    accepted: list[int] = field(default_factory=list)  # per step: accepted drafts

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.nan

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_length()

    def accepted_length(self, prompts: set[int] | None = None, final: bool = True) -> float:
        """Mean tokens kept per verification step of the rows of `prompts` (all: None), each row's last step —
        cut short by EOS or the budget — counted or not."""
        kept = [
            n
            for n, i, last in zip(self.emitted_per_step, self.step_prompts, self.final_steps, strict=True)
            if (prompts is None or i in prompts) and (final or not last)
        ]
        return sum(kept) / len(kept) if kept else math.nan

    def add(self, other: DecodeStats, first_prompt: int = 0) -> None:
        """Append the figures of a later run whose prompts are numbered from `first_prompt`."""
        self.tokens, self.seconds = self.tokens + other.tokens, self.seconds + other.seconds
        self.steps += other.steps
        self.emitted_per_step += other.emitted_per_step
        self.step_prompts += [first_prompt + i for i in other.step_prompts]
        self.final_steps += other.final_steps
        self.confidences += other.confidences
        self.accepted += other.accepted


def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new: int,
    *,
    temperature: float = 0.0,
    speculative: bool = False,
    seed: int = 0,
) -> tuple[list[list[int]], DecodeStats]:
    """Decode all prompts as one continuous batch through the serving path; EOS or `max_new` tokens end a
    sequence. Tokens a step emits past its end (drafts accepted after EOS or beyond the budget) are dropped."""
    if max_new < 1:
        raise ValueError(f"max_new must be at least 1, got {max_new}")
    eos = model.args.eos_token_id
    generator = torch.Generator(device=model.device).manual_seed(seed)
    batch = DecodeBatch(model, capacity=len(prompts))
    seqs: dict[int, Generation] = {}
    prompt_of: dict[int, int] = {}
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            prefill = encode_prefill(model, prompt)
            seq_id, logits = batch.join(prefill.blocks, prefill.encoder_state)
            prompt_of[seq_id] = index
            first = sample(SamplingParams.uniform(1, temperature).probs(logits[None]), generator)
            seqs[seq_id] = Generation([int(first)])
        stats = DecodeStats()
        start = time.perf_counter()
        for seq_id, g in seqs.items():
            _finish_if_done(batch, seq_id, g, eos, max_new)
        while len(batch):
            pending = [seqs[s].tokens[-1] for s in batch.seq_ids]
            params = SamplingParams.uniform(len(batch), temperature)
            if speculative:
                draft = batch.dspark_draft(pending, params, generator)
                result = batch.verify(pending, draft, params, generator=generator)
                emitted = result.tokens
                stats.accepted += result.accepted.tolist()
                stats.confidences += draft.confidence.float().cpu().tolist()
            else:
                logits = batch.decode_step(pending)
                emitted = [[int(t)] for t in sample(params.probs(logits), generator)]
            stats.steps += 1
            for seq_id, new in zip(list(batch.seq_ids), emitted, strict=True):
                g = seqs[seq_id]
                kept = _kept(g.tokens, new, eos, max_new)
                g.tokens += kept
                _finish_if_done(batch, seq_id, g, eos, max_new)
                stats.emitted_per_step.append(len(kept))
                stats.step_prompts.append(prompt_of[seq_id])
                stats.final_steps.append(g.done)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        stats.seconds = time.perf_counter() - start
    outputs = [seqs[s].tokens for s in sorted(seqs)]
    stats.tokens = sum(len(o) for o in outputs)
    return outputs, stats


def _kept(tokens: list[int], new: list[int], eos: int, max_new: int) -> list[int]:
    """The part of a step's `new` tokens that continues `tokens`: up to the first EOS and `max_new` in all."""
    new = new[: max_new - len(tokens)]
    return new[: new.index(eos) + 1] if eos in new else new


def _finish_if_done(batch: Any, seq_id: int, g: Generation, eos: int, max_new: int) -> None:
    if eos in g.tokens or len(g.tokens) >= max_new:
        g.done = True
        batch.leave(seq_id)


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ---------------------------------------------------------------------------------------------- tool calls
def _same_values(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if set(got) != set(want):
        return False
    return all(
        math.isclose(float(got[k]), float(v)) if isinstance(v, int | float) and isinstance(got[k], int | float)
        else got[k] == v
        for k, v in want.items()
    )  # fmt: skip


def judge_call(text: str, conv: Conversation, expected: ToolCall) -> dict[str, bool]:
    """What a model answer to a tool request achieved: parsed call of the right tool, schema-valid, right values."""
    reply = parse_assistant(text, reasoning=conv.thinking, tools=True)
    call = reply.tool_calls[0] if reply.tool_calls else None
    right_tool = call is not None and call.name == expected.name
    try:
        args = msgspec.json.decode(call.arguments) if right_tool else None
        jsonschema.validate(args, tools.TOOLS[expected.name].parameters)
        valid = isinstance(args, dict)
    except (msgspec.DecodeError, jsonschema.ValidationError):
        valid = False
    right_values = valid and _same_values(args, msgspec.json.decode(expected.arguments))
    return {"parsed_call": call is not None, "right_tool": right_tool, "schema_valid": valid,
            "right_values": right_values}  # fmt: skip


def tool_call_validity(model: Transformer, seed: int, prompts: int, batch_size: int, max_new: int) -> dict[str, Any]:
    tok = data.tokenizer()
    results: dict[str, Any] = {}
    for name in tools.TOOLS:
        cases = [data.tool_prompt(seed, i, name) for i in range(prompts)]
        ids = [render(conv, tokenizer=tok).token_ids for conv, _ in cases]
        texts: list[str] = []
        for chunk in tqdm(list(_chunks(ids, batch_size)), desc=f"tool {name}", unit="batch"):
            outputs, _ = generate(model, chunk, max_new)
            texts += [tok.decode([t for t in out if t != model.args.eos_token_id]) for out in outputs]
        verdicts = [judge_call(t, conv, req.call) for t, (conv, req) in zip(texts, cases, strict=True)]
        results[name] = {key: sum(v[key] for v in verdicts) / len(verdicts) for key in verdicts[0]}
        results[name]["examples"] = texts[:2]
    for key in ("parsed_call", "right_tool", "schema_valid", "right_values"):
        results.setdefault("all", {})[key] = sum(results[n][key] for n in tools.TOOLS) / len(tools.TOOLS)
    return results


# ----------------------------------------------------------------------------------------------- DSpark
PROMPT_KINDS = ("chat", "tool", "json")  # held-out prompt i is of kind PROMPT_KINDS[i % 3]


def chat_prompts(seed: int, count: int) -> list[list[int]]:
    """Held-out conversations cut before their last answer (its generation header kept), of the kinds
    PROMPT_KINDS in turn."""
    tok, prompts = data.tokenizer(), []
    for i in range(count):
        conv = data.sample(seed, i, PROMPT_KINDS[i % 3], held_out=True).conversation
        last = max(j for j, m in enumerate(conv.messages) if isinstance(m, Assistant))
        prompt = msgspec.structs.replace(conv, messages=conv.messages[:last])
        prompts.append(render(prompt, tokenizer=tok).token_ids)
    return prompts


def teacher_forced_acceptance(model: Transformer, prompt: list[int], output: list[int]) -> list[int]:
    """Drafts accepted at every anchor of a greedy `output`, teacher-forced (`model.dspark.draft_logits`, the
    training form): entry j is for output[j] pending, capped by the tokens that follow it in `output`.

    The decoder windows start where the serving path's bounded replay after the prompt starts, so the figures are
    those of the served drafts (checked by tests/train/test_eval.py)."""
    g = model.args.dspark_block_size
    P, n = len(prompt), len(output)
    seq = torch.tensor([prompt + output + [model.args.eos_token_id] * g], device=model.device)  # a block per anchor
    with torch.no_grad():
        _, _, taps = model.features(seq, replay_start=max(0, P - model.args.sliding_window))
        logits, _ = draft_logits(model, seq, taps, torch.arange(P - 1, P + n - 1, device=model.device))
    drafts = logits[0].argmax(-1).tolist()  # [n, γ]
    accepted = []
    for j, row in enumerate(drafts):
        k = 0
        while k < min(g, n - 1 - j) and row[k] == output[j + 1 + k]:
            k += 1
        accepted.append(k)
    return accepted


def walk(accepted: list[int]) -> list[int]:
    """Tokens per verification step of a greedy decode with these acceptances: a step at anchor j keeps its
    accepted drafts and the next token — the tokens left, if fewer —, and the next step drafts after the last one
    kept (the first pending token comes from the prompt's logits)."""
    steps, j = [], 0
    while j < len(accepted) - 1:
        steps.append(min(accepted[j] + 1, len(accepted) - 1 - j))
        j += steps[-1]
    return steps


def dspark_teacher_forced(model: Transformer, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
    """Per prompt kind, on the model's own greedy outputs: the mean over every anchor of (accepted drafts + 1) —
    the training-time figure (`train.dspark.expected_accepted_length`) — and the mean over the anchors a greedy
    decode visits, which is what the serving path realises."""
    out: dict[str, Any] = {}
    per_anchor: dict[str, list[int]] = {k: [] for k in PROMPT_KINDS}
    walked: dict[str, list[int]] = {k: [] for k in PROMPT_KINDS}
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        accepted = teacher_forced_acceptance(model, prompt, output)
        kind = PROMPT_KINDS[i % 3]
        per_anchor[kind] += [min(a + 1, len(output) - 1 - j) for j, a in enumerate(accepted[:-1])]
        walked[kind] += walk(accepted)
    for kind in PROMPT_KINDS:
        a, w = per_anchor[kind], walked[kind]
        out[kind] = {"anchors": len(a), "per_anchor": sum(a) / len(a) if a else math.nan,
                     "steps": len(w), "walked": sum(w) / len(w) if w else math.nan}  # fmt: skip
    return out


def per_kind(stats: DecodeStats, count: int) -> dict[str, Any]:
    """Accepted length per prompt kind, with and without each row's last (EOS- or budget-cut) step."""
    out = {}
    for kind in PROMPT_KINDS:
        rows = {i for i in range(count) if PROMPT_KINDS[i % 3] == kind}
        out[kind] = {"steps": sum(i in rows for i in stats.step_prompts),
                     "mean_accepted_length": stats.accepted_length(rows),
                     "without_final_step": stats.accepted_length(rows, final=False)}  # fmt: skip
    return out


def dspark_figures(
    model: Transformer, seed: int, count: int, batch: int, max_new: int, temperatures: list[float]
) -> dict[str, Any]:
    prompts = chat_prompts(seed, count)
    single = prompts[: max(1, count // 4)]
    out: dict[str, Any] = {}
    plain_1, plain_stats_1, spec_1, spec_stats_1 = [], DecodeStats(), [], DecodeStats()
    for i, p in enumerate(single):  # batch 1: the latency setting speculation is for
        o, s = generate(model, [p], max_new)
        plain_1 += o
        plain_stats_1.add(s, i)
        o, s = generate(model, [p], max_new, speculative=True)
        spec_1 += o
        spec_stats_1.add(s, i)
    out["batch1_greedy"] = {
        "prompts": len(single),
        "plain_tokens_per_s": plain_stats_1.tokens_per_second,
        "dspark_tokens_per_s": spec_stats_1.tokens_per_second,
        "speedup": spec_stats_1.tokens_per_second / plain_stats_1.tokens_per_second,
        "mean_accepted_length": spec_stats_1.mean_accepted_length,
        "per_kind": per_kind(spec_stats_1, len(single)),
        "identical_to_plain": plain_1 == spec_1,
    }
    for label, temperature in (("greedy", 0.0), ("t1", 1.0)):
        plain, plain_stats = generate(model, prompts[:batch], max_new, temperature=temperature, seed=seed)
        spec, spec_stats = generate(
            model, prompts[:batch], max_new, temperature=temperature, speculative=True, seed=seed
        )
        figures = {
            "prompts": min(batch, len(prompts)),
            "plain_tokens_per_s": plain_stats.tokens_per_second,
            "dspark_tokens_per_s": spec_stats.tokens_per_second,
            "speedup": spec_stats.tokens_per_second / plain_stats.tokens_per_second,
            "mean_accepted_length": spec_stats.mean_accepted_length,
            "per_kind": per_kind(spec_stats, min(batch, len(prompts))),
        }
        if temperature == 0.0:
            figures["identical_to_plain"] = plain == spec
            figures["calibration"] = confidence_calibration(spec_stats, temperatures)
            figures["teacher_forced"] = dspark_teacher_forced(model, prompts[:batch], plain)
        out[f"batch_{label}"] = figures
    return out


def confidence_calibration(stats: DecodeStats, temperatures: list[float]) -> dict[str, Any]:
    """ECE of the running product of confidences against the serving path's greedy acceptance, per position:
    raw (T = 1) and with the checkpoint's calibrated temperatures.

    The serving draft's confidences already carry the temperatures (σ(z/T)): z is recovered before either is scored.
    """
    t = torch.tensor(temperatures)
    logits = torch.logit(torch.tensor(stats.confidences, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)).float() * t
    g = logits.shape[1]
    all_accepted = torch.arange(g).unsqueeze(0) < torch.tensor(stats.accepted).unsqueeze(1)
    figures: dict[str, Any] = {"steps": len(stats.accepted)}
    for label, scale in (("raw", torch.ones(g)), ("calibrated", t)):
        a = calibrate.running_product(logits, scale)
        figures[f"ece_{label}"] = [calibrate.ece(a[:, k], all_accepted[:, k]) for k in range(g)]
    return figures


def qat_claim_of(training: dict[str, Any]) -> dict[str, Any] | None:
    """The QAT-vs-twin figures of a training report, or of the run it continued (`init`), saying which."""
    runs_back = 0
    while training:
        if "qat_claim" in training:
            return {"runs_before_this_checkpoint": runs_back, **training["qat_claim"]}
        training, runs_back = training.get("init", {}).get("training", {}), runs_back + 1
    return None


def stored_temperatures(directory: Path, model: Transformer) -> list[float]:
    """The confidence head's calibrated temperatures stored with the checkpoint (ones if it has none)."""
    name = f"mtp.{model.args.num_nextn_predict_layers - 1}.confidence_head.temperature"
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return f.get_tensor(name).tolist()
    return [1.0] * model.args.dspark_block_size


# ---------------------------------------------------------------------------------------------------- CLI
SECTIONS = ("bounded_replay", "dspark", "tool_calls")


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure; with `--out`, the JSON is rewritten after each section (a cut-short run keeps what it has)."""
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_checkpoint(args.checkpoint, device=device, progress=True)
    report_file = Path(args.checkpoint) / REPORT_FILE
    training = json.loads(report_file.read_text()) if report_file.exists() else {}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    figures: dict[str, Any] = {"checkpoint": str(args.checkpoint), "device": str(device)}
    figures["qat"] = qat_claim_of(training)
    figures["calibration_fit"] = training.get("calibration")
    started = time.perf_counter()

    def done(section: str, value: Any) -> None:
        figures[section] = value
        figures["seconds"] = time.perf_counter() - started
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2, default=float) + "\n")

    if "bounded_replay" in args.sections:
        with torch.no_grad(), autocast:
            done("bounded_replay", bounded_replay_gap(model, args.seed, args.replay_conversations))
    if "dspark" in args.sections:
        temperatures = stored_temperatures(args.checkpoint, model)
        done("dspark", dspark_figures(model, args.seed, args.dspark_prompts, args.batch, args.max_new, temperatures))
    if "tool_calls" in args.sections:
        done("tool_calls", tool_call_validity(model, args.seed, args.prompts, args.batch, args.max_new))
    return figures


def summary(figures: dict[str, Any]) -> Table:
    """The headline figures, ours against the reference each is compared with."""
    table = Table(title=f"demo checkpoint ({figures['device']})")
    for column in ("figure", "ours", "against", "ratio / share"):
        table.add_column(column)
    for name, t in (figures.get("tool_calls") or {}).items():
        if name != "all":
            table.add_row(f"tool {name}: right tool / schema / values", f"{t['right_tool']:.0%}",
                          f"{t['schema_valid']:.0%}", f"{t['right_values']:.0%}")  # fmt: skip
    for label, q in (figures.get("qat") or {}).items():
        if isinstance(q, dict):
            for kind, percent in q["fp4_vs_bf16_percent"].items():
                table.add_row(f"{label}: {kind} loss, FP4 vs bf16 main KV", f"{q['fp4'][kind]:.4f}",
                              f"{q['bf16'][kind]:.4f}", f"{percent:+.3f} %")  # fmt: skip
    if r := figures.get("bounded_replay"):
        table.add_row("loss, bounded replay vs exact SWA", f"{r['bounded_loss']:.4f}", f"{r['exact_loss']:.4f}",
                      f"{r['relative_percent']:+.3f} %")  # fmt: skip
    for label, d in (figures.get("dspark") or {}).items():
        chat = d["per_kind"]["chat"]["mean_accepted_length"]
        row = f"DSpark {label}: tokens/s (accepted length {d['mean_accepted_length']:.2f}, chat {chat:.2f})"
        table.add_row(row, f"{d['dspark_tokens_per_s']:.1f}", f"{d['plain_tokens_per_s']:.1f}", f"{d['speedup']:.2f}×")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--seed", type=int, default=0, help="the training seed (held-out data derives from it)")
    parser.add_argument("--prompts", type=int, default=200, help="held-out requests per tool")
    parser.add_argument("--batch", type=int, default=100, help="sequences decoded together")
    parser.add_argument("--max-new", type=int, default=96, help="longest answer")
    parser.add_argument("--replay-conversations", type=int, default=64)
    parser.add_argument("--dspark-prompts", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="figures to measure")
    args = parser.parse_args(argv)
    if not (args.checkpoint / "config.json").exists():
        parser.error(f"{args.checkpoint} is not a checkpoint directory (no config.json)")
    figures = evaluate(args)
    sys.stdout.write(json.dumps(figures, indent=2, default=float) + "\n")
    Console(stderr=True).print(summary(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
