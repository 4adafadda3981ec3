"""The real mesh for the end-to-end tests: started once per test session (per xdist worker) with the `tiny` model,
as separate processes on loopback (cache, two prefill and two decode replicas, a gateway), through the same
`mesh.processes.Mesh` that `python -m mesh up` runs. Tests that kill a process restart it before they end, so
every test finds the whole mesh healthy. The harness is in e2e_helpers.py."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from e2e_helpers import START_TIMEOUT_S, start_gateway

from mesh.processes import Mesh, MeshSpec

# Short deadlines, so a frozen replica is noticed within a test's time.
GATEWAY_ARGS = ["--stall-timeout-s", "20", "--load-interval-s", "0.25", "--inhibit-s", "2"]
# Records live an hour: a record that expires during a test is one the test made expire.
CACHE_ARGS = ["--ssd-bytes", str(256 << 20), "--dram-bytes", str(64 << 20), "--record-bytes", str(64 << 20),
              "--record-ttl-s", "3600"]  # fmt: skip


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model="tiny",
        data_dir=tmp_path_factory.mktemp("mesh"),
        prefill_replicas=2,
        decode_replicas=2,
        cache_args=CACHE_ARGS,
        gateway_args=GATEWAY_ARGS,
    )
    running = Mesh(spec)
    running.start(START_TIMEOUT_S)
    yield running
    running.stop()


@pytest.fixture
def oai(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def claude(mesh: Mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def extra_gateway(mesh: Mesh, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`extra_gateway(*flags)` → the base URL of another gateway process over the same replicas."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> str:
        url, process = start_gateway(mesh, tmp_path / f"gateway-{len(processes)}.log", *flags)
        processes.append(process)
        return url

    yield start
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(30)
