"""`python -m mesh up` and `python -m mesh demo` as a user runs them: the mesh comes up and prints its URL, the demo
talks to it with the openai SDK, a child that dies is restarted, SIGTERM stops everything with nothing left
behind; and children never outlive a mesh process that is killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from e2e_helpers import START_TIMEOUT_S, mesh_up, wait_for

from mesh.processes import grpc_serving

ROOT = Path(__file__).resolve().parents[2]
# A metric family each process exports.
METRICS = {
    "cache": "cache_hits_total",
    "prefill-0": "v41mesh_prefill_",
    "decode-0": "v41mesh_decode_",
    "gateway": "v41mesh_gateway_",
}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ", 1)[1].startswith("Z"))


def children_of(data_dir: Path) -> dict[str, dict]:
    return json.loads((data_dir / "mesh.json").read_text())["children"]


def test_up_demo_restart_and_a_clean_stop(tmp_path: Path) -> None:
    data_dir = tmp_path / "mesh"
    up, base_url = mesh_up(data_dir)
    try:
        first = children_of(data_dir)
        assert set(first) == {"cache", "prefill-0", "decode-0", "gateway"}
        for name, family in METRICS.items():  # every process serves Prometheus, at the URL mesh.json gives
            assert family in httpx.get(first[name]["metrics"], timeout=START_TIMEOUT_S).text, name

        demo = subprocess.run(
            [sys.executable, "-m", "mesh", "demo", "--base-url", base_url, "--max-tokens", "3"],
            cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr
        assert demo.stdout.count("user:") == 3
        assert demo.stdout.count("3 generated") == 3
        assert "cached)" in demo.stdout

        os.kill(first["cache"]["pid"], signal.SIGKILL)  # the mesh restarts a child that dies

        def cache_restarted() -> bool:
            pid = children_of(data_dir)["cache"]["pid"]
            return pid != first["cache"]["pid"] and grpc_serving(first["cache"]["address"])

        wait_for(cache_restarted, "mesh up to restart the cache", START_TIMEOUT_S)
        final = children_of(data_dir)
        up.send_signal(signal.SIGTERM)
        assert up.wait(START_TIMEOUT_S) == 0
        stderr = up.stderr.read() if up.stderr else ""
        assert "cache exited with status -9; restarting it" in stderr
        assert "stopped: gateway 0, prefill-0 0, decode-0 0, cache 0" in stderr
        assert not [name for name, child in final.items() if alive(child["pid"])]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    parent = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from mesh.processes import Child
        child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], "-", lambda: True,
                      Path({str(tmp_path / "sleeper.log")!r}), "-")
        child.spawn({{}})
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    assert alive(pid)
    process.kill()  # no chance to stop its children
    process.wait()
    wait_for(lambda: not alive(pid), "the orphaned child to get SIGTERM from the kernel")
