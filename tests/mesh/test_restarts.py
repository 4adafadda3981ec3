"""`mesh up`'s restart budget is a rate with backoff: the policy on its own clock, then the watcher restarting real
processes that die."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from mesh.processes import Child, Mesh, MeshSpec
from mesh.restarts import RestartBudget, RestartPolicy
from mesh.up import UpConfig, restart_policy, watch

FAST_WATCH_S = 0.02


def test_the_budget_counts_restarts_within_the_window_not_since_the_start() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=60.0))
    for now in (0.0, 10.0, 20.0):
        assert budget.allows(now)
        budget.record(now)
    assert not budget.allows(59.0), "a 4th restart within 60 s"
    assert budget.allows(60.0), "the first restart has left the window"
    budget.record(60.0)
    # The case that stopped a whole mesh: a 4th death seven minutes after the first.
    assert budget.allows(7 * 60.0)
    assert budget.total == 4


def test_backoff_doubles_per_restart_in_the_window_up_to_its_cap_and_resets_after_a_quiet_window() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=10, window_s=100.0, backoff_s=1.0, max_backoff_s=5.0))
    delays = []
    for now in range(6):
        delays.append(budget.delay(float(now)))
        budget.record(float(now))
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert budget.delay(105.0) == 1.0, "every restart has left the window"


def test_no_restarts_at_all_when_the_budget_is_zero() -> None:
    assert not RestartBudget(RestartPolicy(max_restarts=0)).allows(0.0)


def test_the_flags_make_the_policy() -> None:
    cfg = UpConfig(max_restarts=2, restart_window_s=30.0, restart_backoff_s=0.5)
    assert restart_policy(cfg) == RestartPolicy(max_restarts=2, window_s=30.0, backoff_s=0.5)


# --- the watcher, on real processes ---

LIFE_S = 0.3
# Prints when it starts, then dies with status 3.
CRASHER = f"import sys, time; print('started', time.monotonic(), flush=True); time.sleep({LIFE_S}); sys.exit(3)"


def crashing_mesh(tmp_path: Path) -> Mesh:
    """A mesh (nothing started yet) whose one child is a short-lived process that exits with status 3."""
    mesh = Mesh(MeshSpec(model="unused", data_dir=tmp_path))
    mesh.logs.mkdir(parents=True)
    argv = [sys.executable, "-c", CRASHER]
    mesh.children = [Child("cache", argv, "-", lambda: True, mesh.logs / "cache.log", "-")]
    mesh.children[0].spawn({})
    return mesh


def starts(mesh: Mesh) -> list[float]:
    """When each life of the child began (its own monotonic clock, which the test process shares)."""
    text = mesh.children[0].log.read_text()
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith("started ")]


def test_a_child_that_dies_now_and_then_is_restarted_however_often(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Deaths further apart than the window never exhaust a budget of one restart."""
    mesh = crashing_mesh(tmp_path)
    stop = threading.Event()
    policy = RestartPolicy(max_restarts=1, window_s=LIFE_S / 2, backoff_s=0.0)
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(watch(mesh, stop, policy, FAST_WATCH_S)))
    watcher.start()
    try:
        deadline = time.monotonic() + 60
        while len(starts(mesh)) < 4 and time.monotonic() < deadline:
            time.sleep(FAST_WATCH_S)
    finally:
        stop.set()
        watcher.join(30)
        mesh.stop(5)
    assert result == [0], "stopped only by the stop event"
    assert len(starts(mesh)) >= 4, "three restarts and more, against a budget of one per window"
    assert "cache exited with status 3; restarting it in 0.0 s (1 of 1 within 0.15 s, 3 in all)" in (
        capsys.readouterr().err
    )


def test_a_crash_loop_backs_off_then_stops_the_mesh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mesh = crashing_mesh(tmp_path)
    policy = RestartPolicy(max_restarts=2, window_s=600.0, backoff_s=0.2)
    try:
        assert watch(mesh, threading.Event(), policy, FAST_WATCH_S) == 1
    finally:
        mesh.stop(5)
    first, second, third = starts(mesh)
    assert second - first >= LIFE_S + 0.2
    assert third - second >= LIFE_S + 0.4, "the second restart waits twice as long"
    err = capsys.readouterr().err
    assert "cache exited with status 3; restarting it in 0.4 s (2 of 2 within 600 s, 2 in all)" in err
    assert "cache exited with status 3 after 2 restarts within 600 s; stopping the mesh" in err
    assert "started" in err.rsplit("stopping the mesh", 1)[1], "the child's last log lines"
