"""DeepSeekMoE with sqrt-softplus scores and aux-loss-free (noaux_tc) bias routing (reference §2.7).

    s = √softplus(x W_gᵀ)                 (fp32)
    experts = top-k(s + bias)             (the bias only chooses; it is updated outside the gradient)
    w = s[experts] / Σ s[experts] · routed_scaling_factor
    y = Σₑ W2ₑ(wₑ · silu(min(W1ₑx, limit)) · clamp(W3ₑx, ±limit)) + shared(x)

The routing weight multiplies the intermediate activation *before* W2 (as the reference does), whose input is then
FP8-quantised like every FP8/FP4 linear input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelArgs
from model.linear import Linear, WeightFormat, param_dtype, quantize_input


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, n_experts: int, topk: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.topk, self.scale, self.norm = topk, args.routed_scaling_factor, args.norm_topk_prob
        fp32 = param_dtype("fp32", dtype or torch.get_default_dtype())
        self.weight = nn.Parameter(torch.empty(n_experts, args.hidden_size, dtype=fp32))
        # noaux_tc routing biases for text and image-span tokens; updated by the trainer, not by gradients.
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=fp32), requires_grad=False)
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=fp32), requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, C] → (weights [N, k] fp32, expert ids [N, k]); ties go to the lower expert id."""
        scores = F.softplus(F.linear(x.to(self.weight.dtype), self.weight)).sqrt()
        ids = torch.sort(scores + self.bias, dim=-1, descending=True, stable=True).indices[:, : self.topk]
        weights = scores.gather(-1, ids)
        if self.norm and self.topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit): the released clamps."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Expert(nn.Module):
    """SwiGLU with the released clamps: gate ≤ limit, up in [−limit, limit]."""

    def __init__(self, dim: int, inter: int, limit: float, fmt: WeightFormat, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, fmt, dtype)
        self.w2 = Linear(inter, dim, fmt, dtype)
        self.w3 = Linear(dim, inter, fmt, dtype)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x: the FP8-cast input (quantize_input), shared by every expert of a token."""
        h = swiglu(self.w1(x, True), self.w3(x, True), self.limit)
        if weight is not None:
            h = h * weight.to(h.dtype).unsqueeze(-1)
        return self.w2(h)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, dspark: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n_experts = args.dspark_n_routed_experts if dspark else args.n_routed_experts
        topk = args.dspark_num_experts_per_tok if dspark else args.num_experts_per_tok
        q = args.quantization_config
        routed: WeightFormat = "fp4" if q and q.expert_dtype == "fp4" else ("fp8" if q else "bf16")
        shared: WeightFormat = "fp8" if q else "bf16"
        dim, inter, limit = args.hidden_size, args.moe_intermediate_size, args.swiglu_limit
        self.gate, self.limit = Gate(args, n_experts, topk, dtype), limit
        self.experts = nn.ModuleList(Expert(dim, inter, limit, routed, dtype) for _ in range(n_experts))
        self.shared_experts = Expert(dim, inter, limit, shared, dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        xq = quantize_input(x) if self.shared_experts.w1.quantized else x  # one FP8 cast for every expert
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32 accumulation over experts
        y = self.shared_experts(xq).to(compute)
        routed = self.routed(xq, weights, ids).to(compute)
        for r in range(routed.shape[1]):  # each token's experts added one at a time, in ascending id
            y = y + routed[:, r]
        return y.to(x.dtype).view(shape)

    def routed(self, xq: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Weighted routed-expert outputs [N, k, C], each token's k slots in ascending expert id.

        Only the matmuls run expert by expert; the gathers, the activation, the routing weights and the FP8 cast of
        W2's input run once over every (token, slot) pair (each is elementwise or per row: the same values).
        """
        N, k = ids.shape
        ids, slot = ids.sort(-1)
        # pairs grouped by expert, tokens ascending within each (a stable sort of the row-major ids): the host waits
        # for the device once per layer (the group sizes), not once per expert
        order = torch.argsort(ids.flatten(), stable=True)
        sizes = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        active = [e for e, size in enumerate(sizes) if size]
        x = xq[order // k].split(sizes)
        gate = torch.cat([self.experts[e].w1(x[e], True) for e in active])
        up = torch.cat([self.experts[e].w3(x[e], True) for e in active])
        weight = weights.gather(-1, slot).flatten()[order]
        h = swiglu(gate, up, self.limit) * weight.to(gate.dtype).unsqueeze(-1)
        w2 = [self.experts[e].w2 for e in active]
        h = (quantize_input(h) if w2[0].quantized else h).split([sizes[e] for e in active])
        out = torch.cat([linear(part, True) for linear, part in zip(w2, h, strict=True)])
        pairs = out.new_empty(out.shape)
        pairs[order] = out
        return pairs.view(N, k, -1)
