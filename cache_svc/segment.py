"""On-disk format of the SSD tier: append-only segment files and the index file of each sealed segment.

    segment file  {id:010d}.seg = header, then commit groups; each group is fsynced as a whole
      header      "V41KVSEG" | version u32 | segment id u64
      entry       "KVB1" | key 16 B | length u32 | committed_at f64 | crc u32 | payload (length bytes)
      commit      "KVC1" | entry count u32 | crc32 of the group's entry crcs u32
    index file    {id:010d}.idx = "V41KVIDX" | version u32 | segment id u64 | count u32
                  | count × (key 16 B | offset u64 | length u32 | crc u32 | committed_at f64) | crc32 u32

An entry's crc is the CRC-32 of zlib over its header fields and payload, so a flipped bit anywhere in it is caught
(computed by zlib-ng, whose carry-less-multiply CRC-32 gives the same values 4× faster than the stock zlib module:
every put and every SSD read checks its whole payload).
Entries count only once a commit marker covers them: a crash mid-put leaves entries without a marker,
which recovery cuts off. All integers are little-endian; committed_at is Unix time in seconds.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import msgspec
from zlib_ng.zlib_ng import crc32

VERSION = 1
KEY_BYTES = 16
SEGMENT_MAGIC = b"V41KVSEG"
INDEX_MAGIC = b"V41KVIDX"
ENTRY_TAG = b"KVB1"
COMMIT_TAG = b"KVC1"

SEGMENT_HEADER = struct.Struct("<8sIQ")
ENTRY_HEADER = struct.Struct("<4s16sIdI")
ENTRY_FIELDS = struct.Struct("<16sId")  # the header fields the crc covers, in order
COMMIT = struct.Struct("<4sII")
INDEX_HEADER = struct.Struct("<8sIQI")
INDEX_ENTRY = struct.Struct("<16sQIId")
CRC = struct.Struct("<I")


class Entry(msgspec.Struct, frozen=True, gc=False):
    """Where one committed block lives: the offset of its entry header in its segment, and its checksum.

    The fields before `segment` are in the order of an index-file record, so those records load in one pass."""

    key: bytes
    offset: int
    length: int
    crc: int
    committed_at: float
    segment: int

    @property
    def size(self) -> int:
        """Bytes the entry occupies in its segment file."""
        return ENTRY_HEADER.size + self.length


def segment_path(data_dir: Path, segment: int) -> Path:
    return data_dir / f"{segment:010d}.seg"


def index_path(data_dir: Path, segment: int) -> Path:
    return data_dir / f"{segment:010d}.idx"


def segment_header(segment: int) -> bytes:
    return SEGMENT_HEADER.pack(SEGMENT_MAGIC, VERSION, segment)


def entry_header(key: bytes, payload: bytes, committed_at: float) -> tuple[bytes, int]:
    """The header that precedes `payload` on disk, and the entry's crc."""
    crc = crc32(payload, crc32(ENTRY_FIELDS.pack(key, len(payload), committed_at)))
    return ENTRY_HEADER.pack(ENTRY_TAG, key, len(payload), committed_at, crc), crc


def commit_marker(crcs: list[int]) -> bytes:
    return COMMIT.pack(COMMIT_TAG, len(crcs), _group_crc(crcs))


def _group_crc(crcs: Sequence[int]) -> int:
    return crc32(struct.pack(f"<{len(crcs)}I", *crcs))


def payload_of(entry: Entry, raw: bytes) -> bytes | None:
    """The payload of `entry` from its raw bytes on disk, or None if they are not exactly what was committed."""
    if len(raw) != entry.size:
        return None
    tag, key, length, _, crc = ENTRY_HEADER.unpack_from(raw)
    if (tag, key, length, crc) != (ENTRY_TAG, entry.key, entry.length, entry.crc):
        return None
    if _entry_crc(memoryview(raw), 0, entry.size) != crc:
        return None
    return raw[ENTRY_HEADER.size :]


_FIELDS = slice(len(ENTRY_TAG), len(ENTRY_TAG) + ENTRY_FIELDS.size)  # where the crc'd header fields sit


def _entry_crc(view: memoryview, start: int, end: int) -> int:
    """The crc of the entry at view[start:end]: its header fields (stored right after the tag) and payload."""
    fields = view[start + _FIELDS.start : start + _FIELDS.stop]
    return crc32(view[start + ENTRY_HEADER.size : end], crc32(fields))


class Scan(msgspec.Struct, frozen=True):
    """What a full read of a segment file found."""

    entries: list[Entry]  # committed entries whose checksum holds, in file order
    end: int  # offset just past the last commit marker: everything after it is uncommitted or torn
    corrupt: int  # committed entries dropped because their checksum failed


def scan_segment(path: Path, segment: int) -> Scan:
    """Read a segment file entry by entry, keeping only entries a valid commit marker covers."""
    size = path.stat().st_size
    if size < SEGMENT_HEADER.size:
        return Scan([], 0, 0)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        view = memoryview(data)
        try:
            return _scan(data, view, size, segment)
        finally:
            view.release()


def _scan(data: mmap.mmap, view: memoryview, size: int, segment: int) -> Scan:
    if SEGMENT_HEADER.unpack_from(data) != (SEGMENT_MAGIC, VERSION, segment):
        return Scan([], 0, 0)
    entries: list[Entry] = []
    group: list[Entry] = []  # entries since the last commit marker
    bad: set[int] = set()  # positions in `group` whose crc failed
    corrupt = 0
    pos = end = SEGMENT_HEADER.size
    while pos + COMMIT.size <= size:
        tag = data[pos : pos + 4]
        if tag == ENTRY_TAG and pos + ENTRY_HEADER.size <= size:
            _, key, length, committed_at, crc = ENTRY_HEADER.unpack_from(data, pos)
            body_end = pos + ENTRY_HEADER.size + length
            if body_end > size:
                break  # torn: the payload never fully reached the file
            if _entry_crc(view, pos, body_end) != crc:
                bad.add(len(group))
            group.append(Entry(key, pos, length, crc, committed_at, segment))
            pos = body_end
        elif tag == COMMIT_TAG:
            _, count, group_crc = COMMIT.unpack_from(data, pos)
            if count != len(group) or group_crc != _group_crc([e.crc for e in group]):
                break
            entries += group if not bad else [e for i, e in enumerate(group) if i not in bad]
            corrupt += len(bad)
            group, bad = [], set()
            pos = end = pos + COMMIT.size
        else:
            break
    return Scan(entries, end, corrupt)


def write_index(data_dir: Path, segment: int, entries: list[Entry]) -> None:
    """Write the index file of a sealed segment atomically (temp file, fsync, rename, fsync directory)."""
    parts = [INDEX_HEADER.pack(INDEX_MAGIC, VERSION, segment, len(entries))]
    parts.extend(INDEX_ENTRY.pack(e.key, e.offset, e.length, e.crc, e.committed_at) for e in entries)
    body = b"".join(parts)
    final = index_path(data_dir, segment)
    tmp = final.with_suffix(".idx.tmp")
    with open(tmp, "wb") as f:
        f.write(body)
        f.write(CRC.pack(crc32(body)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(data_dir)


def read_index(data_dir: Path, segment: int) -> list[Entry] | None:
    """The entries recorded in a segment's index file, or None when it is missing or damaged."""
    try:
        raw = index_path(data_dir, segment).read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < INDEX_HEADER.size + CRC.size:
        return None
    body = memoryview(raw)[: -CRC.size]
    if CRC.unpack_from(raw, len(raw) - CRC.size)[0] != crc32(body):
        return None
    magic, version, seg, count = INDEX_HEADER.unpack_from(raw)
    if (magic, version, seg) != (INDEX_MAGIC, VERSION, segment) or len(
        body
    ) != INDEX_HEADER.size + count * INDEX_ENTRY.size:
        return None
    return list(
        itertools.starmap(functools.partial(Entry, segment=segment), INDEX_ENTRY.iter_unpack(body[INDEX_HEADER.size :]))
    )


def fsync_dir(path: Path) -> None:
    """Make a create, rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
