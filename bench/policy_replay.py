"""DSpark's draft policy replayed offline: the speculative lane at batch 1 over recorded acceptance traces, with a
machine's step times, against verifying every draft and against plain decoding.

    python bench/policy_replay.py --times bench/out/decode.json[:REPLICA] [--model model/checkpoints/v41-demo]
        [--prompts 8] [--max-tokens 96] [--traces bench/out/policy_traces.json] [--out bench/out/policy_replay.json]

Recording (here, greedy, once: `--traces` keeps them): along each prompt's greedy decoding (the decode bench's
prompts: held-out conversations, train.eval), the draft DSpark makes at every output index — its tokens and
confidences — and how many of its drafts the greedy output then accepts. Greedy output does not depend on the drafts,
so one decoding tells the outcome of a draft at any index, whichever indices a policy drafts at.

Replay: the engine's own scheduler, row record and replica calibration (decode_svc.scheduler, decode_svc.speculation)
step through a trace as the speculative lane of one row does — plan, width on the draft's confidences, outcome —, on
a fixed table of step times: a speculative replica's `step_times` in a decode bench JSON (the medians its scheduler
last read on that machine; `:REPLICA` picks one, default `full`, whose table every drafted step renewed). A plain step
costs plain(1), a drafted step draft(1) + verify(1 + width), or draft(1) + plain(1) where the width is 0 — and
draft(1) + verify(1 + budget), every draft judged, where the engine queues the verify ahead (`DraftScheduler.ahead`;
the row is chained, as a GPU's replayed graphs are). Reported per
prompt: tokens/s of `full` and `measured` over plain decoding, and the share of `measured`'s steps that drafted.
What the replay leaves out: the host's work between the forwards, the table's drift, other rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_bench import machine  # noqa: E402

from decode_svc.scheduler import DraftScheduler, Plan  # noqa: E402
from decode_svc.speculation import Calibration, DraftRecord  # noqa: E402
from decode_svc.step_times import Forward, StepTimes  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model import DecodeBatch, SamplingParams, encode_prefill  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from train.eval import chat_prompts  # noqa: E402

POLICIES = ("off", "full", "measured")
console = Console(width=120)


@dataclass
class Trace:
    """One prompt's greedy decoding: at output index n (1 …), the draft's confidences and its accepted drafts."""

    confidence: list[list[float]]  # [n − 1]: the draft after output token n − 1
    accepted: list[int]


def record(model_spec: str, prompts: int, max_tokens: int) -> list[Trace]:
    model = load_model(model_spec, "full", device="cpu")
    greedy = SamplingParams.uniform(1)
    traces = []
    for prompt in tqdm(chat_prompts(0, prompts), desc="recording", unit="prompt"):
        batch = DecodeBatch(model, 1)
        prefill = encode_prefill(model, prompt)
        _, logits = batch.join(prefill.blocks, prefill.encoder_state)
        out, drafts, confidence = [int(logits.argmax())], [], []
        while len(out) < max_tokens:
            draft = batch.dspark_draft([out[-1]], greedy)
            drafts.append(draft.tokens[0].tolist())
            confidence.append(draft.confidence[0].tolist())
            out.append(int(batch.decode_step([out[-1]])[0].argmax()))
        traces.append(Trace(confidence, [leading_matches(d, out[n:]) for n, d in enumerate(drafts, 1)]))
    return traces


def leading_matches(drafts: list[int], truth: list[int]) -> int:
    """How many drafts equal the tokens the output then has (a draft past its end is not accepted)."""
    truth = truth[: len(drafts)]
    return next((k for k, (d, t) in enumerate(zip(drafts, truth, strict=False)) if d != t), len(truth))


def step_times(table: dict[str, dict[str, float]]) -> StepTimes:
    times = StepTimes()
    for forward in Forward:
        for tokens, ms in table[forward.value].items():
            times.observe(forward, int(tokens), ms / 1e3)
    return times


def replay(trace: Trace, table: dict[str, dict[str, float]], policy: str) -> tuple[float, float]:
    """Decode the trace's tokens under `policy` → (seconds, share of the steps that drafted)."""
    times = step_times(table)
    scheduler = DraftScheduler(times, full=policy == "full")
    calibration = Calibration()
    row = DraftRecord(prior=calibration.ratio)
    plain, draft = times.seconds(Forward.PLAIN, 1), times.seconds(Forward.DRAFT, 1)
    limit, gamma = len(trace.accepted) + 1, len(trace.confidence[0])
    n, seconds, steps, drafted = 1, 0.0, 0, 0
    while n < limit:
        steps += 1
        budget = min(gamma, limit - n - 1)
        if policy == "off" or budget == 0:
            n, seconds = n + 1, seconds + plain
            continue
        if scheduler.plan([row.forecast(gamma, calibration.typical)], [budget], chained=True) is Plan.PLAIN:
            row.waited()
            n, seconds = n + 1, seconds + plain
        else:
            drafted += 1
            ahead = scheduler.ahead(1, budget)  # the verify queued behind the draft, at the widest width
            a = [row.drafted(trace.confidence[n - 1])]
            width = budget if ahead else scheduler.width(a, [budget])
            if width == 0 and not ahead:
                scheduler.realised(1, 1, 0)
                row.waited()
                n, seconds = n + 1, seconds + draft + plain
            else:
                columns = width
                k = min(trace.accepted[n - 1], width)
                scheduler.realised(1, 1 + k, columns)
                calibration.add(k, *row.record(width, k))
                n, seconds = n + k + 1, seconds + draft + times.seconds(Forward.VERIFY, 1 + columns)
        calibration.tick()
    return seconds, drafted / steps


def load_times(spec: str) -> tuple[str, dict[str, dict[str, float]]]:
    path, _, replica = spec.partition(":")
    if not Path(path).is_file():
        raise SystemExit(f"{path}: no such decode bench JSON")
    tables = json.loads(Path(path).read_text())["step_times"]
    replica = replica or "full"
    if replica not in tables or not all(tables[replica].get(f.value) for f in Forward):
        raise SystemExit(f"{path} has no complete step-time table for replica {replica!r} (has {sorted(tables)})")
    return replica, tables[replica]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", required=True, help="a decode bench JSON[:replica]: the step times replayed")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--traces", type=Path, default=ROOT / "bench/out/policy_traces.json")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/policy_replay.json")
    args = parser.parse_args()
    replica, table = load_times(args.times)
    if args.traces.exists():
        traces = [Trace(**t) for t in json.loads(args.traces.read_text())]
    else:
        torch.set_num_threads(4)
        traces = record(args.model, args.prompts, args.max_tokens)
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text(json.dumps([vars(t) for t in traces]) + "\n")
    results = []
    for trace in traces:
        (off, _), (full, _), (measured, share) = (replay(trace, table, p) for p in POLICIES)
        results.append({"full": off / full, "measured": off / measured, "drafted": share,
                        "mean_accepted": statistics.mean(trace.accepted)})  # fmt: skip
    show(results, f"{args.times} ({replica})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "table": table,
              "results": results}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


def show(results: list[dict[str, float]], times: str) -> None:
    table = Table(title=f"batch 1, greedy, step times of {times}: speed over plain decoding")
    for column in ("prompt", "accepted / index", "full", "measured", "measured drafted"):
        table.add_column(column, justify="right")
    for i, r in enumerate(results):
        table.add_row(str(i), f"{r['mean_accepted']:.2f}", f"{r['full']:.2f}×", f"{r['measured']:.2f}×",
                      f"{r['drafted']:.0%}")  # fmt: skip
    mean = {k: statistics.mean(r[k] for r in results) for k in ("full", "measured")}
    table.add_row("mean", "", f"{mean['full']:.2f}×", f"{mean['measured']:.2f}×", "")
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
