"""Byte layouts of the state that crosses processes: global KV blocks and encoder states."""

from __future__ import annotations

import struct

import pytest
import torch

from model import LAYOUT_VERSION, EncoderState, GlobalKVBlock, encode_prefill, global_kv_bytes_per_token
from model.accounting import account
from model.quant import fp4_dequant_e4m3, fp4_quant_e4m3


@pytest.fixture(scope="module")
def prefill(tiny):
    gen = torch.Generator().manual_seed(1234)
    return encode_prefill(
        tiny, torch.randint(0, tiny.args.vocab_size, (2 * tiny.args.kv_block_tokens + 7,), generator=gen)
    )


def test_packed_kv_bytes_equal_the_accounting(prefill, tiny_args):
    """The packed payload of a real block, in bytes, is exactly tiny's accounting × kv_block_tokens."""
    block = prefill.blocks[0]
    per_token = account("tiny").global_kv_bytes_per_token
    assert per_token == global_kv_bytes_per_token(tiny_args)
    assert block.payload_bytes == per_token * tiny_args.kv_block_tokens
    header = len(block.to_bytes()) - block.payload_bytes
    assert header < 128  # magic, version, dims, fingerprint, sources, length, checksum


def test_v41_flash_block_payload_is_890_bytes_per_token():
    from model import preset

    a = preset("v41-flash")
    assert global_kv_bytes_per_token(a) == 890
    D, Di = a.head_dim, a.index_head_dim
    assert (D // 2 + D // 16, Di // 2 + Di // 32) == (288, 68)


def test_block_entries_are_the_packed_fp4_of_the_cache(prefill, tiny):
    """Main KV entries decode to FP4 values whose re-quantisation is the identity (they are real packed FP4)."""
    e = prefill.blocks[1].entries[tiny.args.n_encoder_layers]
    values = fp4_dequant_e4m3(e.kv_data, e.kv_scale)
    data, scale = fp4_quant_e4m3(values)
    assert torch.equal(data, e.kv_data)
    assert torch.equal(scale, e.kv_scale)


def test_round_trips(prefill, tiny_args, tiny):
    for block in prefill.blocks:
        again = GlobalKVBlock.from_bytes(block.to_bytes(), tiny_args, tiny.fingerprint)
        assert again.index == block.index
        assert again.to_bytes() == block.to_bytes()
    state = prefill.encoder_state
    again = EncoderState.from_bytes(state.to_bytes(), tiny_args, tiny.fingerprint)
    assert again.to_bytes() == state.to_bytes()
    assert again.position == state.position
    assert torch.equal(again.hidden, state.hidden)


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("kind", ["block", "state"])
def test_bad_records_are_rejected_with_a_reason(prefill, tiny_args, tiny, kind):
    cls, good = (
        (GlobalKVBlock, prefill.blocks[0].to_bytes())
        if kind == "block"
        else (EncoderState, prefill.encoder_state.to_bytes())
    )
    with pytest.raises(ValueError, match="checksum"):
        cls.from_bytes(flip(good, len(good) // 2), tiny_args)
    with pytest.raises(ValueError, match=r"too short|checksum"):
        cls.from_bytes(good[:-40], tiny_args)
    with pytest.raises(ValueError, match="bad magic"):
        cls.from_bytes(b"X" + good[1:], tiny_args)
    with pytest.raises(ValueError, match="expected bytes"):
        cls.from_bytes("not bytes", tiny_args)
    # A well-formed record of another layout version (checksum recomputed) is refused by version.
    import hashlib

    body = bytearray(good[:-16])
    struct.pack_into("<H", body, 8, LAYOUT_VERSION + 1)
    other = bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest()
    with pytest.raises(ValueError, match="layout version"):
        cls.from_bytes(other, tiny_args)
    with pytest.raises(ValueError, match="fingerprint"):
        cls.from_bytes(good, tiny_args, fingerprint=bytes(16))
    other_model = tiny_args.replace(kv_block_tokens=32) if kind == "block" else tiny_args.replace(sliding_window=16)
    with pytest.raises(ValueError, match=r"does not match|!= the model"):
        cls.from_bytes(good, other_model)


def test_state_at_every_position_round_trips(tiny, tiny_args, gen):
    """Open groups (position mod 2) and tail sizes (position mod block) vary with the position."""
    ids = torch.randint(0, tiny_args.vocab_size, (tiny_args.kv_block_tokens + 3,), generator=gen)
    for n in (1, 2, 3, tiny_args.kv_block_tokens, tiny_args.kv_block_tokens + 3):
        state = encode_prefill(tiny, ids[:n]).encoder_state
        assert state.position == n
        assert state.hidden.shape[0] == min(n, tiny_args.sliding_window)
        assert {k: v[0].shape[0] for k, v in state.pending.items()} == {2: n % 2}
        assert EncoderState.from_bytes(state.to_bytes(), tiny_args).to_bytes() == state.to_bytes()
