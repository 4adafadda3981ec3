"""The decode step as CUDA graphs: one captured per batch bucket, replayed with the batch padded to its bucket.

An eager step launches a few thousand small kernels and the host cannot keep up (the GPU idles most of the step).
A graph launches them all at once. What a captured step needs, and how it is given:

- shapes that do not depend on positions: the rows run padded to their bucket (1, 2, 4 … 256), and every
  compressed-entry view spans the entries the cache has reserved, not the host's bound on the visible ones (a
  *static* `Step`: the kernels mask each query's entries by its visibility count, a device tensor);
- buffers that do not move: the cache is reserved ahead (rows and entries grow by doubling), and a growth —
  rare, logarithmic in the context — drops the graphs, which are captured again on their next use;
- inputs and outputs in fixed places: the pending tokens are copied into one buffer, the positions are the cache's
  device copy, and the logits are written to the graph's own output (the caller gets a copy);
- no host work inside: the step's device writes (rings, open groups, H^{L/2} rows, look-back) are captured with
  it, and the positions of the real rows (a device mask, not the padding) advance inside it; the host then follows.

Padding rows beyond the batch are rows of the cache no sequence holds: they run at position 0 and never advance,
their writes land in rows a joining sequence overwrites, and their logits are not returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.cache import KVCache
from model.serving import forward_full

if TYPE_CHECKING:
    from model.transformer import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT = 4096  # positions every row's entries are reserved for at least: short sequences never recapture


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # fp32 [bucket, V], written by every replay


class StepGraphs:
    """The decode step of one `DecodeBatch`'s cache, captured per batch bucket on first use and replayed."""

    def __init__(self, model: Transformer, cache: KVCache, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.model, self.cache, self.buckets = model, cache, buckets
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, Captured] = {}
        self.layout: tuple[int, ...] = ()  # the cache layout the graphs read
        self.tokens = torch.zeros(buckets[-1], 1, dtype=torch.int64, device=cache.device)
        self.active = torch.zeros((), dtype=torch.int64, device=cache.device)  # rows that hold a sequence
        self.captures = 0

    @staticmethod
    def supported(model: Transformer) -> bool:
        """A CUDA model whose step needs no host work: Engram tables on the device, one expert-parallel rank."""
        return model.device.type == "cuda" and model.engram_fetch is None and model.parallel.world_size == 1

    def covers(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def decode(self, tokens: Tensor) -> Tensor:
        """One decode step of every row (tokens [n, 1], n ≤ the largest bucket) → logits [n, V]."""
        cache, n = self.cache, tokens.shape[0]
        b = next(b for b in self.buckets if b >= n)
        self.prepare(b)
        captured = self.graphs.get(b) or self.capture(b)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.active.fill_(n)
        captured.graph.replay()
        cache.advanced(n)
        return captured.logits[:n].clone()  # the caller's: the next replay rewrites the graph's own

    def prepare(self, b: int) -> None:
        """Reserve the cache for this step (rows up to the bucket, entries past every row's next position) and drop
        the graphs if that moved a buffer; the device positions match the host's, zero for rows without a sequence."""
        cache = self.cache
        cache.reserve(b, max(MIN_CONTEXT, *cache.pos) + 1)
        if cache.layout() != self.layout:
            self.graphs.clear()
            self.layout = cache.layout()
        cache.next_positions(slice(0, b))

    def capture(self, b: int) -> Captured:
        """Warm up the step at bucket b (kernels compile; nothing is committed), then capture it."""
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b, commit=True)
        self.graphs[b] = Captured(graph, logits)
        self.captures += 1
        return self.graphs[b]

    def _forward(self, b: int, commit: bool = False) -> Tensor:
        cache = self.cache
        step = cache.step(self.tokens[:b], slice(0, b), static=True)
        logits = forward_full(self.model, step, last_only=True)[:, -1]
        if commit:
            step.write()
            cache.advance_device(slice(0, b), torch.arange(b, device=cache.device) < self.active)
        return logits
