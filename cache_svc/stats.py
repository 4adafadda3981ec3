"""What the service counts, kept once: the Stats RPC and the Prometheus endpoint both read from here.

Counters are plain integers bumped on the event loop; gauges (entries, bytes, capacities) are read from
the live tiers when asked. Latency and commit-group histograms are Prometheus objects, safe to observe
from the writer thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mesh.metrics import LATENCY_BUCKETS
from proto.cache.v1 import cache_pb2


class Counters(msgspec.Struct):
    dram_hits: int = 0
    dram_misses: int = 0
    dram_evictions: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    ssd_evictions: int = 0  # expired blocks dropped by the capacity policy
    corrupt_blocks: int = 0
    compactions: int = 0
    compaction_copied_bytes: int = 0
    refusals_ssd: int = 0
    refusals_records: int = 0
    refusals_staging: int = 0
    record_hits: int = 0
    record_misses: int = 0
    record_expiries: int = 0
    record_evictions: int = 0
    record_deletions: int = 0
    record_put_bytes: int = 0
    aborted_puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0


class Histograms:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rpc_seconds = Histogram(
            "cache_rpc_duration_seconds",
            "Time to serve one RPC",
            ["method"],
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS),
        )
        self.group_seconds = Histogram(
            "cache_commit_group_seconds",
            "Time to write and fsync one commit group",
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS),
        )
        self.group_blocks = Histogram(
            "cache_commit_group_blocks",
            "Blocks made durable by one fsync (group commit)",
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )


# (family, name, help, TierStats field) of the per-tier metrics.
TIER_METRICS = (
    (CounterMetricFamily, "cache_hits", "Reads served, per tier", "hits"),
    (CounterMetricFamily, "cache_misses", "Reads not served, per tier", "misses"),
    (CounterMetricFamily, "cache_evictions", "Entries dropped for space, per tier", "evictions"),
    (GaugeMetricFamily, "cache_entries", "Entries held, per tier", "entries"),
    (GaugeMetricFamily, "cache_bytes", "Bytes held, per tier", "bytes"),
    (GaugeMetricFamily, "cache_capacity_bytes", "Capacity, per tier", "capacity_bytes"),
)


class StatsCollector(Collector):
    """Prometheus view of `snapshot()` (the Stats RPC's answer) and the raw counters."""

    def __init__(self, snapshot: Callable[[], cache_pb2.StatsResponse], counters: Counters) -> None:
        self._snapshot = snapshot
        self._counters = counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s, c = self._snapshot(), self._counters
        tiers = {"dram": s.dram, "ssd": s.ssd, "records": s.records}
        for family, name, help_, field in TIER_METRICS:
            metric = family(name, help_, labels=["tier"])
            for tier, stats in tiers.items():
                metric.add_metric([tier], getattr(stats, field))
            yield metric
        refusals = CounterMetricFamily("cache_refusals", "Writes refused with RESOURCE_EXHAUSTED", labels=["reason"])
        refusals.add_metric(["ssd_full"], c.refusals_ssd)
        refusals.add_metric(["record_pool_full"], c.refusals_records)
        refusals.add_metric(["staging_full"], c.refusals_staging)
        yield refusals
        for name, help_, value in (
            ("cache_record_expiries", "Records dropped at the end of their TTL or lease", c.record_expiries),
            ("cache_record_deletions", "Records removed by DeleteRecords", c.record_deletions),
            (
                "cache_record_put_bytes",
                "Record payload bytes received (once per put, however many keys)",
                c.record_put_bytes,
            ),
            ("cache_corrupt_blocks", "Blocks that failed their checksum and were dropped", c.corrupt_blocks),
            ("cache_compactions", "Segments compacted away", c.compactions),
            ("cache_compaction_copied_bytes", "Bytes re-appended by compaction", c.compaction_copied_bytes),
            ("cache_aborted_puts", "Puts that ended without commit", c.aborted_puts),
            ("cache_put_bytes", "Block payload bytes committed", c.put_bytes),
            ("cache_get_bytes", "Block payload bytes served", c.get_bytes),
        ):
            yield CounterMetricFamily(name, help_, value=value)
        for name, help_, value in (
            ("cache_segments", "Segment files on disk", s.segments),
            ("cache_dead_bytes", "Bytes of dropped entries awaiting compaction", s.dead_bytes),
            ("cache_staged_bytes", "Bytes of puts not yet committed", s.staged_bytes),
        ):
            yield GaugeMetricFamily(name, help_, value=value)


def tier_stats(counters: Counters, name: str, *, entries: int, held: int, capacity: int) -> cache_pb2.TierStats:
    """One tier's answer: what it holds, and its `<name>_hits`, `<name>_misses` and `<name>_evictions` counters."""
    return cache_pb2.TierStats(
        entries=entries,
        bytes=held,
        capacity_bytes=capacity,
        hits=getattr(counters, f"{name}_hits"),
        misses=getattr(counters, f"{name}_misses"),
        evictions=getattr(counters, f"{name}_evictions"),
    )
