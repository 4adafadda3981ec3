"""Global KV blocks: the block index, the DRAM LRU tier, the SSD segment log, retention and capacity.

Reads go DRAM tier → SSD tier → miss. An SSD read verifies the entry's checksum; a block that fails it is
dropped from the index and reported as a miss, never served. Writes go through to the SSD tier (one
fsync per commit group) and are indexed and cached in DRAM only once durable.

Retention: a block committed at t is kept until at least t + retention. The capacity policy keeps the
segment files within `ssd_bytes`: it reclaims space segment by segment from expired and dead entries,
re-appending the still-retained blocks of a partly reclaimable segment (compaction), and refuses a write
(ResourceExhaustedError → RESOURCE_EXHAUSTED) when every block left is still retained. Expired blocks are not dropped
before space is needed: until then they are still good cache hits.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cache_svc.config import CacheConfig
from cache_svc.errors import ResourceExhaustedError, StorageError
from cache_svc.lru import Lru
from cache_svc.segment import COMMIT, ENTRY_HEADER, Entry
from cache_svc.segment_log import SegmentFile, SegmentLog
from cache_svc.stats import Counters, Histograms
from cache_svc.writer import Writer

READ_THREADS = 4
DEAD_FRACTION_TO_COMPACT = 0.5  # a sealed segment at least this dead is compacted without space pressure


class BlockStore:
    def __init__(
        self,
        log: SegmentLog,
        writer: Writer,
        cfg: CacheConfig,
        *,
        clock: Callable[[], float],
        counters: Counters,
        logger: Any,
    ) -> None:
        self._log = log
        self._writer = writer
        self.ssd_capacity = cfg.ssd_bytes
        self.retention_s = cfg.retention_hours * 3600.0
        self._clock = clock
        self._counters = counters
        self._logger = logger
        self._index: dict[bytes, Entry] = {}
        self.dram: Lru[bytes] = Lru(cfg.dram_bytes, len)
        self._room = asyncio.Lock()  # one capacity decision (and compaction) at a time
        self._reserved = 0  # bytes of commits queued but not yet on disk
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="cache-read")
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(
        cls, cfg: CacheConfig, *, clock: Callable[[], float], counters: Counters, histograms: Histograms, logger: Any
    ) -> BlockStore:
        """Load the data directory (reading index files, scanning only the active segment) and index it."""
        start = time.perf_counter()
        log, recovery = await asyncio.to_thread(SegmentLog.open, Path(cfg.data_dir), cfg.segment_bytes)
        writer = Writer(log, asyncio.get_running_loop(), histograms.group_seconds, histograms.group_blocks)
        store = cls(log, writer, cfg, clock=clock, counters=counters, logger=logger)
        store._load(recovery.entries)  # before serving, so blocking the loop here costs nothing
        logger.info(
            "recovered",
            blocks=len(store._index),
            segments=recovery.segments,
            bytes=log.total_bytes,
            rebuilt_indexes=recovery.rebuilt_indexes,
            truncated_bytes=recovery.truncated_bytes,
            corrupt_dropped=recovery.corrupt,
            seconds=round(time.perf_counter() - start, 3),
        )
        return store

    def _load(self, entries: list[Entry]) -> None:
        """Index recovered entries; of two entries for one key the later commit wins (ties: the later one)."""
        self._index = {e.key: e for e in entries}
        if len(self._index) == len(entries):
            return  # no key twice: the usual case, done at C speed
        index = self._index = {}
        for e in entries:
            old = index.get(e.key)
            if old is None or e.committed_at >= old.committed_at:
                index[e.key] = e
                if old is not None:
                    self._mark_dead(old)
            else:
                self._mark_dead(e)

    # --- reads ------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present."""
        for i, key in enumerate(keys):
            if key not in self._index:
                return i
        return len(keys)

    def __len__(self) -> int:
        return len(self._index)

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(keys)
        wanted: list[tuple[int, Entry, SegmentFile]] = []
        for i, key in enumerate(keys):
            payload = self.dram.get(key)
            if payload is not None:
                self._counters.dram_hits += 1
                found[i] = payload
                continue
            self._counters.dram_misses += 1
            entry = self._index.get(key)
            if entry is None:
                self._counters.ssd_misses += 1
            else:
                wanted.append((i, entry, self._log.acquire(entry.segment)))
        if wanted:
            loop = asyncio.get_running_loop()
            try:
                payloads = await loop.run_in_executor(self._readers, _read_all, [(s, e) for _, e, s in wanted])
            finally:
                for _, _, seg in wanted:
                    self._log.release(seg)
            for (i, entry, _), payload in zip(wanted, payloads, strict=True):
                if payload is None:
                    self._drop_corrupt(entry)
                    self._counters.ssd_misses += 1
                    continue
                self._counters.ssd_hits += 1
                found[i] = payload
                self._cache(entry.key, payload)
        self._counters.get_bytes += sum(len(p) for p in found if p is not None)
        return found

    # --- writes -----------------------------------------------------------------------------------------

    async def put(self, blocks: Sequence[tuple[bytes, bytes]]) -> None:
        """Make `blocks` durable and readable. A block already held and within retention is not rewritten;
        an expired one is, which renews its retention."""
        now = self._clock()
        todo = [(k, p) for k, p in blocks if not self._retained(self._index.get(k), now)]
        if not todo:
            return
        need = sum(ENTRY_HEADER.size + len(p) for _, p in todo) + COMMIT.size
        async with self._room:
            await self._make_room(need)
            self._reserved += need

        def apply(entries: list[Entry] | None, error: BaseException | None) -> None:
            self._reserved -= need
            if entries is None:
                return
            for entry, (_, payload) in zip(entries, todo, strict=True):
                if self._install(entry):
                    self._cache(entry.key, payload)
            self._counters.put_bytes += sum(len(p) for _, p in todo)

        try:
            await asyncio.shield(self._writer.commit(todo, now, apply))
        except (OSError, RuntimeError) as exc:
            self._logger.error("commit_failed", error=str(exc), blocks=len(todo))
            raise StorageError(f"the SSD tier failed to write: {exc}") from exc

    def _install(self, entry: Entry) -> bool:
        """Point the index at a newly written entry unless a later commit of the key is already there."""
        old = self._index.get(entry.key)
        if old is not None and old.committed_at > entry.committed_at:
            self._mark_dead(entry)
            return False
        self._index[entry.key] = entry
        if old is not None:
            self._mark_dead(old)
        return True

    def _cache(self, key: bytes, payload: bytes) -> None:
        self._counters.dram_evictions += self.dram.put(key, payload)

    def _retained(self, entry: Entry | None, now: float) -> bool:
        return entry is not None and now < entry.committed_at + self.retention_s

    # --- capacity policy and compaction -----------------------------------------------------------------

    async def _make_room(self, need: int) -> None:
        while (used := self._log.total_bytes) + self._reserved + need > self.ssd_capacity:
            now = self._clock()
            victim = self._pick_victim(now)
            if victim is None:
                self._counters.refusals_ssd += 1
                hours = self.retention_s / 3600
                self._logger.warning("ssd_full", used_bytes=used, capacity_bytes=self.ssd_capacity, refused_bytes=need)
                raise ResourceExhaustedError(
                    f"SSD tier full: {used} of {self.ssd_capacity} bytes hold blocks still within their {hours:g} h "
                    f"retention; a put of {need} bytes was refused"
                )
            await self._compact(victim, drop_expired=True)

    def _pick_victim(self, now: float) -> SegmentFile | None:
        """The sealed segment whose compaction frees the most bytes (a wholly reclaimable one at once)."""
        best, best_gain = None, 0
        for seg in self._log.segments():
            if not seg.sealed:
                continue
            gain = self._reclaimable(seg, now)
            if gain == seg.size:
                return seg
            if gain > best_gain:
                best, best_gain = seg, gain
        return best

    def _reclaimable(self, seg: SegmentFile, now: float) -> int:
        """Bytes compaction would free: everything but the live entries still within retention."""
        if seg.dead_bytes == 0 and now < seg.oldest + self.retention_s:
            return 0
        if seg.newest + self.retention_s <= now:
            return seg.size
        kept = sum(e.size for e in seg.entries if self._index.get(e.key) is e and self._retained(e, now))
        return seg.size - kept

    async def _compact(self, victim: SegmentFile, *, drop_expired: bool) -> None:
        """Re-append the victim's live entries (the retained ones only, if `drop_expired`), then delete it."""
        now = self._clock()
        keep: list[Entry] = []
        evicted = 0
        for e in victim.entries:
            if self._index.get(e.key) is not e:
                continue  # dead: superseded, dropped as corrupt, or evicted
            if drop_expired and not self._retained(e, now):
                self._evict(e)
                evicted += 1
            else:
                keep.append(e)
        copied = 0

        def apply(moved: list[tuple[Entry, Entry | None]] | None, error: BaseException | None) -> None:
            nonlocal copied
            for old, new in moved or ():
                if new is None:
                    self._drop_corrupt(old)
                    continue
                copied += new.size
                if self._index.get(old.key) is old:
                    self._index[old.key] = new
                else:
                    self._mark_dead(new)

        if keep:
            try:
                await asyncio.shield(self._writer.copy(victim, keep, apply))
            except (OSError, RuntimeError) as exc:
                self._logger.error("compaction_failed", segment=victim.id, error=str(exc))
                raise StorageError(f"the SSD tier failed to write during compaction: {exc}") from exc
        self._log.delete(victim)
        self._counters.compactions += 1
        self._counters.compaction_copied_bytes += copied
        self._logger.info(
            "compacted",
            segment=victim.id,
            freed_bytes=victim.size - copied,
            copied_bytes=copied,
            evicted=evicted,
        )

    def _evict(self, entry: Entry) -> None:
        del self._index[entry.key]
        self.dram.pop(entry.key)
        self._counters.ssd_evictions += 1

    def _drop_corrupt(self, entry: Entry) -> None:
        if self._index.get(entry.key) is not entry:
            return
        del self._index[entry.key]
        self.dram.pop(entry.key)
        self._counters.corrupt_blocks += 1
        self._logger.warning("corrupt_block", key=entry.key.hex(), segment=entry.segment, offset=entry.offset)
        self._mark_dead(entry)

    def _mark_dead(self, entry: Entry) -> None:
        seg = self._log.segment(entry.segment)
        if seg is None:
            return
        seg.dead_bytes += entry.size
        if seg.sealed and seg.dead_bytes >= DEAD_FRACTION_TO_COMPACT * seg.size and not seg.compacting:
            seg.compacting = True
            # A fresh context: the compaction belongs to no RPC, its log lines should not claim one.
            task = asyncio.get_running_loop().create_task(self._compact_dead(seg), context=contextvars.Context())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _compact_dead(self, seg: SegmentFile) -> None:
        async with self._room:
            if not seg.deleted:
                await self._compact(seg, drop_expired=False)

    # --- introspection and shutdown ---------------------------------------------------------------------

    @property
    def ssd_bytes(self) -> int:
        return self._log.total_bytes

    def segment_stats(self) -> tuple[int, int]:
        """(segment files, dead bytes awaiting compaction)."""
        segments = self._log.segments()
        return len(segments), sum(s.dead_bytes for s in segments)

    async def close(self) -> None:
        """Finish background compactions and queued commits, fsync, close every file."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.to_thread(self._writer.close)
        self._readers.shutdown(wait=True)
        self._log.close()


def _read_all(wanted: list[tuple[SegmentFile, Entry]]) -> list[bytes | None]:
    return [SegmentLog.read(seg, entry) for seg, entry in wanted]
