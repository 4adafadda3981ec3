"""The SSD tier's files on their own: what recovery keeps after a cut at any byte, checksums, index files."""

from __future__ import annotations

import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
from cache_helpers import key_of, payload_of
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_svc import segment as fmt
from cache_svc.segment_log import DataDirInUseError, SegmentLog

BIG = 1 << 30  # segment size that never seals


def _write_groups(data_dir: Path, sizes: list[list[int]], segment_bytes: int = BIG) -> tuple[list[int], list[bytes]]:
    """Append one commit group per inner list; return the file size after each group and the keys."""
    log, _ = SegmentLog.open(data_dir, segment_bytes)
    ends, keys = [], []
    n = 0
    for group in sizes:
        blocks = []
        for size in group:
            key = key_of(n)
            blocks.append((key, payload_of(key, size)))
            keys.append(key)
            n += 1
        log.append([(blocks, 1000.0 + n)])
        log.roll_if_full()
        ends.append(log.active.size)
    log.close()
    return ends, keys


def _recovered_keys(data_dir: Path) -> list[bytes]:
    log, recovery = SegmentLog.open(data_dir, BIG)
    log.close()
    return [e.key for e in recovery.entries]


def test_round_trip_and_reads(tmp_path: Path) -> None:
    _, keys = _write_groups(tmp_path, [[10, 57_000], [1], [300_000, 5, 7]])
    log, recovery = SegmentLog.open(tmp_path, BIG)
    assert [e.key for e in recovery.entries] == keys
    assert recovery.truncated_bytes == 0
    seg = log.segment(1)
    assert seg is not None
    for entry in recovery.entries:
        assert SegmentLog.read(seg, entry) == payload_of(entry.key, entry.length)
    log.close()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(1, 3000), min_size=1, max_size=4), min_size=1, max_size=5),
    cut_fraction=st.floats(0, 1),
)
def test_a_cut_anywhere_keeps_exactly_the_committed_groups(sizes: list[list[int]], cut_fraction: float) -> None:
    """A crash can stop the file at any byte: recovery returns the groups whose commit marker made it, whole,
    and nothing of the group after them; the next append lands cleanly after them."""
    with tempfile.TemporaryDirectory() as tmp:
        original, copy = Path(tmp) / "a", Path(tmp) / "b"
        ends, keys = _write_groups(original, sizes)
        seg_file = fmt.segment_path(original, 1)
        cut = int(cut_fraction * seg_file.stat().st_size)
        copy.mkdir()
        shutil.copyfile(seg_file, fmt.segment_path(copy, 1))
        with open(fmt.segment_path(copy, 1), "r+b") as f:
            f.truncate(cut)
        committed_groups = sum(end <= cut for end in ends)
        expected = keys[: sum(len(g) for g in sizes[:committed_groups])]
        assert _recovered_keys(copy) == expected

        log, _ = SegmentLog.open(copy, BIG)
        extra = key_of(10_000)
        log.append([([(extra, b"after the crash")], 5000.0)])
        log.close()
        assert _recovered_keys(copy) == [*expected, extra]


def test_entries_without_a_commit_marker_are_cut_off(tmp_path: Path) -> None:
    _, keys = _write_groups(tmp_path, [[100]])
    path = fmt.segment_path(tmp_path, 1)
    header, _ = fmt.entry_header(key_of(99), b"x" * 50, 1.0)
    with open(path, "ab") as f:  # a complete entry of a put whose commit never happened
        f.write(header + b"x" * 50)
    size_before = path.stat().st_size
    log, recovery = SegmentLog.open(tmp_path, BIG)
    log.close()
    assert [e.key for e in recovery.entries] == keys
    assert recovery.truncated_bytes == fmt.ENTRY_HEADER.size + 50
    assert path.stat().st_size == size_before - recovery.truncated_bytes


def test_a_flipped_byte_drops_only_that_entry(tmp_path: Path) -> None:
    _, keys = _write_groups(tmp_path, [[200, 200, 200]])
    log, recovery = SegmentLog.open(tmp_path, BIG)
    victim = recovery.entries[1]
    log.close()
    path = fmt.segment_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[victim.offset + fmt.ENTRY_HEADER.size + 17] ^= 0x01
    path.write_bytes(bytes(data))

    log, recovery = SegmentLog.open(tmp_path, BIG)
    seg = log.segment(1)
    assert seg is not None
    assert SegmentLog.read(seg, victim) is None
    log.close()
    assert [e.key for e in recovery.entries] == [keys[0], keys[2]]
    assert recovery.corrupt == 1


def test_sealed_segments_load_from_index_files_and_rebuild_damaged_ones(tmp_path: Path) -> None:
    _, keys = _write_groups(tmp_path, [[3000]] * 6, segment_bytes=6000)
    sealed = sorted(int(p.stem) for p in tmp_path.glob("*.idx"))
    assert len(sealed) >= 2
    assert _recovered_keys(tmp_path) == keys

    damaged = fmt.index_path(tmp_path, sealed[0])
    raw = bytearray(damaged.read_bytes())
    raw[30] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    fmt.index_path(tmp_path, sealed[1]).unlink()
    log, recovery = SegmentLog.open(tmp_path, 6000)
    log.close()
    assert recovery.rebuilt_indexes == 2
    assert [e.key for e in recovery.entries] == keys
    assert fmt.read_index(tmp_path, sealed[0]) is not None  # rewritten


def test_one_process_per_data_directory(tmp_path: Path) -> None:
    log, _ = SegmentLog.open(tmp_path, BIG)
    with pytest.raises(DataDirInUseError, match="in use"):
        SegmentLog.open(tmp_path, BIG)
    log.close()
    SegmentLog.open(tmp_path, BIG)[0].close()


def test_entry_checksum_is_zlibs_crc32(tmp_path: Path) -> None:
    """The format did not change with the faster CRC: an entry's crc is still zlib's CRC-32 of its header fields
    and payload, as files written before read it."""
    key = key_of(1)
    payload = payload_of(key, 100_000)
    header, crc = fmt.entry_header(key, payload, 1234.5)
    assert crc == zlib.crc32(fmt.ENTRY_FIELDS.pack(key, len(payload), 1234.5) + payload)
    assert fmt.ENTRY_HEADER.unpack(header)[-1] == crc
