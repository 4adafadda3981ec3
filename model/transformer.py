"""DeepSeek-V4.1-Flash: embedding → 40 layers (CED encoder 0..19, decoder 20..39) → norm → head, plus DSpark.

    X⁰ = embed(tokens) copied to hc_mult streams, pre = one-hot
    for layer l:  (Engram)  →  Block (attention site, FFN site; Single-Pass mHC)
    logits = head(norm(collapse(X^L, pre_L)))        (no learned hc_head in V4.1: the last FFN site's pre-mix)

`part="encoder"` builds only what a prefill machine holds: the embedding, layers 0..L/2−1 (with their Engram) and
layer L/2's attn_norm + compressor + indexer keys (the decoder's global KV is projected from H^{L/2}). `part="full"`
adds the decoder, the head and the DSpark blocks. `parallel` says which routed experts the model holds: all of them,
or one rank's share in an expert-parallel group whose ranks meet in every MoE layer of a forward (`model.parallel`).

`forward` is the dense, differentiable form over whole sequences (training, and the oracle of the tests).
`new_cache` and `step_layers` run the same modules over a packed cache: the serving split — prefill and bounded
replay (model.serving), decoding with DSpark (model.decode) — is built from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from model.attention import SharedEntries
from model.block import Block
from model.cache import KVCache, Step
from model.config import ModelArgs
from model.dspark import DSparkBlock
from model.engram import NgramHash
from model.engram_store import DeviceMemory, EngramFetch, Memory
from model.linear import Embedding, Fp8Act, Linear
from model.mhc import identity_pre
from model.moe import MoE
from model.norm import RMSNorm, collapse_norm
from model.parallel import SINGLE, Parallel, serve_idle

Part = Literal["full", "encoder"]


class Transformer(nn.Module):
    def __init__(
        self, args: ModelArgs, part: Part = "full", dtype: torch.dtype | None = None, parallel: Parallel = SINGLE
    ) -> None:
        super().__init__()
        if not args.is_v41:
            raise ValueError(f"model_type {args.model_type!r} is an accounting-only preset; it cannot be built")
        if part not in ("full", "encoder"):
            raise ValueError(f"part must be 'full' or 'encoder', got {part!r}")
        self.args, self.part, self.parallel = args, part, parallel
        L, L2, C = args.num_hidden_layers, args.n_encoder_layers, args.hidden_size
        self.embed = Embedding(args.vocab_size, C, dtype)
        self.layers = nn.ModuleList(
            Block(args, i, dtype=dtype, parallel=parallel) for i in range(L if part == "full" else L2)
        )
        if part == "encoder":
            self.layers.append(Block(args, L2, projection_only=True, dtype=dtype))
        else:
            self.norm = RMSNorm(C, args.rms_norm_eps, dtype)
            self.head = Linear(C, args.vocab_size, "bf16", dtype)
            self.mtp = nn.ModuleList(
                DSparkBlock(args, s, dtype, parallel) for s in range(args.num_nextn_predict_layers)
            )
        self._ngram: list[NgramHash] = []  # built on first use (needs the tokenizer; not needed on `meta`)
        self.engram_fetch: EngramFetch | None = None  # the Engram tables are off the device (model.engram_store)
        # Identifies config + weights in prefix-cache keys; set by model.weights (seed or checkpoint), b"" = unknown.
        self.fingerprint = b""

    # ---------------------------------------------------------------------------------------------- pieces
    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def ngram(self) -> NgramHash:
        if not self._ngram:
            self._ngram.append(NgramHash(self.args).to(self.device))
        return self._ngram[0]

    def check_tokens(self, tokens: Tensor | Sequence[int], host: bool = False) -> Tensor:
        """int64 tensor of token ids on the model's device (`host`: ids given on the host stay there); ValueError
        naming the first id outside the vocabulary.

        Ids from the host (a list, a CPU tensor) are checked there, before the copy. Ids already on an accelerator
        are the sampler's own (always in the vocabulary) and pass unchecked: checking them would wait for the device
        on every decode step."""
        t = torch.as_tensor(tokens, dtype=torch.int64, device=tokens.device if isinstance(tokens, Tensor) else "cpu")
        if t.device.type == "cpu":
            bad = (t < 0) | (t >= self.args.vocab_size)
            if bool(bad.any()):
                raise ValueError(f"token id {int(t[bad][0])} is outside the vocabulary [0, {self.args.vocab_size})")
            if host:
                return t
        return t.to(self.device, torch.int64)

    def embed_stream(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, T] → (X [B, T, n, C] with the embedding in every copy, one-hot pre-mix [B, T, n])."""
        x = self.embed(tokens)
        n = self.args.hc_mult
        return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]), identity_pre(tokens.shape, n, x.dtype, x.device)

    def engram_rows(self, tokens: Tensor, history: Tensor) -> dict[int, Tensor]:
        return {layer: self.ngram.rows(layer, tokens, history) for layer in self.args.engram_layer_ids}

    def engram_memory(self, step: Step) -> Memory:
        """The Engram rows of a step: staged for it (a captured forward, model.graphs), gathered from tables off the
        device (started now, waited for by each Engram layer), or looked up on the device."""
        if step.memory is not None:
            return step.memory
        if self.engram_fetch is None:
            return DeviceMemory(self, step.tokens, step.history)
        return self.engram_fetch.memory(step)

    def logits(self, X: Tensor, pre: Tensor) -> Tensor:
        """fp32 logits of the final stream (collapsed with the last FFN site's pre-mix)."""
        return self.head(collapse_norm(X, pre, self.norm.weight, self.norm.eps)).float()

    def run_layers(
        self,
        layers: Iterable[int],
        X: Tensor,
        pre: Tensor,
        attend: Callable[[Block, Tensor, Tensor | Fp8Act], Tensor],
        memory: Memory | None = None,
        taps: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Layers in order; `attend(block, x, xq)` runs a block's attention on its input x and x's cast xq; collects
        DSpark taps when asked."""
        update = None  # the last block's FFN update, made in the next block's first pass
        for i in layers:
            block = self.layers[i]
            tap = taps is not None and self.args.role(i).dspark_tap
            if update is not None and (hasattr(block, "engram") or tap):
                X, update = update.apply(X), None
            if hasattr(block, "engram"):
                X = block.engram(X, memory.values(i))
            if tap:
                taps.append(X.mean(-2))  # hc-mean of the stream entering the target layer
            X, pre, update = block(X, pre, lambda x, xq, block=block: attend(block, x, xq), update)
        return (X if update is None else update.apply(X)), pre

    def serve_idle(self) -> None:
        """Data-parallel attention: once this rank has run its forwards of a group call (or had none to run), answer
        the MoE rounds of the ranks still running until all are done, so that every rank leaves the call together
        (`model.parallel`)."""
        moes = {m.layer: m for m in self.modules() if isinstance(m, MoE)}
        serve_idle(self.parallel, self.device, lambda layer, received: moes[layer].answer(received, self.dtype))

    # ------------------------------------------------------------------------------------------ dense path
    def features(self, tokens: Tensor, replay_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Dense forward of whole sequences tokens [B, T] up to the head: (final stream X [B, T, n, C], its pre-mix
        [B, T, n], DSpark target features [B, T, n_targets·C]); `self.logits(X, pre)` gives the logits.

        Training takes the logits of the positions it learns only (the head is [C, 129,280]). `replay_start` s
        truncates every decoder layer's window at s (a query at i sees [max(s, i−W+1), i]): the cold-run semantics
        of the serving path, where decode rebuilds decoder windows by a bounded replay of the last W tokens.
        """
        if self.part != "full":
            raise ValueError("the dense forward needs the full model (part='full')")
        tokens = self.check_tokens(tokens)
        X, pre = self.embed_stream(tokens)
        history = torch.full((tokens.shape[0], self.ngram.history_len), -1, dtype=torch.int64, device=self.device)
        shared, L2, taps = SharedEntries(), self.args.n_encoder_layers, []

        def attend(block: Block, x: Tensor, xq: Tensor | Fp8Act) -> Tensor:
            return block.attn(x, xq, shared, replay_start if block.layer >= L2 else 0)

        memory = DeviceMemory(self, tokens, history)
        X, pre = self.run_layers(range(len(self.layers)), X, pre, attend, memory, taps)
        return X, pre, torch.cat(taps, -1)

    def forward(
        self, tokens: Tensor, replay_start: int = 0, return_taps: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Dense forward of whole sequences tokens [B, T] from position 0 → fp32 logits [B, T, V] (see `features`).

        With `return_taps`, also the DSpark target features [B, T, n_targets·C].
        """
        X, pre, taps = self.features(tokens, replay_start)
        logits = self.logits(X, pre)
        return (logits, taps) if return_taps else logits

    # ----------------------------------------------------------------------------------------- packed path
    def new_cache(self, capacity: int = 1, encoder_only: bool = False) -> KVCache:
        """An empty packed cache: encoder rings and sources up to layer L/2 (prefill), or every ring incl. DSpark."""
        a = self.args
        L2 = a.n_encoder_layers
        full = self.part == "full" and not encoder_only
        rings = range(a.n_layers_total) if full else range(L2)
        sources = [s for s in a.kv_source_layer_ids if full or s <= L2]
        fetch = self.engram_fetch
        host = fetch is not None and not fetch.in_place()  # the host hashes Engram rows: it keeps the look-back too
        return KVCache(a, rings, sources, device=self.device, dtype=self.dtype, capacity=capacity, host_history=host)

    def step_layers(self, step: Step, X: Tensor, pre: Tensor, layers: Iterable[int], taps=None):
        """Run layers over a Step of the packed cache."""
        layers = list(layers)
        memory = self.engram_memory(step) if any(self.args.role(i).engram for i in layers) else None
        return self.run_layers(layers, X, pre, lambda block, x, xq: block.attn.forward_step(x, xq, step), memory, taps)
