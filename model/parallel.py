"""Expert parallelism: a replica as W ranks, routed experts split over them, tokens reaching experts by all-to-all.

Rank r of W holds routed experts [r·E/W, (r+1)·E/W) of every MoE layer (the DSpark blocks' own experts too); the
rest of the model — attention, shared expert, mHC, embedding, head — is replicated. Every rank runs the same batch
(replicated attention) and computes the routing of every token; then, per MoE layer:

    share      rank r dispatches only its contiguous share of the tokens, [r·⌈N/W⌉, (r+1)·⌈N/W⌉)
    dispatch   its (token, slot) pairs, sorted by expert (hence by owning rank), go to their experts' ranks by one
               `all_to_all_single` (activation rows, routing weight and local expert id packed as one byte row a
               pair), after the per-rank pair counts are exchanged on the device by another
    compute    the owner runs its local experts over the pairs it received, in the order received
    return     the outputs come back by the reverse all-to-all and are put back in (token, slot) order
    gather     every rank gathers all shares' outputs (`all_gather`), and `model.moe.MoE` adds each
               token's slots one at a time, in ascending expert id — the same code as with one rank

Replicated attention is chosen because it keeps EP = W bit-identical to EP = 1 on a CPU (fp32 or fp64): a matmul's
row may change in its last bits with the number of rows beside it, so every dense layer must see the batch of the
single-rank run; and expert e receives the shares' pairs in rank order, each share's in token order — exactly the
rows, in the order, that expert e computes at W = 1. Data-parallel attention (each rank its own sequences) uses the
same exchange without the share and the gather. W = 1 takes the single-process path: no process group, no exchange.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from model import kernels
from model.linear import Fp8Act

RoutedExperts = Callable[[Tensor | Fp8Act, Tensor, Tensor], Tensor]  # (xq, weights, ids) → [N, k, C], local ids


@dataclass(frozen=True)
class Parallel:
    """Where a model runs: rank `rank` of an expert-parallel group of `world_size` ranks (`group`: its process
    group; None is torch.distributed's default group)."""

    world_size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def experts(self, n_experts: int) -> range:
        """The routed experts this rank holds, [r·E/W, (r+1)·E/W) of E (ValueError unless W divides E)."""
        if n_experts % self.world_size:
            raise ValueError(f"{n_experts} routed experts do not split over {self.world_size} ranks")
        held = n_experts // self.world_size
        return range(self.rank * held, (self.rank + 1) * held)

    def broadcast(self, *tensors: Tensor) -> None:
        """Rank 0's values of `tensors` on every rank, in place: a decision every rank must commit alike (a sampled
        acceptance draws from each rank's own generator; kernels may round apart on different devices)."""
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        for t in tensors:
            dist.broadcast(t, src, group=self.group)

    def share(self, n_tokens: int) -> slice:
        """This rank's contiguous share of `n_tokens` replicated tokens: ⌈N/W⌉ of them (fewer, or none, at the end)."""
        size = math.ceil(n_tokens / self.world_size)
        return slice(min(self.rank * size, n_tokens), min((self.rank + 1) * size, n_tokens))


SINGLE = Parallel()  # one process holding every expert


def expert_parallel(
    experts: RoutedExperts, n_experts: int, xq: Tensor | Fp8Act, weights: Tensor, ids: Tensor, parallel: Parallel
) -> Tensor:
    """Weighted routed-expert outputs [N, k, C] of every token, as the single-rank experts give them: this rank's
    share dispatched to the experts' ranks, computed there by `experts` (this rank's), returned and gathered."""
    share = parallel.share(ids.shape[0])
    mine = _exchange(experts, n_experts, _rows(xq, share), weights[share], ids[share], parallel)
    return _gather(mine, ids.shape[0], parallel)


def _exchange(
    experts: RoutedExperts, n_experts: int, xq: Tensor | Fp8Act, weights: Tensor, ids: Tensor, parallel: Parallel
) -> Tensor:
    """Dispatch → compute → return for this rank's tokens: [n, k, C] in (token, slot) order."""
    held, group = n_experts // parallel.world_size, parallel.group
    order, rows, offsets = kernels.moe_pairs(ids, n_experts)
    sent = (offsets[held::held] - offsets[:-1:held]).long()  # pairs for each rank (experts are contiguous per rank)
    counts = torch.empty_like(sent)
    dist.all_to_all_single(counts, sent, group=group)
    sent_sizes, received_sizes = sent.tolist(), counts.tolist()  # the split sizes: the host waits once per layer
    columns = [*_fields(xq, rows.long()), weights.flatten()[order], ids.flatten()[order] % held]
    payload = _pack(columns)
    received = payload.new_empty(sum(received_sizes), payload.shape[1])
    dist.all_to_all_single(received, payload, received_sizes, sent_sizes, group=group)
    *x, weight, local = _unpack(received, columns)
    out = experts(_like(xq, x), weight.unsqueeze(1), local.unsqueeze(1)).squeeze(1).contiguous()
    back = out.new_empty(order.shape[0], out.shape[-1])
    dist.all_to_all_single(back, out, sent_sizes, received_sizes, group=group)
    pairs = back.new_empty(back.shape)
    pairs[order] = back
    return pairs.view(*ids.shape, back.shape[-1])


def _gather(mine: Tensor, n_tokens: int, parallel: Parallel) -> Tensor:
    """Every rank's share of [N, k, C], concatenated in rank order (shares padded to ⌈N/W⌉ for the collective)."""
    size = math.ceil(n_tokens / parallel.world_size)
    padded = F.pad(mine, (0, 0, 0, 0, 0, size - mine.shape[0]))
    shares = [torch.empty_like(padded) for _ in range(parallel.world_size)]
    dist.all_gather(shares, padded, group=parallel.group)
    return torch.cat(shares)[:n_tokens]


def _fields(xq: Tensor | Fp8Act, index: Tensor | slice) -> list[Tensor]:
    """The rows `index` of the cast input's tensors (FP8 bytes and scales, or the fake-quantised floats)."""
    tensors = [xq.data, xq.scale] if isinstance(xq, Fp8Act) else [xq]
    return [t[index] for t in tensors]


def _like(xq: Tensor | Fp8Act, tensors: list[Tensor]) -> Tensor | Fp8Act:
    """`_fields` undone: the cast input of the given rows, in xq's form."""
    return Fp8Act(*tensors, xq.dtype) if isinstance(xq, Fp8Act) else tensors[0]


def _rows(xq: Tensor | Fp8Act, share: slice) -> Tensor | Fp8Act:
    return _like(xq, _fields(xq, share))


def _pack(columns: list[Tensor]) -> Tensor:
    """Per-pair tensors [P, …] of any dtypes → one uint8 [P, bytes] (one message carries them all)."""
    return torch.cat([c.reshape(c.shape[0], math.prod(c.shape[1:])).contiguous().view(torch.uint8) for c in columns], 1)


def _unpack(packed: Tensor, like: list[Tensor]) -> list[Tensor]:
    """`_pack` undone for received rows: each column back in the dtype and row shape of `like`'s."""
    columns, at = [], 0
    for t in like:
        width = math.prod(t.shape[1:]) * t.element_size()
        column = (
            packed[:, at : at + width].clone(memory_format=torch.contiguous_format).view(t.dtype)
        )  # aligned, to reinterpret
        columns.append(column.view(-1, *t.shape[1:]))
        at += width
    return columns
