"""Block keys (DESIGN §4): h_i = BLAKE2b-128(h_{i-1} ‖ fingerprint ‖ layout version ‖ tokens of block i),
h_{-1} = salt."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.block_keys import KEY_BYTES, LAYOUT_VERSION, block_keys, sequence_key

FP = b"v41-flash/sha256:0123"
B = 4  # tiny blocks keep the examples small; the chain does not depend on the size
tokens_st = st.lists(st.integers(0, 129_279), max_size=40)


def _spec_keys(tokens: list[int], block: int, fingerprint: bytes, salt: bytes, version: int) -> list[bytes]:
    """The definition, written out independently of the implementation."""
    keys, prev = [], salt
    for i in range(len(tokens) // block):
        chunk = tokens[i * block : (i + 1) * block]
        data = prev + fingerprint + struct.pack("<I", version) + b"".join(t.to_bytes(4, "little") for t in chunk)
        prev = hashlib.blake2b(data, digest_size=16).digest()
        keys.append(prev)
    return keys


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, salt=st.binary(max_size=20), version=st.integers(0, 5))
def test_keys_follow_the_definition(tokens: list[int], salt: bytes, version: int) -> None:
    keys = block_keys(tokens, block_tokens=B, fingerprint=FP, salt=salt, layout_version=version)
    assert keys == _spec_keys(tokens, B, FP, salt, version)
    assert len(keys) == len(tokens) // B  # a partial tail block gets no key
    assert all(len(k) == KEY_BYTES for k in keys)


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= B), data=st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(tokens: list[int], data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 129_280
    before = block_keys(tokens, block_tokens=B, fingerprint=FP)
    after = block_keys(changed, block_tokens=B, fingerprint=FP)
    block = position // B
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:], strict=True))


@settings(max_examples=50, deadline=None)
@given(tokens=tokens_st, extra=tokens_st)
def test_a_prefix_has_a_prefix_of_the_keys(tokens: list[int], extra: list[int]) -> None:
    short = block_keys(tokens, block_tokens=B, fingerprint=FP)
    long = block_keys(tokens + extra, block_tokens=B, fingerprint=FP)
    assert long[: len(short)] == short


def test_salt_fingerprint_and_layout_version_each_separate_the_keys() -> None:
    tokens = list(range(3 * B))
    base = block_keys(tokens, block_tokens=B, fingerprint=FP)
    for other in (
        block_keys(tokens, block_tokens=B, fingerprint=FP, salt=b"tenant-a"),
        block_keys(tokens, block_tokens=B, fingerprint=b"another model"),
        block_keys(tokens, block_tokens=B, fingerprint=FP, layout_version=LAYOUT_VERSION + 1),
    ):
        assert len(other) == 3
        assert not set(other) & set(base)


def test_keys_are_the_same_in_every_process() -> None:
    """Never Python's hash(): another interpreter with another hash seed computes the same keys."""
    code = (
        "from mesh.block_keys import block_keys;"
        "print(block_keys(list(range(128)), block_tokens=64, fingerprint=b'fp', salt=b's')[-1].hex())"
    )
    root = Path(__file__).resolve().parents[2]
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, env={"PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {block_keys(list(range(128)), block_tokens=64, fingerprint=b"fp", salt=b"s")[-1].hex()}


def test_sequence_key_covers_the_tail_and_the_length() -> None:
    tokens = list(range(2 * B + 3))
    key = sequence_key(tokens, block_tokens=B, fingerprint=FP)
    assert len(key) == KEY_BYTES
    assert key == sequence_key(list(tokens), block_tokens=B, fingerprint=FP)
    assert key != sequence_key([*tokens[:-1], 99], block_tokens=B, fingerprint=FP)  # tail token
    assert key != sequence_key(tokens[:-1], block_tokens=B, fingerprint=FP)  # length
    assert key != sequence_key([7, *tokens[1:]], block_tokens=B, fingerprint=FP)  # a full block
    assert key != sequence_key(tokens, block_tokens=B, fingerprint=FP, salt=b"tenant")
    full = tokens[: 2 * B]
    assert sequence_key(full, block_tokens=B, fingerprint=FP) not in block_keys(full, block_tokens=B, fingerprint=FP)
    assert sequence_key([], block_tokens=B, fingerprint=FP) != sequence_key([], block_tokens=B, fingerprint=b"x")


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, more=tokens_st, salt=st.binary(max_size=8))
def test_sequence_key_from_precomputed_prefix_keys_is_the_same(tokens: list[int], more: list[int], salt: bytes) -> None:
    # The keys of a longer sequence's blocks serve every shorter end: probing ends costs no rehash of the prefix.
    longer = block_keys(tokens + more, block_tokens=B, fingerprint=FP, salt=salt)
    direct = sequence_key(tokens, block_tokens=B, fingerprint=FP, salt=salt)
    assert sequence_key(tokens, block_tokens=B, fingerprint=FP, salt=salt, prefix_keys=longer) == direct
    if len(tokens) >= B:
        with pytest.raises(ValueError, match="prefix_keys"):
            sequence_key(tokens, block_tokens=B, fingerprint=FP, salt=salt, prefix_keys=longer[: len(tokens) // B - 1])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys([1, 2], block_tokens=0, fingerprint=FP)
    with pytest.raises(ValueError, match="token ids"):
        block_keys([1, -1, 2, 3], block_tokens=B, fingerprint=FP)
    with pytest.raises(ValueError, match="token ids"):
        sequence_key([1, 2**32], block_tokens=B, fingerprint=FP)
