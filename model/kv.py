"""The state that crosses processes: global KV blocks and the encoder state, with versioned byte layouts.

Both records are little-endian frames

    magic (8 bytes) | version u16 | header (fixed fields, then per-record arrays) | payload length u64 | payload |
    BLAKE2b-128 of everything before it

`from_bytes` rejects a wrong magic, version, size, checksum or a header that does not match the model config
(or fingerprint) with a ValueError naming what is wrong. The byte layouts are documented in docs/model.md.

GlobalKVBlock — `kv_block_tokens` tokens of global KV: for every KV-source (Full owner) layer, its Bt/m
compressed entries as packed FP4 main KV (E2M1 + E4M3 scale per 16) and packed FP4 indexer K (E2M1 + UE8M0 scale
per 32). Payload bytes per token = the accounting's global KV bytes per token (890 for v41-flash).

EncoderState — the encoder side of a sequence at a position (the prefill→decode handoff record, and the
end-of-sequence SWA record): the FP8 SWA rings of layers 0..L/2−1, the open m=2 compressor groups, the compressed
entries of the partial tail block, H^{L/2} (hc stream + pre-mix) of the last min(position, W) tokens, and the last
n−1 token ids (Engram look-back). Decoder SWA state is never stored: decode rebuilds it by bounded replay from H.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from model.cache import KVCache
from model.config import ModelArgs

LAYOUT_VERSION = 1
FINGERPRINT_BYTES = 16
_CHECKSUM_BYTES = 16
_BLOCK_MAGIC = b"V41KVBLK"
_STATE_MAGIC = b"V41ENCST"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}


# --------------------------------------------------------------------------------------------- packed entries
@dataclass
class PackedEntries:
    """Compressed entries of one KV-source layer: packed FP4 main KV and indexer K (uint8 tensors, [N, ·])."""

    kv_data: Tensor  # [N, D/2]   E2M1 codes, low nibble = even channel
    kv_scale: Tensor  # [N, D/16]  E4M3 bits
    k_data: Tensor  # [N, Di/2]
    k_scale: Tensor  # [N, Di/32] UE8M0

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.kv_data, self.kv_scale, self.k_data, self.k_scale


def entry_widths(args: ModelArgs) -> tuple[int, int, int, int]:
    """Bytes of one entry's four parts: main KV D/2 + D/16 (288 at D=512), indexer K Di/2 + Di/32 (68 at Di=128)."""
    D, Di = args.head_dim, args.index_head_dim
    return D // 2, D // 16, Di // 2, Di // 32


def kv_sources(args: ModelArgs) -> list[tuple[int, int]]:
    """(layer, compress ratio) of every KV-source layer, in layer order."""
    return [(s, args.compress_ratios[s]) for s in sorted(args.kv_source_layer_ids)]


def global_kv_bytes_per_token(args: ModelArgs) -> float:
    """Σ over KV sources of entry bytes / m — 890 for v41-flash."""
    return sum(sum(entry_widths(args)) / m for _, m in kv_sources(args))


# -------------------------------------------------------------------------------------------------- framing
Layout = list[tuple[tuple, torch.dtype, tuple[int, ...]]]  # (key, dtype, shape) of each payload tensor, in order


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _pack(magic: bytes, header: bytes, layout: Layout, tensors: dict[tuple, Tensor]) -> bytes:
    chunks = []
    for key, dtype, shape in layout:
        t = tensors[key]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{magic.decode()}: {key} is {t.dtype} {tuple(t.shape)}, the layout needs {dtype} {shape}")
        chunks.append(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    payload = b"".join(chunks)
    body = magic + struct.pack("<H", LAYOUT_VERSION) + header + struct.pack("<Q", len(payload)) + payload
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest()


class _Reader:
    """Reads one checked frame; every problem is a ValueError naming the record and what is wrong."""

    def __init__(self, data: bytes, magic: bytes, what: str) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"{what}: expected bytes, got {type(data).__name__}")
        self.buf, self.what = memoryview(bytes(data)), what
        if len(self.buf) < len(magic) + 2 + 8 + _CHECKSUM_BYTES:
            raise ValueError(f"{what}: {len(self.buf)} bytes is too short for a record")
        if bytes(self.buf[: len(magic)]) != magic:
            raise ValueError(f"{what}: bad magic {bytes(self.buf[: len(magic)])!r}, expected {magic!r}")
        body, checksum = self.buf[:-_CHECKSUM_BYTES], bytes(self.buf[-_CHECKSUM_BYTES:])
        if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
            raise ValueError(f"{what}: checksum mismatch (corrupt or truncated record)")
        self.offset = len(magic)
        (version,) = self.unpack("<H")
        if version != LAYOUT_VERSION:
            raise ValueError(f"{what}: layout version {version} is not supported (this build reads {LAYOUT_VERSION})")

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buf) - _CHECKSUM_BYTES:
            raise ValueError(f"{self.what}: header truncated")
        values = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += size
        return values

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{self.what}: {message}")

    def sources(self, args: ModelArgs) -> None:
        (n,) = self.unpack("<H")
        got = [self.unpack("<4H") for _ in range(n)]
        want = [(layer, m, args.head_dim, args.index_head_dim) for layer, m in kv_sources(args)]
        self.expect(got == want, f"KV sources (layer, ratio, head_dim, index_head_dim) {got} != the model's {want}")

    def fingerprint(self, expected: bytes | None) -> bytes:
        (stored,) = self.unpack(f"<{FINGERPRINT_BYTES}s")
        if expected is not None:
            self.expect(stored == _fingerprint_field(expected), "model fingerprint does not match this model")
        return b"" if stored == bytes(FINGERPRINT_BYTES) else stored

    def payload(self, layout: Layout) -> dict[tuple, Tensor]:
        (length,) = self.unpack("<Q")
        end = len(self.buf) - _CHECKSUM_BYTES
        expected = sum(_nbytes(dtype, shape) for _, dtype, shape in layout)
        actual = end - self.offset
        self.expect(length == expected == actual, f"payload is {actual} bytes (declared {length}), needs {expected}")
        out, offset = {}, self.offset
        for key, dtype, shape in layout:
            size = _nbytes(dtype, shape)
            raw = torch.frombuffer(bytearray(self.buf[offset : offset + size]), dtype=torch.uint8) if size else None
            out[key] = raw.view(dtype).reshape(shape) if raw is not None else torch.empty(shape, dtype=dtype)
            offset += size
        return out


def _fingerprint_field(fingerprint: bytes) -> bytes:
    if len(fingerprint) not in (0, FINGERPRINT_BYTES):
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return fingerprint or bytes(FINGERPRINT_BYTES)


def _sources_header(args: ModelArgs) -> bytes:
    sources = kv_sources(args)
    return struct.pack("<H", len(sources)) + b"".join(
        struct.pack("<4H", layer, m, args.head_dim, args.index_head_dim) for layer, m in sources
    )


def _entries_layout(args: ModelArgs, counts: dict[int, int], tag: str) -> Layout:
    return [
        ((tag, layer, part), torch.uint8, (counts[layer], width))
        for layer, _ in kv_sources(args)
        for part, width in enumerate(entry_widths(args))
    ]


def _entries_tensors(entries: dict[int, PackedEntries], tag: str) -> dict[tuple, Tensor]:
    return {(tag, layer, part): t for layer, e in entries.items() for part, t in enumerate(e.tensors())}


def _entries_from(tensors: dict[tuple, Tensor], args: ModelArgs, tag: str) -> dict[int, PackedEntries]:
    return {layer: PackedEntries(*(tensors[(tag, layer, p)] for p in range(4))) for layer, _ in kv_sources(args)}


# ---------------------------------------------------------------------------------------------- KV blocks
@dataclass
class GlobalKVBlock:
    """Global KV of tokens [index·Bt, (index+1)·Bt): every KV source's Bt/m packed entries."""

    args: ModelArgs
    index: int
    entries: dict[int, PackedEntries]
    fingerprint: bytes = b""

    def _layout(self) -> Layout:
        Bt = self.args.kv_block_tokens
        return _entries_layout(self.args, {layer: Bt // m for layer, m in kv_sources(self.args)}, "kv")

    def to_bytes(self) -> bytes:
        header = struct.pack("<IQ", self.args.kv_block_tokens, self.index)
        header += _fingerprint_field(self.fingerprint) + _sources_header(self.args)
        return _pack(_BLOCK_MAGIC, header, self._layout(), _entries_tensors(self.entries, "kv"))

    @classmethod
    def from_bytes(cls, data: bytes, args: ModelArgs, fingerprint: bytes | None = None) -> GlobalKVBlock:
        r = _Reader(data, _BLOCK_MAGIC, "GlobalKVBlock")
        block_tokens, index = r.unpack("<IQ")
        r.expect(block_tokens == args.kv_block_tokens,
                 f"kv_block_tokens {block_tokens} does not match the model's {args.kv_block_tokens}")  # fmt: skip
        stored = r.fingerprint(fingerprint)
        r.sources(args)
        block = cls(args, index, {}, stored)
        block.entries = _entries_from(r.payload(block._layout()), args, "kv")
        return block

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() for e in self.entries.values() for t in e.tensors())


# -------------------------------------------------------------------------------------------- encoder state
@dataclass
class EncoderState:
    """The encoder side of one sequence at `position` (see the module docstring)."""

    args: ModelArgs
    position: int
    ring_data: Tensor  # uint8 [L/2, W, D]     E4M3, slot = position mod W
    ring_scale: Tensor  # uint8 [L/2, W, D/32]  UE8M0
    ring_start: list[int]  # per encoder layer: first position its ring holds (> 0 after a bounded replay)
    pending: dict[int, tuple[Tensor, Tensor]]  # m>1 source → open group (kv, gate logits) [position mod m, D]
    tail: dict[int, PackedEntries]  # every source → entries of the partial block
    hidden: Tensor  # [min(position, W), n, C]  H^{L/2}, oldest first
    hidden_pre: Tensor  # [min(position, W), n]  the pre-mix of layer L/2−1's FFN site (≥ fp32, as pending)
    history: Tensor  # int64 [n−1]  last token ids (−1 before the sequence start)
    fingerprint: bytes = b""

    @staticmethod
    def layout(args: ModelArgs, position: int, dtype: torch.dtype, wide: torch.dtype) -> Layout:
        """Payload of a state at `position` whose hidden rows are `dtype`, open groups and pre-mix `wide` (≥ fp32)."""
        Le, W, D = args.n_encoder_layers, args.sliding_window, args.head_dim
        n_h, Bt = min(position, W), args.kv_block_tokens
        rings: Layout = [(("ring_data", i), torch.uint8, (W, D)) for i in range(Le)]
        rings += [(("ring_scale", i), torch.uint8, (W, D // 32)) for i in range(Le)]
        open_groups: Layout = [
            (("pending", layer, part), wide, (position % m, D))
            for layer, m in kv_sources(args)
            if m > 1
            for part in range(2)
        ]
        tail = _entries_layout(args, {layer: position % Bt // m for layer, m in kv_sources(args)}, "tail")
        rows: Layout = [
            (("hidden",), dtype, (n_h, args.hc_mult, args.hidden_size)),
            (("hidden_pre",), wide, (n_h, args.hc_mult)),
            (("history",), torch.int64, (args.engram_max_ngram_size - 1,)),
        ]
        return rings + open_groups + tail + rows

    def to_bytes(self) -> bytes:
        a, dtype, wide = self.args, self.hidden.dtype, self.hidden_pre.dtype
        Le = a.n_encoder_layers
        header = struct.pack("<QBB", self.position, _DTYPES[dtype], _DTYPES[wide])
        header += struct.pack("<IHIHHB", a.sliding_window, a.head_dim, a.hidden_size, a.hc_mult, Le,
                              a.engram_max_ngram_size - 1)  # fmt: skip
        header += _fingerprint_field(self.fingerprint) + _sources_header(a)
        header += struct.pack(f"<{Le}Q", *self.ring_start)
        tensors = {("hidden",): self.hidden, ("hidden_pre",): self.hidden_pre, ("history",): self.history}
        tensors |= {("ring_data", i): self.ring_data[i] for i in range(Le)}
        tensors |= {("ring_scale", i): self.ring_scale[i] for i in range(Le)}
        tensors |= {("pending", layer, p): t for layer, pair in self.pending.items() for p, t in enumerate(pair)}
        tensors |= _entries_tensors(self.tail, "tail")
        return _pack(_STATE_MAGIC, header, self.layout(a, self.position, dtype, wide), tensors)

    @classmethod
    def from_bytes(cls, data: bytes, args: ModelArgs, fingerprint: bytes | None = None) -> EncoderState:
        r = _Reader(data, _STATE_MAGIC, "EncoderState")
        position, h_code, p_code = r.unpack("<QBB")
        r.expect(h_code in _DTYPE_OF and p_code in _DTYPE_OF, f"unknown dtype codes {h_code}, {p_code}")
        got = r.unpack("<IHIHHB")
        Le = args.n_encoder_layers
        want = (args.sliding_window, args.head_dim, args.hidden_size, args.hc_mult, Le, args.engram_max_ngram_size - 1)
        r.expect(
            got == want, f"(window, head_dim, hidden, hc_mult, encoder layers, history) {got} != the model's {want}"
        )
        stored = r.fingerprint(fingerprint)
        r.sources(args)
        ring_start = list(r.unpack(f"<{Le}Q"))
        t = r.payload(cls.layout(args, position, _DTYPE_OF[h_code], _DTYPE_OF[p_code]))
        return cls(
            args=args,
            position=position,
            ring_data=torch.stack([t[("ring_data", i)] for i in range(Le)]),
            ring_scale=torch.stack([t[("ring_scale", i)] for i in range(Le)]),
            ring_start=ring_start,
            pending={
                layer: (t[("pending", layer, 0)], t[("pending", layer, 1)]) for layer, m in kv_sources(args) if m > 1
            },
            tail=_entries_from(t, args, "tail"),
            hidden=t[("hidden",)],
            hidden_pre=t[("hidden_pre",)],
            history=t[("history",)],
            fingerprint=stored,
        )


# ------------------------------------------------------------------------------------- cache rows ↔ records
def _row_entries(cache: KVCache, row: int, layer: int, lo: int, hi: int) -> PackedEntries:
    e = cache.entries[layer]
    return PackedEntries(*(getattr(e, name)[row, lo:hi].cpu().clone() for name in e.FIELDS))


def export_blocks(cache: KVCache, row: int, first: int, last: int, fingerprint: bytes = b"") -> list[GlobalKVBlock]:
    """Complete blocks first..last−1 of a cache row."""
    args, Bt = cache.args, cache.args.kv_block_tokens
    return [
        GlobalKVBlock(
            args,
            i,
            {layer: _row_entries(cache, row, layer, i * Bt // m, (i + 1) * Bt // m) for layer, m in kv_sources(args)},
            fingerprint,
        )
        for i in range(first, last)
    ]


def export_state(cache: KVCache, row: int, fingerprint: bytes = b"") -> EncoderState:
    """The encoder state of a cache row at its position."""
    args, n = cache.args, cache.pos[row]
    Le, W, Bt = args.n_encoder_layers, args.sliding_window, args.kv_block_tokens
    rings = [cache.rings[i] for i in range(Le)]
    starts = []
    for ring in rings:
        held = ring.pos[row][ring.pos[row] >= 0]
        starts.append(int(held.min()) if held.numel() else n)
    recent = torch.arange(max(0, n - W), n, device=cache.device) % W
    return EncoderState(
        args=args,
        position=n,
        ring_data=torch.stack([r.data[row] for r in rings]).cpu(),
        ring_scale=torch.stack([r.scale[row] for r in rings]).cpu(),
        ring_start=starts,
        pending={
            layer: (
                cache.pending[layer].kv[row, : n % m].cpu().clone(),
                cache.pending[layer].score[row, : n % m].cpu().clone(),
            )
            for layer, m in kv_sources(args)
            if m > 1
        },
        tail={layer: _row_entries(cache, row, layer, n // Bt * Bt // m, n // m) for layer, m in kv_sources(args)},
        hidden=cache.hidden[row, recent].cpu(),
        hidden_pre=cache.hidden_pre[row, recent].cpu(),
        history=cache.history[row].cpu().clone(),
        fingerprint=fingerprint,
    )


def restore(cache: KVCache, row: int, blocks: list[GlobalKVBlock], state: EncoderState | None) -> None:
    """Load a prefix into a fresh cache row: blocks 0..k−1 and, if given, the encoder state at the prefix end.

    Without a state the row sits at k·Bt with empty rings (the caller bounded-replays them).
    """
    args, Bt, W = cache.args, cache.args.kv_block_tokens, cache.args.sliding_window
    for i, block in enumerate(blocks):
        if block.index != i:
            raise ValueError(
                f"prefix blocks must be blocks 0..{len(blocks) - 1} in order; got block {block.index} at {i}"
            )
    n = state.position if state is not None else len(blocks) * Bt
    if state is not None and state.position // Bt != len(blocks):
        raise ValueError(f"an encoder state at position {n} needs {n // Bt} preceding blocks, got {len(blocks)}")
    for layer, _ in kv_sources(args):
        if layer not in cache.entries:
            continue
        parts = [b.entries[layer] for b in blocks] + ([state.tail[layer]] if state is not None else [])
        if parts:
            packed = tuple(torch.cat([p.tensors()[i] for p in parts]).to(cache.device).unsqueeze(0) for i in range(4))
            first = torch.zeros(1, dtype=torch.int64, device=cache.device)
            cache.entries[layer].write(slice(row, row + 1), first, packed[0].shape[1], packed)
    cache.pos[row] = n
    if state is None:
        return
    # The position each slot holds, for every ring at once (one host-to-device copy): the last W positions from the
    # ring's start on, −1 before it
    positions = torch.arange(n - W, n)
    starts = torch.tensor(state.ring_start, dtype=torch.int64).clamp_min(0).unsqueeze(1)
    held = torch.full((len(state.ring_start), W), -1, dtype=torch.int64)
    held[:, positions % W] = torch.where(positions >= starts, positions, -1)
    held = held.to(cache.device)
    for i, ring_pos in enumerate(held):
        ring = cache.rings[i]
        ring.data[row], ring.scale[row] = state.ring_data[i].to(cache.device), state.ring_scale[i].to(cache.device)
        ring.pos[row] = ring_pos
    for layer, (kv, score) in state.pending.items():
        cache.pending[layer].kv[row, : kv.shape[0]] = kv.to(cache.device)
        cache.pending[layer].score[row, : score.shape[0]] = score.to(cache.device)
    recent = torch.arange(max(0, n - W), n) % W
    cache.hidden[row, recent] = state.hidden.to(cache.device, cache.dtype)
    cache.hidden_pre[row, recent] = state.hidden_pre.to(cache.device, cache.hidden_pre.dtype)
    cache.set_history(row, state.history)
