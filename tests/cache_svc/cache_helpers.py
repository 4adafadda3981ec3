"""Helpers shared by the cache_svc tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import hashlib


class FakeClock:
    """Wall-clock stand-in the tests move by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def key_of(n: int, salt: bytes = b"") -> bytes:
    """A 16-byte block key for test block n."""
    return hashlib.blake2b(salt + n.to_bytes(8, "little"), digest_size=16).digest()


def payload_of(key: bytes, size: int) -> bytes:
    """Bytes determined by the key, so any payload read back can be checked against its key."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]
