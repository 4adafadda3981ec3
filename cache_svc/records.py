"""Volatile records (SWA state, prefill → decode handoff): DRAM only, with a TTL and an optional lease.

They never touch disk: SWA state is cheap to rebuild by bounded replay, and a handoff is worthless once
its request is gone. An unleased record lives until its TTL and may be evicted earlier, least recently
used first, when the pool is full. A leased record is pinned: it is never evicted for space and lives
until it is consumed, deleted or its lease ends, whichever comes first. When the pool is full of pinned
records a new one is refused (RESOURCE_EXHAUSTED) rather than dropping a handoff someone is about to pick up.

One put may name several keys (the n handoffs of one prefill): each key is a record of its own — consumed
once, with its own deadline — but all of them share one `Payload`, counted once against the capacity and
freed when the last record holding it ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from cache_svc.errors import ResourceExhaustedError
from cache_svc.stats import Counters


class Payload(msgspec.Struct, gc=False):
    """Bytes stored once for every record that names them."""

    data: bytes
    leased: bool
    refs: int = 0  # records holding it


class Record(msgspec.Struct, gc=False):
    payload: Payload
    expires_at: float


class RecordPool:
    def __init__(self, capacity: int, max_ttl_s: float, clock: Callable[[], float], counters: Counters) -> None:
        self.capacity = capacity
        self.max_ttl_s = max_ttl_s
        self.bytes = 0  # of distinct payloads
        self._clock = clock
        self._counters = counters
        self._records: dict[bytes, Record] = {}
        self._unleased: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._leased_bytes = 0
        self._deadlines: list[tuple[float, int, bytes, Record]] = []  # heap of expiry times
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, keys: Sequence[bytes], payload: bytes, ttl_s: float, lease_s: float) -> float:
        """Store (or replace) one record per key, all sharing `payload`; returns the lifetime granted in seconds.

        Keys must be distinct. A refused put changes nothing."""
        lifetime = min(ttl_s or self.max_ttl_s, self.max_ttl_s)
        if lease_s > 0:
            lifetime = min(lifetime, lease_s)
        self._check_room(keys, len(payload))
        for key in keys:
            self._drop(key)
        while self.bytes + len(payload) > self.capacity:
            self._drop(next(iter(self._unleased)))
            self._counters.record_evictions += 1
        shared = Payload(payload, leased=lease_s > 0)
        expires_at = self._clock() + lifetime
        for key in keys:
            self._add(key, Record(shared, expires_at))
        return lifetime

    def get(self, key: bytes, *, consume: bool = False) -> bytes | None:
        self.expire_due()
        record = self._drop(key) if consume else self._touch(key)
        if record is None:
            self._counters.record_misses += 1
            return None
        self._counters.record_hits += 1
        return record.payload.data

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these records now; returns how many were present (an absent or expired key is no error)."""
        self.expire_due()
        deleted = sum(self._drop(key) is not None for key in keys)
        self._counters.record_deletions += deleted
        return deleted

    def __contains__(self, key: bytes) -> bool:
        self.expire_due()
        return key in self._records

    def expire_due(self) -> int:
        """Drop every record whose time is up; returns how many."""
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, key, record = heapq.heappop(self._deadlines)
            if self._records.get(key) is record:  # not replaced, consumed or deleted since
                self._drop(key)
                expired += 1
        self._counters.record_expiries += expired
        return expired

    def _check_room(self, keys: Sequence[bytes], size: int) -> None:
        """Refuse unless expired and unleased records (and the records being replaced) make room for `size`."""
        if size > self.capacity:
            self._counters.refusals_records += 1
            raise ResourceExhaustedError(
                f"record of {size} bytes exceeds the record pool capacity of {self.capacity} bytes"
            )
        self.expire_due()
        pinned = self._leased_bytes - self._leased_bytes_freed_by_dropping(keys)
        if pinned + size > self.capacity:
            self._counters.refusals_records += 1
            raise ResourceExhaustedError(
                f"record pool full: {pinned} of {self.capacity} bytes held by leased records, {size} more requested"
            )

    def _leased_bytes_freed_by_dropping(self, keys: Sequence[bytes]) -> int:
        """Bytes of leased payloads whose every record is among `keys` (distinct)."""
        dropped: dict[int, tuple[Payload, int]] = {}
        for key in keys:
            record = self._records.get(key)
            if record is not None and record.payload.leased:
                payload, count = dropped.get(id(record.payload), (record.payload, 0))
                dropped[id(payload)] = (payload, count + 1)
        return sum(len(payload.data) for payload, count in dropped.values() if count == payload.refs)

    def _add(self, key: bytes, record: Record) -> None:
        payload = record.payload
        payload.refs += 1
        if payload.refs == 1:
            self._account(payload, len(payload.data))
        if not payload.leased:
            self._unleased[key] = None
        self._records[key] = record
        heapq.heappush(self._deadlines, (record.expires_at, next(self._seq), key, record))

    def _touch(self, key: bytes) -> Record | None:
        """The record, now the most recently used."""
        record = self._records.get(key)
        if record is not None and not record.payload.leased:
            self._unleased.move_to_end(key)
        return record

    def _drop(self, key: bytes) -> Record | None:
        record = self._records.pop(key, None)
        if record is None:
            return None
        payload = record.payload
        payload.refs -= 1
        if payload.refs == 0:
            self._account(payload, -len(payload.data))
        if not payload.leased:
            del self._unleased[key]
        return record

    def _account(self, payload: Payload, change: int) -> None:
        """A payload's bytes come (its first record) or go (its last)."""
        self.bytes += change
        if payload.leased:
            self._leased_bytes += change
