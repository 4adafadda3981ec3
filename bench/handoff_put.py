"""A prefill's n handoff records written once per cache replica (ours) against n PutRecords of the same bytes (the
peer: `KVStore.put_handoffs` before 2026-11-30), side by side in one run on real cache servers.

    python bench/handoff_put.py [--payload-mib 4] [--n 1,4,16] [--shards 1,3] [--rounds 20]
        [--out bench/out/handoff_put.json]

A request with n choices shares one prefill, which leaves one handoff record per choice (prefill_svc, `handoffs`).
Ours is `KVStore.put_handoffs`: one PutRecord per replica owning any of the n fresh handles, the payload stored once
there. The peer sends one PutRecord per handle, concurrently, each carrying the whole payload. The payload is a
Handoff whose encoder state is `--payload-mib` of random bytes (megabytes on a real model). Reported per side: median
and p90 latency of one put_handoffs, the payload bytes the replicas received (their `record_put_bytes` counters) and
the bytes their record pools hold afterwards, and the ratios peer / ours. Every put is checked (n records present)
and its records deleted between rounds, outside the timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
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
from record_probe import latency_summary  # noqa: E402
from serve_bench import machine  # noqa: E402

from cache_svc.client import AsyncCacheClient  # noqa: E402
from model import build_model, preset  # noqa: E402
from model_service.kvstore import HANDLE_PREFIX, KVStore  # noqa: E402
from proto.prefill.v1 import prefill_pb2  # noqa: E402

LEASE_S = 60.0
Put = Callable[[KVStore, prefill_pb2.Handoff, int], Awaitable[list[bytes]]]


async def shared(store: KVStore, handoff: prefill_pb2.Handoff, n: int) -> list[bytes]:
    return await store.put_handoffs(handoff, LEASE_S, n)


async def one_put_per_handle(store: KVStore, handoff: prefill_pb2.Handoff, n: int) -> list[bytes]:
    """The peer, the happy path of put_handoffs before 2026-11-30: serialised once, then n concurrent PutRecords."""
    payload = handoff.SerializeToString()
    handles = [HANDLE_PREFIX + secrets.token_bytes(16) for _ in range(n)]
    await asyncio.gather(*(store.cache.put_record(h, payload, ttl_s=LEASE_S, lease_s=LEASE_S) for h in handles))
    return handles


PUTS: dict[str, Put] = {"ours": shared, "peer": one_put_per_handle}


async def _totals(client: AsyncCacheClient) -> tuple[int, int, int]:
    """(records, bytes held, payload bytes received) summed over the replicas."""
    stats = (await client.stats()).values()
    return (
        sum(s["records"]["entries"] for s in stats),
        sum(s["records"]["bytes"] for s in stats),
        sum(s["record_put_bytes"] for s in stats),
    )


async def measure(addresses: list[str], payload_bytes: int, n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per side: seconds, bytes received and bytes held per put, the sides alternating round by round."""
    encoder = build_model(preset("tiny"), "encoder", device="meta")  # KVStore reads only its args and fingerprint
    handoff = prefill_pb2.Handoff(token_ids=range(1000), encoder_state=os.urandom(payload_bytes))
    found: dict[str, dict[str, list[float]]] = {name: {"seconds": [], "sent": [], "held": []} for name in PUTS}
    async with AsyncCacheClient(addresses, timeout_s=60) as client:
        store = KVStore(client, encoder)
        for round_ in range(rounds + 1):  # round 0 warms the channels
            for name, put in PUTS.items():
                _, _, received = await _totals(client)
                started = time.perf_counter()
                handles = await put(store, handoff, n)
                seconds = time.perf_counter() - started
                records, held, now_received = await _totals(client)
                assert (records, len(set(handles))) == (n, n), f"{name}: {records} records for {n} handles"
                assert await client.delete_records(handles) == n, f"{name}: not every record was stored"
                if round_:
                    found[name]["seconds"].append(seconds)
                    found[name]["sent"].append(now_received - received)
                    found[name]["held"].append(held)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--payload-mib", type=float, default=4.0, help="size of the handoff's encoder state")
    parser.add_argument("--n", default="1,4,16", help="handoff records per prefill (choices), comma-separated")
    parser.add_argument("--shards", default="1,3", help="cache replicas, comma-separated counts")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "handoff_put.json")
    args = parser.parse_args()
    payload_bytes = int(args.payload_mib * (1 << 20))
    counts = [int(n) for n in args.n.split(",")]

    table = Table(title=f"put_handoffs of a {args.payload_mib:g} MiB handoff for n decodes")
    columns = ("shards", "n", "ours ms", "ours p90", "peer ms", "peer p90", "peer / ours")
    for column in (*columns, "ours MiB sent", "peer MiB sent", "sent peer / ours", "ours MiB held", "peer MiB held"):
        table.add_column(column, justify="right")
    rows = []
    pool = max(counts) * (payload_bytes + (1 << 20)) * 2  # the peer's n copies, with room to spare
    with tempfile.TemporaryDirectory() as work:
        for shards in map(int, args.shards.split(",")):
            servers = [Ours(Path(work) / f"{shards}-{i}", "--record-bytes", str(pool)) for i in range(shards)]
            try:
                for n in counts:
                    found = asyncio.run(measure([s.address for s in servers], payload_bytes, n, args.rounds))
                    row = {"shards": shards, "n": n, **{name: _summary(values) for name, values in found.items()}}
                    rows.append(row)
                    ours, peer = row["ours"], row["peer"]
                    table.add_row(
                        str(shards), str(n),
                        f"{ours['median_ms']:.1f}", f"{ours['p90_ms']:.1f}",
                        f"{peer['median_ms']:.1f}", f"{peer['p90_ms']:.1f}",
                        f"{peer['median_ms'] / ours['median_ms']:.2f}×",
                        f"{ours['sent_mib']:.1f}", f"{peer['sent_mib']:.1f}",
                        f"{peer['sent_mib'] / ours['sent_mib']:.1f}×",
                        f"{ours['held_mib']:.1f}", f"{peer['held_mib']:.1f}",
                    )  # fmt: skip
            finally:
                for server in servers:
                    server.stop()
    Console(width=180).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "payload_bytes": payload_bytes, "rounds": args.rounds, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _summary(values: dict[str, list[float]]) -> dict[str, float]:
    mib = 1 << 20
    return {
        **latency_summary(values["seconds"]),
        "sent_mib": statistics.mean(values["sent"]) / mib,
        "held_mib": statistics.mean(values["held"]) / mib,
    }


if __name__ == "__main__":
    sys.exit(main())
