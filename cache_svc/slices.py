"""Payloads on the wire: cut into slices of at most `CHUNK_BYTES` and put back together.

Both directions use these: the client packs puts and reassembles gets, the server reassembles puts and
packs gets. A message carries several small blocks or one slice of a large one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

from mesh.grpc_server import CHUNK_BYTES

T = TypeVar("T", bound=Hashable)
Slice = tuple[T, int, int, bytes]  # (id, total bytes, offset, data)


class SliceError(ValueError):
    """A slice that does not fit what its payload declared."""


def pack(payloads: Iterable[tuple[T, bytes]], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[Slice[T]]]:
    """Group payloads into messages of at most `chunk_bytes` of data; only payloads larger than a chunk are
    split, so small ones travel without a copy."""
    batch: list[Slice[T]] = []
    room = chunk_bytes
    for ident, payload in payloads:
        total = len(payload)
        if room < min(total, chunk_bytes):
            yield batch
            batch, room = [], chunk_bytes
        offset = 0
        while True:
            take = min(room, total - offset)
            data = payload if take == total else payload[offset : offset + take]
            batch.append((ident, total, offset, data))
            offset += take
            room -= take
            if room == 0:
                yield batch
                batch, room = [], chunk_bytes
            if offset >= total:
                break
    if batch:
        yield batch


class _Partial:
    __slots__ = ("parts", "received", "total")

    def __init__(self, total: int, first: bytes) -> None:
        self.total = total
        self.received = len(first)
        self.parts = [first]


class Assembler(Generic[T]):
    """Collects slices per id, checking each against the size its first slice declared."""

    def __init__(self, max_total: int, name: str = "block") -> None:
        self._max_total = max_total
        self._name = name
        self._partials: dict[T, _Partial] = {}

    def add(self, ident: T, total: int, offset: int, data: bytes) -> None:
        partial = self._partials.get(ident)
        if partial is None:
            if offset != 0:
                raise SliceError(f"{self._label(ident)}: slice at offset {offset} before its first slice")
            if not 0 < total <= self._max_total:
                problem = "is empty (total_bytes 0)" if total == 0 else f"declares {total} bytes"
                limit = "" if total == 0 else f"; the limit is {self._max_total}"
                raise SliceError(f"{self._label(ident)} {problem}{limit}")
            if len(data) > total:
                raise SliceError(f"{self._label(ident)}: slices exceed the declared {total} bytes")
            self._partials[ident] = _Partial(total, data)
            return
        if offset == 0:
            raise SliceError(f"{self._label(ident)} appears twice")
        if total not in (0, partial.total):
            raise SliceError(f"{self._label(ident)}: a slice declares {total} bytes, the first one {partial.total}")
        if offset != partial.received:
            raise SliceError(f"{self._label(ident)}: slice at offset {offset}, expected {partial.received}")
        if partial.received + len(data) > partial.total:
            raise SliceError(f"{self._label(ident)}: slices exceed the declared {partial.total} bytes")
        partial.parts.append(data)
        partial.received += len(data)

    def incomplete(self) -> list[str]:
        """One line per payload still missing bytes."""
        return [
            f"{self._label(i)}: {p.received} of {p.total} bytes"
            for i, p in self._partials.items()
            if p.received < p.total
        ]

    def complete(self) -> list[tuple[T, bytes]]:
        """Every fully received payload, in first-slice order."""
        return [
            (ident, p.parts[0] if len(p.parts) == 1 else b"".join(p.parts))
            for ident, p in self._partials.items()
            if p.received == p.total
        ]

    def _label(self, ident: Hashable) -> str:
        return f"{self._name} {ident.hex() if isinstance(ident, bytes) else f'#{ident}'}"
