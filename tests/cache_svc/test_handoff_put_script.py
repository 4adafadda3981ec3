"""bench/handoff_put.py runs end to end on real cache servers and checks both sides' records as it goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_handoff_put_bench_runs_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "handoff_put.json"
    argv = ["--payload-mib", "0.25", "--n", "1,3", "--shards", "2", "--rounds", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "bench/handoff_put.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["shards"], row["n"]) for row in rows] == [(2, 1), (2, 3)]
    payload_mib = 0.25
    for row in rows:
        assert all(row[side]["median_ms"] > 0 for side in ("ours", "peer"))
        assert row["peer"]["sent_mib"] >= row["n"] * payload_mib  # a payload per handle
        assert row["ours"]["sent_mib"] <= min(row["n"], 2) * payload_mib * 1.01  # a payload per replica touched
    assert "peer / ours" in done.stdout
