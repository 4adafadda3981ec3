"""DSpark's draft policy run live on this CPU against a GPU's step times: the decode engine's own speculative lane,
its scheduler believing one table of step times while a virtual clock charges another.

    python bench/policy_live.py --times bench/out/decode.json[:REPLICA] [--clock bench/out/decode.json[:REPLICA]]
        [--plain-ms MS] [--policies measured,full] [--samplings greedy,t1,t1-seeded] [--repeats 3] [--max-tokens 96]
        [--model model/checkpoints/v41-demo] [--out bench/out/policy_live.json]

`bench/policy_replay.py` replays the scheduler alone over recorded greedy outcomes, each prompt with a fresh scheduler;
what happens to a replica whose scheduler state (trust, the replica's calibration, the probe's wait) carries from run to
run, through the engine's own code path (ahead verifies, caps, sampled rows), it cannot show. Here one engine per policy
(decode_svc.engine.Engine on the CPU, no thread, no gRPC, batch 1) decodes the decode bench's batch-1 runs in its order
— the first held-out prompt, `--max-tokens`, each sampling in turn, `--repeats` times —; its step-time table holds a
decode bench JSON's `step_times` of `--times` (default the `measured` replica's: what its scheduler last read on that
machine) and never learns from this CPU's forwards, and every forward the engine runs is charged on a virtual clock at
`--clock`'s seconds (default the `full` replica's table, whose every verify was queued behind its draft as the engine's
verify-ahead steps are), a plain step at `--plain-ms` (default the `off` replica's mean batch-1 engine step in
`--times`'s JSON: `full` seldom steps plain, its table's plain seconds are its start-up profile's). Reported per run:
the speed over plain decoding on that clock (tokens per clock second against 1 / plain(1)), the share of the steps that
drafted, the scheduler's trust after the run.
What it leaves out: the host's work between the forwards, a table that drifts, other rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_profile import new_engine, running  # noqa: E402
from policy_replay import load_times, step_times  # noqa: E402
from serve_bench import machine  # noqa: E402

from decode_svc.engine import Engine  # noqa: E402
from decode_svc.scheduler import DraftScheduler  # noqa: E402
from decode_svc.sequence import Sampling, State  # noqa: E402
from decode_svc.step_times import Forward, StepTimes  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from train.eval import chat_prompts  # noqa: E402

SAMPLINGS = {
    "greedy": Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=None),
    "t1": Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None),
    "t1-seeded": Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=1234),
}
POLICIES = ("measured", "full")
console = Console(width=120)


class Believed(StepTimes):
    """A fixed table the scheduler reads, and a virtual clock that each forward the engine times advances by its
    seconds on the clock's table (this CPU's own seconds are not counted)."""

    def __init__(self, believed: StepTimes, clock: StepTimes) -> None:
        super().__init__()
        for forward in Forward:
            for tokens, seconds in believed.known(forward).items():
                super().observe(forward, tokens, seconds)
        self.clock_table, self.clock = clock, 0.0

    def observe(self, forward: Forward, tokens: int, seconds: float) -> None:
        self.clock += self.clock_table.seconds(forward, tokens)


def drafted_steps(engine: Engine) -> float:
    """The speculative lane's steps that drafted so far (plan draft or probe), from the engine's metrics."""
    samples = (sample for metric in engine.metrics.draft_steps.collect() for sample in metric.samples)
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["plan"] in ("draft", "probe"))


def decode(
    engine: Engine, prompt: list[int], sampling: Sampling, limit: int, loop: asyncio.AbstractEventLoop
) -> tuple[int, int]:
    """Decode one request to its end → (its output tokens after the first, which the prefill emits; the steps)."""
    (seq,) = running(engine, [prompt], loop, limit, sampling)
    steps = 0
    while seq.state is State.RUNNING:
        engine.iterate()
        steps += 1
    return len(seq.output) - 1, steps


def run_policy(model: Any, policy: str, believed: StepTimes, clock: StepTimes, args: argparse.Namespace) -> list[dict]:
    times = Believed(believed, clock)
    engine = new_engine(model, 1, policy, model.args.dspark_block_size)
    engine.times, engine.scheduler = times, DraftScheduler(times, full=policy == "full")
    prompt, plain = chat_prompts(0, 1)[0], clock.seconds(Forward.PLAIN, 1)
    loop, runs = asyncio.new_event_loop(), []
    for repeat in range(args.repeats):
        for name in args.samplings.split(","):
            started, drafted = times.clock, drafted_steps(engine)
            tokens, steps = decode(engine, prompt, SAMPLINGS[name], args.max_tokens, loop)
            share = (drafted_steps(engine) - drafted) / steps
            runs.append({"policy": policy, "repeat": repeat, "sampling": name, "tokens": tokens, "steps": steps,
                         "speed": tokens * plain / (times.clock - started), "drafted": share,
                         "trust": engine.scheduler.trust(1, SAMPLINGS[name].greedy)})  # fmt: skip
            console.print(runs[-1])
    loop.close()
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", required=True, help="a decode bench JSON[:replica]: the table the scheduler reads")
    parser.add_argument("--clock", help="a decode bench JSON[:replica]: the seconds charged (default: --times's full)")
    parser.add_argument("--plain-ms", type=float, help="a plain step's ms on the clock (default: the JSON's off's)")
    parser.add_argument("--policies", default="measured,full")
    parser.add_argument("--samplings", default="greedy,t1,t1-seeded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/policy_live.json")
    args = parser.parse_args()
    times_spec = args.times if ":" in args.times else f"{args.times}:measured"
    clock_spec = args.clock or f"{times_spec.partition(':')[0]}:full"
    believed_name, believed = load_times(times_spec)
    clock_name, clock = load_times(clock_spec)
    clock = {**clock, Forward.PLAIN.value: {"1": args.plain_ms or off_step_ms(times_spec.partition(":")[0])}}
    for option, given, known in (("samplings", args.samplings, SAMPLINGS), ("policies", args.policies, POLICIES)):
        if unknown := set(given.split(",")) - set(known):
            parser.error(f"unknown {option} {sorted(unknown)} (known: {', '.join(known)})")
    model = load_model(args.model, "full", device="cpu")
    runs = [
        r for p in args.policies.split(",") for r in run_policy(model, p, step_times(believed), step_times(clock), args)
    ]
    show(runs, f"scheduler reads {times_spec}, clock {clock_spec}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "believed": believed,
              "clock": clock, "believed_replica": believed_name, "clock_replica": clock_name, "runs": runs}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


def off_step_ms(path: str) -> float:
    """The decode bench's `off` replica's mean engine step at batch 1, greedy (its results)."""
    found = json.loads(Path(path).read_text())["results"].get("off/b1/greedy")
    if found is None:
        raise SystemExit(f"{path} has no off/b1/greedy result: give --plain-ms")
    return found["engine_step_ms"]


def show(runs: list[dict], title: str) -> None:
    table = Table(title=f"batch 1, {title}: speed over plain decoding on the clock")
    for column in ("policy", "repeat", "sampling", "steps", "speed", "drafted", "trust after"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(r["policy"], str(r["repeat"]), r["sampling"], str(r["steps"]), f"{r['speed']:.2f}×",
                      f"{r['drafted']:.0%}", f"{r['trust']:.2f}")  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
