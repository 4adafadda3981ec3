"""bench/kernels.py --check is what the H200 runs before every benchmark; in the interpreter at --tiny sizes it must
pass too, so that a broken check or a kernel signature change shows here rather than on the next (scarce) GPU call."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_gpu_check_script_passes_at_tiny_sizes() -> None:
    done = subprocess.run(
        [sys.executable, "bench/kernels.py", "--tiny", "--check", "all"],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = done.stdout + done.stderr
    failed = "\n".join(line for line in done.stdout.splitlines() if "FAIL" in line)
    assert not failed, f"{failed}\n…\n{report[-3000:]}"
    assert done.returncode == 0, report[-3000:]
    assert done.stdout.count("PASS") >= 15, report[-3000:]  # every kernel family reported
