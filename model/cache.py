"""Packed inference state of a batch of sequences, and one forward step over it.

`KVCache` holds, for up to `capacity` sequences in rows 0..n−1 (rows compacted on removal, so a step reads plain
leading views and never gathers):

- an FP8 SWA ring per attention layer: `sliding_window` slots, slot = position mod W, E4M3 bytes + UE8M0 scale
  bytes + the position each slot holds (−1 = empty; a ring rebuilt by bounded replay starts empty); every layer's
  ring lives in one tensor per field (`Rings`), so that a commit writes all layers' new entries at once;
- per KV-source (Full owner) layer, its compressed entries as packed FP4 (main KV: E2M1 + E4M3 scale per 16;
  indexer K: E2M1 + UE8M0 scale per 32), entry j at index j, grown by doubling;
- per m>1 compressor, the pending partial group (kv and gate logits of the pos mod m tokens since the last group);
- H^{L/2} rows (the hc stream entering layer L/2 and its pre-mix) of the last W positions — the decoder's bounded
  replay input — and the last n−1 token ids (Engram look-back), mirrored on the host when the Engram tables are
  there (`host_history`: the host hashes a step's rows without waiting for the device).

A `Step` runs T new positions of every active row. Layers read committed state plus the step's own new entries and
*stage* their writes; `Step.commit(keep)` then keeps the first keep[b] positions of row b (verification drops
rejected drafts). Compressed entries are written ahead into their buffers (a query sees them through its
visibility count, so entries of dropped positions are simply overwritten later); rings, pending groups, H rows and
history are written only on commit, since a ring write would overwrite slots that earlier queries still read.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.config import ModelArgs
from model.fused import fused
from model.indexer import Selection
from model.mhc import mix_dtype

if TYPE_CHECKING:
    from model.engram_store import Memory


def _grow(t: Tensor, dim: int, size: int) -> Tensor:
    """t with dimension `dim` enlarged (zero-filled) to at least `size`, doubling to amortise copies."""
    if t.shape[dim] >= size:
        return t
    new = max(size, 2 * t.shape[dim], 1)
    shape = list(t.shape)
    shape[dim] = new
    out = t.new_zeros(shape) if t.dtype != torch.int64 else t.new_full(shape, -1)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


@dataclass
class Rings:
    """The FP8 sliding-window rings of every ring layer, one tensor per field with the layers first: a commit writes
    the new entries of every layer it staged with one indexed store per field."""

    data: Tensor  # uint8 [L, S, W, D]
    scale: Tensor  # uint8 [L, S, W, D/32]
    pos: Tensor  # int64 [L, S, W], −1 = empty

    FIELDS = ("data", "scale", "pos")


class Ring:
    """One layer's ring for every row: views of the cache's `Rings` at `index` (taken anew on each access: growing
    the rows reallocates the stack)."""

    def __init__(self, rings: Rings, index: int) -> None:
        self.rings, self.index = rings, index

    @property
    def data(self) -> Tensor:  # uint8 [S, W, D]
        return self.rings.data[self.index]

    @property
    def scale(self) -> Tensor:  # uint8 [S, W, D/32]
        return self.rings.scale[self.index]

    @property
    def pos(self) -> Tensor:  # int64 [S, W]
        return self.rings.pos[self.index]


@fused
def _visible(positions: Tensor, ratio: int) -> Tensor:
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def counting(n: int, device: torch.device) -> Tensor:
    """0 … n − 1 (int64) on `device` without a launch: a view of a range made once per power of two (never freed,
    as captured graphs read it; under four times the longest range asked for, in all)."""
    return _range(1 << max(n - 1, 0).bit_length(), device)[:n]


@functools.cache
def _range(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device)


@fused
def _window_slots(pos: Tensor, new_pos: Tensor) -> Tensor:
    """Query t's window positions q−W+1 … q as slots of [ring ‖ step]: this step's column of a position it writes
    (W + column: the step's positions are consecutive), else the ring's slot (position mod W) when it holds it.
    pos [..., B, W] (the rings of any number of layers) and new_pos [B, T] → [..., B, T, W]."""
    W = pos.shape[-1]
    want = new_pos.unsqueeze(2) - (W - 1) + torch.arange(W, device=pos.device)  # [B, T, W]
    slot = want.remainder(W)
    lead = pos.shape[:-2]
    in_ring = pos.gather(-1, slot.flatten(1).expand(*lead, -1, -1)).view(*lead, *want.shape) == want
    column = want - new_pos[:, :1, None]
    idx = torch.where(column >= 0, W + column, torch.where(in_ring, slot, -1)).masked_fill(want < 0, -1)
    return idx.to(torch.int32)


def _write_kept(pairs, rows: slice, pos: Tensor, keep: Tensor | None, W: int) -> None:
    """dst[l, rows.start + b, pos mod W] = src[l, b, t] for the last ≤ W of the first keep[b] columns t of each row,
    for every (dst [L, S, W, ·], src [L, B, T, ·]) pair: the layers of a ring field, or one tensor viewed as such.

    A step no longer than the ring (every decode and verify step) writes all its columns at once, a dropped column
    rewriting its slot's old value: the same bytes as writing only the kept ones, without a host sync (nonzero).
    """
    B, T = pos.shape
    if T > W:  # a long prefill chunk: several of a row's columns share a slot, so only the last W may be written
        b, t = _kept(keep if keep is not None else pos.new_full((B,), T), T, W)
        at = (slice(None), b + rows.start, pos[b, t] % W)
        for dst, src in pairs:
            dst[at] = src[:, b, t]
        return
    b = counting(rows.start + B, pos.device)[rows.start :].unsqueeze(1)
    slots = pos % W
    kept = None if keep is None else counting(T, pos.device) < keep.unsqueeze(1)
    for dst, src in pairs:
        dst[:, b, slots] = src if kept is None else _kept_or_old(src, dst, b, slots, kept)


@fused
def _kept_or_old(src: Tensor, dst: Tensor, b: Tensor, slots: Tensor, kept: Tensor) -> Tensor:
    """src [L, B, T, ·] where kept [B, T], else what dst [L, S, W, ·] holds at (b, slots): one gather-select."""
    return torch.where(kept.view(1, *kept.shape, *(1,) * (src.dim() - 3)), src, dst[:, b, slots])


def _kept(keep: Tensor, T: int, W: int) -> tuple[Tensor, Tensor]:
    """(row, column) of the last ≤ W of the first keep[b] columns of each row: the ring writes of a commit."""
    t = torch.arange(T, device=keep.device)
    return torch.nonzero((t < keep.unsqueeze(1)) & (t >= keep.unsqueeze(1) - W), as_tuple=True)


@dataclass
class Entries:
    """Compressed entries of one KV-source layer: main KV and indexer K, packed."""

    kv_data: Tensor  # uint8 [S, N, D/2]
    kv_scale: Tensor  # uint8 [S, N, D/16]
    k_data: Tensor  # uint8 [S, N, Di/2]
    k_scale: Tensor  # uint8 [S, N, Di/32]

    FIELDS = ("kv_data", "kv_scale", "k_data", "k_scale")

    @staticmethod
    def room(n: int) -> int:
        """The entries a row reserved for n holds: n in multiples of 4, so that the indexer K's scale rows (4 bytes
        an entry) are 16-byte multiples apart, which its kernel needs to read them by TMA."""
        return -(-n // 4) * 4

    def reserve(self, n: int) -> None:
        """Room for n entries per row (`room`)."""
        for name in self.FIELDS:
            setattr(self, name, _grow(getattr(self, name), 1, self.room(n)))

    def write(self, rows: slice, first: Tensor, end: int, packed: tuple[Tensor, ...]) -> None:
        """Step row b takes packed[...][b, j] at entry first[b] + j for every j; `end` bounds first + G on the host.

        Entries past a row's complete groups are written too (latents of open groups): no query sees them (their
        index is ≥ its visibility count), no export reads them, and the completed group overwrites them later.
        """
        self.reserve(end)
        G = packed[0].shape[1]
        b = counting(rows.start + first.shape[0], first.device)[rows.start :].unsqueeze(1)
        at = (b, first.unsqueeze(1) + counting(G, first.device))
        for name, value in zip(self.FIELDS, packed, strict=True):
            getattr(self, name)[at] = value

    def view(self, rows: slice, n: int) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name)[rows, :n] for name in self.FIELDS)


@dataclass
class Pending:
    """The open group of an m>1 compressor: kv and gate logits of the (pos mod m) tokens since the last entry."""

    kv: Tensor  # [S, m−1, D]
    score: Tensor  # [S, m−1, D]


class KVCache:
    """Inference state of up to `capacity` sequences; rows 0..n_rows−1 are active."""

    def __init__(
        self,
        args: ModelArgs,
        ring_layers: Iterable[int],
        source_layers: Iterable[int],
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        capacity: int = 1,
        host_history: bool = False,
    ) -> None:
        self.args, self.device, self.dtype = args, torch.device(device), dtype
        S, W, D, Di = capacity, args.sliding_window, args.head_dim, args.index_head_dim
        u8 = {"dtype": torch.uint8, "device": self.device}
        ring_layers = list(ring_layers)
        L = len(ring_layers)
        self.ring_stack = Rings(
            torch.zeros(L, S, W, D, **u8),
            torch.zeros(L, S, W, D // 32, **u8),
            torch.full((L, S, W), -1, dtype=torch.int64, device=self.device),
        )
        self.rings = {layer: Ring(self.ring_stack, i) for i, layer in enumerate(ring_layers)}
        self.entries = {
            layer: Entries(
                torch.zeros(S, 0, D // 2, **u8),
                torch.zeros(S, 0, D // 16, **u8),
                torch.zeros(S, 0, Di // 2, **u8),
                torch.zeros(S, 0, Di // 32, **u8),
            )
            for layer in source_layers
        }
        ratios = {layer: args.compress_ratios[layer] for layer in self.entries}
        wide = {"dtype": torch.promote_types(dtype, torch.float32), "device": self.device}  # gated compressors are fp32
        self.pending = {
            layer: Pending(torch.zeros(S, m - 1, D, **wide), torch.zeros(S, m - 1, D, **wide))
            for layer, m in ratios.items()
            if m > 1
        }
        hc, C, h = args.hc_mult, args.hidden_size, args.engram_max_ngram_size - 1
        self.hidden = torch.zeros(S, W, hc, C, dtype=dtype, device=self.device)  # H^{L/2}, slot = pos mod W
        self.hidden_pre = torch.zeros(S, W, hc, dtype=mix_dtype(dtype), device=self.device)  # its pre-mix
        self.history = torch.full((S, h), -1, dtype=torch.int64, device=self.device)
        self.host_history = torch.full((S, h), -1, dtype=torch.int64) if host_history else None
        self.pos: list[int] = []  # committed positions per active row
        # The same on the device, valid while it was built from (or advanced with) `pos`: steps read their
        # positions from it instead of copying the host list every step.
        self._next = torch.zeros(S, dtype=torch.int64, device=self.device)
        self._next_of: list[int] = []

    # ------------------------------------------------------------------------------------------------ rows
    @property
    def n_rows(self) -> int:
        return len(self.pos)

    @property
    def capacity(self) -> int:
        return self.history.shape[0]

    def _row_tensors(self) -> list[tuple[object, str, int]]:
        """(owner, attribute, its rows' dimension) of every tensor with a row per sequence."""
        owners: list[tuple[object, str, int]] = [(self, "hidden", 0), (self, "hidden_pre", 0), (self, "history", 0)]
        if self.host_history is not None:
            owners.append((self, "host_history", 0))
        owners += [(self.ring_stack, name, 1) for name in Rings.FIELDS]
        for entries in self.entries.values():
            owners += [(entries, name, 0) for name in Entries.FIELDS]
        for pending in self.pending.values():
            owners += [(pending, "kv", 0), (pending, "score", 0)]
        return owners

    def _row_views(self, row: int) -> list[Tensor]:
        """Row `row` of every row tensor."""
        return [getattr(owner, name).select(dim, row) for owner, name, dim in self._row_tensors()]

    def _reserve_rows(self, rows: int) -> None:
        if rows > self.capacity:  # by doubling
            for owner, name, dim in self._row_tensors():
                setattr(owner, name, _grow(getattr(owner, name), dim, rows))

    def add_row(self) -> int:
        """A fresh empty row (position 0); grows the capacity by doubling when full."""
        row = self.n_rows
        self._reserve_rows(row + 1)
        for t in self._row_views(row):
            t.fill_(-1 if t.dtype == torch.int64 else 0)  # fill_: no scalar tensor made per tensor and row
        self.pos.append(0)
        return row

    def copy_row(self, src: int) -> int:
        """A new row holding a copy of row `src` (a fork: n samples or beams of one prompt share its prefill)."""
        row = self.add_row()
        for t, source in zip(self._row_views(row), self._row_views(src), strict=True):
            t.copy_(source)
        self.pos[row] = self.pos[src]
        return row

    def remove_row(self, row: int) -> None:
        """Drop a row; the last row moves into its place (callers track the new order)."""
        last = self.n_rows - 1
        if row != last:
            for t, source in zip(self._row_views(row), self._row_views(last), strict=True):
                t.copy_(source)
            self.pos[row] = self.pos[last]
        self.pos.pop()

    def set_history(self, row: int, ids: Tensor) -> None:
        """A row's Engram look-back: the n−1 token ids before its next position (−1 before the sequence start)."""
        self.history[row] = ids.to(self.device)
        if self.host_history is not None:
            self.host_history[row] = ids.cpu()

    # ------------------------------------------------------------------------------------------------ steps
    def step(
        self,
        tokens: Tensor | None,
        rows: slice | None = None,
        positions: Tensor | None = None,
        replay: bool = False,
        history: Tensor | None = None,
        replayed: int = 0,
        static: bool = False,
    ) -> Step:
        """A forward over tokens [B, T] of cache rows `rows` (all active rows by default) at their next positions.

        `tokens` may be on the host or the device (the step holds them on the device, and on the host too where the
        look-back is mirrored there: host tokens then cost no wait). `history`, likewise on either.
        A bounded replay (`replay`) runs at explicit `positions` whose global entries are cached already: owners
        write no entries, positions and history do not advance; SWA rings (and H rows) are rebuilt. Its `history`
        is the Engram look-back before the first replayed token (the decoder replay has no tokens at all: it
        starts from H^{L/2}). `replayed` > 0 makes only the step's first `replayed` positions such a replay: one
        forward rebuilds the windows of a cached prefix and encodes the tokens after it, whose entries are written
        and past which positions and history advance. A `static` step's shapes do not depend on its positions
        (model.graphs): it may run rows past n_rows (padding, at position 0) and views every entry reserved.
        """
        rows = slice(0, self.n_rows) if rows is None else rows
        if positions is None:
            start = self.pos[rows] + [0] * (rows.stop - max(rows.start, self.n_rows))  # rows past n_rows: padding
            positions = self.next_positions(rows).unsqueeze(1) + counting(tokens.shape[1], self.device)
        else:
            start = positions[:, 0].tolist()
        host = None
        if self.host_history is not None and not static:  # a static step's rows are staged by its graph
            host_tokens = None if tokens is None else tokens.cpu()  # a no-op for host tokens
            host = (host_tokens, self.host_history[rows].clone() if history is None else history.cpu())
        tokens = None if tokens is None else tokens.to(self.device)
        history = self.history[rows] if history is None else history.to(self.device)
        replayed = positions.shape[1] if replay else replayed
        return Step(self, rows, tokens, positions, start, replayed, history, host=host, static=static)

    def next_positions(self, rows: slice) -> Tensor:
        """int64 [B]: the next position of each row (its committed length), on the device."""
        if self._next_of != self.pos or self._next.shape[0] != self.capacity:  # rows joined, left, forked or grew
            pos = torch.zeros(self.capacity, dtype=torch.int64)  # rows without a sequence: position 0
            pos[: self.n_rows] = torch.tensor(self.pos, dtype=torch.int64)
            if self._next.shape[0] != self.capacity:  # else in place: captured graphs read this very tensor
                self._next = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self._next.copy_(pos)
            self._next_of = list(self.pos)
        return self._next[rows]

    def advance_device(self, rows: slice, by: Tensor | int) -> None:
        """Rows' device positions move by `by` [B] (a captured step: the host follows with `advanced`)."""
        self._next[rows] += by

    def advanced(self, by: list[int], tokens: Tensor | None = None) -> None:
        """Rows 0 … len(by) − 1 moved by[r] positions on the device (a replayed forward): the host follows, and so
        does the look-back it mirrors (tokens [n, T]: the forward's, of which row r kept by[r]; read to the host
        where they are on the device)."""
        for r, k in enumerate(by):
            self.pos[r] += k
        self._next_of = list(self.pos)
        if self.host_history is not None:
            rows = slice(0, len(by))
            keep = torch.tensor(by, dtype=torch.int64)
            _keep_last(self.host_history, rows, self.host_history[rows].clone(), tokens.cpu(), keep)

    def reserve(self, rows: int, positions: int) -> None:
        """Room for `rows` rows and, in every row, the entries of `positions` positions plus a step's write-ahead."""
        self._reserve_rows(rows)
        for layer, entries in self.entries.items():
            entries.reserve(positions // self.args.compress_ratios[layer] + 1)

    def layout(self) -> tuple[int, ...]:
        """Changes whenever a buffer a step reads is reallocated (every growth changes a shape)."""
        return (self.capacity, *(e.kv_data.shape[1] for e in self.entries.values()))

    def advance(self, rows: slice, start: list[int], keep: list[int], keep_t: Tensor | None) -> None:
        """Rows' positions move past their kept tokens, on the host and (in place) on the device."""
        in_sync = self._next_of == self.pos
        for b, k in enumerate(keep):
            self.pos[rows.start + b] = start[b] + k
        if in_sync:
            self.advance_device(rows, keep_t if keep_t is not None else keep[0])
            self._next_of = list(self.pos)


@dataclass
class Step:
    """One forward over positions [B, T]: cross-layer slots (Top-K, candidate pool) and staged writes."""

    cache: KVCache
    rows: slice  # cache rows of the step's rows 0..B−1
    tokens: Tensor | None  # [B, T]
    positions: Tensor  # int64 [B, T]
    start: list[int]  # positions[:, 0] on the host (shapes and bounds never wait for the device)
    replayed: int  # leading positions that only rebuild windows (their global entries are cached); T: a replay
    history: Tensor  # int64 [B, n−1] token ids before the step (Engram look-back)
    host: tuple[Tensor | None, Tensor] | None = None  # (tokens, history) on the host, where the cache mirrors them
    selection: Selection = field(default_factory=Selection)  # Top-K per index source, candidate pool
    rings: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer → staged (data, scale) [B, T, ·]
    groups: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)  # layer → (kv, score, n_open)
    hidden: tuple[Tensor, Tensor] | None = None  # staged H^{L/2} rows (X [B, T, n, C], pre [B, T, n])
    static: bool = False  # shapes independent of positions (a captured step, model.graphs)
    memory: Memory | None = None  # its Engram rows, where a graph stages them (else the model looks them up)
    _visible: dict[int, Tensor] = field(default_factory=dict, repr=False)  # ratio → n_visible
    _slots: Tensor | None = field(default=None, repr=False)  # every ring layer's window slots [L, B, T, W]

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def host_ids(self) -> tuple[Tensor, Tensor]:
        """(tokens [B, T], history [B, n−1]) on the host: what the host hashes Engram rows from."""
        if self.host is None or self.host[0] is None:
            raise ValueError("this step's token ids are not on the host (the cache mirrors no look-back)")
        return self.host[0], self.host[1]

    @property
    def replay(self) -> bool:
        """The whole step is a bounded replay: it writes no entries and its rows do not advance."""
        return self.replayed == self.length

    def cached_groups(self, ratio: int) -> int:
        """Groups of `ratio` positions completed inside the replayed prefix: their entries are cached already."""
        if not self.replayed:  # every decode step, for every owner layer: no per-row work
            return 0
        counts = {(s + self.replayed) // ratio - s // ratio for s in self.start}
        if len(counts) > 1:
            raise ValueError("the rows of a step must replay the same number of groups")
        return counts.pop()

    def n_visible(self, ratio: int) -> Tensor:
        """[B, T] compressed entries visible to each query: entry j once j < ⌊(t+1)/m⌋ (computed once per step and
        ratio: every layer of the ratio asks)."""
        if ratio not in self._visible:
            self._visible[ratio] = _visible(self.positions, ratio)
        return self._visible[ratio]

    def max_visible(self, ratio: int) -> int:
        """The largest n_visible(ratio), from the host positions."""
        return (max(self.start) + self.length) // ratio

    def entries(self, source: int, ratio: int) -> tuple[Tensor, ...]:
        """A KV source's packed entries (kv data, kv scale, K data, K scale) [B, N, ·] as the step's queries may see
        them: N = the host bound on the visible ones, or every entry reserved in a static step."""
        entries = self.cache.entries[source]
        return entries.view(self.rows, entries.kv_data.shape[1] if self.static else self.max_visible(ratio))

    def window(self, layer: int, data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Stage this step's ring entries (data, scale) [B, T, ·] of a layer; return its attention keys — committed
        ring (data, scale), the step's entries — and, per query, its window's key slots of [ring ‖ step], oldest
        position first (−1: no key), so every step meets a position's keys in the same order
        (kernels.sparse_attention)."""
        self.rings[layer] = (data, scale)
        ring = self.cache.rings[layer]
        return ring.data[self.rows], ring.scale[self.rows], data, scale, self.window_slots()[ring.index]

    def window_slots(self) -> Tensor:
        """`_window_slots` of every ring layer [L, B, T, W], computed once a step: every layer asks, and the rings
        stay as they are until the commit."""
        if self._slots is None:
            self._slots = _window_slots(self.cache.ring_stack.pos[:, self.rows], self.positions)
        return self._slots

    def commit(self, keep: list[int] | None = None) -> None:
        """Keep the first keep[b] positions of row b (all by default) and advance the rows' positions."""
        keep_t = None if keep is None else torch.tensor(keep, dtype=torch.int64, device=self.cache.device)
        self.write(keep_t)
        self.advance(keep, keep_t)

    def advance(self, keep: list[int] | None, keep_t: Tensor | None) -> None:
        """The host half of a commit: the rows' positions (and the host's look-back) move past their kept tokens;
        keep_t is `keep` on the device, as `write` had it."""
        cache, B, T = self.cache, self.batch, self.length
        if not self.replay:
            if self.host is not None and cache.host_history is not None:
                host_keep = None if keep is None else torch.tensor(keep, dtype=torch.int64)
                _keep_last(cache.host_history, self.rows, self.host[1], self.host[0], host_keep)
            cache.advance(self.rows, self.start, [T] * B if keep is None else keep, keep_t)

    def write(self, keep: Tensor | None = None) -> None:
        """The device half of a commit: rings, open groups, H^{L/2} rows and look-back keep the first keep[b]
        positions of row b (all: None); positions do not move."""
        cache = self.cache
        windowed = self._staged_rings()
        if self.hidden is not None:  # as one more layer of a ring field
            windowed += [(cache.hidden.unsqueeze(0), self.hidden[0].unsqueeze(0)),
                         (cache.hidden_pre.unsqueeze(0), self.hidden[1].unsqueeze(0))]  # fmt: skip
        if windowed:  # every ring and the H^{L/2} rows share the window's slots: one index for all of them
            _write_kept(windowed, self.rows, self.positions, keep, cache.args.sliding_window)
        for layer, (kv, score, n_open) in self.groups.items():
            self._commit_group(layer, kv, score, n_open, keep)
        if not self.replay:  # each row's look-back ends with its kept tokens
            _keep_last(cache.history, self.rows, self.history, self.tokens, keep)

    def _staged_rings(self) -> list[tuple[Tensor, Tensor]]:
        """(a ring field's layers lo…hi−1 [L, S, W, ·], their staged values [L, B, T, ·]) for each run of consecutive
        staged layers (a decode step stages every layer: one run, one store per field)."""
        stack, pairs = self.cache.ring_stack, []
        staged = sorted((self.cache.rings[layer].index, entries) for layer, entries in self.rings.items())
        for _, run in itertools.groupby(enumerate(staged), lambda item: item[1][0] - item[0]):
            indices, entries = zip(*(item for _, item in run), strict=True)
            lo, hi = indices[0], indices[-1] + 1
            pairs += [
                (stack.data[lo:hi], torch.stack([data for data, _ in entries])),
                (stack.scale[lo:hi], torch.stack([scale for _, scale in entries])),
                (stack.pos[lo:hi], self.positions.expand(hi - lo, *self.positions.shape)),
            ]
        return pairs

    def _commit_group(self, layer: int, kv: Tensor, score: Tensor, n_open: Tensor, keep: Tensor | None) -> None:
        """New open group = the kept tokens after the last complete group (kv/score are group-aligned [B, L, D])."""
        pending = self.cache.pending[layer]
        kept = self.length if keep is None else keep
        m = self.cache.args.compress_ratios[layer]
        opened = _open_group(kv, score, n_open, kept, pending.kv[self.rows], pending.score[self.rows], m)
        pending.kv[self.rows], pending.score[self.rows] = opened


@fused
def _open_group(
    kv: Tensor, score: Tensor, n_open: Tensor, kept: Tensor | int, open_kv: Tensor, open_score: Tensor, m: int
) -> tuple[Tensor, Tensor]:
    """The open groups after a step: row b's tokens past its last complete group of m, out of the group-aligned
    kv/score [B, L, D] (n_open[b] open tokens before the step, kept[b] kept by it); slots past them keep
    open_kv/open_score's values."""
    end = n_open + kept  # [B]
    j = torch.arange(m - 1, device=end.device)
    lo = end - end % m
    take = (lo.unsqueeze(1) + j).clamp_max(kv.shape[1] - 1).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
    open_ = (j < (end - lo).unsqueeze(1)).unsqueeze(-1)
    return (torch.where(open_, kv.gather(1, take).to(open_kv.dtype), open_kv),
            torch.where(open_, score.gather(1, take).to(open_score.dtype), open_score))  # fmt: skip


def _keep_last(history: Tensor, rows: slice, before: Tensor, tokens: Tensor, keep: Tensor | None) -> None:
    """history[rows] ← the last n−1 ids of before ‖ tokens[:, :keep[b]] per row (keep None: all the tokens)."""
    h = history.shape[1]
    seen = torch.cat((before, tokens), dim=1)  # the step's look-back: before a replayed prefix too
    if keep is None:
        history[rows] = seen[:, seen.shape[1] - h :]
    else:
        history[rows] = seen.gather(1, keep.unsqueeze(1) + counting(h, keep.device))
