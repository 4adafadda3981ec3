"""Joining a decode batch: the k prompts an engine iteration admits restored and replayed in ONE decoder bounded replay
forward (ours, `DecodeBatch.join_many`), against one forward each (the peer: decode before 2026-11-30), side by side.

    python bench/join_bench.py [--model tiny] [--arrivals 1,2,4,8] [--running 8] [--repeats 7]
                               [--out bench/out/join_bench.json]

A join runs on the engine thread between two steps: the k-th arrival of an iteration waits for every join before its
own, and every running stream waits for all of them. Reported per k, medians over the repeats: the iteration's join
time (what the last arrival and the running streams wait), per arrival, and the ratio peer / ours. Prompts are random
token ids of ragged lengths (W to 40·W, so every replay runs W positions from a different position), prefilled once;
the lane already holds `--running` sequences. One torch thread, as each process of a 2-core mesh gets.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_bench import machine  # noqa: E402

from model import DecodeBatch, PrefillOutput, Transformer, encode_prefill  # noqa: E402
from model_service.runtime import load_model  # noqa: E402

console = Console(width=120)
Join = Callable[[DecodeBatch, list[PrefillOutput]], list[int]]


def ours(batch: DecodeBatch, prompts: list[PrefillOutput]) -> list[int]:
    return [seq for seq, _ in batch.join_many([(p.blocks, p.encoder_state) for p in prompts])]


def peer(batch: DecodeBatch, prompts: list[PrefillOutput]) -> list[int]:
    return [batch.join(p.blocks, p.encoder_state)[0] for p in prompts]


def timed(batch: DecodeBatch, join: Join, prompts: list[PrefillOutput]) -> float:
    """Seconds to join `prompts` (they leave again after, so the batch is the same for the next measure)."""
    started = time.perf_counter()
    seqs = join(batch, prompts)
    seconds = time.perf_counter() - started
    for seq in seqs:
        batch.leave(seq)
    return seconds


def measure(model: Transformer, args: argparse.Namespace) -> list[dict[str, float]]:
    W = model.args.sliding_window
    rng = random.Random(0)

    def prefill() -> PrefillOutput:
        return encode_prefill(model, [rng.randrange(10, model.args.vocab_size) for _ in range(rng.randint(W, 40 * W))])

    arrivals = [int(k) for k in args.arrivals.split(",")]
    prompts = [prefill() for _ in range(max(arrivals))]
    batch = DecodeBatch(model, args.running + max(arrivals))
    for _ in range(args.running):
        ours(batch, [prefill()])
    timed(batch, ours, prompts)  # warm-up: the batch's buffers grown, the kernels loaded
    rows = []
    for k in arrivals:
        seconds: dict[str, list[float]] = {"ours": [], "peer": []}
        for r in range(args.repeats):
            for name, join in sorted({"ours": ours, "peer": peer}.items(), reverse=bool(r % 2)):  # alternate order
                seconds[name].append(timed(batch, join, prompts[:k]))
        ours_s, peer_s = (statistics.median(seconds[name]) for name in ("ours", "peer"))
        rows.append({"arrivals": k, "ours_s": ours_s, "peer_s": peer_s, "ratio": peer_s / ours_s})
    return rows


def show(rows: list[dict[str, float]], running: int) -> None:
    table = Table(title=f"joining a lane of {running} running sequences: one replay forward vs one per arrival")
    for column in ("arrivals", "ours ms", "peer ms", "ours ms / arrival", "peer ms / arrival", "peer / ours"):
        table.add_column(column, justify="right")
    for row in rows:
        k = row["arrivals"]
        table.add_row(
            str(k), f"{row['ours_s'] * 1e3:.1f}", f"{row['peer_s'] * 1e3:.1f}", f"{row['ours_s'] * 1e3 / k:.1f}",
            f"{row['peer_s'] * 1e3 / k:.1f}", f"[bold]{row['ratio']:.2f}×[/bold]",
        )  # fmt: skip
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, small or a checkpoint directory")
    parser.add_argument("--arrivals", default="1,2,4,8", help="prompts admitted in one iteration")
    parser.add_argument("--running", type=int, default=8, help="sequences already in the lane")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/join_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model, "full")
    with torch.no_grad():
        rows = measure(model, args)
    show(rows, args.running)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
