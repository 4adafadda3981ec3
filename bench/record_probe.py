"""The SWA-record probe every prefill makes, batched (ours) against one Lookup per record key (the peer: the client
before 2026-11-30), side by side in one run on real cache servers.

    python bench/record_probe.py [--ends 63] [--shards 1,3] [--concurrency 1,8] [--rounds 200]
        [--out bench/out/record_probe.json]

A prefill does not know where the conversation's previous turn ended inside its last cached block, so it asks the
cache which of the up to `kv_block_tokens` − 1 possible ends holds an SWA record (model_service/kvstore.py,
`_find_record`) — before the encoder starts, on every request, so the probe's latency is time to first token. Ours
sends one Lookup per shard holding any of the keys (`AsyncCacheClient.has_records`); the peer sends one Lookup per
key, concurrently. `concurrency` prefills probe at once (a busy prefill replica). Reported: median and p90 latency of
one probe and the ratio peer / ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cache_bench import Ours  # noqa: E402
from serve_bench import machine  # noqa: E402

from cache_svc.client import AsyncCacheClient  # noqa: E402

Probe = Callable[[AsyncCacheClient, list[bytes]], Awaitable[list[bool]]]


async def batched(client: AsyncCacheClient, keys: list[bytes]) -> list[bool]:
    return await client.has_records(keys)


async def one_rpc_per_key(client: AsyncCacheClient, keys: list[bytes]) -> list[bool]:
    return [found for [found] in await asyncio.gather(*(client.has_records([key]) for key in keys))]


PROBES: dict[str, Probe] = {"ours": batched, "peer": one_rpc_per_key}


async def measure(addresses: list[str], ends: int, concurrency: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per probe for each side, the sides alternating round by round (a shared machine's load hits both)."""
    seconds: dict[str, list[float]] = {name: [] for name in PROBES}
    async with AsyncCacheClient(addresses, timeout_s=30) as client:
        held = os.urandom(16)  # one end holds a record, as after a conversation's previous turn
        await client.put_record(held, b"state", ttl_s=600)
        prompts = [[os.urandom(16) for _ in range(ends - 1)] + [held] for _ in range(concurrency)]
        for probe in PROBES.values():  # warm the channels
            await asyncio.gather(*(probe(client, keys) for keys in prompts))
        for _ in range(rounds):
            for name, probe in PROBES.items():
                started = time.perf_counter()
                found = await asyncio.gather(*(probe(client, keys) for keys in prompts))
                seconds[name].append(time.perf_counter() - started)
                assert all(f == [False] * (ends - 1) + [True] for f in found), f"{name} answered wrong"
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ends", type=int, default=63, help="record keys per probe (kv_block_tokens − 1)")
    parser.add_argument("--shards", default="1,3", help="cache replicas, comma-separated counts")
    parser.add_argument("--concurrency", default="1,8", help="probes at once, comma-separated counts")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "record_probe.json")
    args = parser.parse_args()

    table = Table(title=f"SWA-record probe of {args.ends} ends: latency of one round (all concurrent probes)")
    for column in ("shards", "concurrent", "ours median ms", "ours p90", "peer median ms", "peer p90", "peer / ours"):
        table.add_column(column, justify="right")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for shards in map(int, args.shards.split(",")):
            servers = [Ours(Path(work) / f"{shards}-{i}") for i in range(shards)]
            try:
                for concurrency in map(int, args.concurrency.split(",")):
                    seconds = asyncio.run(measure([s.address for s in servers], args.ends, concurrency, args.rounds))
                    stats = {name: latency_summary(values) for name, values in seconds.items()}
                    rows.append({"shards": shards, "concurrency": concurrency, **stats})
                    ratio = stats["peer"]["median_ms"] / stats["ours"]["median_ms"]
                    table.add_row(
                        str(shards), str(concurrency),
                        f"{stats['ours']['median_ms']:.2f}", f"{stats['ours']['p90_ms']:.2f}",
                        f"{stats['peer']['median_ms']:.2f}", f"{stats['peer']['p90_ms']:.2f}", f"{ratio:.1f}×",
                    )  # fmt: skip
            finally:
                for server in servers:
                    server.stop()
    Console(width=150).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "ends": args.ends, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def latency_summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
    }


if __name__ == "__main__":
    sys.exit(main())
