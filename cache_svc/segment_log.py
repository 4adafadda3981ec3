"""The SSD tier's files: recovery at start, appends of commit groups, reads, and deletion of segments.

One thread (`cache_svc.writer`) appends; reads come from a thread pool; deciding what to delete is the
event loop's job. A segment is *active* while it takes appends and *sealed* once it reaches
`segment_bytes`, at which point its index file is written so that a restart loads it without reading
the segment (restart time grows with the number of blocks, not their bytes).
"""

from __future__ import annotations

import errno
import fcntl
import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec

from cache_svc import segment as fmt
from cache_svc.segment import Entry

IOV_MAX = 1024  # buffers per pwritev call (Linux limit)
_committed_at = operator.attrgetter("committed_at")


class DataDirInUseError(OSError):
    """Another process holds the data directory's lock."""


class SegmentFile:
    """One open segment file and what the store tracks about it."""

    def __init__(self, segment: int, path: Path, fd: int, size: int, entries: list[Entry], *, sealed: bool) -> None:
        self.id = segment
        self.path = path
        self.fd = fd
        self.size = size
        self.entries = entries  # every committed entry in the file, in file order
        self.sealed = sealed
        times = list(map(_committed_at, entries))
        self.oldest = min(times, default=float("inf"))
        self.newest = max(times, default=float("-inf"))
        self.dead_bytes = 0  # entries no longer in the block index (event loop only)
        self.readers = 0  # reads in flight; the fd stays open until they finish (event loop only)
        self.deleted = False
        self.compacting = False  # a dead-space compaction is scheduled (event loop only)

    def add(self, entries: Sequence[Entry], end: int) -> None:
        self.entries.extend(entries)
        self.size = end
        times = list(map(_committed_at, entries))
        self.oldest = min(self.oldest, *times) if times else self.oldest
        self.newest = max(self.newest, *times) if times else self.newest


class Recovery(msgspec.Struct, frozen=True):
    """What opening the data directory found."""

    entries: list[Entry]  # in segment and file order: a later entry for a key supersedes an earlier one
    segments: int
    rebuilt_indexes: int  # sealed segments whose index file was missing or damaged and was rebuilt
    truncated_bytes: int  # uncommitted or torn bytes cut off the active segment
    corrupt: int  # entries dropped because their checksum failed


class SegmentLog:
    def __init__(self, data_dir: Path, segment_bytes: int, lock_fd: int) -> None:
        self.data_dir = data_dir
        self.segment_bytes = segment_bytes
        self._lock_fd = lock_fd
        self._segments: dict[int, SegmentFile] = {}
        self._segments_lock = threading.Lock()  # the writer thread adds segments, the event loop removes them
        self.active: SegmentFile

    # --- opening ----------------------------------------------------------------------------------------

    @classmethod
    def open(cls, data_dir: Path, segment_bytes: int) -> tuple[SegmentLog, Recovery]:
        """Lock the data directory and load every segment; cut the active one back to its last commit."""
        data_dir.mkdir(parents=True, exist_ok=True)
        log = cls(data_dir, segment_bytes, _lock(data_dir))
        for tmp in data_dir.glob("*.tmp"):
            tmp.unlink()
        ids = sorted(int(p.stem) for p in data_dir.glob("*.seg") if p.stem.isdigit())
        for orphan in data_dir.glob("*.idx"):
            if orphan.stem.isdigit() and int(orphan.stem) not in ids:
                orphan.unlink()
        entries: list[Entry] = []
        rebuilt = truncated = corrupt = 0
        for seg_id in ids[:-1]:
            seg_entries = fmt.read_index(data_dir, seg_id)
            if seg_entries is None:
                scan = fmt.scan_segment(fmt.segment_path(data_dir, seg_id), seg_id)
                seg_entries, corrupt = scan.entries, corrupt + scan.corrupt
                fmt.write_index(data_dir, seg_id, seg_entries)
                rebuilt += 1
            log._register(log._open_file(seg_id, seg_entries, sealed=True))
            entries.extend(seg_entries)
        if ids:
            last = ids[-1]
            path = fmt.segment_path(data_dir, last)
            scan = fmt.scan_segment(path, last)
            size = path.stat().st_size
            truncated, corrupt = size - max(scan.end, fmt.SEGMENT_HEADER.size), corrupt + scan.corrupt
            if scan.end == 0:  # the header itself never made it: start the file over
                path.write_bytes(fmt.segment_header(last))
            os.truncate(path, max(scan.end, fmt.SEGMENT_HEADER.size))
            log.active = log._register(log._open_file(last, scan.entries, sealed=False))
            entries.extend(scan.entries)
            log.roll_if_full()
        else:
            log.active = log._create(1)
        return log, Recovery(entries, len(log._segments), rebuilt, max(truncated, 0), corrupt)

    def _open_file(self, seg_id: int, entries: list[Entry], *, sealed: bool) -> SegmentFile:
        path = fmt.segment_path(self.data_dir, seg_id)
        fd = os.open(path, os.O_RDWR)
        return SegmentFile(seg_id, path, fd, os.fstat(fd).st_size, entries, sealed=sealed)

    def _register(self, seg: SegmentFile) -> SegmentFile:
        with self._segments_lock:
            self._segments[seg.id] = seg
        return seg

    def _create(self, seg_id: int) -> SegmentFile:
        path = fmt.segment_path(self.data_dir, seg_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        header = fmt.segment_header(seg_id)
        os.pwrite(fd, header, 0)
        os.fdatasync(fd)
        fmt.fsync_dir(self.data_dir)
        return self._register(SegmentFile(seg_id, path, fd, len(header), [], sealed=False))

    # --- writer thread ----------------------------------------------------------------------------------

    def append(self, batches: Sequence[tuple[Sequence[tuple[bytes, bytes]], float]]) -> list[list[Entry]]:
        """Write every (blocks, committed_at) batch as one commit group, fsync it, and say where blocks landed."""
        seg = self.active
        pos = seg.size
        buffers: list[bytes] = []
        crcs: list[int] = []
        placed: list[list[Entry]] = []
        for blocks, committed_at in batches:
            entries = []
            for key, payload in blocks:
                header, crc = fmt.entry_header(key, payload, committed_at)
                entries.append(Entry(key, pos, len(payload), crc, committed_at, seg.id))
                buffers += (header, payload)
                crcs.append(crc)
                pos += len(header) + len(payload)
            placed.append(entries)
        end = pos + fmt.COMMIT.size
        buffers.append(fmt.commit_marker(crcs))
        self._write(seg, buffers, end)
        seg.add([e for entries in placed for e in entries], end)
        return placed

    def _write(self, seg: SegmentFile, buffers: list[bytes], end: int) -> None:
        offset = seg.size
        try:
            for start in range(0, len(buffers), IOV_MAX):
                chunk = buffers[start : start + IOV_MAX]
                want = sum(len(b) for b in chunk)
                done = os.pwritev(seg.fd, chunk, offset)
                if done != want:  # a short write: finish it buffer by buffer
                    rest = b"".join(chunk)[done:]
                    while rest:
                        n = os.pwrite(seg.fd, rest, offset + done)
                        rest, done = rest[n:], done + n
                offset += want
            os.fdatasync(seg.fd)
        except OSError:
            # Leave the file as it was before this group, so recovery and the next group see a clean end.
            os.ftruncate(seg.fd, seg.size)
            raise
        if offset != end:
            raise RuntimeError(f"segment {seg.id}: wrote up to {offset}, expected {end}")

    def roll_if_full(self) -> SegmentFile | None:
        """Seal the active segment once it is full: write its index file and start the next one."""
        seg = self.active
        if seg.size < self.segment_bytes:
            return None
        fmt.write_index(self.data_dir, seg.id, seg.entries)
        self.active = self._create(seg.id + 1)
        seg.sealed = True
        return seg

    # --- any thread -------------------------------------------------------------------------------------

    @staticmethod
    def read(seg: SegmentFile, entry: Entry) -> bytes | None:
        """The payload of a committed entry, or None when the bytes on disk fail their checksum."""
        try:
            raw = os.pread(seg.fd, entry.size, entry.offset)
        except OSError:
            return None
        return fmt.payload_of(entry, raw)

    @property
    def total_bytes(self) -> int:
        with self._segments_lock:
            return sum(s.size for s in self._segments.values())

    def segment(self, seg_id: int) -> SegmentFile | None:
        return self._segments.get(seg_id)

    def segments(self) -> list[SegmentFile]:
        """Every segment, oldest first."""
        with self._segments_lock:
            return [self._segments[i] for i in sorted(self._segments)]

    # --- event loop -------------------------------------------------------------------------------------

    def acquire(self, seg_id: int) -> SegmentFile:
        """Pin a segment's fd for a read; pair with `release`."""
        seg = self._segments[seg_id]
        seg.readers += 1
        return seg

    @staticmethod
    def release(seg: SegmentFile) -> None:
        seg.readers -= 1
        if seg.deleted and seg.readers == 0:
            os.close(seg.fd)

    def delete(self, seg: SegmentFile) -> None:
        """Remove a sealed segment: unlink its files now, close its fd once no read is using it."""
        assert seg.sealed
        with self._segments_lock:
            del self._segments[seg.id]
        seg.path.unlink()
        fmt.index_path(self.data_dir, seg.id).unlink(missing_ok=True)
        fmt.fsync_dir(self.data_dir)
        seg.deleted = True
        if seg.readers == 0:
            os.close(seg.fd)

    def close(self) -> None:
        os.fdatasync(self.active.fd)
        for seg in self.segments():
            os.close(seg.fd)
        os.close(self._lock_fd)


def _lock(data_dir: Path) -> int:
    """Hold an exclusive lock on the data directory for the life of the process (released on any exit)."""
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise DataDirInUseError(f"{data_dir} is in use by another cache_svc process") from exc
        raise
    return fd
