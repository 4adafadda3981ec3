"""One payload under several record keys (the n handoffs of one prefill) and DeleteRecords, on real servers: the
bytes are stored once per replica and freed with the last key; each key is consumed, expires or is deleted on its
own; a stopped replica fails only its own keys; records stay volatile across a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import FakeClock
from prometheus_client import generate_latest

from cache_svc.client import AsyncCacheClient, CacheClient, CacheError

HANDOFF = bytes(range(256)) * 4096  # 1 MiB: several slices per put
KEYS = [b"handoff:%d" % i for i in range(16)]


def _stats(client: CacheClient) -> dict[str, Any]:
    (only,) = client.stats().values()
    return only


def test_n_keys_store_one_payload_each_consumed_once_and_the_last_frees_it(start_server: Any) -> None:
    server = start_server()
    with server.client() as client:
        assert client.put_records_shared(KEYS, HANDOFF, ttl_s=60, lease_s=30) == 30
        stats = _stats(client)
        assert (stats["records"]["entries"], stats["records"]["bytes"]) == (16, len(HANDOFF))  # not 16 × the bytes
        assert stats["record_put_bytes"] == len(HANDOFF)
        assert client.get_record(KEYS[3]) == HANDOFF  # a peek leaves it
        for i, key in enumerate(KEYS):
            assert client.get_record(key, consume=True) == HANDOFF
            assert client.get_record(key, consume=True) is None  # each key once
            left = _stats(client)["records"]
            assert (left["entries"], left["bytes"]) == (15 - i, len(HANDOFF) if i < 15 else 0)


def test_each_key_ends_on_its_own(start_server: Any) -> None:
    """Replacing one key by a shorter-lived record, its expiry, and a delete leave the other keys and their bytes."""
    clock = FakeClock()
    server = start_server(clock=clock)
    with server.client() as client:
        client.put_records_shared(KEYS[:3], HANDOFF, ttl_s=60, lease_s=30)
        assert client.put_record(KEYS[1], b"short", ttl_s=60, lease_s=5) == 5
        assert _stats(client)["records"]["bytes"] == len(HANDOFF) + 5
        clock.advance(5.01)
        assert client.get_record(KEYS[1]) is None
        assert client.get_record(KEYS[0]) == client.get_record(KEYS[2]) == HANDOFF
        assert _stats(client)["records"]["bytes"] == len(HANDOFF)
        assert client.delete_records([KEYS[0], b"handoff:missing"]) == 1
        assert client.get_record(KEYS[2], consume=True) == HANDOFF
        clock.advance(30)  # the deadlines of the consumed, deleted and replaced keys find nothing to end
        stats = _stats(client)
    assert (stats["record_expiries"], stats["record_deletions"]) == (1, 1)
    assert (stats["records"]["entries"], stats["records"]["bytes"]) == (0, 0)


def test_delete_records_is_idempotent_and_counts_what_existed(start_server: Any) -> None:
    clock = FakeClock()
    server = start_server(clock=clock)
    with server.client() as client:
        client.put_records_shared(KEYS[:4], b"h" * 1000, ttl_s=60, lease_s=30)
        client.put_record(b"swa/seq", b"s" * 500, ttl_s=10)
        clock.advance(10)  # swa/seq expires: deleting it counts nothing
        assert client.delete_records([KEYS[0], KEYS[1], b"swa/seq", b"never"]) == 2
        assert client.delete_records([KEYS[0], KEYS[1]]) == 0
        assert client.delete_records([]) == 0
        assert [client.get_record(k) for k in KEYS[:4]] == [None, None, b"h" * 1000, b"h" * 1000]
        assert client.delete_records(KEYS[2:4]) == 2
        stats = _stats(client)
    text = generate_latest(server.server.registry).decode()
    assert (stats["records"]["entries"], stats["records"]["bytes"], stats["record_deletions"]) == (0, 0, 4)
    assert "cache_record_deletions_total 4.0" in text
    assert "cache_record_put_bytes_total 1500.0" in text


def test_a_leased_payload_counts_once_against_the_pool(start_server: Any) -> None:
    server = start_server(record_bytes=2500)
    with server.client() as client:
        client.put_records_shared(KEYS[:8], b"a" * 1000, ttl_s=60, lease_s=30)
        client.put_records_shared(KEYS[8:], b"b" * 1000, ttl_s=60, lease_s=30)
        with pytest.raises(CacheError) as full:
            client.put_record(b"handoff:other", b"c" * 1000, ttl_s=60, lease_s=30)
        assert full.value.code.name == "RESOURCE_EXHAUSTED"
        with pytest.raises(CacheError):  # KEYS[1..7] still hold the first payload: replacing one frees nothing
            client.put_record(KEYS[0], b"d" * 1000, ttl_s=60, lease_s=30)
        client.put_records_shared(KEYS[:8], b"e" * 1000, ttl_s=60, lease_s=30)  # replacing all of them does
        assert [client.get_record(k) for k in (KEYS[0], KEYS[7], KEYS[8])] == [b"e" * 1000] * 2 + [b"b" * 1000]
        assert _stats(client)["records"]["bytes"] == 2000


def test_sharded_keys_send_the_payload_once_per_replica(start_server: Any, tmp_path: Path) -> None:
    servers = [start_server(data_dir=tmp_path / f"replica-{i}") for i in range(3)]
    with CacheClient([s.address for s in servers], timeout_s=60) as client:
        shards = client.ring.split(KEYS)
        assert len(shards) > 1
        client.put_records_shared(KEYS, HANDOFF, ttl_s=60, lease_s=30)
        stats = client.stats()
        for address, positions in shards.items():
            assert stats[address]["records"]["entries"] == len(positions)
            assert stats[address]["record_put_bytes"] == stats[address]["records"]["bytes"] == len(HANDOFF)
        assert sum(s["record_put_bytes"] for s in stats.values()) == len(shards) * len(HANDOFF)
        assert all(client.get_record(k, consume=True) == HANDOFF for k in KEYS)


def test_a_stopped_replica_fails_only_its_keys(start_server: Any, tmp_path: Path) -> None:
    servers = [start_server(data_dir=tmp_path / f"replica-{i}") for i in range(2)]
    down = servers[1]
    down.stop()
    with CacheClient([s.address for s in servers], timeout_s=60) as client:
        live = [k for k in KEYS if client.ring.node(k) == servers[0].address]
        with pytest.raises(CacheError) as failed:
            client.put_records_shared(KEYS, HANDOFF, ttl_s=60, lease_s=30)
        assert (failed.value.code.name, failed.value.address) == ("UNAVAILABLE", down.address)
        assert failed.value.committed == live
        assert [client.get_record(k) is not None for k in KEYS] == [k in live for k in KEYS]
        with pytest.raises(CacheError) as delete_failed:  # the live replica's deletes are still done
            client.delete_records(KEYS)
        assert delete_failed.value.address == down.address
        assert _stats_of(client, servers[0].address)["records"]["entries"] == 0


def _stats_of(client: CacheClient, address: str) -> dict[str, Any]:
    return client.stats()[address]


def test_async_client_shares_and_deletes_the_same_way(start_server: Any, tmp_path: Path) -> None:
    servers = [start_server(data_dir=tmp_path / f"replica-{i}") for i in range(2)]

    async def scenario() -> None:
        async with AsyncCacheClient([s.address for s in servers], timeout_s=60) as client:
            assert await client.put_records_shared(KEYS, HANDOFF, ttl_s=60, lease_s=20) == 20
            stats = await client.stats()
            assert sum(s["records"]["entries"] for s in stats.values()) == 16
            assert sum(s["record_put_bytes"] for s in stats.values()) == 2 * len(HANDOFF)
            assert await client.get_record(KEYS[5], consume=True) == HANDOFF
            assert await client.delete_records(KEYS) == 15
            with pytest.raises(ValueError, match="no record keys"):
                await client.put_records_shared([], HANDOFF, ttl_s=60)

    asyncio.run(scenario())


def test_shared_records_are_volatile_across_a_restart(start_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_server(data_dir=data)
    with server.client() as client:
        client.put_records_shared(KEYS[:4], HANDOFF, ttl_s=60, lease_s=30)
    server.stop()
    again = start_server(data_dir=data)
    with again.client() as client:
        assert [client.get_record(k) for k in KEYS[:4]] == [None] * 4
        assert client.delete_records(KEYS[:4]) == 0
    assert HANDOFF[:4096] not in b"".join(p.read_bytes() for p in data.iterdir() if p.is_file())
