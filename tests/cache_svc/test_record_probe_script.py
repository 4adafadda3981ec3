"""bench/record_probe.py runs end to end on real cache servers and checks both sides' answers as it goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_record_probe_bench_runs_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    argv = ["--rounds", "3", "--ends", "9", "--shards", "2", "--concurrency", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "bench/record_probe.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert (row["shards"], row["concurrency"]) == (2, 2)
    assert all(row[side]["median_ms"] > 0 for side in ("ours", "peer"))
    assert "peer / ours" in done.stdout
