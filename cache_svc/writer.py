"""The writer thread: every append to the SSD tier goes through it, one commit group at a time.

Commits that arrive while a group is being written and fsynced wait in the queue and then go out together
as the next group, under one fsync (group commit): the more concurrent puts, the fewer fsyncs per block.
Compaction copies go through the same thread so that appends never interleave. Each job's `apply` runs on
the event loop once its group is durable, whether or not the RPC that asked for it is still waiting, so
the block index always matches what is on disk.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from prometheus_client import Histogram

from cache_svc.segment import Entry
from cache_svc.segment_log import SegmentFile, SegmentLog

COPY_GROUP_BYTES = 16 << 20  # compaction copies are fsynced in groups of about this many bytes

Block = tuple[bytes, bytes]
Apply = Callable[[Any, BaseException | None], None]


class Commit(msgspec.Struct):
    blocks: Sequence[Block]
    committed_at: float
    apply: Apply  # (list[Entry] | None, error) on the event loop
    future: asyncio.Future[list[Entry]]


class Copy(msgspec.Struct):
    victim: SegmentFile
    entries: Sequence[Entry]
    apply: Apply  # (list[tuple[old Entry, new Entry | None]] | None, error) on the event loop
    future: asyncio.Future[list[tuple[Entry, Entry | None]]]


class Writer:
    def __init__(
        self, log: SegmentLog, loop: asyncio.AbstractEventLoop, group_seconds: Histogram, group_blocks: Histogram
    ) -> None:
        self._log = log
        self._loop = loop
        self._group_seconds = group_seconds
        self._group_blocks = group_blocks
        self._queue: queue.SimpleQueue[Commit | Copy | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    def commit(self, blocks: Sequence[Block], committed_at: float, apply: Apply) -> asyncio.Future[list[Entry]]:
        """Append `blocks` durably; `apply(entries, error)` runs on the loop before the future resolves."""
        job = Commit(blocks, committed_at, apply, self._loop.create_future())
        self._queue.put(job)
        return job.future

    def copy(self, victim: SegmentFile, entries: Sequence[Entry], apply: Apply) -> asyncio.Future[Any]:
        """Re-append the still-valid `entries` of `victim` (compaction); corrupt ones come back as None."""
        job = Copy(victim, entries, apply, self._loop.create_future())
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Finish every queued job, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            commits: list[Commit] = []
            for job in jobs:
                if isinstance(job, Commit):
                    commits.append(job)
                    continue
                self._write_group(commits)
                commits = []
                if job is None:
                    return
                self._copy(job)
            self._write_group(commits)

    def _write_group(self, commits: list[Commit]) -> None:
        if not commits:
            return
        start = time.perf_counter()
        try:
            placed = self._log.append([(c.blocks, c.committed_at) for c in commits])
            self._log.roll_if_full()
        except Exception as exc:  # never leave a caller waiting: every failure goes back to its commits
            for c in commits:
                self._finish(c, None, exc)
            return
        self._group_seconds.observe(time.perf_counter() - start)
        self._group_blocks.observe(sum(len(c.blocks) for c in commits))
        for c, entries in zip(commits, placed, strict=True):
            self._finish(c, entries, None)

    def _copy(self, job: Copy) -> None:
        moved: list[tuple[Entry, Entry | None]] = []
        pending: list[tuple[Entry, bytes]] = []
        pending_bytes = 0
        try:
            for old in job.entries:
                payload = self._log.read(job.victim, old)
                if payload is None:
                    moved.append((old, None))
                    continue
                pending.append((old, payload))
                pending_bytes += len(payload)
                if pending_bytes >= COPY_GROUP_BYTES:
                    moved += self._append_copies(pending)
                    pending, pending_bytes = [], 0
            moved += self._append_copies(pending)
        except Exception as exc:
            self._finish(job, None, exc)
            return
        self._finish(job, moved, None)

    def _append_copies(self, pending: list[tuple[Entry, bytes]]) -> list[tuple[Entry, Entry | None]]:
        """Append copies that keep their original commit time, so retention is unchanged by compaction."""
        if not pending:
            return []
        placed = self._log.append([([(old.key, payload)], old.committed_at) for old, payload in pending])
        self._log.roll_if_full()
        return [(old, new) for (old, _), (new,) in zip(pending, placed, strict=True)]

    def _finish(self, job: Commit | Copy, result: Any, error: BaseException | None) -> None:
        self._loop.call_soon_threadsafe(_resolve, job, result, error)


def _resolve(job: Commit | Copy, result: Any, error: BaseException | None) -> None:
    job.apply(result, error)
    if job.future.done():  # the caller was cancelled; the work is applied all the same
        return
    if error is not None:
        job.future.set_exception(error)
    else:
        job.future.set_result(result)
