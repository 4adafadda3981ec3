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
from e2e_helpers import serve, start_gateway, tiny_mesh

from mesh.processes import Mesh


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from serve(tiny_mesh(tmp_path_factory.mktemp("mesh"), replicas=2))


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
