"""DeepSeekMoE with sqrt-softplus scores and aux-loss-free (noaux_tc) bias routing (reference §2.7).

    s = √softplus(x W_gᵀ)                 (fp32)
    experts = top-k(s + bias)             (the bias only chooses; it is updated outside the gradient)
    w = s[experts] / Σ s[experts] · routed_scaling_factor
    y = Σₑ W2ₑ(wₑ · silu(min(W1ₑx, limit)) · clamp(W3ₑx, ±limit)) + shared(x)

The routing weight multiplies the intermediate activation *before* W2 (as the reference does), whose input is then
FP8-quantised like every FP8/FP4 linear input. Each token's expert outputs are added one at a time in ascending
expert id (fp32), whatever computed them, so every form and kernel of the routed experts sums alike.

The routed experts come in the two forms of `model.linear`: `Experts` (float weights, one `Expert` module each:
training and the oracle) and `PackedExperts` (the checkpoint's packed E2M1 nibbles and UE8M0 scales, W1‖W3 stacked
per expert, computed by the grouped MXFP4 GEMM: the (token, slot) pairs sorted by expert on the device, one launch
for W1‖W3 with SwiGLU and one for W2 — no host sync, no loop over experts). Under expert parallelism either form
holds one rank's share of the experts and reaches the others' by all-to-all (`model.parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from model import kernels
from model.activation import swiglu
from model.config import ModelArgs
from model.fused import fused
from model.linear import Fp8Act, Fp8Linear, Linear, WeightFormat, packed_param, param_dtype, project_together
from model.parallel import SINGLE, Parallel, answer_round, expert_parallel


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
        """x [N, C] → (weights [N, k] fp32, expert ids [N, k]) with each row's slots in ascending expert id; the
        choice keeps the k best scores, ties to the lower expert id."""
        norm, be = self.norm and self.topk > 1, kernels.backend_for(x)
        return kernels.moe_route(x, self.weight, self.bias, self.topk, norm, self.scale, backend=be)


class Expert(nn.Module):
    """SwiGLU with the released clamps: gate ≤ limit, up in [−limit, limit]."""

    SIBLINGS = (("w1", "w3"),)  # one input: stacked when packed (`model.linear.stack`)

    def __init__(self, dim: int, inter: int, limit: float, fmt: WeightFormat, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, fmt, dtype)
        self.w2 = Linear(inter, dim, fmt, dtype)
        self.w3 = Linear(dim, inter, fmt, dtype)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x: the input cast (`w1.cast`), shared by every expert of a token. A packed W2 reads its input as SwiGLU's
        kernel casts it (`kernels.swiglu_cast`)."""
        gate, up = project_together(x, self.w1, self.w3)
        if weight is None and isinstance(self.w2, Fp8Linear):
            data, scale = kernels.swiglu_cast(gate, up, self.limit, backend=kernels.backend_for(gate))
            return self.w2(Fp8Act(data, scale, gate.dtype), True)
        h = swiglu(gate, up, self.limit)
        if weight is not None:
            h = h * weight.to(h.dtype).unsqueeze(-1)
        return self.w2(h)


class Experts(nn.Module):
    """The routed experts with float weights, this rank's share: local expert i is `experts.{first + i}` (`w1` …,
    the checkpoint's names, whose expert index is global)."""

    def __init__(self, experts: Iterable[Expert], first: int = 0) -> None:
        super().__init__()
        self.first = first
        for i, expert in enumerate(experts):
            self.add_module(str(first + i), expert)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Expert:
        """Local expert i."""
        return self._modules[str(self.first + i)]

    def __iter__(self) -> Iterator[Expert]:
        return iter(self._modules.values())

    def forward(self, xq: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Weighted routed-expert outputs [N, k, C] of the cast input xq [N, C], slot by slot as the local ids [N, k]
        have them.

        Only the matmuls run expert by expert; the gathers, the activation, the routing weights and the FP8 cast of
        W2's input run once over every (token, slot) pair (each is elementwise or per row: the same values).
        """
        order, _ = kernels.moe_pairs(ids, len(self), kernels.backend_for(ids))
        k = ids.shape[1]
        sizes = torch.bincount(ids.flatten(), minlength=len(self)).tolist()  # the host waits once per layer
        active = [e for e, size in enumerate(sizes) if size]
        if not active:  # an expert-parallel rank may receive no pairs
            return xq.new_zeros(*ids.shape, self[0].w2.out_features)
        x = xq[order // k].split(sizes)
        gate = torch.cat([self[e].w1(x[e], True) for e in active])
        up = torch.cat([self[e].w3(x[e], True) for e in active])
        h = swiglu(gate, up, self[0].limit) * weights.flatten()[order].to(gate.dtype).unsqueeze(-1)
        w2 = [self[e].w2 for e in active]
        h = w2[0].cast(h).split([sizes[e] for e in active])
        out = torch.cat([linear(part, True) for linear, part in zip(w2, h, strict=True)])
        return _unsort(out, order, ids.shape)


class PackedExperts(nn.Module):
    """The routed experts at native precision: per expert, W1‖W3 as one [2I, C/2] block of E2M1 nibbles (low nibble =
    even input) and W2 as [C, I/2], each with a UE8M0 scale per `block` inputs (32 or 16: the released files leave it
    open, reference §2.9; `model.weights` reads it off the scales' shapes). Holds this rank's `n_experts`, the
    checkpoint's experts `first` … `first + n_experts − 1`."""

    def __init__(
        self, n_experts: int, dim: int, inter: int, limit: float, block: int, device=None, first: int = 0
    ) -> None:
        super().__init__()
        self.n_experts, self.dim, self.inter, self.limit, self.block = n_experts, dim, inter, limit, block
        self.first = first
        u8 = torch.uint8
        self.w13 = packed_param(n_experts, 2 * inter, dim // 2, dtype=u8, device=device)
        self.w13_scale = packed_param(n_experts, 2 * inter, dim // block, dtype=u8, device=device)
        self.w2 = packed_param(n_experts, dim, inter // 2, dtype=u8, device=device)
        self.w2_scale = packed_param(n_experts, dim, inter // block, dtype=u8, device=device)

    def checkpoint_views(self, prefix: str) -> dict[str, Tensor]:
        """The checkpoint's per-expert tensors (`{prefix}{e}.w1.weight` …, e global) as views of the stacked storage."""
        I, views = self.inter, {}
        for e in range(self.n_experts):
            for name, (data, scale) in {
                "w1": (self.w13[e, :I], self.w13_scale[e, :I]),
                "w3": (self.w13[e, I:], self.w13_scale[e, I:]),
                "w2": (self.w2[e], self.w2_scale[e]),
            }.items():
                key = f"{prefix}{self.first + e}.{name}"
                views[f"{key}.weight"], views[f"{key}.scale"] = data, scale
        return views

    def forward(self, xq: Fp8Act, weights: Tensor, ids: Tensor) -> Tensor:
        """Weighted routed-expert outputs [N, k, C] of the cast input xq [N, C], slot by slot as `ids` [N, k] lists
        them: two grouped GEMMs over the (token, slot) pairs sorted by expert."""
        be = kernels.backend_for(xq.data)
        order, offsets = kernels.moe_pairs(ids, self.n_experts, be)
        h_data, h_scale = kernels.moe_gate_up_cast(
            xq.data, xq.scale, order, offsets, weights, self.w13, self.w13_scale, self.limit, xq.dtype, backend=be
        )
        out = kernels.moe_down(h_data, h_scale, offsets, self.w2, self.w2_scale, xq.dtype, backend=be, order=order)
        return out.view(*ids.shape, out.shape[-1])

    def extra_repr(self) -> str:
        held = f"{self.first}…{self.first + self.n_experts - 1}"
        return f"experts={held}, dim={self.dim}, inter={self.inter}, fp4 scale block={self.block}"


def _unsort(out: Tensor, order: Tensor, shape: torch.Size) -> Tensor:
    """Rows of the expert-sorted pairs back to [N, k, C] (pair order[i] is sorted row i)."""
    pairs = out.new_empty(out.shape)
    pairs[order] = out
    return pairs.view(*shape, out.shape[-1])


class MoE(nn.Module):
    """Gate, routed experts (this rank's share of them: `model.parallel`) and the shared expert of block `layer`."""

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        dspark: bool = False,
        dtype: torch.dtype | None = None,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.n_experts = args.dspark_n_routed_experts if dspark else args.n_routed_experts
        topk = args.dspark_num_experts_per_tok if dspark else args.num_experts_per_tok
        q = args.quantization_config
        routed: WeightFormat = "fp4" if q else "bf16"
        shared: WeightFormat = "fp8" if q else "bf16"
        dim, inter, limit = args.hidden_size, args.moe_intermediate_size, args.swiglu_limit
        self.gate, self.limit, self.parallel = Gate(args, self.n_experts, topk, dtype), limit, parallel
        held = parallel.experts(self.n_experts)
        self.experts: Experts | PackedExperts = Experts(
            (Expert(dim, inter, limit, routed, dtype) for _ in held), first=held.start
        )
        self.shared_experts = Expert(dim, inter, limit, shared, dtype)

    def routed(self, xq: Tensor | Fp8Act, weights: Tensor, ids: Tensor) -> Tensor:
        """Weighted routed-expert outputs [N, k, C]: this process's experts, or the expert-parallel group's."""
        if self.parallel.world_size == 1:
            return self.experts(xq, weights, ids)
        return expert_parallel(self.experts, self.n_experts, xq, weights, ids, self.parallel, self.layer)

    def answer(self, received: list[int], dtype: torch.dtype) -> None:
        """This rank's part of an MoE round of this layer that other ranks run while this one has no tokens
        (data-parallel attention, `model.parallel.serve_idle`); `dtype`: the activations' (the payload's form)."""
        x = torch.empty(0, self.gate.weight.shape[1], dtype=dtype, device=self.gate.weight.device)
        weights, ids = self.gate(x)
        xq = self.shared_experts.w1.cast(x)
        answer_round(self.experts, self.n_experts, xq, weights, ids, self.parallel, received)

    def forward(self, x: Tensor, xq: Tensor | Fp8Act | None = None) -> Tensor:
        """x [..., C] → [..., C]; xq: x's FP8 cast, one for every expert (`model.linear.norm_share`; None: cast
        here)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        if xq is None:
            xq = self.shared_experts.w1.cast(x)
        elif isinstance(xq, Fp8Act):
            xq = Fp8Act(xq.data.reshape(x.shape), xq.scale.reshape(x.shape[0], -1), xq.dtype)
        else:
            xq = xq.reshape(x.shape)
        return combine(self.shared_experts(xq), self.routed(xq, weights, ids)).view(shape)


@fused
def combine(shared: Tensor, routed: Tensor) -> Tensor:
    """shared [N, C] + routed [N, k, C], accumulated in fp32: each token's experts added one at a time, in ascending
    id (the slot order), whatever the number of ranks that computed them."""
    compute = torch.promote_types(shared.dtype, torch.float32)
    y = shared.to(compute)
    for r in range(routed.shape[1]):
        y = y + routed[:, r].to(compute)
    return y.to(shared.dtype)
