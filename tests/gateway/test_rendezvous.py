"""Rendezvous hashing: the owner does not depend on the order replicas are listed in; a replica that leaves moves only
the conversations it owned, one that joins takes conversations only for itself; owners spread evenly."""

from __future__ import annotations

import collections
import hashlib
import random

from hypothesis import assume, given
from hypothesis import strategies as st

from gateway.rendezvous import owner

names = st.lists(st.text(min_size=1, max_size=24), min_size=2, max_size=12, unique=True)
conversations = st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=50, unique=True)


@given(names, conversations, st.randoms())
def test_every_gateway_agrees_whatever_the_order_it_lists_replicas_in(
    replicas: list[str], keys: list[bytes], rng: random.Random
) -> None:
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    for key in keys:
        assert owner(key, replicas) == owner(key, shuffled) in replicas


@given(names, conversations, st.data())
def test_a_replica_that_leaves_moves_only_its_own_conversations(
    replicas: list[str], keys: list[bytes], data: st.DataObject
) -> None:
    leaving = data.draw(st.sampled_from(replicas))
    staying = [r for r in replicas if r != leaving]
    for key in keys:
        before, after = owner(key, replicas), owner(key, staying)
        if before == leaving:
            assert after in staying
        else:
            assert after == before


@given(names, conversations, st.text(min_size=1, max_size=24))
def test_a_replica_that_joins_takes_conversations_only_for_itself(
    replicas: list[str], keys: list[bytes], joining: str
) -> None:
    assume(joining not in replicas)
    for key in keys:
        assert owner(key, [*replicas, joining]) in (owner(key, replicas), joining)


def test_owners_spread_evenly() -> None:
    replicas = ["decode-0", "decode-1", "decode-2"]
    counts = collections.Counter(owner(b"prefix:%d" % i, replicas) for i in range(3000))
    assert set(counts) == set(replicas)
    assert all(850 <= n <= 1150 for n in counts.values()), counts  # 1000 each, within 6 standard deviations


@given(names, st.binary(min_size=1, max_size=40))
def test_the_weight_is_blake2b_of_the_conversation_then_the_replica_name(replicas: list[str], key: bytes) -> None:
    """The contract between gateway versions: during a rolling update old and new gateways must pick the same owner,
    and no process-local hash (Python's hash() is seeded per process) may enter it."""

    def weight(name: str) -> int:
        digest = hashlib.blake2b(key + name.encode(), digest_size=8, person=b"v41mesh-hrw").digest()
        return int.from_bytes(digest, "big")

    assert owner(key, replicas) == max(replicas, key=weight)
