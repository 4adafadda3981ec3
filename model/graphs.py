"""A batch's forwards as CUDA graphs: each captured per batch bucket (and width), replayed with the rows padded.

An eager step launches a few thousand small kernels and the host cannot keep up (the GPU idles most of the step).
A graph launches them all at once. These forwards are captured, each per bucket b (1, 2, 4 … 256):

    decode   one token per row → next-token logits, the step's writes committed, every real row advanced by one
    draft    the DSpark blocks over [y, noise…] → their features and head logits (model.dspark.draft_features);
             the Markov chain over them stays eager where a link is cut by top-k, top-p or a grammar's mask (host)
    keyed_draft  the same blocks and the chain of a batch whose links are keyed races of their tempered logits
             (greedy rows: arg-maxes; model.sampling.keyed_link): one graph, the rows' temperatures, seeds and
             output indices in fixed buffers
    verify   T = 1 + width tokens per row → logits [b, T, V], writes staged; then its commit (`Verified`) replays a
             second graph that keeps the first keep[r] positions of row r and advances its device position by keep[r]
             — where the targets' tokens are a pure function of the logits (greedy rows' arg-maxes, sampled rows'
             keyed races), that graph also accepts (`accept`: the host launches one graph between the verify and its
             read-back), else keep is given

What a captured forward needs, and how it is given:

- shapes that do not depend on positions: the rows run padded to their bucket, and every compressed-entry view
  spans the entries the cache has reserved, not the host's bound on the visible ones (a *static* `Step`: the kernels
  mask each query's entries by its visibility count, a device tensor);
- buffers that do not move: the cache is reserved ahead (rows and entries grow by doubling), and a growth — rare,
  logarithmic in the context — drops the graphs, which are captured again on their next use;
- inputs and outputs in fixed places: the tokens are copied into one buffer, the positions are the cache's device
  copy, and the outputs are the graph's own tensors (the caller gets copies: the next replay rewrites them);
- no host work inside: a step's device writes (rings, open groups, H^{L/2} rows, look-back) are captured with it,
  and the positions of the real rows (a device mask, not the padding) advance inside it; the host then follows
  (`KVCache.advanced`).

Padding rows beyond the batch are rows of the cache no sequence holds: they run at position 0, keep none of their
writes, never advance, and their outputs are not returned.

Engram tables off the device (model.engram_store) take part through fixed buffers, which the graph's first work
fills on a side stream, beside the layers before the first Engram layer, which waits for them on the device
(`StagedMemory`): tables in pinned host memory are read in place (the graph hashes its tokens and the GPU gathers
their rows from the mapped host memory), others' rows are hashed and gathered into pinned staging by the host before
the replay, and copied by the graph.

Without `capture` (a CPU model, tests) every forward runs the same static steps eagerly: what a replay would compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.cache import KVCache, Step
from model.dspark import Draft, draft_features, keyed_links, markov_chain
from model.engram_store import StagedMemory
from model.sampling import accept_targets, greedy_accept, raced_tokens, tempered_probs
from model.serving import forward_full

if TYPE_CHECKING:
    from model.transformer import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFTS = ("draft", "keyed_draft")  # the forwards of the DSpark blocks alone: no Engram layer among them
Forward = Callable[[int, int, bool], tuple[tuple[Tensor, ...], Step | None]]  # (bucket, T, commit) → outputs, step
MIN_CONTEXT = 4096  # positions every row's entries are reserved for at least: short sequences never recapture


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph | None  # None: not captured, the outputs of the last eager run
    outputs: tuple[Tensor, ...]  # written by every replay
    step: Step | None = None  # a verify's staged writes, which its commit graph reads


After = Callable[[int, Captured, bool], tuple[Tensor, ...]]  # (bucket, the verify, commit) → outputs: what follows it


@dataclass
class Verified:
    """A replayed verify's commit, in the two halves an eager `Step` has: `write(keep)` replays the commit graph
    (the device half; or `accept(lengths, raced)`, the acceptance with it), `advance(by, keep)` moves the host's
    positions and look-back after it."""

    graphs: StepGraphs
    key: tuple[str, int, int]  # the verify's graph
    tokens: Tensor  # [n, T] as the verify had them (on the host, or on the device where it hashes there)

    def write(self, keep: Tensor) -> None:
        self.graphs.commit(self.key, keep)

    def accept(self, lengths: Tensor, raced: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        return self.graphs.accept(self.key, lengths, raced)

    def advance(self, by: list[int], keep: Tensor | None) -> None:
        self.graphs.cache.advanced(by, self.tokens)


class StepGraphs:
    """The decode, draft and verify forwards of one `DecodeBatch`'s cache, captured per bucket on first use."""

    def __init__(
        self, model: Transformer, cache: KVCache, buckets: tuple[int, ...] = BUCKETS, capture: bool = True
    ) -> None:
        self.model, self.cache, self.buckets, self.capture = model, cache, buckets, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[str, int, int], Captured] = {}  # (forward, bucket, tokens per row) → its graph
        self.staged: dict[tuple[int, int], StagedMemory] = {}  # (bucket, tokens per row) → its Engram rows
        self.layout: tuple[int, ...] = ()  # the cache layout the graphs read
        widest = 1 + model.args.dspark_block_size
        self.tokens = torch.zeros(buckets[-1], widest, dtype=torch.int64, device=cache.device)
        self.keep = torch.zeros(buckets[-1], dtype=torch.int64, device=cache.device)
        self.lengths = torch.zeros(buckets[-1], dtype=torch.int64, device=cache.device)  # drafts an accept tests
        self.active = torch.zeros((), dtype=torch.int64, device=cache.device)  # rows that hold a sequence
        # a keyed draft's or a raced accept's rows: temperatures, seeds, output indices of their first positions
        self.keyed = (
            torch.zeros(buckets[-1], device=cache.device),
            *torch.zeros(2, buckets[-1], dtype=torch.int64, device=cache.device),
        )
        self.captures = 0

    @staticmethod
    def supported(model: Transformer) -> bool:
        """A CUDA model whose forwards need no collectives: one expert-parallel rank."""
        return model.device.type == "cuda" and model.parallel.world_size == 1

    def covers(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def hashes_on_device(self) -> bool:
        """Whether the forwards read their Engram rows without the host (tables on the device or gathered in place:
        the cache then mirrors no look-back on the host): their tokens may stay on the device."""
        return self.cache.host_history is None

    # ------------------------------------------------------------------------------------------------ forwards
    def decode(self, tokens: Tensor) -> Tensor:
        """One decode step of every row (tokens [n, 1]) → logits [n, V]; the rows advance by one."""
        n = tokens.shape[0]
        (logits,) = self._replay("decode", tokens, self._decode)
        self.cache.advanced([1] * n, tokens)
        return logits[:n].clone()

    def draft(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """The DSpark blocks after each row's pending token (y [n]) → (features [n, γ, C], logits [n, γ, V])."""
        n = y.shape[0]
        x, base = self._replay("draft", y.unsqueeze(1), self._draft)
        return x[:n].clone(), base[:n].clone()

    def keyed_draft(self, y: Tensor, temperature: Tensor, seeds: Tensor, cursor: Tensor) -> Draft:
        """A draft after each row's pending token (y [n]) whose links race on keyed noise: row b's link k is output
        position cursor[b] + k of seed seeds[b] at temperature[b] (host tensors [n]; `model.dspark.keyed_links`) —
        the DSpark blocks and the Markov chain in one graph."""
        n = y.shape[0]
        for buffer, rows in zip(self.keyed, (temperature, seeds, cursor), strict=True):
            buffer[:n].copy_(rows, non_blocking=True)
        tokens, confidence = self._replay("keyed_draft", y.unsqueeze(1), self._keyed_draft)
        return Draft(tokens[:n].clone(), None, confidence[:n].clone())

    def verify(self, tokens: Tensor) -> tuple[Tensor, Verified]:
        """The target forward over tokens [n, T] (a pending token and T − 1 drafts per row) → (logits [n, T, V], its
        commit); nothing is kept until the commit, which must follow before any other forward of this batch."""
        (logits,) = self._replay("verify", tokens, self._verify)
        return logits[: tokens.shape[0]].clone(), Verified(self, self._key("verify", tokens), tokens)

    def commit(self, verified: tuple[str, int, int], keep: Tensor) -> None:
        """Keep the first keep[r] positions of the verify's row r (keep [n] on the device, 1 … T) and move its device
        position past them; the host follows with `KVCache.advanced`."""
        self.keep[: keep.shape[0]].copy_(keep, non_blocking=True)
        self._after(("commit", *verified[1:]), verified, self._given)

    def accept(
        self, verified: tuple[str, int, int], lengths: Tensor, raced: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """The acceptance of the verify's drafts by one-hot targets and its commit: row r accepts its leading drafts,
        of its first lengths[r] (host [n]), equal to its targets' tokens, keeps them and its pending token, and emits
        the target's token after them → (accepted [n], next token [n]) on the device. The targets' tokens are the
        logits' arg-maxes (a greedy batch: `model.sampling.greedy_accept`), or with `raced` — (temperature, seed,
        output index of the first position) per row, host [n] — each position's keyed race of its tempered softmax
        (`model.sampling.raced_tokens`, a greedy row's race its arg-max)."""
        n = lengths.shape[0]
        self.lengths[:n].copy_(lengths, non_blocking=True)
        if raced is not None:
            for buffer, rows in zip(self.keyed, raced, strict=True):
                buffer[:n].copy_(rows, non_blocking=True)
        forward, run = ("accept", self._greedy) if raced is None else ("raced_accept", self._raced)
        accepted, nxt = self._after((forward, *verified[1:]), verified, run)
        return accepted[:n].clone(), nxt[:n].clone()

    def capture_all(
        self, rows: int, widths: Sequence[int] = (), progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Capture ahead of use every bucket a batch of up to `rows` rows takes: its decode graph and, for each verify
        width w in `widths`, its draft, verify and commit graphs — at start-up, so that no request waits for a
        capture (nothing is committed: a capture runs its forward once, uncommitted, then records it). Without
        `capture`, those warm-up forwards run. `progress(done, total)` after each bucket."""
        last = next(b for b in self.buckets if b >= rows)
        buckets = [b for b in self.buckets if b <= last]
        self.prepare(last)  # the cache's rows for the widest bucket first: a growth later would drop the graphs
        self.active.fill_(0)
        for done, b in enumerate(buckets, 1):
            self.prepare(b)
            self._ready(("decode", b, 1), self._decode)
            if widths:
                self._ready(("draft", b, 1), self._draft)
                self._ready(("keyed_draft", b, 1), self._keyed_draft)
            for w in widths:
                verify = self._ready(("verify", b, 1 + w), self._verify)
                if self.capture:
                    self._after_graph(("commit", b, 1 + w), verify, self._given)
                    self._after_graph(("accept", b, 1 + w), verify, self._greedy)
                    self._after_graph(("raced_accept", b, 1 + w), verify, self._raced)
            if progress is not None:
                progress(done, len(buckets))

    def _ready(self, key: tuple[str, int, int], run: Forward) -> Captured:
        """The key's graph, captured now if it is not yet (without `capture`: its warm-up forward, run)."""
        forward, b, T = key
        self._stage(forward, b, torch.zeros(0, T, dtype=torch.int64))
        if not self.capture:
            return Captured(None, *run(b, T, False))
        return self.graphs.get(key) or self._capture(key, run)

    # ------------------------------------------------------------------------------------------------ capture
    def _key(self, forward: str, tokens: Tensor) -> tuple[str, int, int]:
        return forward, next(b for b in self.buckets if b >= tokens.shape[0]), tokens.shape[1]

    def _replay(self, forward: str, tokens: Tensor, run: Forward) -> tuple[Tensor, ...]:
        key = self._key(forward, tokens)
        _, b, T = key
        self.prepare(b)
        n = tokens.shape[0]
        self.tokens[:n, :T].copy_(tokens, non_blocking=True)
        self.active.fill_(n)
        staged = self._stage(forward, b, tokens)
        if self.capture:
            captured = self.graphs.get(key) or self._capture(key, run)
            captured.graph.replay()
        else:
            captured = self.graphs[key] = Captured(None, *run(b, T, True))
        if staged is not None:
            staged.staged()
        return captured.outputs

    def _stage(self, forward: str, b: int, tokens: Tensor) -> StagedMemory | None:
        """Where the Engram tables are off the device, this forward's rows (`StagedMemory`), and where the graph
        cannot gather them in place, the rows of its tokens (padded to the bucket, on the host) gathered into its
        staging: then the staging, else None. The draft runs no Engram layer."""
        fetch, T = self.model.engram_fetch, tokens.shape[1]
        if fetch is None or forward in DRAFTS:
            return None
        staged = self.staged.get((b, T)) or self.staged.setdefault((b, T), StagedMemory(fetch, b, T))
        if staged.in_place:
            return None
        padded = torch.zeros(b, T, dtype=torch.int64)
        padded[: tokens.shape[0]] = tokens
        staged.stage(padded, self.cache.host_history[:b])
        return staged

    def prepare(self, b: int) -> None:
        """Reserve the cache for any forward (rows up to the bucket, entries past every row's positions plus the
        widest verify's) and drop the graphs if that moved a buffer; the device positions match the host's, zero for
        rows without a sequence."""
        cache = self.cache
        cache.reserve(b, max([MIN_CONTEXT, *cache.pos]) + self.tokens.shape[1])
        if cache.layout() != self.layout:
            self._drop()
            self.layout = cache.layout()
        cache.next_positions(slice(0, b))

    def _drop(self) -> None:
        """Forget every graph; later captures take a fresh memory pool: the allocator refuses to capture into a pool
        whose graphs are all gone while memory of it is still held, and a refused capture leaves the CUDA generator
        in capture mode, which fails every later random draw of the process."""
        self.graphs.clear()
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, key: tuple[str, int, int], run: Forward) -> Captured:
        """Warm up `run` at the key's bucket (kernels compile; nothing is committed), then capture it, committing."""
        _, b, T = key
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(b, T, False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with self._recording(graph):
            outputs, step = run(b, T, True)
        return self._keep(key, Captured(graph, outputs, step))

    def _after(self, key: tuple[str, int, int], verified: tuple[str, int, int], run: After) -> tuple[Tensor, ...]:
        """Replay the graph of `run` after the verify `verified` (uncaptured: run it) → its outputs."""
        verify = self.graphs[verified]
        if not self.capture:
            return run(key[1], verify, True)
        captured = self._after_graph(key, verify, run)
        captured.graph.replay()
        return captured.outputs

    def _after_graph(self, key: tuple[str, int, int], verify: Captured, run: After) -> Captured:
        """The graph of `run` after a verify (its commit, or its acceptance and commit), captured on first use."""
        if key in self.graphs:
            return self.graphs[key]
        run(key[1], verify, False)  # the warm-up: its kernels compile, nothing is kept
        graph = torch.cuda.CUDAGraph()
        with self._recording(graph):
            outputs = run(key[1], verify, True)
        return self._keep(key, Captured(graph, outputs))

    def _recording(self, graph: torch.cuda.CUDAGraph) -> torch.cuda.graph:
        """Capture into `graph` from this batch's pool. Only this thread's unsafe CUDA calls may void it
        ("thread_local"): a capture runs on the engine's thread whenever a bucket is first used or the cache moved,
        while other threads may be copying finished sequences' blocks to the host for their write-back."""
        return torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")

    def _commit(self, b: int, step: Step | None, keep: Tensor) -> None:
        assert step is not None, "a verify graph holds its step"
        keep = torch.where(self._real(b), keep, 0)  # padding rows keep nothing, whatever the buffers hold
        step.write(keep)
        self.cache.advance_device(slice(0, b), keep)

    def _given(self, b: int, verify: Captured, commit: bool) -> tuple[Tensor, ...]:
        """The commit of the keep in its buffer (`commit`; a warm-up keeps nothing)."""
        self._commit(b, verify.step, self.keep[:b] if commit else self._nothing(b))
        return ()

    def _greedy(self, b: int, verify: Captured, commit: bool) -> tuple[Tensor, ...]:
        """The greedy acceptance of the verify's drafts, then the commit of what it accepts (`accept`)."""
        (logits,) = verify.outputs
        drafts = self.tokens[:b, 1 : logits.shape[1]]
        return self._accepted(b, verify, commit, *greedy_accept(logits, drafts, self.lengths[:b]))

    def _raced(self, b: int, verify: Captured, commit: bool) -> tuple[Tensor, ...]:
        """The acceptance of the verify's drafts by its raced targets, then the commit of what it accepts (`accept`)."""
        (logits,) = verify.outputs
        temperature, seeds, cursor = (rows[:b] for rows in self.keyed)
        targets = raced_tokens(tempered_probs(logits, temperature.view(b, 1, 1)), seeds, cursor)
        drafts = self.tokens[:b, 1 : logits.shape[1]]
        return self._accepted(b, verify, commit, *accept_targets(targets, drafts, self.lengths[:b]))

    def _accepted(self, b: int, verify: Captured, commit: bool, accepted: Tensor, nxt: Tensor) -> tuple[Tensor, ...]:
        self._commit(b, verify.step, accepted + 1 if commit else self._nothing(b))
        return accepted, nxt

    def _keep(self, key: tuple[str, int, int], captured: Captured) -> Captured:
        self.graphs[key] = captured
        self.captures += 1
        return captured

    def _real(self, b: int) -> Tensor:
        return torch.arange(b, device=self.cache.device) < self.active

    def _nothing(self, b: int) -> Tensor:
        """A commit's keep that keeps no token of any row: a warm-up's, which writes every kept slot back as it was
        (kernels compile — a capture cannot — and no state changes)."""
        return torch.zeros(b, dtype=torch.int64, device=self.cache.device)

    # ---------------------------------------------------------------------------------------- what is captured
    def _static_step(self, b: int, T: int) -> Step:
        step = self.cache.step(self.tokens[:b, :T], slice(0, b), static=True)
        if self.model.engram_fetch is not None:
            step.memory = self.staged[(b, T)].start(step.tokens, step.history)
        return step

    def _decode(self, b: int, T: int, commit: bool) -> tuple[tuple[Tensor, ...], Step | None]:
        step = self._static_step(b, T)
        logits = forward_full(self.model, step, last_only=True)[:, -1]
        keep = self._real(b).long() if commit else self._nothing(b)
        step.write(keep)
        if commit:
            self.cache.advance_device(slice(0, b), keep)
        return (logits,), None

    def _draft(self, b: int, T: int, commit: bool) -> tuple[tuple[Tensor, ...], Step | None]:
        return draft_features(self.model, self.cache, self.tokens[:b, 0]), None

    def _keyed_draft(self, b: int, T: int, commit: bool) -> tuple[tuple[Tensor, ...], Step | None]:
        y = self.tokens[:b, 0]
        x, base = draft_features(self.model, self.cache, y)
        draft = markov_chain(self.model, x, base, y, keyed_links(*(rows[:b] for rows in self.keyed)))
        return (draft.tokens, draft.confidence), None

    def _verify(self, b: int, T: int, commit: bool) -> tuple[tuple[Tensor, ...], Step | None]:
        step = self._static_step(b, T)
        return (forward_full(self.model, step),), step
