"""Payloads cut into ≤ chunk-size slices and put back together, byte for byte."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_svc.slices import Assembler, SliceError, pack


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=12), chunk=st.integers(1, 2048))
def test_pack_then_assemble_is_identity(sizes: list[int], chunk: int) -> None:
    payloads = [(i, bytes([i % 251]) * size) for i, size in enumerate(sizes) if size]
    assembler: Assembler[int] = Assembler(max_total=10_000)
    for message in pack(payloads, chunk):
        assert sum(len(data) for *_, data in message) <= chunk
        assert message
        for ident, total, offset, data in message:
            assembler.add(ident, total, offset, data)
    assert assembler.incomplete() == []
    assert assembler.complete() == payloads


def test_small_payloads_are_never_split_or_copied() -> None:
    payloads = [(i, bytes(300)) for i in range(10)]
    messages = list(pack(payloads, 1000))
    assert [len(m) for m in messages] == [3, 3, 3, 1]
    assert all(data is payloads[ident][1] for m in messages for ident, _, _, data in m)


@pytest.mark.parametrize(
    ("slices", "error"),
    [
        ([(1, 4, 0, b"ab"), (1, 4, 3, b"c")], "offset 3, expected 2"),
        ([(1, 4, 0, b"abcde")], "exceed the declared 4"),
        ([(1, 4, 0, b"ab"), (1, 5, 2, b"cd")], "declares 5 bytes, the first one 4"),
        ([(1, 0, 0, b"")], "is empty"),
        ([(1, 11, 0, b"x")], "the limit is 10"),
    ],
)
def test_inconsistent_slices_are_rejected(slices: list[tuple[int, int, int, bytes]], error: str) -> None:
    assembler: Assembler[int] = Assembler(max_total=10)
    *accepted, last = slices
    for s in accepted:
        assembler.add(*s)
    with pytest.raises(SliceError, match=error):
        assembler.add(*last)
