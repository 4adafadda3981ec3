"""The released model at native precision on one GPU: the loader, and the decode step of a full-width slice and of
one expert-parallel rank's share against the bandwidth bound (issue 19).

    python bench/native_bench.py --out DIR [--scratch DIR]      # on the H200 (sections: loader, step)
    python bench/native_bench.py --tiny --out DIR               # CPU smoke of this script (tiny shapes)

- **loader**: a seeded checkpoint of a `--loader-layers`-layer full-width slice, written to `--scratch` in the
  released layout (shards + index) and loaded packed: GB/s, resident weight bytes against the bytes read, and the
  loaded model's logits against the seeded in-memory model's (they must be equal).
- **step**: `decode_step` of two models built from seeded weights through the same store path the loader fills:
  `slice` (hidden 5120, the released attention / indexer / compressor dims, all 384 experts, `--slice-layers`
  layers keeping the CSA2 role pattern) and `rank` (all 40 layers, 48 of 384 experts: what one rank of an 8-way
  expert-parallel group holds; top-6 over its 48 experts gives it the same (token, expert) pairs per token as EP 8
  does). Engram tables are shrunk (`--engram-vocab`: a full table alone is 98 GB, and it lives in host memory in
  the released deployment). At batch 1 / 64 / 256 and context 4 K / 128 K, from `filled_decode_batch`'s synthesised
  caches: the eager step's wall time (the host launches every kernel), a CUDA-graph replay of the same step (the
  GPU's own time), the bytes the step reads (the parameters of every module that ran — routed experts counted only
  where a token went — plus the KV it attends and scores), the bound bytes / 4.28 TB/s and the ratio to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import filled_decode_batch
from model import build_model, load_checkpoint, preset, serving
from model.checkpoint import write_seeded
from model.config import ModelArgs
from model.engram import table_sizes
from model.linear import Embedding, Fp8Rows
from model.moe import PackedExperts
from model.weights import weight_bytes

HBM_BYTES_PER_S = 4.28e12  # the device-to-device copy the H200 sustains (docs/benchmarks.md, kernels: copy)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------- models
def full_width(layers: int, experts: int, engram_vocab: int, context: int) -> ModelArgs:
    """V4.1-Flash at full width with `layers` layers (even) keeping the CSA2 role pattern: up to two SWA-only layers,
    a Full m=2 owner every 6 further encoder layers with Reuse between, layer L/2 the Full m=1 decoder source and
    candidate source, Reindex layers after it with Reuse between, Engram in the encoder; `experts` routed experts
    (DSpark's scaled alike); Engram tables built over `engram_vocab` ids per head. 40 layers: the released roles."""
    a, L2 = preset("v41-flash"), layers // 2
    if layers == 40:
        ratios, kv, index, engram = a.compress_ratios, a.kv_source_layer_ids, a.index_source_layer_ids, (1, 14)
    else:
        swa = min(2, L2 - 1)
        ratios = (0,) * swa + (2,) * (L2 - swa) + (1,) * L2 + (0,) * a.num_nextn_predict_layers
        encoder = tuple(range(swa, L2, 6))
        kv = (*encoder, L2)
        index = tuple(sorted({*encoder, *range(L2, layers, max(1, min(4, (layers - L2) // 2)))}))
        engram = (min(1, L2 - 1),)
    args = a.replace(
        num_hidden_layers=layers, compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=index,
        candidate_source_layer_id=L2, n_routed_experts=experts,
        dspark_n_routed_experts=max(3, a.dspark_n_routed_experts * experts // a.n_routed_experts),
        dspark_target_layer_ids=tuple(range(max(L2, layers - 3), layers)), engram_layer_ids=engram,
        engram_num_embeddings=(0,) * len(engram), engram_vocab_size=engram_vocab,
        max_position_embeddings=max(a.max_position_embeddings, 2 * context),
    )  # fmt: skip
    rows = tuple(sum(map(sum, table_sizes(args)[layer])) for layer in engram)
    return args.replace(engram_num_embeddings=rows)


# ------------------------------------------------------------------------------------------------- bytes
def touched_bytes(model, step: Callable[[], object]) -> int:
    """Weight bytes one decode step reads: every backbone parameter, the final norm and head, what DSpark's ring
    update reads (its context projection and each block's window projection), the embedding and Engram rows looked
    up, and the routed experts some token went to (counted on one call of `step`)."""
    looked_up: dict[torch.nn.Module, int] = {}

    def hook(module, inputs, output) -> None:
        if isinstance(module, PackedExperts):
            active = torch.zeros(module.n_experts, dtype=torch.bool, device=inputs[2].device)
            active[inputs[2].flatten()] = True
            looked_up[module] = int(active.sum()) * weight_bytes(module) // module.n_experts
        else:
            looked_up[module] = looked_up.get(module, 0) + inputs[0].numel() * weight_bytes(module) // len(
                module.weight
            )

    tables = (PackedExperts, Embedding, Fp8Rows)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, tables)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    mtp = model.mtp
    dspark = [mtp[0].main_proj, mtp[0].main_norm, *(m for b in mtp for m in (b.attn.wkv, b.attn.kv_norm))]
    every = [
        m for s in (model.layers, model.norm, model.head, *dspark) for m in s.modules() if not isinstance(m, tables)
    ]
    return sum(p.numel() * p.element_size() for m in every for p in m.parameters(recurse=False)) + sum(
        looked_up.values()
    )


def kv_bytes(args: ModelArgs, batch: int, context: int) -> int:
    """KV the step reads per sequence and layer: the FP8 window, the selected FP4 entries, and the indexer K each
    index source scores (all visible entries at Full layers, at most the candidate pool at Reindex layers)."""
    D, Di, W = args.head_dim, args.index_head_dim, args.sliding_window
    window, entry, key = W * (D + D // 32), D // 2 + D // 16, Di // 2 + Di // 32
    pool = args.candidate_topk_blocks * args.candidate_block_size
    total = 0
    for role in args.layer_roles[: args.num_hidden_layers]:
        total += window
        if not role.ratio:
            continue
        visible = context // role.ratio
        total += min(args.index_topk, visible) * entry
        if role.owns_index_query:
            total += (min(pool, visible) if role.uses_candidates else visible) * key
    return total * batch


# ------------------------------------------------------------------------------------------------- timing
def wall_ms(fn: Callable[[], object], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured once as a CUDA graph (after a warm-up call on a side stream) → its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    held = (graph, fn)  # the replay reads the tensors fn holds: they live as long as it
    return lambda: held[0].replay()


def graph_ms(fn: Callable[[], object], repeat: int) -> list[float] | str:
    """Replay times of `fn` captured once as a CUDA graph (the error, if it cannot be captured)."""
    if DEVICE != "cuda":
        return "no GPU"
    try:
        replay = captured(fn)
    except Exception as error:  # a host sync or pageable copy inside: report it, keep the eager figures
        return f"{type(error).__name__}: {error}"[:300]
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


# ----------------------------------------------------------------------------------------------- sections
def bench_loader(ns: argparse.Namespace) -> list[dict]:
    """Load a seeded checkpoint (`--checkpoint`, written by `python -m model.checkpoint write --seed 0`, else one of
    the slice written here to `--scratch`) and compare it with the seeded model built in memory."""
    with tempfile.TemporaryDirectory(dir=ns.scratch) as tmp:
        written, write_s = ns.checkpoint, None
        if written is None:
            args = preset("tiny") if ns.tiny else full_width(ns.loader_layers, 384, ns.engram_vocab, 4096)
            start = time.perf_counter()
            written = write_seeded(Path(tmp) / "ckpt", args, seed=0, device=DEVICE, shard_bytes=4 << 30)
            write_s = round(time.perf_counter() - start, 2)
        loaded = load_checkpoint(written, device=DEVICE, dtype=torch.bfloat16, progress=sys.stderr.isatty())
        report, args = loaded.load_report, loaded.args
        seeded = build_model(args, seed=0, device=DEVICE, dtype=torch.bfloat16)
        tokens = torch.randint(0, args.vocab_size, (1, 64), device=DEVICE)
        with torch.no_grad():
            equal = bool(torch.equal(loaded(tokens), seeded(tokens)))
    row = {"section": "loader", "layers": args.num_hidden_layers, "experts": args.n_routed_experts,
           "write_s": write_s, "read_bytes": report.read_bytes, "weight_bytes": report.weight_bytes,
           "load_s": round(report.seconds, 2), "load_gb_per_s": round(report.gb_per_s, 2),
           "logits_equal_seeded": equal}  # fmt: skip
    print(json.dumps(row), flush=True)
    return [row]


def bench_steps(ns: argparse.Namespace) -> list[dict]:
    contexts = [256, 512] if ns.tiny else ns.contexts
    batches = [1, 4] if ns.tiny else ns.batches
    models = {"slice": (ns.slice_layers, 384), "rank": (40, 48)}
    rows = []
    for name, (layers, experts) in models.items():
        if name not in ns.models:
            continue
        args = preset("tiny") if ns.tiny else full_width(layers, experts, ns.engram_vocab, contexts[-1])
        started = time.perf_counter()
        model = build_model(args, seed=0, device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
        build_s = time.perf_counter() - started
        for B in batches:
            for context in contexts:
                try:
                    rows.append(step_row(name, model, B, context, ns.repeat, build_s))
                except torch.OutOfMemoryError as error:
                    print(f"  {name} B={B} ctx={context}: out of memory ({error})"[:400], flush=True)
                finally:
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
        del model
    return rows


def step_row(name: str, model, B: int, context: int, repeat: int, build_s: float) -> dict:
    batch = filled_decode_batch(model, B, context, steps=2 * repeat + 8, graphs=False)
    tokens = torch.randint(0, model.args.vocab_size, (B, 1), device=DEVICE)
    with torch.no_grad():
        eager = wall_ms(lambda: batch.decode_step(tokens), repeat + 2)[2:]
        weights = touched_bytes(model, lambda: batch.decode_step(tokens))  # module hooks: an eager step
        step = batch.cache.step(tokens)

        def forward() -> None:
            serving.forward_full(model, step, last_only=True)

        graph = graph_ms(forward, repeat)
    read = weights + kv_bytes(model.args, B, context)
    bound_ms = read / HBM_BYTES_PER_S * 1e3
    best = statistics.median(graph) if isinstance(graph, list) else statistics.median(eager)
    row = {
        "section": "step", "model": name, "layers": model.args.num_hidden_layers,
        "experts": model.args.n_routed_experts, "batch": B, "context": context,
        "weight_gib": round(weight_bytes(model) / 2**30, 2), "build_s": round(build_s, 1),
        "eager_ms": round(statistics.median(eager), 3), "eager_spread_ms": [round(min(eager), 3), round(max(eager), 3)],
        "graph_ms": round(statistics.median(graph), 3) if isinstance(graph, list) else graph,
        "graph_spread_ms": [round(min(graph), 3), round(max(graph), 3)] if isinstance(graph, list) else None,
        "read_gb": round(read / 1e9, 3), "bound_ms": round(bound_ms, 3), "ratio_to_bound": round(best / bound_ms, 2),
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | B | context | eager ms | graph ms | GB read | bound ms | × bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["section"] == "step":
            model = f"{r['model']} ({r['layers']} L, {r['experts']} E)"
            cells = (model, r["batch"], f"{r['context']:,}", r["eager_ms"], r["graph_ms"], r["read_gb"], r["bound_ms"],
                     r["ratio_to_bound"])  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for native.json")
    parser.add_argument("--sections", default="loader,step", help="comma-separated: loader, step")
    parser.add_argument("--models", default="slice,rank", help="comma-separated: slice, rank")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a seeded checkpoint for the loader section")
    parser.add_argument("--scratch", default=None, help="where the loader writes its checkpoint (local disk)")
    parser.add_argument("--slice-layers", type=int, default=8)
    parser.add_argument("--loader-layers", type=int, default=2)
    parser.add_argument("--engram-vocab", type=int, default=200_000, help="ids per Engram head table")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")], default=[4096, 131_072])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke of the script)")
    ns = parser.parse_args(argv)
    ns.models = ns.models.split(",")
    ns.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    sections = {"loader": bench_loader, "step": bench_steps}
    for section in ns.sections.split(","):
        rows += sections[section](ns)
        (ns.out / "native.json").write_text(json.dumps({"rows": rows, "env": environment()}, indent=2))
    print(table(rows))
    return 0


def environment() -> dict[str, str]:
    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if DEVICE == "cuda":
        env["device"] = torch.cuda.get_device_name()
    return env | {"date": time.strftime("%Y-%m-%d")}


if __name__ == "__main__":
    sys.exit(main())
