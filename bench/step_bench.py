"""The whole decode step as served against its peers, side by side in one process: the `small` preset's step replayed
from its CUDA graph (`DecodeBatch.decode_step` on a GPU), the same step run eagerly, and a dense-attention model of
the same size (bench/kernels.py `dense_decode_step`) captured as a CUDA graph the same way; and the bytes floor. With
`--plain-launches`, also the served step's graph captured without programmatic dependent launches
(model.kernels.launch): every kernel starting only once its predecessor has ended.

    python bench/step_bench.py [--batches 1,64,256] [--contexts 4096,131072,1048576] [--rounds 5] [--steps 10]
        [--profile-steps 5] [--sources] [--no-dense] [--plain-launches] [--out bench/out/step_bench.json]

Caches are synthesised at the context (bench/kernels.py `filled_decode_batch`). Per (batch, context), every round
times `steps` consecutive steps of each side (synchronised before and after; sides in a rotating order); the table
gives the median ms per step over the rounds and the spread (min–max). The floor is the bytes a step must read
(weights touched, window and selected entries, scored keys: bench/native_bench.py) ÷ 4.28 TB/s. The profile rows
count the CUDA kernels of one step and the share of its wall time the GPU spent in kernels (torch.profiler over
`profile-steps` steps) for the graphs and the eager step at the first context (a dependent launch's kernel counts
from its placement, its wait included: the share flatters the graph launched so).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import decode_model, dense_decode_step, filled_decode_batch
from bench.native_bench import HBM_BYTES_PER_S, captured, kv_bytes, touched_bytes
from model import kernels
from model.kernels.launch import plain_launches

Step = Callable[[], object]
ROOT = Path(__file__).resolve().parents[1]


def sides(model, B: int, context: int, steps: int, dense: bool, plain: bool) -> tuple[dict[str, Step], int]:
    """The steps at batch B and `context` tokens (each call of a side runs one step; the dense side if `dense`, the
    graph of plain launches if `plain`), and the weight bytes a step reads (counted on an eager step: module hooks do
    not run in a graph's replay)."""
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (B, 1), device="cuda")
    graph = filled_decode_batch(model, B, context, steps, graphs=True)
    eager = filled_decode_batch(model, B, context, steps, graphs=False)
    plainly = filled_decode_batch(model, B, context, steps, graphs=True) if plain else None
    runs: dict[str, Step] = {"graph": lambda: graph.decode_step(tokens), "eager": lambda: eager.decode_step(tokens)}
    if plainly is not None:
        runs["plain graph"] = functools.partial(_plain_step, plainly, tokens)
    if dense:  # B × context bf16 latents: 64 GiB at 64 × 1 M
        history = torch.randint(0, vocab, (B, model.ngram.history_len), device="cuda")
        kv = torch.randn(B, context, model.args.head_dim, device="cuda", dtype=model.dtype)
        runs["dense graph"] = captured(lambda: dense_decode_step(model, tokens, context, history, kv))
    return runs, touched_bytes(model, lambda: eager.decode_step(tokens))


def _plain_step(batch, tokens: torch.Tensor) -> object:
    """A step whose graph, captured on its first call, launches its kernels plainly."""
    with plain_launches():
        return batch.decode_step(tokens)


def ms_per_step(fn: Step, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def kernel_profile(fn: Step, steps: int) -> dict[str, float]:
    """CUDA kernels per step, the GPU's busy share of the wall time and the kernels taking most of it (µs per
    step, by name), over `steps` steps."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name]
    busy_us = sum(e.device_time for e in kernels)
    names = Counter(e.name[:80] for e in kernels).most_common(30)
    times: Counter[str] = Counter()
    for e in kernels:
        times[e.name[:80]] += e.device_time
    return {
        "kernels_per_step": len(kernels) / steps, "gpu_busy": busy_us / wall_us, "wall_ms": wall_us / 1e3 / steps,
        "top_kernels": [(name, count / steps) for name, count in names],
        "top_kernel_us": [(name, round(us / steps, 1)) for name, us in times.most_common(30)],
    }  # fmt: skip


def kernel_sources(fn: Step, steps: int, top: int = 100) -> list[tuple[str, float]]:
    """CUDA kernels per step by the lines of this repository that launched them (the two innermost frames of this
    repository in the launching op's Python stack; eager steps only: a graph's replay has no stack)."""
    torch.cuda.synchronize()
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)  # FunctionEvent.stack is empty without it
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, experimental_config=stacks
    ) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    sources: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels:
            continue
        where = " < ".join([frame for frame in map(_repository_frame, event.stack) if frame][:2]) or "(outside)"
        sources[f"{where} {event.name}"] += sum("emcpy" not in k.name for k in event.kernels)
    return [(where, count / steps) for where, count in sources.most_common(top)]


@functools.cache
def _repository_frame(frame: str) -> str:
    """A profiler stack frame ("file(line): function") if the file is this repository's own, else "". The profiler
    names a file relative to the sys.path entry it was imported from ("model/cache.py", "torch/functional.py"), or
    absolute where none holds it."""
    file = Path(frame.partition("(")[0])
    try:
        relative = file.resolve().relative_to(ROOT) if file.is_absolute() else file
    except (OSError, ValueError):
        return ""
    ours = relative.parts[:1] != (".venv",) and (ROOT / relative).is_file()
    return f"{relative}({frame.partition('(')[2]}" if ours else ""


def measure(model, B: int, context: int, ns: argparse.Namespace, profiled: bool) -> dict:
    room = ns.rounds * ns.steps + 4 * ns.profile_steps + 8
    steps, weights = sides(model, B, context, room, ns.dense, ns.plain_launches)
    for fn in steps.values():  # warm: captures, compiles
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(ns.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(ms_per_step(steps[name], ns.steps))
    floor_ms = (weights + kv_bytes(model.args, B, context)) / HBM_BYTES_PER_S * 1e3
    row: dict = {"batch": B, "context": context, "floor_ms": round(floor_ms, 3)}
    for name, ms in times.items():
        row[name] = {"median_ms": round(statistics.median(ms), 3), "spread_ms": [round(min(ms), 3), round(max(ms), 3)]}
    if profiled:
        for name in ("graph", "plain graph", "eager"):
            if name in steps:
                row[name] |= kernel_profile(steps[name], ns.profile_steps)
        if ns.sources:
            row["eager"]["kernel_sources"] = kernel_sources(steps["eager"], ns.profile_steps)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| B | context | graph ms | plain graph ms | eager ms | dense graph ms | floor ms | graph × floor"
        " | graph vs dense | kernels / step (graph, eager) | GPU busy (graph, plain graph, eager) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, e, d, plain = r["graph"], r["eager"], r.get("dense graph"), r.get("plain graph")
        cell = lambda s: f"{s['median_ms']:.2f} ({s['spread_ms'][0]:.2f}–{s['spread_ms'][1]:.2f})" if s else "–"  # noqa: E731
        versus = f"{d['median_ms'] / g['median_ms']:.2f}×" if d else "–"
        kernels = f"{g['kernels_per_step']:.0f}, {e['kernels_per_step']:.0f}" if "kernels_per_step" in g else ""
        busy = ", ".join(f"{s['gpu_busy']:.0%}" for s in (g, plain, e) if s and "gpu_busy" in s)
        lines.append(
            f"| {r['batch']} | {r['context']:,} | {cell(g)} | {cell(plain)} | {cell(e)} | {cell(d)} | "
            f"{r['floor_ms']:.3f} | "
            f"{g['median_ms'] / r['floor_ms']:.1f} | {versus} | {kernels} | {busy} |"
        )
    return "\n".join(lines)


def add_batch_invariant(parser: argparse.ArgumentParser, default: bool) -> None:
    """The benches' `--batch-invariant` / `--no-batch-invariant` (set it with `kernels.set_batch_invariant` before the
    first forward: it is process-wide)."""
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=default,
        help="batch-invariant numerics on a GPU (model.kernels.invariance), as the decode service's default is",
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="4096,131072,1048576")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=5, help="0: no profile rows")
    p.add_argument("--out", type=Path, default=Path("bench/out/step_bench.json"))
    p.add_argument("--sources", action="store_true", help="profile rows: the eager step's kernels by launching line")
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True, help="time the dense peer too")
    p.add_argument("--plain-launches", action="store_true", help="time the graph without dependent launches too")
    add_batch_invariant(p, default=False)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_bench needs a CUDA device (it compares CUDA graphs)")
    kernels.set_batch_invariant(ns.batch_invariant)
    contexts = [int(c) for c in ns.contexts.split(",")]
    model = decode_model(False, max(contexts))
    rows = []
    for B in (int(b) for b in ns.batches.split(",")):
        for context in contexts:
            try:
                with torch.no_grad():
                    rows.append(
                        measure(model, B, context, ns, profiled=ns.profile_steps > 0 and context == contexts[0])
                    )
            except torch.OutOfMemoryError as error:
                print(f"B={B} ctx={context}: out of memory ({error})"[:300], flush=True)
            finally:
                torch.cuda.empty_cache()
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
