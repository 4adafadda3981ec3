"""Kernel launches of one decode step on the GPU's path, counted on the CPU: an estimate of `bench/step_bench.py`'s
CUDA kernels per step without a GPU, and where they come from.

    python bench/launch_count.py [--preset tiny] [--batch 1] [--context 4096] [--step decode|draft|dspark]
        [--temperature 0] [--per-row-generators] [--batch-invariant] [--top 40] [--out F]

The model is the preset with FP8 weights (the `small` preset's quantisation config, as served), its state
synthesised as step_bench's is (bench/kernels.py `filled_decode_batch`), every kernel op on its Triton backend (run by
the interpreter; on a CPU the model would take the torch references). One eager step — a decode step, a DSpark
draft alone, or a DSpark step: the draft and the verify of all its drafts, sampled at `--temperature` from one
generator for the batch (as the decode engine draws) or from one per row; with `--batch-invariant`, the launches
chosen as a served replica chooses them (`model.kernels.invariance`) — is counted three ways:
- Triton launches, by kernel;
- calls of compiled functions (`model.fused`): one to three kernels each on a GPU, the plain torch ops here;
- the remaining torch ops by the line of this repository that issued them (a dispatch mode; views and empty
  allocations excluded, as they launch nothing), and the host reads among them (`.item()` and the like: a sync
  where the tensor is on the device).
Their sum approximates the GPU's count: a compiled call or a cuBLAS GEMV can be two kernels there, a sort three, and
the checks of host-side tensors (the token ids' range) launch none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernels import filled_decode_batch  # noqa: E402
from model import SamplingParams, kernels, preset  # noqa: E402  (sets TRITON_INTERPRET on a CPU, before triton loads)
from model.fused import fused  # noqa: E402
from model.weights import build_model  # noqa: E402

import triton.runtime.interpreter as interpreter  # noqa: E402  isort: skip

NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "promote_types", "_unsafe_view"}
SYNCS = {"_local_scalar_dense", "item", "nonzero"}


class TorchOps(TorchDispatchMode):
    """Counts the ops that launch kernels by the innermost line of this repository that issued them, except inside
    a compiled function (`fused`: counted by call) or the Triton interpreter."""

    def __init__(self, fused: set[CodeType]) -> None:
        super().__init__()
        self.fused, self.ops, self.syncs = fused, Counter[str](), Counter[str]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        frames = _callers(sys._getframe(1))
        if any("/triton/" in f.f_code.co_filename or f.f_code in self.fused for f in frames):
            return out
        ours = next((f for f in frames if _ours(f.f_code)), None)
        where = (
            f"{Path(ours.f_code.co_filename).relative_to(ROOT)}:{ours.f_lineno} {ours.f_code.co_name}" if ours else "?"
        )
        (self.syncs if name in SYNCS else self.ops)[f"{name} @ {where}"] += 1
        return out


def _callers(frame: FrameType | None) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _ours(code: CodeType) -> bool:
    """Code of this repository's model and services (not this script, not the virtual environment)."""
    return code.co_filename.startswith(str(ROOT)) and "/.venv/" not in code.co_filename and code.co_filename != __file__


def fused_functions() -> dict[CodeType, str]:
    """The plain functions `model.fused.fused` compiles on a GPU, by code object: every loaded `model` module's
    attributes that are fused's wrapper (all share its code) around a function."""
    wrapper = fused(lambda x: x).__code__
    found = {}
    for name, module in list(sys.modules.items()):
        if name == "model" or name.startswith("model."):
            for attr in list(vars(module).values()):
                if getattr(attr, "__code__", None) is wrapper and hasattr(attr, "__wrapped__"):
                    found[attr.__wrapped__.__code__] = attr.__wrapped__.__name__
    return found


def count(preset_name: str, B: int, context: int, kind: str = "decode", temperature: float = 0.0,
          per_row: bool = False) -> dict:  # fmt: skip
    args = preset(preset_name)
    args = dataclasses.replace(args, quantization_config=preset("small").quantization_config,
                               max_position_embeddings=max(args.max_position_embeddings, 2 * context))  # fmt: skip
    model = build_model(args, device="cpu", dtype=torch.float32)
    kernels.backend_for = lambda _t: "triton"  # the GPU's path: every kernel op on Triton (interpreted)
    batch = filled_decode_batch(model, B, context, 4, graphs=False)
    tokens = torch.randint(0, args.vocab_size, (B, 1))
    sampling = SamplingParams.uniform(B, temperature)
    generator = [torch.Generator() for _ in range(B)] if per_row else torch.Generator()

    def step() -> None:
        if kind == "decode":
            batch.decode_step(tokens)
        elif kind == "draft":
            batch.dspark_draft(tokens, sampling, generator)
        else:
            batch.verify(tokens, batch.dspark_draft(tokens, sampling, generator), sampling, generator=generator)

    codes = fused_functions()
    launches, calls, counting = Counter[str](), Counter[str](), [False]
    run_grid = interpreter.GridExecutor.__call__

    def launch(executor, *a, **k):
        if counting[0]:
            launches[executor.fn.__name__] += 1
        return run_grid(executor, *a, **k)

    def called(frame, event, _arg):  # a compiled function's outermost call (one inside another compiles with it)
        if event == "call" and frame.f_code in codes and not any(f.f_code in codes for f in _callers(frame.f_back)):
            calls[codes[frame.f_code]] += 1

    interpreter.GridExecutor.__call__ = launch
    ops = TorchOps(set(codes))
    with torch.no_grad():
        step()  # first calls build lazy state
        counting[0] = True
        sys.setprofile(called)
        with ops:
            step()
        sys.setprofile(None)
    interpreter.GridExecutor.__call__ = run_grid
    total = sum(launches.values()) + sum(calls.values()) + sum(ops.ops.values())
    return {
        "preset": preset_name, "layers": args.num_hidden_layers, "batch": B, "context": context, "step": kind,
        "temperature": temperature, "per_row_generators": per_row, "estimate": total,
        "triton": dict(launches.most_common()), "fused": dict(calls.most_common()),
        "torch_ops": dict(ops.ops.most_common()), "host_syncs": dict(ops.syncs.most_common()),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--step", choices=("decode", "draft", "dspark"), default="decode")
    p.add_argument("--temperature", type=float, default=0.0, help="the DSpark step's sampling (0: greedy)")
    p.add_argument("--per-row-generators", action="store_true", help="the DSpark step draws from one per row")
    p.add_argument("--batch-invariant", action="store_true", help="the kernels' launch choices as served")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()
    kernels.set_batch_invariant(ns.batch_invariant)  # here only the launch choices: no GPU to set up
    result = count(ns.preset, ns.batch, ns.context, ns.step, ns.temperature, ns.per_row_generators)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(result, indent=1))
    head = f"{result['preset']} ({result['layers']} layers), B={ns.batch}, {ns.step} step"
    print(f"{head}: ≈ {result['estimate']} launches")
    for part in ("triton", "fused"):
        print(f"{part}: {sum(result[part].values())}  " + ", ".join(f"{k} {v}" for k, v in result[part].items()))
    print(f"torch ops: {sum(result['torch_ops'].values())}; host syncs: {result['host_syncs'] or 'none'}")
    for where, n in list(result["torch_ops"].items())[: ns.top]:
        print(f"{n:5d}  {where}")


if __name__ == "__main__":
    main()
