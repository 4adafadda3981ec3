"""What expert parallelism would move between 8 GPUs per decode step of V4.1-Flash, from the real dispatch code.

W ranks (processes on this machine, gloo on loopback) run `model.parallel.expert_parallel` — the header, dispatch and
return of one routed-expert layer — with the released widths: hidden 5120 as FP8 rows (E4M3 bytes + UE8M0 scales,
the packed model's cast input), fp32 routing weights, int64 expert ids, top-6 of 384 experts, bf16 expert outputs.
Routing is uniform at random (every expert equally likely; a real router is more skewed, which moves the same bytes
but loads ranks unevenly). Each rank's collectives are counted as they are issued (bytes it sends to other ranks;
what it keeps for itself moves no link). The experts' compute is left out — the local output rows are zeros of the
right shape: this measures traffic, not time.

Every rank dispatches B tokens of its own, as data-parallel attention over B sequences a rank gives them (the
services' form: `model_service.ranks`), with its own routing. A layer's exchange is a header (each rank's pair
counts and layer), the dispatch of the pairs and the return of their outputs; the forward's closing round (one more
header) is left out. The projection: the bytes of one layer times the routed-expert layers of a step (`--layers`,
40: every layer of V4.1-Flash), over a link rate (`--link-gb-s`, 450: one H200's NVLink 4 in one direction); sending
and receiving overlap, so a step's time is the larger of the two at that rate.

    python bench/ep_projection.py [--ranks 8] [--batches 1,64,256] [--layers 40] [--link-gb-s 450] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from model.linear import Fp8Act
from model.parallel import Parallel, answer_round, expert_parallel, serve_idle

HIDDEN, EXPERTS, TOPK = 5120, 384, 6


def counted(totals: dict[str, list[int]]) -> None:
    """Wrap the all-to-alls `model.parallel` issues so that each adds (bytes sent to others, received from others):
    the int64 header apart from the pairs and their outputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    all_to_all = dist.all_to_all_single

    def to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        row = input.element_size() * (input[0].numel() if input.dim() > 1 and input.shape[0] else 1)
        sent = input_split_sizes or [input.shape[0] // world] * world
        got = output_split_sizes or [output.shape[0] // world] * world
        kind = "header" if input.dtype == torch.int64 else "pairs"
        totals[kind][0] += row * (sum(sent) - sent[rank])
        totals[kind][1] += row * (sum(got) - got[rank])
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = to_all  # type: ignore[assignment]


def rank_main(rank: int, world: int, rendezvous: str, batches: list[int], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    counted(totals)
    parallel = Parallel(world, rank, data_parallel=True)
    held = parallel.experts(EXPERTS)

    def experts(xq, weights, local):  # this rank's experts: output rows of the right shape (traffic, not time)
        assert local.numel() == 0 or int(local.max()) < len(held)
        return torch.zeros(local.shape[0], 1, HIDDEN, dtype=torch.bfloat16)

    def tokens(n: int, g: torch.Generator | None = None) -> tuple[Fp8Act, Tensor, Tensor]:
        """n tokens' cast input (E4M3 bytes and UE8M0 scales), routing weights and top-k expert ids (uniform)."""
        ids = torch.rand(n, EXPERTS, generator=g).argsort(-1)[:, :TOPK].sort(-1).values
        xq = Fp8Act(torch.zeros(n, HIDDEN, dtype=torch.uint8), torch.full((n, HIDDEN // 32), 127, dtype=torch.uint8),
                    torch.bfloat16)  # fmt: skip
        return xq, torch.rand(n, TOPK, generator=g), ids

    def answer(layer: int, received: list[int]) -> None:  # another rank's round, once this one is done
        answer_round(experts, EXPERTS, *tokens(0), parallel, received)

    rows = []
    for B in batches:
        totals.clear()
        expert_parallel(experts, EXPERTS, *tokens(B, torch.Generator().manual_seed(B * world + rank)), parallel, 0)
        rows.append({"batch": B, "rank": rank, **{k: list(v) for k, v in totals.items()}})
        serve_idle(
            parallel, torch.device("cpu"), lambda _, got: answer_round(experts, EXPERTS, *tokens(0), parallel, got)
        )
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))  # type: ignore[union-attr]
    dist.destroy_process_group()


def project(rows: list[dict], layers: int, link_gb_s: float) -> list[dict]:
    """Per batch: the worst rank's bytes per layer and per step, and the step's time at the link rate."""
    table = []
    for B in sorted({r["batch"] for r in rows}):
        moved = [max(r["pairs"]) + max(r["header"]) for r in rows if r["batch"] == B]  # each rank's busier direction
        worst = max(moved)
        table.append({
            "batch_per_rank": B,
            "bytes_per_layer": worst,
            "per_step_mb": round(worst * layers / 1e6, 2),
            "per_step_ms_at_link": round(worst * layers / (link_gb_s * 1e9) * 1e3, 3),
        })  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--link-gb-s", type=float, default=450.0)
    parser.add_argument("--out", type=Path, default=Path("bench/out/ep_projection.json"))
    ns = parser.parse_args()
    batches = [int(b) for b in ns.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, (ns.ranks, os.path.join(tmp, "rendezvous"), batches, raw), nprocs=ns.ranks)
        rows = json.loads(Path(raw).read_text())
    table = project(rows, ns.layers, ns.link_gb_s)
    for row in table:
        print(json.dumps(row))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"ranks": ns.ranks, "layers": ns.layers, "link_gb_s": ns.link_gb_s,
                                  "per_rank": rows, "projection": table}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
