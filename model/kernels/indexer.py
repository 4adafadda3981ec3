"""Lightning-indexer scores straight from FP4 q and K (model-architecture.md §2.5).

I[b,t,s] = Σ_h w[b,t,h] · ReLU(q[b,t,h] · K[b,s]), −inf where s ≥ n_visible[b,t].
"""

import torch
from torch import Tensor

from model.kernels.kv_quant import dequantize_index_fp4_torch


def indexer_scores_torch(
    q_data: Tensor, q_scale: Tensor, weights: Tensor, k_data: Tensor, k_scale: Tensor, n_visible: Tensor
) -> Tensor:
    q = dequantize_index_fp4_torch(q_data, q_scale, torch.float32)  # [B, T, H, Di]
    k = dequantize_index_fp4_torch(k_data, k_scale, torch.float32)  # [B, S, Di]
    scores = torch.einsum("bth,bths->bts", weights.float(), torch.einsum("bthd,bsd->bths", q, k).relu())
    positions = torch.arange(k.shape[1], device=k.device)
    return scores.masked_fill(positions >= n_visible[..., None], float("-inf"))
