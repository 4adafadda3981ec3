"""Three real replicas behind one client: one is killed, its keys miss, the others serve; it comes back whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import key_of, payload_of

from cache_svc.client import AsyncCacheClient, CacheClient, CacheError

N = 300


def test_one_replica_down_then_back_with_its_data(spawn: Any, tmp_path: Path) -> None:
    replicas = [spawn(tmp_path / f"replica-{i}") for i in range(3)]
    addresses = [r.address for r in replicas]
    blocks = [(key_of(n), payload_of(key_of(n), 2000)) for n in range(N)]
    keys = [k for k, _ in blocks]
    records = {f"swa/{i}".encode(): f"state {i}".encode() * 100 for i in range(30)}

    with CacheClient(addresses, timeout_s=20) as client:
        assert client.put_blocks(blocks) == keys
        for key, payload in records.items():
            client.put_record(key, payload, ttl_s=300)
        owner = {k: client.ring.node(k) for k in keys}
        held = {a: s["ssd"]["entries"] for a, s in client.stats().items()}
        assert held == {a: sum(o == a for o in owner.values()) for a in addresses}
        assert all(held[a] > N // 6 for a in addresses)  # consistent hashing spreads the keys

        down = replicas[1]
        down.kill()
        on_down = [k for k in keys if owner[k] == down.address]
        assert client.get_blocks(keys) == [None if owner[k] == down.address else p for k, p in blocks]
        assert client.lookup(keys) == keys.index(on_down[0])
        for key, payload in records.items():
            expected = None if client.ring.node(key) == down.address else payload
            assert client.get_record(key) == expected
        probe = [b"swa/never", *records, b"swa/nor"]  # one Lookup per live replica answers for all of them
        assert client.has_records(probe) == [k in records and client.ring.node(k) != down.address for k in probe]
        assert "UNAVAILABLE" in client.stats()[down.address]["error"]

        more = [(key_of(n), b"new") for n in range(N, N + 30)]
        with pytest.raises(CacheError) as failed:
            client.put_blocks(more)
        assert failed.value.code.name == "UNAVAILABLE"
        assert failed.value.address == down.address
        assert failed.value.committed == [k for k, _ in more if client.ring.node(k) != down.address]
        down_record = next(k for k in records if client.ring.node(k) == down.address)
        with pytest.raises(CacheError):
            client.put_record(down_record, b"x", ttl_s=10)

    replicas[1] = spawn(tmp_path / "replica-1", port=down.port)
    with CacheClient(addresses, timeout_s=20) as client:
        assert client.get_blocks(keys) == [p for _, p in blocks]
        assert client.lookup(keys) == N
        assert client.get_record(down_record) is None  # records are volatile: gone with the process


def test_async_client_same_contract(spawn: Any, tmp_path: Path) -> None:
    up = spawn(tmp_path / "up")
    gone = "127.0.0.1:1"  # nothing listens there

    async def scenario() -> None:
        blocks = [(key_of(n), payload_of(key_of(n), 70_000)) for n in range(40)]
        keys = [k for k, _ in blocks]
        async with AsyncCacheClient(up.address, timeout_s=60, chunk_bytes=50_000) as client:
            assert await client.put_blocks(blocks) == keys
            assert await client.get_blocks([*keys, key_of(999)]) == [p for _, p in blocks] + [None]
            assert await client.lookup([*keys[:5], key_of(999), keys[6]]) == 5
            assert await client.put_record(b"handoff", b"h" * 200_000, ttl_s=30, lease_s=5) == 5
            assert await client.has_record(b"handoff")
            assert await client.get_record(b"handoff", consume=True) == b"h" * 200_000
            assert await client.get_record(b"handoff") is None
            assert (await client.stats())[up.address]["ssd"]["entries"] == 40

        async with AsyncCacheClient([up.address, gone], timeout_s=20) as client:
            owner = {k: client.ring.node(k) for k in keys}
            found = await client.get_blocks(keys)
            assert found == [None if owner[k] == gone else p for k, p in blocks]
            first_gone = next(i for i, k in enumerate(keys) if owner[k] == gone)
            assert await client.lookup(keys) == first_gone
            probe = [f"swa/{i}".encode() for i in range(20)]  # on both replicas
            held = next(k for k in probe if client.ring.node(k) == up.address)
            await client.put_record(held, b"h", ttl_s=30)
            assert await client.has_records(probe) == [k == held for k in probe]
            assert {client.ring.node(k) for k in probe} == {up.address, gone}
            with pytest.raises(CacheError) as failed:
                await client.put_blocks(blocks)
            assert failed.value.address == gone
            assert failed.value.committed == [k for k in keys if owner[k] != gone]

    asyncio.run(scenario())
