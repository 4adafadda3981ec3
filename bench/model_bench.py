"""Model benchmarks (issue 3): the CED prefill against a full-depth prefill, and decode throughput, in one run.

    python bench/model_bench.py                                  # tiny and small on CPU, default sizes
    python bench/model_bench.py --presets small --prompt 2048 --device cuda --dtype bfloat16

For each preset, over the same random prompt:
- `encode_prefill` (ours: layers 0..L/2−1 + layer L/2's KV projection, what a prefill machine runs) against a
  full-depth prefill (the peer: every layer over every prompt token, what a model without CED must run), both on the
  packed-cache path; the ratio is the paper's "about half" claim;
- the decoder bounded replay that starts a decode (L/2 layers over the last W tokens);
- what the bounded replays cost in accuracy: KL(exact full-depth ‖ decoder-replayed) next-token distributions, and
  the same after a half-prompt cache hit whose SWA record is gone (encoder replay);
- decode tokens/s at batch 1 and 16 (`decode_step`, one token per sequence per step).
Prints a table, writes JSON (default bench/out/model_bench.json). Imports only torch and the model.

    python bench/model_bench.py --decode-step --baseline 7cfa99c     # the decode step, ours vs a git revision
    python bench/model_bench.py --decode-step --temperature 1 --top-p 0.9 --presets tiny,model/checkpoints/v41-demo

The decode-step section times one `decode_step`, the sampling of its logits (`SamplingParams.probs` and `sample`, at
`--temperature`, `--top-k`, `--top-p`; greedy by default), one `dspark_draft` + `verify` round (full width, the same
sampling) on a filled DecodeBatch (a prompt joined, forked to the batch), and one `join_many` of B prompts (one
decoder bounded replay forward; the lane is emptied, untimed, between calls), per preset and batch B, together with
the aten ops one call dispatches (torch.profiler): the host work of a step. The peer is the same code path at
another git revision (checked out into a temporary worktree); ours and the peer run in alternating child processes,
`--rounds` times, and each figure is the median over rounds (CPU time of the child: the shared cores' other load does
not count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# A --decode-step child of --baseline imports another revision's model.
sys.path.insert(0, os.environ.get("MODEL_BENCH_TREE") or str(Path(__file__).resolve().parents[1]))

from model import DecodeBatch, Transformer, build_model, encode_prefill, preset, serving

REPO = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of `repeat` runs after one warm-up: wall clock on a GPU (synchronised), process CPU time on
    the CPU (the CPU machines are shared, and CPU time does not count other tenants' load)."""
    fn()
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - start)
    return statistics.median(times)


@torch.no_grad()
def full_depth_prefill(model: Transformer, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """The peer: every layer over every prompt token (exact decoder windows, no bounded replay) → next logits."""
    cache = model.new_cache()
    cache.add_row()
    for a in range(0, tokens.shape[0], chunk):
        step = cache.step(tokens[None, a : a + chunk])
        logits = serving.forward_full(model, step, last_only=True)  # a prefill needs the last position's only
        step.commit()
    return logits[0, -1]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of two next-token distributions, in nats."""
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def decode_rate(model: Transformer, out: serving.PrefillOutput, batch: int, steps: int, device, repeat: int) -> float:
    """Tokens/s of `steps` decode steps over `batch` sequences continuing one prompt."""
    b = DecodeBatch(model, capacity=batch)
    seq, _ = b.join(out.blocks, out.encoder_state)
    for _ in range(batch - 1):
        b.fork(seq)
    ids = torch.randint(0, model.args.vocab_size, (steps, batch), device=device)

    def run() -> None:
        for t in range(steps):
            b.decode_step(ids[t])

    return batch * steps / timed(run, device, repeat)


def bench(name: str, prompt: int, chunk: int, steps: int, device: torch.device, dtype: torch.dtype, repeat: int):
    args = preset(name)
    model = build_model(args, seed=0, device=device, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).to(device)
    ours = timed(lambda: encode_prefill(model, tokens, chunk_tokens=chunk), device, repeat)
    peer = timed(lambda: full_depth_prefill(model, tokens, chunk), device, repeat)
    out = encode_prefill(model, tokens, chunk_tokens=chunk)
    replay = timed(lambda: DecodeBatch(model).join(out.blocks, out.encoder_state), device, repeat)
    # What the approximations cost (random weights: indicative only): the decoder bounded replay against the exact
    # full-depth logits, and an encoder replay after a half-prompt cache hit without its SWA record.
    exact = full_depth_prefill(model, tokens, chunk)
    _, replayed = DecodeBatch(model).join(out.blocks, out.encoder_state)
    hit = out.blocks[: len(out.blocks) // 2]
    warmless = encode_prefill(model, tokens, serving.Past(hit), chunk_tokens=chunk)
    _, hit_logits = DecodeBatch(model).join(hit + warmless.blocks, warmless.encoder_state)
    row = {
        "preset": name,
        "params": sum(p.numel() for p in model.parameters()),
        "prompt_tokens": prompt,
        "encode_prefill_s": ours,
        "full_depth_prefill_s": peer,
        "prefill_cost_ratio": ours / peer,
        "encode_prefill_tok_s": prompt / ours,
        "full_depth_prefill_tok_s": prompt / peer,
        "decoder_replay_s": replay,
        "decoder_replay_kl": kl(exact, replayed),
        "encoder_replay_hit_tokens": len(hit) * args.kv_block_tokens,
        "encoder_replay_kl": kl(exact, hit_logits),
    }
    for batch in (1, 16):
        row[f"decode_tok_s_b{batch}"] = decode_rate(model, out, batch, steps, device, repeat)
    return row


def table(rows: list[dict]) -> str:
    head = f"{'preset':<7} {'params':>8} {'prompt':>6} | {'encode_prefill':>15} {'full-depth':>11} {'ratio':>6} | "
    head += f"{'replay':>8} {'KL dec':>8} {'KL enc':>8} | {'decode b=1':>11} {'decode b=16':>12} {'b16/b1':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        prefill = f"{r['encode_prefill_tok_s']:>11.0f} t/s {r['full_depth_prefill_tok_s']:>7.0f} t/s"
        decode = f"{r['decode_tok_s_b1']:>7.1f} t/s {r['decode_tok_s_b16']:>8.1f} t/s"
        lines.append(
            f"{r['preset']:<7} {r['params'] / 1e6:>7.1f}M {r['prompt_tokens']:>6} | {prefill} "
            f"{r['prefill_cost_ratio']:>6.2f} | {r['decoder_replay_s'] * 1e3:>6.0f}ms "
            f"{r['decoder_replay_kl']:>8.1e} {r['encoder_replay_kl']:>8.1e} | {decode} "
            f"{r['decode_tok_s_b16'] / r['decode_tok_s_b1']:>6.2f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- decode step
SECTION_CALLS = ("decode_step", "sample", "draft_verify", "join")


def step_costs(
    name: str, batch: int, prompt: int, steps: int, device: torch.device, dtype: torch.dtype, sampled: tuple, keys: list
) -> dict:
    """Median CPU seconds of a decode step, of sampling its logits, of a draft + verify round and of joining `batch`
    prompts in one decoder replay (`join_many`, what a decode engine runs for an iteration's arrivals), and the aten
    ops each dispatches, for the calls named in `keys`; `sampled`: (temperature, top_k, top_p)."""
    from torch.profiler import ProfilerActivity, profile

    from model import SamplingParams, sample
    from model.checkpoint import load_checkpoint

    if Path(name).is_dir():  # a checkpoint: trained distributions, as the served model samples them
        model = load_checkpoint(name, device=device, dtype=dtype)
    else:
        model = build_model(preset(name), seed=0, device=device, dtype=dtype)
    tokens = torch.randint(0, model.args.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    out = encode_prefill(model, tokens.to(device), chunk_tokens=256)
    b = DecodeBatch(model, capacity=batch)
    seq, _ = b.join(out.blocks, out.encoder_state)
    for _ in range(batch - 1):
        b.fork(seq)
    ids, sampling = [1] * batch, SamplingParams.uniform(batch, *sampled)
    lane = DecodeBatch(model, capacity=batch)
    logits = b.decode_step(ids) if "sample" in keys else None

    def speculate() -> None:
        b.verify(ids, b.dspark_draft(ids, sampling), sampling)

    def join() -> None:
        lane.join_many([(out.blocks, out.encoder_state)] * batch)

    def leave_all() -> None:  # between timed joins, untimed: the lane is empty again
        for s in list(lane.seq_ids):
            lane.leave(s)

    row = {"preset": Path(name).name, "batch": batch, "prompt_tokens": prompt}
    calls = (
        ("decode_step", lambda: b.decode_step(ids)),
        ("sample", lambda: sample(sampling.probs(logits))),
        ("draft_verify", speculate),
        ("join", join),
    )
    for key, fn in (call for call in calls if call[0] in keys):
        times = []
        for _ in range(steps + 1):  # the first call warms up
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
            leave_all()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        leave_all()
        row[f"{key}_s"] = statistics.median(times[1:])
        row[f"{key}_aten_ops"] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return row


def child(ns: argparse.Namespace, tree: Path) -> list[dict]:
    """One round of the decode-step section in a child process importing the model from `tree`."""
    argv = [sys.executable, __file__, "--decode-step-child", "--presets", ns.presets, "--batches", ns.batches]
    argv += ["--prompt", str(ns.prompt), "--steps", str(ns.steps), "--device", ns.device, "--dtype", ns.dtype]
    argv += ["--temperature", str(ns.temperature), "--top-k", str(ns.top_k), "--top-p", str(ns.top_p)]
    argv += ["--calls", ",".join(ns.calls)]
    env = {**os.environ, "MODEL_BENCH_TREE": str(tree), "OMP_NUM_THREADS": str(ns.threads)}
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def decode_step_section(ns: argparse.Namespace) -> list[dict]:
    """Ours (this tree) and the baseline revision, alternating, `ns.rounds` rounds → rows with medians and ratios."""
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(peer), ns.baseline], check=True,
                       capture_output=True)  # fmt: skip
        try:
            rounds = [(child(ns, REPO), child(ns, peer)) for _ in tqdm(range(ns.rounds), desc="decode-step rounds")]
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(peer)], check=True)
    rows = []
    for i, ours in enumerate(rounds[0][0]):
        row = {k: ours[k] for k in ("preset", "batch", "prompt_tokens")}
        for key in ns.calls:
            for side, j in (("ours", 0), ("peer", 1)):
                row[f"{key}_{side}_s"] = statistics.median(r[j][i][f"{key}_s"] for r in rounds)
                row[f"{key}_{side}_aten_ops"] = rounds[0][j][i][f"{key}_aten_ops"]
            row[f"{key}_speedup"] = row[f"{key}_peer_s"] / row[f"{key}_ours_s"]
        rows.append(row)
    return rows


def decode_step_table(rows: list[dict], baseline: str, keys: list[str]) -> str:
    head = f"{'preset':<6} {'B':>3}"
    for key in keys:
        head += f" | {key + ' ms':>16} {baseline[:10]:>10} {'×':>5} {'aten ops':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['preset']:<6} {r['batch']:>3}"
        for key in keys:
            ops = f"{r[f'{key}_ours_aten_ops']}/{r[f'{key}_peer_aten_ops']}"
            line += (
                f" | {r[f'{key}_ours_s'] * 1e3:>16.1f} {r[f'{key}_peer_s'] * 1e3:>10.1f} {r[f'{key}_speedup']:>5.2f}"
                f" {ops:>15}"
            )
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small", help="comma-separated presets (decode step: or checkpoints)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (CPU time is summed over them)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/out/model_bench[_decode_step].json)")
    parser.add_argument("--decode-step", action="store_true", help="the decode-step section against --baseline")
    parser.add_argument("--baseline", default="HEAD", help="git revision of the decode-step peer")
    parser.add_argument("--batches", default="1,8", help="decode-step batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating decode-step rounds (median)")
    parser.add_argument("--temperature", type=float, default=0.0, help="decode-step sampling (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="decode-step sampling (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="decode-step sampling (1: off)")
    parser.add_argument("--calls", default=",".join(SECTION_CALLS), help="decode-step calls to time (comma-separated)")
    parser.add_argument("--decode-step-child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.calls = ns.calls.split(",")
    if unknown := set(ns.calls) - set(SECTION_CALLS):
        parser.error(f"--calls: unknown {sorted(unknown)}; choose from {', '.join(SECTION_CALLS)}")
    torch.set_num_threads(ns.threads)
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    if ns.decode_step_child:
        grid = [(p, int(b)) for p in ns.presets.split(",") for b in ns.batches.split(",")]
        sampled = (ns.temperature, ns.top_k, ns.top_p)
        print(json.dumps([step_costs(p, b, ns.prompt, ns.steps, device, dtype, sampled, ns.calls) for p, b in grid]))
        return 0
    if ns.decode_step:
        rows = decode_step_section(ns)
        print(decode_step_table(rows, ns.baseline, ns.calls))
        ns.out = ns.out or "bench/out/model_bench_decode_step.json"
    else:
        rows = [bench(name, ns.prompt, ns.chunk, ns.steps, device, dtype, ns.repeat) for name in ns.presets.split(",")]
        print(table(rows))
        ns.out = ns.out or "bench/out/model_bench.json"
    machine = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": ns.dtype,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps({"machine": machine, "args": vars(ns), "results": rows}, indent=2))
    print(f"\n{machine}\nJSON written to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
