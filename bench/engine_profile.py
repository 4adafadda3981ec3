"""Where a served decode step's time goes: the engine's whole iteration against the captured graph it replays.

    python bench/engine_profile.py [--model model/checkpoints/v41-demo] [--batches 1,24] [--steps 40]
        [--speculation off|measured|full] [--no-batch-invariant] [--out bench/out/engine_profile.json]

One engine (decode_svc.engine.Engine, no thread, no gRPC) on the model takes B held-out prompts (train.eval) with a
budget no step reaches, prefills them itself and then iterates, as its thread would; per batch it reports:
- `iterate ms`: the engine's whole iteration (step, sampling, delivery, the loop's bookkeeping), median and spread;
- `replay ms`: the plain step's decode graph replayed alone on the same batch (`graphs.decode`), synchronised —
  what the GPU needs; the difference is the host's;
- the profiled iterations: CUDA kernels per iteration, the GPU's busy share of the wall time and the kernels taking
  most of it;
- `phases`: where an iteration's GPU time goes, phase by phase — CUDA events recorded on the stream as the iteration
  starts and as each of the batch's calls returns (`decode_step`: plain; `dspark_draft`, `verify_forward`, `accept`),
  so the interval ending at a phase's event holds its kernels and any time the GPU waited for the host to launch
  them, and `between` the time from the last phase's event to the next iteration's start (the host's delivery and
  planning, the GPU idle); medians per iteration;
- the host's hottest functions over the timed iterations (cProfile, by own and by cumulative time), which name
  what to cut.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import pstats
import statistics
import sys
import time
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import structlog
import torch
from prometheus_client import CollectorRegistry
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from step_bench import add_batch_invariant, kernel_profile  # noqa: E402

from decode_svc.engine import Engine, EngineSettings  # noqa: E402
from decode_svc.metrics import DecodeMetrics  # noqa: E402
from decode_svc.sequence import Outbox, Params, Prompt, Sampling, Sequence, State  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model import kernels  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from train.eval import chat_prompts  # noqa: E402

console = Console(stderr=True)
GREEDY = Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)


def new_engine(model: Any, batch: int, speculation: str, max_draft: int = 4) -> Engine:
    """An engine of `batch` rows; speculation "off", or DSpark under the "measured" or "full" draft policy."""
    settings = EngineSettings(
        max_batch=batch,
        max_queue=batch,
        speculation=speculation != "off",
        max_draft=max_draft,
        draft_policy="full" if speculation == "full" else "measured",
        chunk_size=512,
    )
    log = structlog.wrap_logger(structlog.PrintLogger(sys.stderr), processors=[structlog.processors.JSONRenderer()])
    engine = Engine(model, settings, DecodeMetrics(CollectorRegistry()), log, lambda *a: None)
    if not engine.warm_up():
        raise SystemExit(engine.start_error)
    return engine


def running(
    engine: Engine, prompts: list[list[int]], loop: asyncio.AbstractEventLoop, limit: int, sampling: Sampling = GREEDY
) -> list[Sequence]:
    """Submit the prompts and iterate until every one decodes."""
    seqs = []
    for ids in prompts:
        params = Params(uuid.uuid4().hex, sampling, frozenset(), limit, False, 0, True, b"")
        seq = Sequence(params, Outbox(loop), Prompt(ids, local_prefill="token_ids"), limit=limit)
        engine.register(seq)
        engine.submit(seq)
        seqs.append(seq)
    while any(seq.state is not State.RUNNING for seq in seqs):
        engine.iterate()
    return seqs


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def spread(ms: list[float]) -> dict[str, Any]:
    return {"median_ms": round(statistics.median(ms), 3), "spread_ms": [round(min(ms), 3), round(max(ms), 3)]}


PHASES = {"decode_step": "plain", "dspark_draft": "draft", "verify_forward": "verify", "accept": "accept"}


def phases(engine: Engine, lane: Any, steps: int) -> dict[str, float]:
    """Median GPU ms per iteration of each phase and of the gap between iterations (module docstring): the lane's
    batch calls wrapped, on the instance, to record an event as each returns."""
    marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    def marking(call: Any, name: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            mark(name)
            return out

        return run

    for method, name in PHASES.items():
        setattr(lane, method, marking(getattr(lane, method), name))
    try:
        for _ in range(steps):
            mark("start")
            engine.iterate()
        mark("start")
        torch.cuda.synchronize()
    finally:
        for method in PHASES:
            delattr(lane, method)
    per_step: list[dict[str, float]] = []
    for (before, a), (name, b) in itertools.pairwise(marks):
        if before == "start":
            per_step.append({})
        label = "between" if name == "start" else name
        per_step[-1][label] = per_step[-1].get(label, 0.0) + a.elapsed_time(b)
    labels = sorted({label for step in per_step for label in step})
    return {label: round(statistics.median(step.get(label, 0.0) for step in per_step), 3) for label in labels}


def hottest(engine: Engine, steps: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.iterate()
    torch.cuda.synchronize()
    prof.disable()
    text = StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
    return text.getvalue()


def measure(model: Any, batch: int, steps: int, speculation: str, top: int) -> dict[str, Any]:
    engine = new_engine(model, batch, speculation)
    loop = asyncio.new_event_loop()
    prompts = chat_prompts(0, batch)
    running(engine, prompts, loop, limit=20 * steps + 64)
    for _ in range(5):  # warm
        engine.iterate()
    iterate = timed(engine.iterate, steps)
    profiled = kernel_profile(engine.iterate, 5)
    lane = next(b for b in engine.batches.values() if len(b))
    found = {"batch": batch, "iterate": spread(iterate), **profiled, "phases": phases(engine, lane, steps)}
    found["hottest"] = hottest(engine, steps, top)
    tokens = torch.zeros(batch, 1, dtype=torch.long)  # on the host, as the engine gives them (the Engram look-back)
    # Last: the replayed graph's rows advance past what the engine knows.
    found["replay"] = spread(timed(lambda: lane.graphs.decode(tokens), steps))
    loop.close()
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batches", default="1,24")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--speculation",
        choices=("off", "measured", "full"),
        default="off",
        help="plain steps, or DSpark's lane under the measured or full (every step drafts) policy",
    )
    p.add_argument("--top", type=int, default=30, help="functions listed from the host profile")
    add_batch_invariant(p, default=True)
    p.add_argument("--out", type=Path, default=ROOT / "bench/out/engine_profile.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_profile times CUDA graphs: run it on a GPU")
    kernels.set_batch_invariant(args.batch_invariant)  # process-wide, before the first GEMM
    model = load_model(args.model, "full", device="cuda")
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        found = measure(model, batch, args.steps, args.speculation, args.top)
        console.print(f"B={batch}: iterate {found['iterate']} replay {found['replay']} "
                      f"kernels/iterate {found['kernels_per_step']:.0f} busy {found['gpu_busy']:.0%}")  # fmt: skip
        console.print(f"GPU ms per iteration by phase: {found['phases']}")
        console.print(
            "kernels by time (µs per iteration): "
            + ", ".join(f"{name} {us}" for name, us in found["top_kernel_us"][:12])
        )
        console.print(found["hottest"])
        results.append(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    found = {"model": args.model, "speculation": args.speculation, "batch_invariant": args.batch_invariant}
    args.out.write_text(json.dumps({**found, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
