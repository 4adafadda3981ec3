"""Volatile records (SWA state, prefill → decode handoff): DRAM only, with a TTL and an optional lease.

They never touch disk: SWA state is cheap to rebuild by bounded replay, and a handoff is worthless once
its request is gone. An unleased record lives until its TTL and may be evicted earlier, least recently
used first, when the pool is full. A leased record is pinned: it is never evicted for space and lives
until it is consumed or its lease ends, whichever comes first. When the pool is full of pinned records a
new one is refused (RESOURCE_EXHAUSTED) rather than dropping a handoff someone is about to pick up.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import msgspec

from cache_svc.errors import ResourceExhaustedError
from cache_svc.lru import Lru
from cache_svc.stats import Counters


class Record(msgspec.Struct, gc=False):
    payload: bytes
    expires_at: float
    leased: bool


def _size(record: Record) -> int:
    return len(record.payload)


class RecordPool:
    def __init__(self, capacity: int, max_ttl_s: float, clock: Callable[[], float], counters: Counters) -> None:
        self.capacity = capacity
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._counters = counters
        self._lru: Lru[Record] = Lru(float("inf"), _size)  # unleased records
        self._leased: dict[bytes, Record] = {}
        self._leased_bytes = 0
        self._deadlines: list[tuple[float, int, bytes, Record]] = []  # heap of expiry times
        self._seq = itertools.count()

    @property
    def bytes(self) -> int:
        return self._lru.bytes + self._leased_bytes

    def __len__(self) -> int:
        return len(self._lru) + len(self._leased)

    def put(self, key: bytes, payload: bytes, ttl_s: float, lease_s: float) -> float:
        """Store (or replace) a record; returns the lifetime granted in seconds. A refused put changes nothing."""
        lifetime = min(ttl_s or self.max_ttl_s, self.max_ttl_s)
        if lease_s > 0:
            lifetime = min(lifetime, lease_s)
        self._check_room(key, len(payload))
        self._drop(key)
        while self.bytes + len(payload) > self.capacity:
            self._lru.pop_oldest()
            self._counters.record_evictions += 1
        record = Record(payload, self._clock() + lifetime, leased=lease_s > 0)
        if record.leased:
            self._leased[key] = record
            self._leased_bytes += len(payload)
        else:
            self._lru.put(key, record)
        heapq.heappush(self._deadlines, (record.expires_at, next(self._seq), key, record))
        return lifetime

    def get(self, key: bytes, *, consume: bool = False) -> bytes | None:
        self.expire_due()
        record = self._drop(key) if consume else (self._leased.get(key) or self._lru.get(key))
        if record is None:
            self._counters.record_misses += 1
            return None
        self._counters.record_hits += 1
        return record.payload

    def __contains__(self, key: bytes) -> bool:
        self.expire_due()
        return key in self._leased or key in self._lru

    def expire_due(self) -> int:
        """Drop every record whose time is up; returns how many."""
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, key, record = heapq.heappop(self._deadlines)
            if self._current(key) is record:  # not replaced or consumed since
                self._drop(key)
                expired += 1
        self._counters.record_expiries += expired
        return expired

    def _check_room(self, key: bytes, size: int) -> None:
        """Refuse unless expired and unleased records (and the record being replaced) make room for `size`."""
        if size > self.capacity:
            self._counters.refusals_records += 1
            raise ResourceExhaustedError(
                f"record of {size} bytes exceeds the record pool capacity of {self.capacity} bytes"
            )
        self.expire_due()
        old = self._leased.get(key)
        pinned = self._leased_bytes - (len(old.payload) if old is not None else 0)
        if pinned + size > self.capacity:
            self._counters.refusals_records += 1
            raise ResourceExhaustedError(
                f"record pool full: {pinned} of {self.capacity} bytes held by leased records, {size} more requested"
            )

    def _current(self, key: bytes) -> Record | None:
        return self._leased.get(key) or self._lru.peek(key)

    def _drop(self, key: bytes) -> Record | None:
        record = self._leased.pop(key, None)
        if record is not None:
            self._leased_bytes -= len(record.payload)
            return record
        return self._lru.pop(key)
