"""bench/moe_ablation.py swaps moe_gemm's jit helpers for cut-down ones: a rename or a signature change there must
show here, not as a failed GPU call; the served kernel must still compute the product."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_variant_runs_the_gemm_in_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "ablation.json"
    command = [sys.executable, "bench/moe_ablation.py", "--tiny", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["base", "no-scale", "i2f", "no-dot", "bytes", "base"]
    assert all(row["ms"] > 0 for row in rows)
    exact = [row for row in rows if "rel_err" in row]  # the served kernel's runs, checked against the reference
    assert [row["variant"] for row in exact] == ["base", "base"]
    assert all(row["rel_err"] < 1e-2 for row in exact)
    assert "| no-dot |" in done.stdout


def test_an_unknown_variant_is_refused_by_name() -> None:
    command = [sys.executable, "bench/moe_ablation.py", "--tiny", "--variants", "base,fast"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown variants ['fast']" in done.stderr
