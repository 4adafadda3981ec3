"""Processes that share one stderr pipe (a rank group's ranks, `mesh up`'s children) with write-through streams
(PYTHONUNBUFFERED, as `mesh up` runs them) each write whole JSON lines: none is torn by another's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINES = 400
WRITER = f"""
from mesh.logging import configure_logging
log = configure_logging("writer")
for i in range({LINES}):
    log.info("line", i=i, padding="x" * 300)
"""


def test_concurrent_processes_write_whole_log_lines() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    read, write = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER], stderr=write, stdout=subprocess.DEVNULL, env=env)
        for _ in range(3)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert all(w.wait(timeout=60) == 0 for w in writers)
    events = [json.loads(line) for line in lines]  # a torn line would not parse
    assert sorted(e["i"] for e in events) == sorted(list(range(LINES)) * 3)
