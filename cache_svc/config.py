"""The cache service's one typed configuration (flags and CACHE_SVC_* environment variables)."""

from __future__ import annotations

import os
import shutil
from typing import Annotated, Literal

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

ENV_PREFIX = "CACHE_SVC"
MIN_SEGMENTS = 16  # the SSD tier holds at least this many segments' worth of bytes
MIN_SEGMENT_BYTES = 64 << 10


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Persistent KV store: global KV blocks in a DRAM LRU tier and an SSD tier, volatile records in DRAM.

    host: address to listen on
    port: gRPC port (0 picks a free port, logged at start)
    data_dir: directory of the SSD tier (segment files and their index files)
    dram_bytes: capacity of the DRAM LRU tier for blocks (0 disables it)
    ssd_bytes: capacity of the SSD tier (0 = what the data directory holds now + 90 % of the free space)
    retention_hours: a committed block is kept at least this long; only older blocks are evicted for space
    record_bytes: capacity of the DRAM pool for volatile records (0 = 10 % of host memory)
    record_ttl_s: default and maximum lifetime of a volatile record
    segment_bytes: a segment file is sealed (and its index file written) once it reaches this size
    max_block_bytes: largest accepted block payload
    put_lease_s: a put stream must commit within this many seconds of its first message
    max_staged_bytes: bytes of uncommitted puts held at once (more are refused)
    metrics_port: Prometheus /metrics port (0 disables it)
    metrics_host: address of the metrics endpoint
    grace_s: seconds in-flight RPCs get to finish after SIGTERM
    log_level: debug, info, warning or error
    """

    host: str = "127.0.0.1"
    port: NonNegative = 7001
    data_dir: str
    dram_bytes: NonNegative = 1 << 30
    ssd_bytes: NonNegative = 0
    retention_hours: PositiveFloat = 72.0
    record_bytes: NonNegative = 0
    record_ttl_s: PositiveFloat = 300.0
    segment_bytes: Positive = 256 << 20
    max_block_bytes: Positive = 64 << 20
    put_lease_s: PositiveFloat = 60.0
    max_staged_bytes: Positive = 1 << 30
    metrics_port: NonNegative = 0
    metrics_host: str = "0.0.0.0"
    grace_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"


def resolve_defaults(cfg: CacheConfig) -> CacheConfig:
    """Turn the 0 = automatic sizes into bytes for this machine, so the start-up line shows real values."""
    ssd = cfg.ssd_bytes
    if ssd == 0:
        os.makedirs(cfg.data_dir, exist_ok=True)
        held = sum(entry.stat().st_size for entry in os.scandir(cfg.data_dir) if entry.is_file())
        ssd = held + int(shutil.disk_usage(cfg.data_dir).free * 0.9)
    records = cfg.record_bytes or host_memory_bytes() // 10
    # Only sealed segments can be compacted: keep segments small next to the tier so space can always be found.
    segment = min(cfg.segment_bytes, max(ssd // MIN_SEGMENTS, MIN_SEGMENT_BYTES))
    return msgspec.structs.replace(cfg, ssd_bytes=ssd, record_bytes=records, segment_bytes=segment)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
