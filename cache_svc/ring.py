"""Consistent hashing of keys over cache replicas.

Each replica owns `VNODES` points on a 64-bit ring (BLAKE2b of its address and the point number); a key
belongs to the first point at or after its own hash. Adding or removing a replica moves only the keys
that land on its points, so the other replicas keep their data. Replicas are named by the address the
clients use (for a StatefulSet, the stable per-pod DNS name).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

VNODES = 160


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashRing:
    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES) -> None:
        if not nodes:
            raise ValueError("a hash ring needs at least one replica address")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"replica addresses repeat: {list(nodes)}")
        self.nodes = list(nodes)
        points = sorted((_point(f"{node}#{i}".encode()), node) for node in nodes for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def node(self, key: bytes) -> str:
        i = bisect.bisect_left(self._hashes, _point(key))
        return self._owners[i % len(self._owners)]

    def split(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Positions of `keys` per owning replica, each list in the original order."""
        if not keys:
            return {}
        if len(self.nodes) == 1:
            return {self.nodes[0]: list(range(len(keys)))}
        owners: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            owners.setdefault(self.node(key), []).append(i)
        return owners
