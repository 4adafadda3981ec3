"""Prefix-cache block keys (DESIGN §4), shared by prefill, decode and the gateway.

    h_i = BLAKE2b-128(h_{i-1} ‖ model fingerprint ‖ layout version ‖ token ids of block i),  h_{-1} = salt

Only full blocks get keys. Token ids enter the hash as little-endian uint32, so keys are the same on
every machine and every run (never Python's `hash()`). A sequence key (for the end-of-sequence SWA
record and handoff records) chains the last full block's key with the partial tail.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16
LAYOUT_VERSION = 1


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def block_keys(
    token_ids: Sequence[int],
    *,
    block_tokens: int,
    fingerprint: bytes,
    salt: bytes = b"",
    layout_version: int = LAYOUT_VERSION,
) -> list[bytes]:
    """Keys of every full `block_tokens`-token block of `token_ids`, chained from `salt`."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    version = struct.pack("<I", layout_version)
    keys: list[bytes] = []
    prev = salt
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(fingerprint)
        h.update(version)
        h.update(_tokens_bytes(token_ids[start : start + block_tokens]))
        prev = h.digest()
        keys.append(prev)
    return keys


def sequence_key(
    token_ids: Sequence[int],
    *,
    block_tokens: int,
    fingerprint: bytes,
    salt: bytes = b"",
    layout_version: int = LAYOUT_VERSION,
    prefix_keys: Sequence[bytes] | None = None,
) -> bytes:
    """Key of the whole sequence: the last full block's key (or the salt) chained with the tail.

    `prefix_keys`, when the caller already has them, are the block keys of (at least) every full block of
    `token_ids`; passing them makes probing many sequence ends of one prompt O(tail) each instead of O(prefix).
    """
    n_blocks = len(token_ids) // block_tokens
    if prefix_keys is None:
        prefix_keys = block_keys(
            token_ids, block_tokens=block_tokens, fingerprint=fingerprint, salt=salt, layout_version=layout_version
        )
    elif len(prefix_keys) < n_blocks:
        raise ValueError(f"prefix_keys has {len(prefix_keys)} keys; the sequence has {n_blocks} full blocks")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"v41-seq")
    h.update(prefix_keys[n_blocks - 1] if n_blocks else salt)
    h.update(fingerprint)
    h.update(struct.pack("<IQ", layout_version, len(token_ids)))
    h.update(_tokens_bytes(token_ids[n_blocks * block_tokens :]))
    return h.digest()
