"""Where the grouped MXFP4 gate_up GEMM's K loop spends its time: the served kernel beside variants with one part of
the loop taken out, each timed alone (issue 19: the GEMM sits at 20–49 % of HBM bandwidth, its target is 60 %).

    python bench/moe_ablation.py [--variants base,no-scale,i2f,no-dot,bytes] [--out bench/out/moe_ablation.json]
    python bench/moe_ablation.py --tiny        # smoke run on CPU (Triton interpreter, small experts)

Each variant swaps one of `model.kernels.moe_gemm`'s jit helpers for a cut-down one before the kernel is first
compiled, in a process of its own (`base` runs first and last: the spread of the served kernel between them):
- `base`: the kernel as served;
- `no-scale`: the nibble decode with one constant scale (the scale loads and their unpacking gone);
- `i2f`: each nibble converted to bf16 by one integer conversion (no table decode, no scales);
- `no-dot`: the decode as served, the two tensor-core dots replaced by row sums (no wgmma, no operand shuffles);
- `bytes`: `i2f` and `no-dot` together (the loads and the loop alone).
A cut-down variant's output is meaningless; its time says what the part it removes costs. `base` computes the
product: its output is checked against the torch reference (the run fails past 1e-2 relative).
Shapes: top-6 over 48 experts at 64 and 256 tokens (one expert-parallel rank of eight) and over all 384 at 256,
C = 5120, I = 2304, scales per 32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl

from bench.kernels import expert_weights, median_ms, moe_inputs
from model.kernels import moe_gemm
from model.kernels.formats import e2m1_scaled

VARIANTS = ("base", "no-scale", "i2f", "no-dot", "bytes")
TOLERANCE = 1e-2  # relative, against the torch reference in bf16
SHAPES = ((48, 64), (48, 256), (384, 256))  # (experts, tokens)
TINY_SHAPES = ((8, 4),)


@triton.jit
def weight_halves_no_scale(w_ptr, ws_ptr, rows, ok, k0, K: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
                           WORDS: tl.constexpr, HW: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """`moe_gemm._weight_halves` with every scale 2^-7: the same decode, no scale loads."""
    R: tl.constexpr = rows.shape[0]
    packed = moe_gemm._packed_weights(w_ptr, rows, ok, k0, K, BK)
    scale = tl.full((R, BK // SB, 1), 0.0078125, tl.float32)
    low, high = e2m1_scaled(tl.reshape(packed, (R, BK // SB, SB // 2)), scale.to(tl.bfloat16) if PTX else scale, PTX)
    operand = tl.bfloat16 if HW else tl.float32
    return tl.reshape(low, (R, BK // 2)).to(operand), tl.reshape(high, (R, BK // 2)).to(operand)


@triton.jit
def weight_halves_i2f(w_ptr, ws_ptr, rows, ok, k0, K: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
                      WORDS: tl.constexpr, HW: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """`moe_gemm._weight_halves` with each nibble's code converted as an integer: one instruction a value."""
    packed = moe_gemm._packed_weights(w_ptr, rows, ok, k0, K, BK)
    operand = tl.bfloat16 if HW else tl.float32
    return (packed & 0xF).to(operand), (packed >> 4).to(operand)


@triton.jit
def project_no_dot(acc, w_ptr, ws_ptr, rows, ok, x_even, x_odd, k0, K: tl.constexpr, SB: tl.constexpr,
                   BK: tl.constexpr, WORDS: tl.constexpr, HW: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """`moe_gemm._project` with the dots replaced by an outer product of row sums: both operands still loaded and
    decoded (whichever `_weight_halves` is in place), no tensor-core work."""
    low, high = moe_gemm._weight_halves(w_ptr, ws_ptr, rows, ok, k0, K, SB, BK, WORDS, HW, PTX)
    w = tl.sum(low.to(tl.float32) + high.to(tl.float32), axis=1)
    x = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=0)
    return acc + w[:, None] * x[None, :]


PATCHES = {
    "base": {},
    "no-scale": {"_weight_halves": weight_halves_no_scale},
    "i2f": {"_weight_halves": weight_halves_i2f},
    "no-dot": {"_project": project_no_dot},
    "bytes": {"_weight_halves": weight_halves_i2f, "_project": project_no_dot},
}


def time_variant(variant: str, shapes: tuple[tuple[int, int], ...], C: int, I: int) -> list[dict[str, object]]:
    """Swap in the variant's helpers (the kernel compiles on its first launch, after this), then time gate_up."""
    for name, fn in PATCHES[variant].items():
        if type(getattr(moe_gemm, name, None)) is not type(fn):  # a jit helper (interpreted on CPU)
            raise SystemExit(f"moe_gemm.{name} is no longer a jit helper: update bench/moe_ablation.py")
        setattr(moe_gemm, name, fn)
    rows = []
    for E, N in shapes:
        m = moe_inputs(expert_weights(E, C, I, 32), N, 6)
        w13_bytes, _ = m.weight_bytes()
        ms = median_ms(lambda m=m: m.gate_up("triton"))
        row = {"variant": variant, "experts": E, "tokens": N, "ms": ms, "TB/s": w13_bytes / ms / 1e9}
        if variant == "base":
            got, want = m.gate_up("triton").float(), m.gate_up("torch").float()
            row["rel_err"] = float((got - want).norm() / want.norm().clamp_min(1e-30))
            if not row["rel_err"] <= TOLERANCE:
                raise SystemExit(f"{variant}, {E} experts × {N} tokens: rel err {row['rel_err']:.2e} > {TOLERANCE}")
        rows.append(row)
    return rows


def table(rows: list[dict[str, object]], shapes: tuple[tuple[int, int], ...]) -> str:
    """Markdown: a row per variant, a column per shape, every run of the variant (ms, TB/s of the weight bytes)."""
    lines = ["| variant | " + " | ".join(f"{E} experts × {N} tokens, ms (TB/s)" for E, N in shapes) + " |",
             "|---|" + "---:|" * len(shapes)]  # fmt: skip
    for variant in dict.fromkeys(row["variant"] for row in rows):
        cells = []
        for E, N in shapes:
            runs = [r for r in rows if (r["variant"], r["experts"], r["tokens"]) == (variant, E, N)]
            cells.append(" / ".join(f"{r['ms']:.3f} ({r['TB/s']:.2f})" for r in runs))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--tiny", action="store_true", help="small experts and one shape (the CPU smoke run)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one variant, its rows as JSON lines on stdout
    args = parser.parse_args()
    shapes, (C, I) = (TINY_SHAPES, (256, 128)) if args.tiny else (SHAPES, (5120, 2304))
    if args.child:
        for row in time_variant(args.child, shapes, C, I):
            print(json.dumps(row), flush=True)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in PATCHES]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    order = ["base", *(v for v in variants if v != "base"), "base"]
    rows, failed = [], []
    for variant in order:
        command = [sys.executable, __file__, "--child", variant, *(["--tiny"] if args.tiny else [])]
        done = subprocess.run(command, capture_output=True, text=True)
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode:
            failed.append(variant)
            print(f"{variant} failed:\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
        print(f"{variant} done", file=sys.stderr, flush=True)
    print(table(rows, shapes))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else
                                        "cpu", "rows": rows}, indent=1))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
