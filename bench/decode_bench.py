"""Decode speed with DSpark speculation — DSpark's scheduler (`measured`), every draft verified (`full`) — against the
peer, speculation off, side by side in one run.

    OMP_NUM_THREADS=1 python bench/decode_bench.py [--model model/checkpoints/v41-demo] [--batches 1,8]
        [--samplings greedy,t1,t1-seeded] [--replicas off,measured,full] [--max-tokens 48] [--repeats 3]
        [--out bench/out/decode_bench.json]

Up to three decode replicas in this process (decode_svc.server.DecodeServer, no cache, real gRPC on loopback) share one
loaded model: `off` (--no-speculation), `measured` and `full` (--draft-policy); `--replicas` picks them (`off`, the
peer, always). Each logs its start-up time (on a GPU: its step graphs captured). Each run sends B prompts at once
(held-out conversations of the demo checkpoint's training data, cut before their last answer: train.eval) as token-id
Generate streams with `max_tokens` and no stop token, so every row decodes the whole budget; the streams run from a
process of their own (stream_client.py), as the gateway's do, so that receiving them takes no GIL from the engine.
Decode tokens/s of a run = every stream's tokens after its first / the time from the first stream's first token to the
last stream's end (the batch's throughput; the engine joins the prompts over its first iterations, alike on every
replica), and a user's: the median stream's tokens after its first over their time. Runs interleave: each repeat runs
every (batch, sampling) on every replica in turn, in a rotating order, so a machine whose load changes (other jobs on a
shared host) weighs on them alike; the table gives the medians. Samplings: greedy; T = 1 (speculative sampling from each
row's own generator); T = 1 with a seed per row (decode_svc.sampler: tokens fixed per output position, so every replica
must emit the same tokens).

Reported per (replica, batch, sampling): median decode tokens/s (the batch's and a user's) and the batch's ratio to
`off`, mean accepted length per verify (accepted drafts + 1, over the rows a drafted step verified), the share of the
speculative lane's steps that drafted (plan draft or probe), the share of the outputs' tokens past each row's first
end of sequence (a tail that loops, which drafts predict better than answers: read the accepted length beside it;
a run that never ends an answer is suspect), the engine's mean step (its `step_seconds` metric: forward,
sampling and the step's read back) and that time's share of the run's clock (the rest passes between steps: delivering
tokens, the engine's loop, waits for the GIL, which the engine shares with the replicas' event loop), and whether greedy
and seeded outputs equal `off`'s. Then, per speculative replica, what its drafted steps are made of: its plain, draft
and verify forwards' seconds by token count, as its scheduler last read them (each timed to its read-back). The JSON's
runs carry, per run, the scheduler's trust for the run's batch and its forwards' seconds at that batch after the run:
how a replica's drafting evolves from run to run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_bench import machine  # noqa: E402
from step_bench import add_batch_invariant  # noqa: E402
from stream_client import Batch, StreamClient  # noqa: E402

from decode_svc.config import DecodeConfig  # noqa: E402
from decode_svc.sequence import Lane  # noqa: E402
from decode_svc.server import DecodeServer  # noqa: E402
from decode_svc.step_times import Forward  # noqa: E402
from mesh.logging import configure_logging  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model import kernels  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from train.eval import chat_prompts  # noqa: E402

REPLICAS: dict[str, dict[str, Any]] = {
    "off": {"speculation": False},
    "measured": {"draft_policy": "measured"},
    "full": {"draft_policy": "full"},
}
PEER = "off"
SAMPLINGS = {"greedy": (0.0, False), "t1": (1.0, False), "t1-seeded": (1.0, True)}
PLANS = ("plain", "draft", "probe")
console = Console(width=160)


@dataclass
class Run:
    replica: str
    batch: int
    sampling: str
    repeat: int
    tokens: int  # decoded: every stream's tokens after its first
    seconds: float  # from the first stream's first token to the last stream's end
    row_rate: float  # the median stream's decode tokens/s (its tokens after the first over their time)
    accepted: float  # drafts accepted, over the run
    row_steps: float  # rows of drafted steps that verified
    plans: dict[str, float]
    outputs: list[list[int]]
    steps: float  # engine steps of the run
    step_seconds: float  # their summed time: forward, sampling and the step's reads back (the engine's clock)
    trust: float | None  # the scheduler's trust in its forecasts for the run's batch bucket, after the run
    forwards_ms: dict[str, list[float | None]]  # ms as the scheduler read them after the run (`scheduler_state`)

    @property
    def step_ms(self) -> float:
        return self.step_seconds / self.steps * 1e3

    @property
    def engine_share(self) -> float:
        """The engine's step time over the run's clock: the rest passes between two steps."""
        return self.step_seconds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class Replicas:
    """The decode replicas, serving on a background event loop; `generate` runs one batch of streams on one."""

    def __init__(self, model_spec: str, device: str, max_batch: int, names: list[str]) -> None:
        self.model = load_model(model_spec, "full", device=device)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers: dict[str, DecodeServer] = {}
        self.client = StreamClient()
        for name in names:
            cfg = DecodeConfig(
                model=model_spec, port=0, metrics_port=0, max_batch=max_batch, log_level="warning", **REPLICAS[name]
            )
            started = time.perf_counter()
            server = self.servers[name] = DecodeServer(cfg, model=self.model)
            self._call(server.start())  # its start-up captures and profile: alone on the GPU, before the next's
            console.log(f"replica {name} started (graphs captured, step times profiled) in "
                        f"{time.perf_counter() - started:.1f} s")  # fmt: skip

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def counters(self, name: str) -> dict[str, float]:
        registry = self.servers[name].registry

        def value(metric: str, **labels: str) -> float:
            return registry.get_sample_value(f"v41mesh_decode_{metric}", labels) or 0.0

        found = {f"plan_{p}": value("draft_steps_total", plan=p) for p in PLANS}
        found["accepted"] = value("draft_accepted_tokens_total")
        found["row_steps"] = value("speculative_row_steps_total")
        found["steps"] = sum(value("step_seconds_count", lane=lane.value) for lane in Lane)
        found["step_seconds"] = sum(value("step_seconds_sum", lane=lane.value) for lane in Lane)
        return found

    def generate(self, name: str, prompts: list[list[int]], sampling: str, max_tokens: int, repeat: int) -> Run:
        temperature, seeded = SAMPLINGS[sampling]
        seeds = [1000 + i if seeded else None for i in range(len(prompts))]
        before = self.counters(name)
        streams = self.client.run(self.servers[name].port, Batch(prompts, temperature, seeds, max_tokens))
        after = self.counters(name)
        delta = {k: after[k] - before[k] for k in after}
        ends = [s[-1][0] for s in streams.stamps]
        decoded = [sum(n for at, n in s if at > first) for s, first in zip(streams.stamps, streams.first, strict=True)]
        row_rates = [n / (end - first) for n, end, first in zip(decoded, ends, streams.first, strict=True) if n]
        plans = {p: delta[f"plan_{p}"] for p in PLANS}
        trust, forwards = self.scheduler_state(name, len(prompts), temperature == 0)
        return Run(name, len(prompts), sampling, repeat, sum(decoded), max(ends) - min(streams.first),
                   statistics.median(row_rates), delta["accepted"], delta["row_steps"], plans, streams.outputs,
                   delta["steps"], delta["step_seconds"], trust, forwards)  # fmt: skip

    def scheduler_state(self, name: str, rows: int, greedy: bool) -> tuple[float | None, dict[str, list[float | None]]]:
        """What the replica's DSpark scheduler holds for a batch of `rows` rows, greedy or sampled: its trust (None:
        speculation off) and its forwards' ms at that batch (each read as the scheduler reads it, None where never
        measured)."""
        engine = self.servers[name].engine
        if not engine.settings.speculation:
            return None, {}
        times, widths = engine.times, range(1, engine.max_draft + 1)
        sizes = {Forward.PLAIN: [rows], Forward.DRAFT: [rows], Forward.VERIFY: [rows * (1 + w) for w in widths]}
        forwards = {
            f.value: [round(times.seconds(f, n) * 1e3, 3) if times.measured(f) else None for n in ns]
            for f, ns in sizes.items()
        }
        return round(engine.scheduler.trust(rows, greedy), 3), forwards

    def step_times(self, name: str) -> dict[str, dict[int, float]]:
        """The replica's forwards as its DSpark scheduler reads them, ms by tokens: the medians of its latest steps
        (step_times.StepTimes; empty for a forward it never timed)."""
        times = self.servers[name].engine.times
        return {f.value: {n: round(s * 1e3, 3) for n, s in times.known(f).items()} for f in Forward}

    def stop(self) -> None:
        self.client.close()
        for server in self.servers.values():
            self._call(server.stop(5))
        self.loop.call_soon_threadsafe(self.loop.stop)


def past_end(outputs: list[list[int]], eos: int) -> float:
    """The share of the outputs' tokens that follow their row's first end of sequence (decoded only because the bench
    sets no stop: such a tail tends to loop, which drafts predict better than an answer)."""
    after = sum(len(out) - 1 - out.index(eos) for out in outputs if eos in out)
    return after / max(1, sum(len(out) for out in outputs))


def summarise(runs: list[Run], eos: int) -> dict[str, dict[str, Any]]:
    """Per (replica, batch, sampling): median tokens/s, its ratio to the peer's, accepted length, drafted share, the
    share of tokens decoded past an end of sequence, and whether its outputs equal the peer's in the same repeat."""
    groups: dict[tuple[str, int, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.replica, run.batch, run.sampling].append(run)
    peer_outputs = {(r.batch, r.sampling, r.repeat): r.outputs for r in runs if r.replica == PEER}
    summary: dict[str, dict[str, Any]] = {}
    for (replica, batch, sampling), group in groups.items():
        rate = statistics.median(r.tokens_per_s for r in group)
        peer = statistics.median(r.tokens_per_s for r in groups[PEER, batch, sampling])
        row_steps = sum(r.row_steps for r in group)
        steps = sum(sum(r.plans.values()) for r in group)
        drafted = sum(r.plans["draft"] + r.plans["probe"] for r in group)
        summary[f"{replica}/b{batch}/{sampling}"] = {
            "replica": replica,
            "batch": batch,
            "sampling": sampling,
            "tokens_per_s_median": rate,
            "tokens_per_s": [r.tokens_per_s for r in group],
            "row_tokens_per_s_median": statistics.median(r.row_rate for r in group),
            "vs_off": rate / peer,
            "mean_accepted_length": (sum(r.accepted for r in group) + row_steps) / row_steps if row_steps else None,
            "drafted_share": drafted / steps if steps else None,
            "past_eos_share": past_end([out for r in group for out in r.outputs], eos),
            "plans": {p: sum(r.plans[p] for r in group) for p in PLANS},
            "engine_step_ms": statistics.median(r.step_ms for r in group),
            "engine_share": statistics.median(r.engine_share for r in group),
            "same_tokens_as_off": all(r.outputs == peer_outputs[r.batch, r.sampling, r.repeat] for r in group),
        }
    return summary


def show(summary: dict[str, dict[str, Any]]) -> None:
    table = Table(title=f"decode tokens/s: DSpark vs speculation off (median of the repeats; peer = {PEER})")
    columns = ("batch", "sampling", "replica", "tok/s", "user tok/s", "vs off", "accepted length", "drafted steps",
               "past EOS", "engine ms / step", "engine share", "= off")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for s in sorted(summary.values(), key=lambda s: (s["batch"], list(SAMPLINGS).index(s["sampling"]), s["replica"])):
        length, share = s["mean_accepted_length"], s["drafted_share"]
        table.add_row(str(s["batch"]), s["sampling"], s["replica"], f"{s['tokens_per_s_median']:.2f}",
                      f"{s['row_tokens_per_s_median']:.2f}", f"{s['vs_off']:.2f}×",
                      "–" if length is None else f"{length:.2f}",
                      "–" if share is None else f"{share:.0%}", f"{s['past_eos_share']:.0%}",
                      f"{s['engine_step_ms']:.2f}",
                      f"{s['engine_share']:.0%}",
                      "–" if s["sampling"] == "t1" else ("yes" if s["same_tokens_as_off"] else "no"))  # fmt: skip
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="tiny, small or a checkpoint directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--samplings", default=",".join(SAMPLINGS))
    parser.add_argument("--replicas", default=",".join(REPLICAS), help=f"of {', '.join(REPLICAS)}; {PEER} is the peer")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-seed", type=int, default=0, help="which held-out conversations (train.eval)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_batch_invariant(parser, default=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/decode_bench.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    samplings = [s for s in args.samplings.split(",") if s]
    unknown = [s for s in samplings if s not in SAMPLINGS]
    if unknown or min(batches) < 1:
        parser.error(f"batches must be ≥ 1; samplings one of {', '.join(SAMPLINGS)} (got {unknown})")
    order = [r for r in args.replicas.split(",") if r]
    if PEER not in order or any(r not in REPLICAS for r in order):
        parser.error(f"replicas: some of {', '.join(REPLICAS)}, {PEER} among them (got {args.replicas})")
    torch.set_num_threads(args.threads)
    kernels.set_batch_invariant(args.batch_invariant and torch.cuda.is_available())
    configure_logging("decode_bench", level="warning")

    prompts = chat_prompts(args.prompt_seed, max(batches))
    console.print(f"model {args.model}; prompts of {[len(p) for p in prompts]} tokens; max_tokens {args.max_tokens}")
    replicas = Replicas(args.model, args.device, max(batches), order)
    runs: list[Run] = []
    try:
        for name in order:  # first calls pay one-off costs (allocations, lazy initialisation): not measured
            for sampling in samplings:  # each sampling path pays its own first-call costs
                replicas.generate(name, prompts, sampling, 4, -1)
        work = [(r, b, s) for r in range(args.repeats) for b in batches for s in samplings]
        for i, (repeat, batch, sampling) in enumerate(tqdm(work, desc="runs")):
            for name in order[i % len(order) :] + order[: i % len(order)]:  # rotate who goes first
                runs.append(replicas.generate(name, prompts[:batch], sampling, args.max_tokens, repeat))
        times = {name: replicas.step_times(name) for name in order if name != PEER}
    finally:
        replicas.stop()
    summary = summarise(runs, replicas.model.args.eos_token_id)
    show(summary)
    for name, forwards in times.items():  # what a drafted step is made of, on this machine
        console.print(f"{name}: ms by tokens, the scheduler's latest medians: {forwards}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "results": summary,
              "step_times": times,
              "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} | {"tokens_per_s": r.tokens_per_s}
                       for r in runs]}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
