"""Engram addressing: the normalised vocabulary, the released table sizes, and the n-gram hash against a direct
transcription of the Engram paper's NgramHashMapping (numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from model import preset
from model.engram import NgramHash, _tokenizer_json, multipliers, normalised_vocab, table_sizes


def test_normalised_vocabulary():
    mapping = normalised_vocab(129280)
    assert mapping.shape == (129280,)
    assert int(mapping.max()) + 1 == 99092
    tok = Tokenizer.from_file(str(_tokenizer_json()))
    ids = [tok.token_to_id(t) for t in ("the", "The", "THE", "Ġthe", "ĠThe")]
    assert None not in ids
    assert len({int(mapping[i]) for i in ids}) == 1
    assert mapping[tok.token_to_id("cat")] != mapping[tok.token_to_id("dog")]


def test_released_table_sizes():
    """Primes above engram_vocab_size − 1, never reused: the released 384,006,168 / 384,016,682 rows."""
    a = preset("v41-flash")
    sizes = table_sizes(a)
    assert [sum(map(sum, sizes[layer])) for layer in a.engram_layer_ids] == list(a.engram_num_embeddings)
    primes = [p for layer in sizes.values() for order in layer for p in order]
    assert len(set(primes)) == 48
    assert min(primes) > 16_000_000


def paper_hashes(ids: np.ndarray, args, layer: int, pad: int) -> np.ndarray:
    """NgramHashMapping._get_ngram_hashes of the Engram demo, on already-normalised ids [B, T] (pad-shifted)."""
    m = np.array(multipliers(args, layer), dtype=np.int64)
    _B, T = ids.shape
    shifts = [ids] + [
        np.pad(ids, ((0, 0), (k, 0)), constant_values=pad)[:, :T] for k in range(1, args.engram_max_ngram_size)
    ]
    out = []
    sizes = table_sizes(args)[layer]
    for n in range(2, args.engram_max_ngram_size + 1):
        mix = shifts[0] * m[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifts[k] * m[k])
        out += [mix % p for p in sizes[n - 2]]
    offsets = np.cumsum([0, *[p for order in sizes for p in order][:-1]])
    return np.stack(out, axis=2) + offsets


@pytest.mark.parametrize("name", ["tiny", "v41-flash"])
def test_hash_matches_the_paper(name, gen):
    a = preset(name)
    h = NgramHash(a)
    ids = torch.randint(0, a.vocab_size, (2, 11), generator=gen)
    mapped = normalised_vocab(a.vocab_size)[ids.numpy()]
    for layer in a.engram_layer_ids:
        rows = h.rows(layer, ids, torch.full((2, h.history_len), -1))
        want = paper_hashes(mapped, a, layer, h.pad)
        assert np.array_equal(rows.numpy(), want)
        assert int(rows.max()) < a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
    # Streaming: the hashes of a suffix given the look-back equal the hashes of the whole sequence.
    layer = a.engram_layer_ids[0]
    whole = h.rows(layer, ids, torch.full((2, h.history_len), -1))
    tail = h.rows(layer, ids[:, 5:], ids[:, 5 - h.history_len : 5])
    assert torch.equal(tail, whole[:, 5:])


@pytest.mark.parametrize("name", ["tiny", "v41-flash"])
@pytest.mark.parametrize(("B", "T", "known"), [(1, 1, 3), (5, 1, 0), (3, 9, 2)])
def test_host_hash_gives_every_layers_rows(name, B, T, known, gen):
    """The host's numpy hash (off-device tables) gives each layer's `rows`, with a look-back partly unknown (−1)."""
    a = preset(name)
    h = NgramHash(a)
    tokens = torch.randint(0, a.vocab_size, (B, T), generator=gen)
    history = torch.randint(0, a.vocab_size, (B, h.history_len), generator=gen)
    history[:, : h.history_len - known] = -1
    host = h.host_rows(tokens.numpy(), history.numpy())
    assert list(host) == list(a.engram_layer_ids)
    for layer, rows in host.items():
        assert np.array_equal(rows, h.rows(layer, tokens, history).numpy())
