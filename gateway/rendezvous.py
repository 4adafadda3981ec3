"""Rendezvous (highest-random-weight) hashing: the replica that owns a conversation, agreed by every gateway without
a word between them.

Each replica's weight for a conversation is a hash of (conversation, replica name); the owner is the replica of
highest weight. Every gateway that sees the same replicas computes the same owner, and a replica that leaves moves
only the conversations it owned (each to its second-highest weight): everyone else's highest weight is still there.
One that joins takes about 1/n of the conversations, from every replica alike (Thaler & Ravishankar, 1998).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

WEIGHT_BYTES = 8
PERSON = b"v41mesh-hrw"  # blake2b's personalisation: these weights mean nothing to any other hash of the same bytes


def owner(conversation: bytes, replicas: Collection[str]) -> str:
    """The replica of highest weight for the conversation, among `replicas` (at least one)."""
    seeded = _seeded(conversation)
    return max(replicas, key=lambda name: _weight(seeded, name))


def _seeded(conversation: bytes) -> hashlib.blake2b:
    # The conversation is hashed once per decision, each replica's name then continues a copy of that state.
    return hashlib.blake2b(conversation, digest_size=WEIGHT_BYTES, person=PERSON)


def _weight(seeded: hashlib.blake2b, replica: str) -> int:
    """64 bits of BLAKE2b over (conversation, replica): the same in every process and host, unlike Python's hash()."""
    h = seeded.copy()
    h.update(replica.encode())
    return int.from_bytes(h.digest(), "big")
