"""Sparse decode attention over [FP8 SWA ring ‖ selected FP4 compressed entries] (model-architecture.md §1.2, §2.3).

One softmax per (query, head) over the valid ring slots and the selected entries, with the head's sink logit in
the denominator only: o = Σ_i exp(s_i) v_i / (Σ_j exp(s_j) + exp(sink_h)), s = scale · q·k. K = V = the shared
dequantised latent. The output is before the inverse RoPE.
"""

import torch
from torch import Tensor

from model.kernels.kv_quant import dequantize_kv_fp4_torch, dequantize_swa_fp8_torch


def gather_entries(kv_data: Tensor, kv_scale: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Rows idx [B, T, K] (−1 → row 0, masked later) of [B, N, ...] → [B, T, K, ...]."""
    rows = idx.clamp(min=0).long()
    batch = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    return kv_data[batch, rows], kv_scale[batch, rows]


def sparse_attention_torch(
    q: Tensor,
    swa_data: Tensor,
    swa_scale: Tensor,
    swa_mask: Tensor,
    kv_data: Tensor,
    kv_scale: Tensor,
    idx: Tensor,
    sink: Tensor,
    softmax_scale: float,
) -> Tensor:
    qf = q.float()
    ring = dequantize_swa_fp8_torch(swa_data, swa_scale, torch.float32)  # [B, W, D]
    entries = dequantize_kv_fp4_torch(*gather_entries(kv_data, kv_scale, idx), torch.float32)  # [B, T, K, D]
    s_ring = torch.einsum("bthd,bwd->bthw", qf, ring).masked_fill(~swa_mask[:, :, None, :], float("-inf"))
    s_sel = torch.einsum("bthd,btkd->bthk", qf, entries).masked_fill(idx[:, :, None, :] < 0, float("-inf"))
    logits = torch.cat((s_ring, s_sel), dim=-1) * softmax_scale
    sink_logit = sink.float()[None, None, :, None]
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_logit)
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink_logit - m)
    W = ring.shape[1]
    out = torch.einsum("bthw,bwd->bthd", p[..., :W], ring) + torch.einsum("bthk,btkd->bthd", p[..., W:], entries)
    return (out / denom).to(q.dtype)
