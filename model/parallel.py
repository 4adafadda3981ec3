"""Expert parallelism: a replica as W ranks, routed experts split over them, tokens reaching experts by all-to-all.

Rank r of W holds routed experts [r·E/W, (r+1)·E/W) of every MoE layer (the DSpark blocks' own experts too); the
rest of the model — attention, shared expert, mHC, embedding, head — is on every rank. Attention runs one of two ways:

- **replicated**: every rank runs the same batch and computes the routing of every token; per MoE layer rank r
  dispatches only its contiguous share of the tokens, [r·⌈N/W⌉, (r+1)·⌈N/W⌉), and after the exchange every rank
  gathers all shares' outputs (`all_gather`). This keeps EP = W bit-identical to EP = 1 on a CPU (fp32 or fp64): a
  matmul's row may change in its last bits with the number of rows beside it, so every dense layer sees the batch of
  the single-rank run, and expert e receives the shares' pairs in rank order, each share's in token order — exactly
  the rows, in the order, that expert e computes at W = 1.
- **data-parallel** (`data_parallel`): each rank runs its own sequences and dispatches all of its tokens; a group of
  W serves W times the sequences of one rank. Ranks may run different forwards, or none: each MoE round starts with
  a header naming the layer the sender runs (IDLE: none), and a rank with no work left answers the rounds of those
  still running, with no tokens of its own (`serve_idle`), until a round finds every rank idle.

Per MoE layer (the exchange):

    header     per-rank pair counts and the sender's layer, by one `all_to_all_single` on the device
    dispatch   the (token, slot) pairs, sorted by expert (hence by owning rank), go to their experts' ranks by one
               `all_to_all_single` (activation rows, routing weight and local expert id packed as one byte row a pair)
    compute    the owner runs its local experts over the pairs it received, in the order received
    return     the outputs come back by the reverse all-to-all and are put back in (token, slot) order

`model.moe.MoE` then adds each token's slots one at a time, in ascending expert id — the same code as with one rank.
W = 1 takes the single-process path: no process group, no exchange.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from model import kernels
from model.linear import Fp8Act

RoutedExperts = Callable[[Tensor | Fp8Act, Tensor, Tensor], Tensor]  # (xq, weights, ids) → [N, k, C], local ids
IDLE = -1  # the layer a rank names in an MoE round's header when it runs no forward (data-parallel attention)


class Rounds:
    """The MoE rounds a rank has entered: every rank of the group enters each round, so a rank group's watcher
    tells a long forward (still entering rounds) from a stuck one by this count (model_service.ranks)."""

    def __init__(self) -> None:
        self.entered = 0


@dataclass(frozen=True)
class Parallel:
    """Where a model runs: rank `rank` of an expert-parallel group of `world_size` ranks (`group`: its process
    group; None is torch.distributed's default group); `data_parallel`: each rank attends to its own sequences (else
    every rank runs the same batch); `rounds`: the MoE rounds this rank has entered."""

    world_size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None
    data_parallel: bool = False
    rounds: Rounds = field(default_factory=Rounds, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def replicated(self) -> bool:
        """Several ranks run the same batch: what one rank draws alone must be rank 0's everywhere (`broadcast`)."""
        return self.world_size > 1 and not self.data_parallel

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
    experts: RoutedExperts,
    n_experts: int,
    xq: Tensor | Fp8Act,
    weights: Tensor,
    ids: Tensor,
    parallel: Parallel,
    layer: int,
) -> Tensor:
    """Weighted routed-expert outputs [N, k, C] of this rank's tokens, as the single-rank experts give them: dispatched
    to the experts' ranks, computed there by `experts` (this rank's), returned — with replicated attention only this
    rank's share of the tokens, the others' gathered from their ranks. `layer`: the MoE's block, for the header."""
    if parallel.data_parallel:
        return _exchange(experts, n_experts, xq, weights, ids, parallel, layer)
    share = parallel.share(ids.shape[0])
    mine = _exchange(experts, n_experts, _rows(xq, share), weights[share], ids[share], parallel, layer)
    return _gather(mine, ids.shape[0], parallel)


def serve_idle(parallel: Parallel, device: torch.device, answer: Callable[[int, list[int]], None]) -> None:
    """A data-parallel rank done with its forwards, or with none to run: answer the MoE rounds of the ranks still
    running, with no tokens of its own, until a round finds every rank idle. `answer(layer, received)` runs this
    rank's part of a round of `layer` whose header it took (`answer_round`)."""
    nothing = torch.zeros(parallel.world_size, dtype=torch.int64, device=device)
    while True:
        received, layers, _ = _header(nothing, IDLE, parallel)
        layer = _running(layers)
        if layer == IDLE:
            return
        answer(layer, received)


def answer_round(
    experts: RoutedExperts,
    n_experts: int,
    xq: Tensor | Fp8Act,
    weights: Tensor,
    ids: Tensor,
    parallel: Parallel,
    received: list[int],
) -> None:
    """An idle rank's part of one MoE round (`serve_idle`): xq, weights and ids hold no tokens (their form tells the
    payload's); the pairs `received` from each rank are computed here and sent back."""
    _exchange(experts, n_experts, xq, weights, ids, parallel, IDLE, received)


def _exchange(
    experts: RoutedExperts,
    n_experts: int,
    xq: Tensor | Fp8Act,
    weights: Tensor,
    ids: Tensor,
    parallel: Parallel,
    layer: int,
    received: list[int] | None = None,
) -> Tensor:
    """Header → dispatch → compute → return for this rank's tokens: [n, k, C] in (token, slot) order. `received`:
    the pairs each rank sends, when this rank took the round's header already (it idles)."""
    held, group = n_experts // parallel.world_size, parallel.group
    order, offsets = kernels.moe_pairs(ids, n_experts, kernels.backend_for(ids))
    sent = (offsets[held::held] - offsets[:-1:held]).long()  # pairs for each rank (experts are contiguous per rank)
    if received is None:  # the split sizes both ways: the host waits once per layer
        received, layers, sent_sizes = _header(sent, layer, parallel)
        _running(layers)
    else:
        sent_sizes = sent.tolist()
    columns = [*_fields(xq, order // ids.shape[1]), weights.flatten()[order], ids.flatten()[order] % held]
    payload = _pack(columns)
    arrived = payload.new_empty(sum(received), payload.shape[1])
    dist.all_to_all_single(arrived, payload, received, sent_sizes, group=group)
    *x, weight, local = _unpack(arrived, columns)
    out = experts(_like(xq, x), weight.unsqueeze(1), local.unsqueeze(1)).squeeze(1).contiguous()
    back = out.new_empty(order.shape[0], out.shape[-1])
    dist.all_to_all_single(back, out, sent_sizes, received, group=group)
    pairs = back.new_empty(back.shape)
    pairs[order] = back
    return pairs.view(*ids.shape, back.shape[-1])


def _header(sent: Tensor, layer: int, parallel: Parallel) -> tuple[list[int], list[int], list[int]]:
    """An MoE round's header: the pairs this rank sends each rank and the layer it runs, for every rank's → (pairs
    each rank sends this one, the layer each runs, the pairs this one sends each), read by the host at once."""
    header = torch.stack((sent, torch.full_like(sent, layer)), 1)
    got = torch.empty_like(header)
    parallel.rounds.entered += 1
    dist.all_to_all_single(got, header, group=parallel.group)
    (received, layers), (sent_sizes, _) = torch.stack((got.T, header.T)).tolist()
    return received, layers, sent_sizes


def _running(layers: list[int]) -> int:
    """The layer the running ranks of a round are in (IDLE: none runs); their forwards must line up."""
    running = set(layers) - {IDLE}
    if len(running) > 1:
        raise RuntimeError(f"the ranks of one MoE round run different layers {sorted(running)}: their plans differ")
    return running.pop() if running else IDLE


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
