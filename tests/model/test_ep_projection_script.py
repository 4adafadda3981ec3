"""bench/ep_projection.py runs the real data-parallel exchange over gloo and projects its traffic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIR_BYTES, OUTPUT_BYTES = 5120 + 160 + 4 + 8, 2 * 5120  # E4M3 row, UE8M0 scales, fp32 weight, int64 id; bf16 row
TOPK = 6


def test_projection_counts_each_ranks_header_pairs_and_outputs(tmp_path: Path) -> None:
    """Two ranks: each sends a 16-byte header and, for d pairs routed to the other rank's experts and e routed the
    other way, d packed pairs out and e outputs back — what it sends the other receives — and the projection is the
    busier rank's busier direction, times the layers."""
    out = tmp_path / "ep.json"
    argv = ["--ranks", "2", "--batches", "1,4", "--layers", "3", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "bench/ep_projection.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    by = {(r["batch"], r["rank"]): r for r in result["per_rank"]}
    assert sorted(by) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for (B, rank), row in by.items():
        assert row["header"] == [16, 16]  # [pairs, layer] as int64, to the other rank and from it
        sent, got = row["pairs"]
        assert [got, sent] == by[(B, 1 - rank)]["pairs"]
        splits = [
            (d, e)
            for d in range(TOPK * B + 1)
            for e in range(TOPK * B + 1)
            if (sent, got) == (d * PAIR_BYTES + e * OUTPUT_BYTES, e * PAIR_BYTES + d * OUTPUT_BYTES)
        ]
        assert len(splits) == 1, (B, rank, sent, got)
    for row in result["projection"]:
        worst = max(max(r["pairs"]) + 16 for (B, _), r in by.items() if row["batch_per_rank"] == B)
        assert row["bytes_per_layer"] == worst
        assert row["per_step_mb"] == round(worst * 3 / 1e6, 2)
