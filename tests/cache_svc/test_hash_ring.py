"""Consistent hashing: adding or removing a replica moves only the keys it gains or loses."""

from __future__ import annotations

import pytest
from cache_helpers import key_of
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_svc.ring import HashRing

KEYS = [key_of(n) for n in range(1000)]
addresses = st.lists(st.from_regex(r"cache-[0-9]{1,3}:7001", fullmatch=True), min_size=2, max_size=6, unique=True)


@settings(max_examples=25, deadline=None)
@given(nodes=addresses)
def test_removing_a_replica_moves_only_its_keys(nodes: list[str]) -> None:
    before = HashRing(nodes)
    after = HashRing(nodes[1:])
    for key in KEYS:
        if before.node(key) != nodes[0]:
            assert after.node(key) == before.node(key)


@settings(max_examples=25, deadline=None)
@given(nodes=addresses)
def test_adding_a_replica_moves_keys_only_to_it(nodes: list[str]) -> None:
    before = HashRing(nodes[:-1])
    after = HashRing(nodes)
    moved = [key for key in KEYS if after.node(key) != before.node(key)]
    assert all(after.node(key) == nodes[-1] for key in moved)
    assert 0 < len(moved) < len(KEYS)


def test_keys_spread_evenly_and_split_keeps_order() -> None:
    ring = HashRing(["a:1", "b:1", "c:1"])
    shares = ring.split(KEYS)
    assert all(0.2 < len(positions) / len(KEYS) < 0.47 for positions in shares.values())
    assert sorted(p for positions in shares.values() for p in positions) == list(range(len(KEYS)))
    assert all(positions == sorted(positions) for positions in shares.values())
    assert HashRing(["c:1", "a:1", "b:1"]).split(KEYS) == shares  # the order of the list does not matter


def test_bad_replica_lists() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HashRing([])
    with pytest.raises(ValueError, match="repeat"):
        HashRing(["a:1", "a:1"])
