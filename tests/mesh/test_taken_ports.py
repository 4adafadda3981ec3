"""A port drawn for a child can be taken by another process before the child binds it (the draw and the bind are
apart: parallel test workers, other services). The child then exits at start-up; the mesh draws its ports again and
starts over, instead of failing every test that shares it."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, start_http_server

from mesh import processes
from mesh.processes import Mesh, MeshSpec

CACHE_ARGS = ["--ssd-bytes", str(64 << 20), "--dram-bytes", str(16 << 20), "--record-bytes", str(16 << 20)]


def test_a_child_whose_port_was_taken_restarts_the_mesh_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        draws = iter([taken])  # the first port drawn (the cache's) is one another process holds
        real = processes.free_port
        monkeypatch.setattr(processes, "free_port", lambda host="127.0.0.1": next(draws, None) or real(host))
        events: list[str] = []
        spec = MeshSpec(model="tiny", data_dir=tmp_path, cache_args=CACHE_ARGS)
        with Mesh(spec, on_event=events.append) as mesh:
            cache = mesh.child("cache")
            assert cache.address != f"127.0.0.1:{taken}"
            assert any("a port was taken before its child bound it" in line for line in events)
            assert "Failed to bind" in (tmp_path / "logs" / "cache.log").read_text()  # the first run's end
            assert "Failed to bind" not in cache.tail(200)  # this run's lines
            assert httpx.get(mesh.base_url + "/health", timeout=10).json()["ready"] is True


def test_a_gateway_port_answered_by_another_server_is_not_the_gateway_ready() -> None:
    """The gateway's health poll on a port another HTTP server holds (a replica's metrics server answers any path with
    its metrics, status 200): not ready — the gateway, failing to bind, exits and the mesh draws new ports —, not a
    JSON error out of the mesh's start."""
    port = processes.free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert not processes.gateway_sees(url, prefill=1, decode=1, cache=1)
    finally:
        server.shutdown()
        thread.join()
