"""free_port: a port below the kernel's ephemeral range, bindable when returned."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mesh import processes
from mesh.processes import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="the ephemeral range is read from Linux's /proc")
def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = int(RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 1, "picked at random, not one fixed port"
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_held_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        picks = iter([taken, taken, free_port()])
        monkeypatch.setattr(processes.random, "choice", lambda _candidates: next(picks))
        assert free_port() != taken
        assert next(picks, None) is None, "the held port was tried twice, then the free one"
