"""Values kept in least-recently-used order within a byte budget: the DRAM tier in front of the SSD tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Lru(Generic[V]):
    def __init__(self, capacity: float, size: Callable[[V], int]) -> None:
        self.capacity = capacity
        self.bytes = 0
        self._size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> V | None:
        """The value, now the most recently used; None if absent."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> int:
        """Insert as most recently used, evicting the least recently used to fit; returns how many went.

        A value larger than the whole budget is not kept (and evicts nothing)."""
        self.pop(key)
        size = self._size(value)
        if size > self.capacity:
            return 0
        evicted = 0
        while self.bytes + size > self.capacity:
            self.pop_oldest()
            evicted += 1
        self._items[key] = value
        self.bytes += size
        return evicted

    def pop(self, key: Hashable) -> V | None:
        value = self._items.pop(key, None)
        if value is not None:
            self.bytes -= self._size(value)
        return value

    def pop_oldest(self) -> tuple[Hashable, V]:
        key, value = self._items.popitem(last=False)
        self.bytes -= self._size(value)
        return key, value
