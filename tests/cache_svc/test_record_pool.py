"""Volatile records through a real server: TTL and leases on an injectable clock, capacity, never on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cache_helpers import FakeClock

from cache_svc.client import CacheClient, CacheError


def _stats(client: CacheClient) -> dict[str, Any]:
    (only,) = client.stats().values()
    return only


def test_records_expire_on_time(start_server: Any) -> None:
    clock = FakeClock()
    server = start_server(clock=clock, record_ttl_s=300)
    with server.client() as client:
        assert client.put_record(b"swa/seq-1", b"ring" * 1000, ttl_s=120) == 120
        assert client.put_record(b"swa/seq-2", b"other", ttl_s=0) == 300  # 0: the server's default
        assert client.put_record(b"swa/seq-3", b"capped", ttl_s=3600) == 300  # capped at --record-ttl-s
        clock.advance(119.9)
        assert client.get_record(b"swa/seq-1") == b"ring" * 1000
        assert client.has_record(b"swa/seq-1")
        clock.advance(0.2)
        assert client.get_record(b"swa/seq-1") is None
        assert not client.has_record(b"swa/seq-1")
        assert client.get_record(b"swa/seq-2") == b"other"
        clock.advance(300)
        assert client.get_record(b"swa/seq-2") is None
        stats = _stats(client)
    assert stats["record_expiries"] == 3
    assert stats["records"]["entries"] == 0
    assert stats["records"]["bytes"] == 0


def test_handoff_lease_is_consumed_once_or_expires_with_the_lease(start_server: Any) -> None:
    clock = FakeClock()
    server = start_server(clock=clock)
    with server.client() as client:
        assert client.put_record(b"handoff/a", b"state-a", ttl_s=60, lease_s=10) == 10
        assert client.get_record(b"handoff/a") == b"state-a"  # a peek leaves it in place
        assert client.get_record(b"handoff/a", consume=True) == b"state-a"
        assert client.get_record(b"handoff/a", consume=True) is None  # picked up once

        client.put_record(b"handoff/b", b"state-b", ttl_s=60, lease_s=10)
        clock.advance(10.01)  # nobody came for it
        assert client.get_record(b"handoff/b", consume=True) is None
        assert _stats(client)["record_expiries"] == 1


def test_lru_eviction_spares_leased_records_and_refuses_when_they_fill_the_pool(start_server: Any) -> None:
    clock = FakeClock()
    server = start_server(clock=clock, record_bytes=1000)
    with server.client() as client:
        client.put_record(b"swa/1", b"a" * 300, ttl_s=60)
        client.put_record(b"swa/2", b"b" * 300, ttl_s=60)
        client.put_record(b"handoff/1", b"h" * 300, ttl_s=60, lease_s=30)
        client.get_record(b"swa/1")  # swa/2 is now the least recently used
        client.put_record(b"swa/3", b"c" * 300, ttl_s=60)
        assert client.get_record(b"swa/2") is None
        assert client.get_record(b"swa/1") == b"a" * 300
        assert client.get_record(b"handoff/1") == b"h" * 300

        client.put_record(b"handoff/2", b"i" * 300, ttl_s=60, lease_s=30)
        client.put_record(b"handoff/3", b"j" * 300, ttl_s=60, lease_s=30)  # evicts the unleased ones
        with pytest.raises(CacheError) as full:
            client.put_record(b"handoff/4", b"k" * 300, ttl_s=60, lease_s=30)
        assert full.value.code.name == "RESOURCE_EXHAUSTED"
        assert "leased" in full.value.details
        with pytest.raises(CacheError) as too_big:
            client.put_record(b"huge", b"x" * 1001, ttl_s=60)
        assert too_big.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(CacheError):  # replacing handoff/1 by 600 B does not fit beside the other two
            client.put_record(b"handoff/1", b"z" * 600, ttl_s=60, lease_s=30)
        assert all(client.get_record(k) is not None for k in (b"handoff/1", b"handoff/2", b"handoff/3"))
        assert client.get_record(b"handoff/1") == b"h" * 300  # a refused replace changes nothing
        stats = _stats(client)
    assert stats["records"]["evictions"] == 3
    assert stats["refusals"] == 2  # handoff/4 and the replace; the over-size one is INVALID_ARGUMENT


def test_large_records_stream_in_slices_and_never_reach_disk(start_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_server(data_dir=data)
    swa_ring = bytes(range(256)) * (2_703_360 // 256)  # 2.58 MiB: the released model's SWA rings per sequence
    marker = b"never-on-disk-" * 4
    with server.client() as client:
        client.put_record(b"seq/ring", swa_ring, ttl_s=300)
        client.put_record(b"seq/marker", marker, ttl_s=300, lease_s=30)
        assert client.get_record(b"seq/ring") == swa_ring
    server.stop()
    on_disk = b"".join(p.read_bytes() for p in data.iterdir() if p.is_file())
    assert marker not in on_disk
    assert swa_ring[:4096] not in on_disk
