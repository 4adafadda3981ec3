"""bench/sass.py compiles kernels for sm_90 without a GPU (Triton's own ptxas and cuobjdump): a change that breaks
the GPU compile — or moves the indexer's tile loop off the FP8 tensor cores — shows here, not on the next GPU call."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def sass(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "bench/sass.py", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_the_indexer_decode_launch_compiles_onto_fp8_tensor_cores() -> None:
    report = sass("indexer")
    registers = int(re.search(r"4 warps, (\d+) registers", report).group(1))
    assert registers <= 128  # the decode cap: four programs per SM
    loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
    assert any("QGMMA" in loop for loop in loops), report  # FP8 E4M3 wgmma in a tile loop


def test_the_topk_kernels_compile() -> None:
    report = sass("topk", "--rows", "256", "--length", "65536")
    kernels = [line.split(":")[0] for line in report.splitlines() if not line.startswith(" ")]
    assert kernels == ["top-k group maxima", "top-k threshold", "top-k gather", "top-k select"], report
