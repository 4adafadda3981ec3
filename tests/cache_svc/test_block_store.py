"""Global KV blocks through a real server and client: tiers, checksums, restart, retention, capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cache_helpers import FakeClock, key_of, payload_of

from cache_svc import segment as fmt
from cache_svc.client import CacheClient, CacheError

HOUR = 3600.0
BLOCK = 57_000  # one 64-token block of the released model is 56,960 B


def _blocks(first: int, count: int, size: int = BLOCK) -> list[tuple[bytes, bytes]]:
    return [(key_of(n), payload_of(key_of(n), size)) for n in range(first, first + count)]


def _stats(client: CacheClient) -> dict[str, Any]:
    (only,) = client.stats().values()
    return only


def test_put_get_lookup_round_trip(start_server: Any) -> None:
    server = start_server()
    sizes = [1, 4096, BLOCK, 3 << 20]  # a 3 MiB block travels as several 1 MiB slices
    blocks = [(key_of(i), payload_of(key_of(i), s)) for i, s in enumerate(sizes)]
    with server.client() as client:
        assert client.put_blocks(blocks) == [k for k, _ in blocks]
        keys = [k for k, _ in blocks]
        assert client.get_blocks([*keys, key_of(99)]) == [p for _, p in blocks] + [None]
        assert client.lookup(keys) == 4
        assert client.lookup([keys[0], keys[1], key_of(99), keys[2]]) == 2
        assert client.lookup([]) == 0
        assert client.put_blocks(blocks[:2]) == keys[:2]  # already held: not rewritten
        stats = _stats(client)
    assert stats["ssd"]["entries"] == 4
    assert stats["ssd"]["bytes"] < sum(sizes) + 4 * 100 + 200  # nothing written twice


def test_dram_tier_is_lru(start_server: Any) -> None:
    server = start_server(dram_bytes=3 * BLOCK)
    a, b, c, d = _blocks(0, 4)
    with server.client() as client:
        client.put_blocks([a, b, c])
        client.get_blocks([a[0]])  # a is now the most recently used; b the least
        client.put_blocks([d])  # evicts b from DRAM (not from SSD)
        before = _stats(client)
        assert client.get_blocks([a[0], c[0], d[0]]) == [a[1], c[1], d[1]]
        middle = _stats(client)
        assert client.get_blocks([b[0]]) == [b[1]]
        after = _stats(client)
    assert middle["dram"]["hits"] - before["dram"]["hits"] == 3
    assert after["dram"]["hits"] == middle["dram"]["hits"]
    assert after["ssd"]["hits"] - middle["ssd"]["hits"] == 1
    assert after["dram"]["evictions"] >= 1


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed-segment", "active-segment"])
def test_flipped_byte_is_a_miss_and_the_block_is_dropped(start_server: Any, tmp_path: Path, sealed: bool) -> None:
    """A sealed segment is loaded from its index file and checked at read time; the active one is checked
    at recovery. Either way the block is never served."""
    data = tmp_path / "data"
    options = {"dram_bytes": 0, "segment_bytes": BLOCK if sealed else 64 << 20}
    server = start_server(data_dir=data, **options)
    blocks = _blocks(0, 3)
    with server.client() as client:
        for block in blocks:
            client.put_blocks([block])
    server.stop()
    segment = next(p for p in data.glob("*.seg") if blocks[1][1][:64] in p.read_bytes())
    raw = bytearray(segment.read_bytes())
    raw[raw.find(blocks[1][1][:64]) + 1000] ^= 0x40
    segment.write_bytes(bytes(raw))

    server = start_server(data_dir=data, **options)
    keys = [k for k, _ in blocks]
    with server.client() as client:
        assert client.get_blocks(keys) == [blocks[0][1], None, blocks[2][1]]
        assert client.lookup(keys) == 1  # dropped from the index, not just skipped
        assert client.get_blocks(keys[1:2]) == [None]
        stats = _stats(client)
    assert stats["corrupt_blocks"] == (1 if sealed else 0)  # at recovery it counts in the recovery log line


def test_restart_keeps_every_block_and_rebuilds_lost_index_files(start_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_server(data_dir=data, segment_bytes=4 * BLOCK)
    blocks = _blocks(0, 40)
    with server.client() as client:
        for i in range(0, 40, 4):
            client.put_blocks(blocks[i : i + 4])
    server.stop()
    indexes = sorted(data.glob("*.idx"))
    assert len(indexes) >= 5
    indexes[0].unlink()
    indexes[1].write_bytes(b"not an index")

    server = start_server(data_dir=data, segment_bytes=4 * BLOCK)
    with server.client() as client:
        assert client.lookup([k for k, _ in blocks]) == 40
        assert client.get_blocks([k for k, _ in blocks]) == [p for _, p in blocks]
    assert fmt.read_index(data, int(indexes[0].stem)) is not None


def test_capacity_policy_evicts_expired_first_then_refuses(start_server: Any, tmp_path: Path) -> None:
    clock = FakeClock()
    # 1 MiB tier in 64 KiB segments: room for about 16 blocks of 57 KB.
    server = start_server(clock=clock, ssd_bytes=1 << 20, segment_bytes=64 << 10, retention_hours=72)
    old = _blocks(0, 8)
    with server.client() as client:
        client.put_blocks(old)
        clock.advance(71 * HOUR)
        young = _blocks(100, 6)
        client.put_blocks(young)

        # Full of blocks still inside their 72 h: a new write is refused, nothing retained is dropped.
        with pytest.raises(CacheError) as refused:
            client.put_blocks(_blocks(200, 6))
        assert refused.value.code.name == "RESOURCE_EXHAUSTED"
        assert "retention" in refused.value.details
        assert client.lookup([k for k, _ in old]) == 8
        assert _stats(client)["refusals"] == 1

        # Two hours later the first eight are past retention: they go first, the young ones stay.
        clock.advance(2 * HOUR)
        fresh = _blocks(200, 6)
        assert client.put_blocks(fresh) == [k for k, _ in fresh]
        assert client.get_blocks([k for k, _ in young + fresh]) == [p for _, p in young + fresh]
        remaining_old = sum(p is not None for p in client.get_blocks([k for k, _ in old]))
        stats = _stats(client)
    assert remaining_old < 8
    assert stats["ssd"]["evictions"] == 8 - remaining_old
    assert stats["ssd"]["bytes"] <= 1 << 20
    assert stats["compactions"] >= 1


def test_expired_blocks_stay_readable_until_space_is_needed(start_server: Any) -> None:
    clock = FakeClock()
    server = start_server(clock=clock, retention_hours=1)
    blocks = _blocks(0, 4)
    with server.client() as client:
        client.put_blocks(blocks)
        clock.advance(10 * HOUR)
        assert client.get_blocks([k for k, _ in blocks]) == [p for _, p in blocks]
        # A put of an expired block rewrites it, which renews its retention.
        client.put_blocks(blocks[:1])
        stats = _stats(client)
    assert stats["ssd"]["entries"] == 4
    assert stats["dead_bytes"] > 0


def test_compaction_reclaims_dead_space(start_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_server(data_dir=data, dram_bytes=0, segment_bytes=2 * BLOCK)
    blocks = _blocks(0, 6)
    with server.client() as client:
        for i in range(0, 6, 2):
            client.put_blocks(blocks[i : i + 2])
    server.stop()
    first_segment = sorted(data.glob("*.seg"))[0]
    raw = bytearray(first_segment.read_bytes())
    for _, payload in blocks[:2]:  # corrupt both blocks of the first segment
        raw[raw.find(payload[:64]) + 500] ^= 0x01
    first_segment.write_bytes(bytes(raw))

    server = start_server(data_dir=data, dram_bytes=0, segment_bytes=2 * BLOCK)
    with server.client() as client:
        assert client.get_blocks([k for k, _ in blocks]) == [None, None] + [p for _, p in blocks[2:]]
        stats = _stats(client)
    server.stop()
    assert stats["compactions"] == 1  # the dead segment went without any space pressure
    assert not first_segment.exists()
    assert stats["dead_bytes"] == 0
