"""Offline sm_90 (H100 / H200) compiles of the Triton kernels, no GPU needed: registers, spills, shared memory and
the SASS of each loop, per launch shape. Triton's wheel ships ptxas and cuobjdump, so this runs anywhere.

    python bench/sass.py indexer                                   # the decode launch's defaults
    python bench/sass.py indexer --queries 2 --tiles 4 --max-registers 0   # a prefill tile's
    python bench/sass.py indexer --block-s 256 --tiles 32 --max-registers 0
    python bench/sass.py attention --heads 64 --keys 16 --warps 8
    python bench/sass.py topk                                      # the four top-k kernels at 256 × 64 K
    python bench/sass.py fp8-gemm --tokens 64 --weight-rows 5120 --inputs 8192   # the FP8 linear's default launch
    python bench/sass.py moe-gemm --tokens 256 --experts 48 --block 32    # gate_up and down, default launches
    python bench/sass.py moe-gemm --tokens 256 --dot fp8                  # ... with FP8 code dots per chunk
    python bench/sass.py step-glue --experts 384          # mHC coefficients and the MoE routing, per layer

What the H200 cannot tell you cheaply, this does: an instruction count per loop trip (what a tile loop's cost is
cut by), and registers per thread → programs per SM (65 536 / (registers × threads)).
Spill loads (LDL) inside a loop are the ones that cost.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret: decided when the kernels' module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model.kernels import fp8_gemm, hc_mixes, indexer, moe_gemm, route, sparse_attn, topk

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
REGISTERS_PER_SM = 65_536


@dataclass
class Loop:
    instructions: int
    opcodes: collections.Counter[str]


@dataclass
class Report:
    name: str
    warps: int
    registers: int
    stack: int
    shared: int
    instructions: int
    spill_loads: int
    loops: list[Loop] = field(default_factory=list)

    @property
    def programs_per_sm(self) -> int:
        return REGISTERS_PER_SM // (self.registers * 32 * self.warps)

    def lines(self, top: int) -> list[str]:
        head = (
            f"{self.name}: {self.warps} warps, {self.registers} registers ({self.programs_per_sm} programs per SM by "
            f"registers), {self.stack} B of stack, {self.spill_loads} spill loads, {self.shared} B shared, "
            f"{self.instructions} SASS instructions"
        )
        body = [
            f"  loop of {loop.instructions}: " + ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(top))
            for loop in self.loops
        ]
        return [head, *body]


def _cuobjdump(cubin: Path, flag: str) -> str:
    command = [str(TOOLS / "cuobjdump"), flag, str(cubin)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode without modifiers, line) of every SASS instruction."""
    found = []
    for line in sass.splitlines():
        match = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2).split(".")[0], line))
    return found


def _loops(instructions: list[tuple[int, str, str]]) -> list[Loop]:
    """The bodies of backward branches, longest first."""
    spans = []
    for address, opcode, line in instructions:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    loops = [
        Loop(
            instructions=sum(1 for a, _, _ in instructions if lo <= a <= hi),
            opcodes=collections.Counter(op for a, op, _ in instructions if lo <= a <= hi),
        )
        for lo, hi in spans
    ]
    return sorted(loops, key=lambda loop: -loop.instructions)


def compile_sm90(
    name: str,
    fn: triton.runtime.JITFunction,
    signature: dict[str, str],
    constexprs: dict[str, object],
    warps: int,
    max_registers: int | None = None,
    multiples_of_16: tuple[str, ...] = (),
    work_dir: Path = Path("/tmp"),
    stages: int = 3,
) -> Report:
    """Compile `fn` for sm_90 and read its cubin. Pointers are taken as 16-byte aligned (as torch allocates) and the
    integer arguments named in `multiples_of_16` as multiples of 16 — what Triton's launcher specialises on at run
    time, and what lets it vectorise and pipeline loads (without it a strided load compiles to plain LDG). Kernels
    compile as programmatic dependents (model.kernels.launch) unless `constexprs` says otherwise."""
    arguments = list(fn.arg_names)
    constexprs = {"PDL": True, "EARLY": False} | constexprs
    aligned = [a for a, kind in signature.items() if kind.startswith("*") or a in multiples_of_16]
    attrs = {(arguments.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(
        fn=fn, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs, attrs=attrs
    )
    options = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": max_registers} if max_registers else {})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = work_dir / f"sass_{os.getpid()}_{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = _cuobjdump(cubin, "-res-usage")
    instructions = _instructions(_cuobjdump(cubin, "-sass"))
    cubin.unlink()
    return Report(
        name=name,
        warps=warps,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        shared=kernel.metadata.shared,
        instructions=len(instructions),
        spill_loads=sum(op == "LDL" for _, op, _ in instructions),
        loops=_loops(instructions),
    )


def indexer_reports(
    block_s: int, tiles: int, warps: int, max_registers: int | None, queries: int = 1, heads: int = 32
) -> list[Report]:
    """The launch for `queries` queries per program (1: decode; prefill tiles take 2 at 32 heads), Di = 128, FP8
    operands, K tiles by TMA, at one tile shape."""
    signature = {
        "q_ptr": "*u8",
        "qs_ptr": "*u8",
        "w_ptr": "*fp32",
        "k_ptr": "*u8",
        "ks_ptr": "*u8",
        "k_desc": f"tensordesc<u8[1, {block_s}, 64]>",
        "ks_desc": f"tensordesc<i32[1, {block_s}]>",
        "nv_ptr": "*i64",
        "out_ptr": "*fp32",
        "T": "i32",
        "H": "i32",
        "S": "i32",
        "k_stride": "i64",
        "ks_stride": "i64",
    }
    constexprs = {
        "DI": 128,
        "DIP": 128,
        "HP": triton.next_power_of_2(heads),
        "BLOCK_T": queries,
        "BLOCK_S": block_s,
        "OPERAND": indexer.FP8.value,
        "TILES": tiles,
        "STAGES": 3,
        "SCALE_WORDS": True,
        "SCAN": triton.next_power_of_2(tiles * block_s),
        "TMA_K": True,
        "TMA_SCALES": True,
    }
    name = f"indexer {queries} × {block_s} × {tiles}"
    strides = ("k_stride", "ks_stride")
    return [compile_sm90(name, indexer._indexer_kernel, signature, constexprs, warps, max_registers, strides)]


def attention_reports(heads: int, keys: int, warps: int) -> list[Report]:
    """Sparse decode attention, one split, D = 512, bf16 dots, RoPE⁻¹ of the last 64 dims on the way out."""
    signature = {
        "q_ptr": "*bf16",
        "swa_ptr": "*u8",
        "swas_ptr": "*u8",
        "new_ptr": "*u8",
        "news_ptr": "*u8",
        "sidx_ptr": "*i32",
        "kv_ptr": "*u8",
        "kvs_ptr": "*u8",
        "idx_ptr": "*i32",
        "sink_ptr": "*fp32",
        "out_ptr": "*bf16",
        "po_ptr": "*fp32",
        "pm_ptr": "*fp32",
        "pl_ptr": "*fp32",
        "pos_ptr": "*i64",
        "freq_ptr": "*fp64",
        "rq_ptr": "*bf16",
        "T": "i32",
        "H": "i32",
        "R": "i32",
        "TN": "i32",
        "W": "i32",
        "kv_stride": "i64",
        "kvs_stride": "i64",
        "K": "i32",
        "qk_scale": "fp32",
        "tiles_per_split": "i32",
    }
    constexprs = {"D": 512, "DP": 512, "BLOCK_H": heads, "BLOCK_N": keys, "SPLITS": 1, "DOT_F32": False, "RD": 64}
    name = f"attention {heads} heads × {keys} keys"
    strides = ("kv_stride", "kvs_stride")
    return [compile_sm90(name, sparse_attn._sparse_attention_kernel, signature, constexprs, warps, None, strides)]


def topk_reports(rows: int, length: int, k: int) -> list[Report]:
    """The group path's four kernels for bf16 rows at the launch shapes `topk_indices_triton` picks by default, each
    waiting on its predecessor (dependent launch, as on sm_90) and none letting its successor launch early (one
    instruction, which the launch picks by the GPU's SM count)."""
    t = topk.TopKTuning(direct_max=0).resolved(rows, length, k)  # the group path's default shape, at any length
    GS = t.group_size
    NGP = triton.next_power_of_2(triton.cdiv(length, GS))
    KP = triton.next_power_of_2(k)
    CG, P, span, _slots = t.gather_shape(k)
    row = {"x_ptr": "*bf16", "len_ptr": "*i32"}
    candidates = {"ckey_ptr": "*u32", "cpos_ptr": "*i32", "count_ptr": "*i32"}
    return [
        compile_sm90(
            "top-k group maxima",
            topk._group_max_kernel,
            row | {"gmax_ptr": "*u32", "L": "i32", "NG": "i32", "tiles": "i32"},
            {"HAS_LENGTHS": False, "TILE": t.group_tile, "GS": GS, "LOW_BIT": 16},
            4,
            None,
            ("L", "NG"),
        ),
        compile_sm90(
            "top-k threshold",
            topk._threshold_kernel,
            {
                "gmax_ptr": "*u32",
                "glist_ptr": "*i32",
                "thr_ptr": "*u32",
                "ngroups_ptr": "*i32",
                "NG": "i32",
                "k": "i32",
            },
            {"NGP": NGP, "KP": KP, "LOW_BIT": 16},
            t.threshold_warps,
            None,
            ("NG",),
        ),
        compile_sm90(
            "top-k gather",
            topk._gather_kernel,
            row
            | {"glist_ptr": "*i32", "thr_ptr": "*u32", "ngroups_ptr": "*i32"}
            | candidates
            | {"L": "i32", "NGP": "i32", "SEG": "i32"},
            {
                "HAS_LENGTHS": False,
                "P": P,
                "SPAN": span,
                "CG": CG,
                "GS": GS,
                "LOW_BIT": 16,
            },
            4,
            None,
            ("L", "NGP", "SEG"),
        ),
        compile_sm90(
            "top-k select",
            topk._select_kernel,
            row | {"thr_ptr": "*u32"} | candidates | {"out_ptr": "*i32", "L": "i32", "SEG": "i32", "k": "i32"},
            {
                "HAS_LENGTHS": False,
                "DIRECT": False,
                "P": P,
                "PP": triton.next_power_of_2(P),
                "LOW_BIT": 16,
                "TILE": t.tile,
                "KP": KP,
            },
            t.num_warps,
            None,
            ("L", "SEG"),
        ),
    ]


def fp8_gemm_reports(tokens: int, rows: int, inputs: int, dot: str | None = None, cast: bool = False) -> list[Report]:
    """The FP8 linear's default launch for `tokens` tokens × a [rows, inputs] weight on an sm_90 GPU (`dot`: another
    way than the default's), scales read as words where whole (K a multiple of 128); `cast`: bf16 activations, cast
    inside the GEMM (`fp8_linear_cast` below 32 tokens)."""
    t = fp8_gemm.FP8GemmTuning(dot=dot or ("bf16" if tokens >= fp8_gemm.FOLDED_FROM else "fp8")).resolved(tokens)
    operand = "*fp8e4nv" if t.dot == "fp8" else "*u8"
    signature = {
        "x_ptr": "*bf16" if cast else operand,
        "xs_ptr": "*u8",
        "w_ptr": operand,
        "ws_ptr": "*u8",
        "out_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "tiles_per_split": "i32",
    }
    constexprs = {
        "K": inputs,
        "BM": t.block_m,
        "BN": t.block_n,
        "BK": t.block_k,
        "STAGES": t.num_stages,
        "FOLDED": t.dot == "bf16",
        "FP8_DOT": t.dot == "fp8",
        "WORDS": inputs % 128 == 0 and t.block_k % 128 == 0,
        "HW": True,
        "CAST_X": cast,
    }
    name = f"fp8 linear {t.dot} dots, {t.block_m} tokens × {t.block_n} rows × {t.block_k}{', cast inside' * cast}"
    return [compile_sm90(name, fp8_gemm._fp8_linear_kernel, signature, constexprs, t.num_warps, None, ("N",))]


def moe_gemm_reports(
    tokens: int, experts: int, block: int, dot: str = "bf16", top: int = 6, C: int = 5120, I: int = 2304
) -> list[Report]:
    """The grouped expert GEMMs' default launches (gate_up, down) for `tokens` tokens routed to `top` of `experts`
    (pairs per tile from the average): bf16 dots with the nibbles decoded by the PTX table lookups, or (`dot` fp8)
    FP8 code dots per 32-input chunk; gate_up casting its output to FP8 as the model runs it."""
    t = moe_gemm.MoEGemmTuning(ptx=True, dot=dot).resolved(tokens * top, experts)
    chunked = dot != "bf16"
    signature = {
        "x_ptr": "*u8" if chunked else "*bf16",
        "xs_ptr": "*u8",
        "order_ptr": "*i64",
        "offsets_ptr": "*i32",
        "pw_ptr": "*fp32",
        "w_ptr": "*u8",
        "ws_ptr": "*u8",
        "out_ptr": "*bf16",
        "os_ptr": "*u8",
        "n_out": "i32",
        "limit": "fp32",
        "n_experts": "i32",
    }
    reports = []
    for name, gated, inputs in (("moe gate_up", True, C), ("moe down", False, I)):
        constexprs = {
            "K": inputs,
            "SB": block,
            "BM": t.block_m,
            "BN": t.block_n // 2 if gated else t.block_n,
            "BK": t.block_k,
            "STAGES": t.num_stages,
            "GATED": gated,
            "COMPACT": tokens * top < experts,
            "E_BLOCK": triton.next_power_of_2(experts),
            "W_WORDS": inputs // block % 4 == 0,
            "HW": True,
            "PTX": True,
            "CHUNKED": chunked,
            "FP8_DOT": dot == "fp8",
            "SLOTS": top if gated and chunked else 0,
            "X_WORDS": inputs % 128 == 0 and t.block_k % 128 == 0,
            "SCATTER": not gated,
            "CAST": gated,  # gate_up's output leaves as moe_down's FP8 input
            "ROUND": tl.bfloat16,
        }
        types = signature | {"out_ptr": "*u8" if gated else "*bf16"}
        name = f"{name} {t.block_m} pairs × {t.block_n} weight rows × {t.block_k} (block {block}, {dot} dots)"
        reports.append(compile_sm90(name, moe_gemm._moe_kernel, types, constexprs, t.num_warps, None, ("n_out",)))
    return reports


def step_glue_reports(experts: int, hc: int = 4, splits: int = 4) -> list[Report]:
    """A decode step's per-site kernels at their launch constants: the mHC coefficients' split-K projection and
    Sinkhorn (n = hc), the MoE routing's gate logits and top-k (E = experts, the gate's K in `splits`)."""
    M = (2 + hc) * hc
    mix = hc_mixes.MIXES
    f32, i32 = "*fp32", "i32"
    part = {"part_ptr": f32, "sq_ptr": f32}
    partials = [
        compile_sm90(
            f"mHC mix partials{' of the update' if expand else ''}",
            hc_mixes._mix_partials_kernel,
            {"x_ptr": "*bf16", "fn_ptr": f32}
            | part
            | {"R": i32, "K": i32, "x_stride": i32, "split_k": i32}
            | {"out_ptr": "*bf16", "post_ptr": f32, "comb_ptr": f32, "new_ptr": "*bf16", "C": i32},
            {"M": M, "M_PAD": triton.next_power_of_2(M), "BLOCK_R": mix.block_r, "BLOCK_K": mix.block_k}
            | {"EXPAND": expand, "N": hc},
            mix.num_warps,
            multiples_of_16=("K", "x_stride", "split_k", "C"),
            stages=mix.num_stages,
        )
        for expand in (False, True)
    ]
    return [
        *partials,
        compile_sm90(
            "mHC coefficients",
            hc_mixes._coefficients_kernel,
            part
            | dict.fromkeys(("scale_ptr", "base_ptr", "pre_ptr", "post_ptr", "comb_ptr"), f32)
            | dict.fromkeys(("R", "K", "splits", "iters"), i32)
            | {"rms_eps": "fp32", "eps": "fp32"},
            {
                "N": hc,
                "M_PAD": triton.next_power_of_2(M),
                "BLOCK_R": mix.block_r,
                "CHUNK": hc_mixes._CHUNK,
            },
            mix.sinkhorn_warps,
        ),
        compile_sm90(
            "MoE gate logits",
            route._gate_logits_kernel,
            {"x_ptr": "*bf16", "w_ptr": f32, "p_ptr": f32}
            | dict.fromkeys(("R", "C", "E", "x_stride", "k_per_split"), i32),
            {"BLOCK_R": route._BLOCK_R, "BLOCK_E": route._BLOCK_E, "BLOCK_K": route._BLOCK_K},
            4,
            multiples_of_16=("C", "x_stride", "k_per_split"),
        ),
        compile_sm90(
            "MoE top-k",
            route._route_select_kernel,
            {
                "p_ptr": f32,
                "bias_ptr": f32,
                "w_ptr": f32,
                "ids_ptr": "*i64",
                "R": i32,
                "E": i32,
                "topk": i32,
                "scale": "fp32",
            },
            {"SPLITS": splits, "NORM": True, "BLOCK_R": route._SELECT_ROWS, "E_PAD": triton.next_power_of_2(experts)},
            4,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=["indexer", "attention", "topk", "fp8-gemm", "moe-gemm", "step-glue"])
    parser.add_argument("--block-s", type=int, default=128, help="indexer: positions per K tile")
    parser.add_argument("--tiles", type=int, default=64, help="indexer: K tiles per program")
    parser.add_argument(
        "--max-registers", type=int, default=indexer.DECODE_REGISTERS, help="indexer: register cap per thread (0: none)"
    )
    parser.add_argument("--queries", type=int, default=1, help="indexer: queries per program (prefill tiles: 2)")
    parser.add_argument("--heads", type=int, default=16, help="attention: heads per program")
    parser.add_argument("--keys", type=int, default=64, help="attention: keys per tile")
    parser.add_argument("--warps", type=int, help="warps per program (default: the kernel's own)")
    parser.add_argument("--rows", type=int, default=256, help="top-k: rows")
    parser.add_argument("--length", type=int, default=65_536, help="top-k: scores per row")
    parser.add_argument("--k", type=int, default=512, help="top-k: k")
    parser.add_argument("--tokens", type=int, default=64, help="fp8-gemm / moe-gemm: tokens")
    parser.add_argument("--weight-rows", type=int, default=5120, help="fp8-gemm: weight rows (N)")
    parser.add_argument("--inputs", type=int, default=8192, help="fp8-gemm: inputs (K)")
    parser.add_argument(
        "--dot", choices=["fp8", "fp32", "bf16"], help="fp8-gemm: the dots (default: by tokens); moe-gemm: (bf16)"
    )
    parser.add_argument("--cast", action="store_true", help="fp8-gemm: bf16 activations cast inside the GEMM")
    parser.add_argument("--experts", type=int, default=48, help="moe-gemm, step-glue: experts")
    parser.add_argument("--block", type=int, default=32, choices=[16, 32], help="moe-gemm: inputs per weight scale")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = parser.parse_args()
    if args.kernel == "indexer":
        reports = indexer_reports(args.block_s, args.tiles, args.warps or 4, args.max_registers or None, args.queries)
    elif args.kernel == "attention":
        reports = attention_reports(args.heads, args.keys, args.warps or 8)
    elif args.kernel == "topk":
        reports = topk_reports(args.rows, args.length, args.k)
    elif args.kernel == "fp8-gemm":
        reports = fp8_gemm_reports(args.tokens, args.weight_rows, args.inputs, args.dot, args.cast)
    elif args.kernel == "moe-gemm":
        reports = moe_gemm_reports(args.tokens, args.experts, args.block, args.dot or "bf16")
    else:
        reports = step_glue_reports(args.experts)
    for report in reports:
        print("\n".join(report.lines(args.top)), flush=True)


if __name__ == "__main__":
    main()
