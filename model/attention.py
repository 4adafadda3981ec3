"""Attention of every layer: own q, own FP8 SWA window, shared CSA2 compressed KV (reference §2.3–2.5).

    c^Q = q_norm(W_qa x)             q = RoPE(W_qb c^Q)          (no per-head q norm in V4.1)
    k = v = FP8(RoPE(kv_norm(W_kv x)))                           (one latent, the layer's own window entry)
    o = Σᵢ pᵢ vᵢ,  pᵢ = exp(sᵢ) / (Σⱼ exp(sⱼ) + exp(sink_h))      over [window ‖ selected compressed entries]
    out = W_ob · concat_g(W_oa,g · RoPE⁻¹(o)_g)                  (grouped low-rank output)

Full layers also own the compressor and indexer keys (they write the shared compressed KV); index sources (Full,
Reindex) select Top-K; Reuse layers attend with their index source's indices over their KV source's entries.
Every layer keeps its own window, but the compressed entries that also lie inside the window are attended as well
(the reference does not exclude them: they are different vectors).

Two forms of the same math: `forward` (whole sequences, fake-quantised floats, dense masked attention,
differentiable — training and the oracle) and `forward_step` (a `Step` over the packed cache, through
`model.kernels`). The dense form rounds the compressed main KV as serving stores it (FP4, the released QAT) unless
a `main_kv("bf16")` block says otherwise (the no-QAT baseline of training).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

import torch
from torch import Tensor, nn

from model import kernels, quant
from model.cache import Step, counting
from model.compressor import Compressor
from model.config import ModelArgs
from model.indexer import Indexer, Selection
from model.linear import Fp8Act, Linear, norm_share, param_dtype, project_together, quantize_input
from model.norm import RMSNorm
from model.rope import Rope

MainKV = Literal["fp4", "bf16"]
_MAIN_KV: ContextVar[MainKV] = ContextVar("main_kv", default="fp4")


@contextmanager
def main_kv(fmt: MainKV) -> Iterator[None]:
    """Within the block (this thread or task), the dense path rounds the compressed main KV to `fmt`: "fp4" (E2M1 +
    E4M3 scale per 16: what serving stores, the released QAT) or "bf16" (no QAT). The packed path always stores FP4."""
    if fmt not in ("fp4", "bf16"):
        raise ValueError(f"main KV format must be 'fp4' or 'bf16', got {fmt!r}")
    token = _MAIN_KV.set(fmt)
    try:
        yield
    finally:
        _MAIN_KV.reset(token)


def fake_quant_main_kv(kv: Tensor) -> Tensor:
    """The dense path's main KV values in the current `main_kv` format (gradient straight through)."""
    return quant.fake_quant_fp4_e4m3(kv) if _MAIN_KV.get() == "fp4" else quant.fake_quant_bf16(kv)


class SharedEntries(Selection):
    """Dense-path cross-layer slots: Top-K and candidate pool, plus each owner's fake-quantised entries."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[int, Tensor] = {}  # owner → main KV values [B, N, D]
        self.index_k: dict[int, tuple[Tensor, Tensor]] = {}  # owner → packed indexer K (data, scale)


def dense_attention(q: Tensor, parts: list[tuple[Tensor, Tensor]], sink: Tensor, softmax_scale: float) -> Tensor:
    """q [B, T, H, D] over key sets [(keys = values [B, S, D], mask [B, T, S]), …] → o [B, T, H, D].

    One softmax over every allowed key of every set and the per-head sink, which joins the denominator only.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    q = q.to(compute)
    logits = [
        (torch.einsum("bthd,bsd->bhts", q, keys.to(compute)) * softmax_scale).masked_fill(~mask.unsqueeze(1), -math.inf)
        for keys, mask in parts
    ]
    B, H, T, _ = logits[0].shape
    logits.append(sink.to(compute).view(1, H, 1, 1).expand(B, H, T, 1))
    p = torch.cat(logits, dim=-1).softmax(-1).split([k.shape[1] for k, _ in parts] + [1], dim=-1)
    return sum(torch.einsum("bhts,bsd->bthd", pk, keys.to(compute)) for pk, (keys, _) in zip(p, parts, strict=False))


class Attention(nn.Module):
    SIBLINGS = (("wq_a", "wkv"), ("wq_b", "indexer.wq_b"))  # one input each: stacked when packed (`linear.stack`)

    def __init__(self, args: ModelArgs, layer: int, projection_only: bool = False, dtype: torch.dtype | None = None):
        """`projection_only`: the layer-L/2 stub of an encoder-only model (compressor + indexer keys only)."""
        super().__init__()
        self.args, self.layer, self.role = args, layer, args.role(layer)
        H, D, C = args.num_attention_heads, args.head_dim, args.hidden_size
        G, R = args.o_groups, args.o_lora_rank
        self.rope = Rope(args, self.role.yarn)
        self.softmax_scale = 1.0 / math.sqrt(D)
        if not projection_only:
            fp8 = "fp8" if args.quantization_config else "bf16"
            self.wq_a = Linear(C, args.q_lora_rank, fp8, dtype)
            self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, dtype)
            self.wq_b = Linear(args.q_lora_rank, H * D, fp8, dtype)
            self.wkv = Linear(C, D, fp8, dtype)
            self.kv_norm = RMSNorm(D, args.rms_norm_eps, dtype)
            self.wo_a = Linear(H * D // G, G * R, "bf16", dtype)  # block-diagonal: [G·R, H·D/G] viewed [G, R, H·D/G]
            self.wo_b = Linear(G * R, C, fp8, dtype)
            self.attn_sink = nn.Parameter(torch.zeros(H, dtype=param_dtype("fp32", dtype or torch.get_default_dtype())))
        if self.role.owns_kv:
            self.compressor = Compressor(args, layer, dtype)
        queries = self.role.owns_index_query and not projection_only
        if queries or self.role.owns_kv:
            self.indexer = Indexer(args, self.role, queries, dtype)

    # --------------------------------------------------------------------------------------------- pieces
    def query(self, x: Tensor, positions: Tensor) -> tuple[Tensor | None, Tensor]:
        """(the indexer's query heads before RoPE, or None: `heads`, rotated q [B, T, H, D]); x is the FP8-cast input
        (`cast_input`)."""
        q, index_q = self.query_heads(x)
        return index_q, self.rope.rotate(q, positions)

    def query_window(self, x: Tensor, positions: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """`query` and `window_kv` of one input: (the indexer's query heads or None, rotated q, rotated K=V latent).
        The latent rides as one more head of q through a single rotation (same positions, same frequencies): half
        the RoPE ops of every layer."""
        q_latent, kv = self.input_latents(x)
        q, index_q = self.heads(q_latent)
        rotated = self.rope.rotate(torch.cat((q, self.kv_norm(kv).unsqueeze(-2)), -2), positions)
        return index_q, rotated[..., :-1, :], rotated[..., -1, :]

    def input_latents(self, x: Tensor | Fp8Act) -> tuple[Tensor, Tensor]:
        """(wq_a(x), wkv(x)) of the cast input x, before their norms: one GEMM where `pack` stacked the two
        (`project_together`)."""
        a, kv = project_together(x, self.wq_a, self.wkv)
        return a, kv

    def query_heads(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """`heads` of the cast input x."""
        return self.heads(self.wq_a(x, True))

    def heads(self, q_latent: Tensor) -> tuple[Tensor, Tensor | None]:
        """wq_a's output → (q [B, T, H, D] before RoPE, the indexer's query heads [B, T, Hᵢ, Dᵢ] before RoPE where
        this layer has them, else None). wq_b and the indexer's wq_b read c^Q = q_norm(q_latent), cast once
        (`Fp8Linear.share`): one GEMM where `pack` stacked them."""
        _, qr = norm_share(q_latent, None, self.q_norm, self.wq_b)
        heads = (self.args.num_attention_heads, self.args.head_dim)
        if not self.role.owns_index_query:
            return self.wq_b(qr, True).unflatten(-1, heads), None
        q, index_q = project_together(qr, self.wq_b, self.indexer.wq_b)
        return q.unflatten(-1, heads), index_q.unflatten(-1, (self.indexer.n_heads, self.indexer.head_dim))

    def window_latent(self, x: Tensor) -> Tensor:
        """This layer's K=V latent [B, T, D] before RoPE and the FP8 cast."""
        return self.kv_norm(self.wkv(x, True))

    def window_kv(self, x: Tensor, positions: Tensor) -> Tensor:
        """This layer's rotated K=V latent [B, T, D] (before the FP8 cast); x is the FP8-cast input."""
        return self.rope.rotate(self.window_latent(x), positions)

    def window_entries(self, kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """wkv's output [B, T, D] as the SWA ring stores its K=V latent (`window_latent`), FP8 bytes and UE8M0
        scales: normed, rotated and cast in one launch."""
        norm = (self.kv_norm.weight, self.kv_norm.eps)
        return kernels.quantize_swa_fp8(kv, kernels.backend_for(kv), (positions, self.rope.inv_freq), norm)

    def cast_input(self, x: Tensor) -> Tensor | Fp8Act:
        """The attention input as wq_a and wkv (both FP8 linears) share it: one FP8 cast (`Fp8Linear.share`), plain
        if unquantised. A block takes it from the input's norm instead (`model.linear.norm_share`)."""
        return self.wq_a.share(x)

    def entry_latents(self, latent: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        """Pre-RoPE latents [B, G, D] of entries first.. → (rotated main KV, rotated indexer K), entry j at j·m."""
        positions = (first.unsqueeze(1) + counting(latent.shape[1], latent.device)) * self.role.ratio
        return self.rope.rotate(latent, positions), self.rope.rotate(self.indexer.keys(latent), positions)

    def index_queries(self, x: Tensor, q: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The indexer's query heads q before RoPE (`heads`) → packed FP4 queries (data, scale) [B, T, H, ·], and the
        fp32 head weights [B, T, H] of the input x."""
        q_data, q_scale = kernels.quantize_index_fp4(self.rope.rotate(q, positions), backend=kernels.backend_for(q))
        return q_data, q_scale, self.indexer.head_weights(x).float()

    def project_out(self, o: Tensor, positions: Tensor) -> Tensor:
        """RoPE⁻¹ on o's rope dims, then the grouped low-rank output projection."""
        return self.project(self.rope.rotate(o, positions, inverse=True))

    def project(self, o: Tensor) -> Tensor:
        """The grouped low-rank output projection of the attention output o [B, T, H, D], RoPE⁻¹ applied: one batched
        GEMM over the groups, reading o's rows by their strides and, outside autograd (which records no `out=`),
        writing its output rows in place, so neither side is copied into a transposed layout whatever the batch."""
        a, (B, T) = self.args, o.shape[:2]
        o = o.to(self.wo_a.weight.dtype).reshape(B * T, a.o_groups, -1).transpose(0, 1)  # [G, B·T, H·D/G]
        wo_a = self.wo_a.weight.view(a.o_groups, a.o_lora_rank, -1).transpose(1, 2)
        if torch.is_grad_enabled():
            out = torch.bmm(o, wo_a).transpose(0, 1)
        else:
            out = o.new_empty(B * T, a.o_groups, a.o_lora_rank)
            torch.bmm(o, wo_a, out=out.transpose(0, 1))
        return self.wo_b(out.reshape(B, T, -1))

    # ------------------------------------------------------------------------------------------ dense path
    def forward(self, x: Tensor, xq: Tensor | Fp8Act, shared: SharedEntries, window_start: int = 0) -> Tensor:
        """Whole sequences x [B, T, C] from position 0, xq their cast (`cast_input`). `window_start` truncates the
        window (bounded replay)."""
        a, role = self.args, self.role
        B, T = x.shape[:2]
        positions = torch.arange(T, device=x.device).expand(B, T)
        index_q, q, kv = self.query_window(xq, positions)
        kv = quantize_input(kv)
        i, j = positions[0].unsqueeze(1), positions[0].unsqueeze(0)
        parts = [(kv, ((j <= i) & (j > i - a.sliding_window) & (j >= window_start)).expand(B, T, T))]
        if role.ratio:
            if role.owns_kv:
                self.dense_entries(x, shared)
            n_visible = torch.div(positions + 1, role.ratio, rounding_mode="floor")
            if role.owns_index_query:
                k_data, k_scale = shared.index_k[role.kv_source]
                assert index_q is not None
                q_data, q_scale, w = self.index_queries(x, index_q, positions)
                scores = kernels.indexer_scores(
                    q_data, q_scale, w, k_data, k_scale, n_visible, backend=kernels.backend_for(x)
                )
                shared.select(a, role, scores, n_visible)
            comp = shared.kv[role.kv_source]
            idx = shared.topk[role.index_source].long()
            chosen = torch.zeros(B, T, comp.shape[1] + 1, dtype=torch.bool, device=x.device)
            chosen.scatter_(2, torch.where(idx < 0, comp.shape[1], idx), True)  # −1 lands in a dropped column
            parts.append((comp, chosen[..., :-1]))
        o = dense_attention(q, parts, self.attn_sink, self.softmax_scale)
        return self.project_out(o, positions)

    def dense_entries(self, x: Tensor, shared: SharedEntries) -> None:
        """Owner: fake-quantised main KV values and packed indexer K of every complete group."""
        latent = self.compressor(x)
        first = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        kv, k = self.entry_latents(latent, first)
        shared.kv[self.layer] = fake_quant_main_kv(kv)
        shared.index_k[self.layer] = kernels.quantize_index_fp4(k, backend=kernels.backend_for(k))

    # ----------------------------------------------------------------------------------------- packed path
    def forward_step(self, x: Tensor, xq: Tensor | Fp8Act, step: Step) -> Tensor:
        """x [B, T, C] at step.positions over the packed cache, xq its cast (`cast_input`); stages this layer's
        writes in `step`."""
        a, role, be = self.args, self.role, kernels.backend_for(x)
        positions = step.positions
        q_latent, kv = self.input_latents(xq)
        q, index_q = self.heads(q_latent)  # q rotates in the attention kernel
        window = step.window(self.layer, *self.window_entries(kv, positions))
        compressed = None
        if role.ratio:
            if role.owns_kv and not step.replay:
                self.write_entries(x, step)
            n_visible = step.n_visible(role.ratio)
            kv_data, kv_scale, k_data, k_scale = step.entries(role.kv_source, role.ratio)
            if role.owns_index_query:
                assert index_q is not None
                q_data, q_scale, w = self.index_queries(x, index_q, positions)
                scores = kernels.indexer_scores(q_data, q_scale, w, k_data, k_scale, n_visible, backend=be)
                step.selection.select(a, role, scores, n_visible)
            compressed = (kv_data, kv_scale, step.selection.topk[role.index_source])
        return self.attend_packed(q, positions, window, compressed)

    def attend_packed(
        self,
        q: Tensor,
        positions: Tensor,
        window: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
        compressed: tuple[Tensor, Tensor, Tensor] | None,
    ) -> Tensor:
        """Sparse attention of q before RoPE over [window keys (ring data, scale, new data, scale, slots) ‖ selected
        compressed entries (data, scale, idx)] — RoPE on q and RoPE⁻¹ on its output in the same kernel —, then the
        output projection."""
        B, T, D = q.shape[0], q.shape[1], self.args.head_dim
        if compressed is None:  # SWA-only layer: no compressed entries, no indices
            compressed = (
                q.new_zeros(B, 0, D // 2, dtype=torch.uint8),
                q.new_zeros(B, 0, D // 16, dtype=torch.uint8),
                torch.full((B, T, 0), -1, dtype=torch.int32, device=q.device),
            )
        kv_data, kv_scale, idx = compressed
        rope = (positions, self.rope.inv_freq)
        o = kernels.sparse_attention(
            q, *window, kv_data, kv_scale, idx, self.attn_sink, self.softmax_scale, kernels.backend_for(q), rope
        )
        return self.project(o)

    def write_entries(self, x: Tensor, step: Step) -> None:
        """Owner: compress this step's complete groups and write their packed entries ahead into the cache (not
        those of a replayed prefix: they are cached)."""
        latent, first, end = self.compressor.forward_step(x, step)
        skip = step.cached_groups(self.compressor.ratio)
        latent, first = latent[:, skip:], first + skip
        kv, k = self.entry_latents(latent, first)
        be = kernels.backend_for(x)
        packed = (*kernels.quantize_kv_fp4(kv, backend=be), *kernels.quantize_index_fp4(k, backend=be))
        step.cache.entries[self.layer].write(step.rows, first, end, packed)
