"""free_port: a port below the kernel's ephemeral range, bindable when returned, never one this process was just
given."""

from __future__ import annotations

import socket
from collections import deque
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
    monkeypatch.setattr(processes, "_GIVEN", deque(maxlen=8))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        free = free_port()
        processes._GIVEN.clear()  # given to nothing that binds it: to be drawn again below
        picks = iter([taken, taken, free])
        monkeypatch.setattr(processes.random, "choice", lambda _candidates: next(picks))
        assert free_port() != taken
        assert next(picks, None) is None, "the held port was tried twice, then the free one"


def test_a_port_just_given_is_not_given_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mesh draws every port before its children bind any: with four candidates, four draws get four ports and a
    fifth finds none (drawn at random, the same port would come back within a few draws)."""
    monkeypatch.setattr(processes, "_PORT_SPAN", 4)
    monkeypatch.setattr(processes, "_GIVEN", deque(maxlen=8))
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == 4
    with pytest.raises(OSError, match="no free port"):
        free_port()
