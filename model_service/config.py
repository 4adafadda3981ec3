"""The settings every model service shares (prefill_svc's and decode_svc's configurations extend
`ModelServiceConfig`), and the constrained field types they use."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]

S = TypeVar("S", bound=type)


class ModelServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of every model service.

    host: address to listen on
    port: gRPC port (0 picks a free port, logged at start)
    metrics_port: Prometheus /metrics port (0 disables it)
    metrics_host: address of the metrics endpoint
    model: a preset (tiny, small) or a checkpoint directory
    seed: weight seed of a preset model (the same seed on every prefill and decode replica)
    device: auto, cpu, cuda or cuda:N
    dtype: auto (bfloat16 on a GPU, float32 on the CPU), float32, float64, bfloat16 or float16
    engram_store: Engram tables: device, host (pinned memory), mmap (the checkpoint's shards), auto (docs/services.md)
    threads: torch CPU threads (0: torch's default; with --ranks on the CPU, the cores divided among the ranks)
    batch_invariant: on a GPU, each sequence's numerics independent of the batch it runs in (model.kernels.invariance)
    cache: cache_svc addresses, host:port[,host:port...] (the same list, in the same order, on every client)
    cache_timeout_s: deadline of every cache RPC
    chunk_size: prompt tokens per encoder forward (bounds activation memory on long prompts)
    grace_s: seconds in-flight work gets to finish after SIGTERM
    log_level: debug, info, warning or error
    ranks: rank processes this replica starts on this node, one GPU each (W = ranks·nodes; 1: one process, no group)
    nodes: nodes the replica's rank group spans (each starts --ranks of them)
    node_rank: this node's index in the group (0 serves gRPC and runs the scheduler; the others follow its plans)
    master_addr: address of node rank 0, where the group meets (torch.distributed's store)
    master_port: port of that store on node rank 0
    rank_timeout_s: a rank silent this long fails the group (NOT_SERVING, streams UNAVAILABLE, exit non-zero)
    stall_timeout_s: a plan in which the ranks pass no MoE round for this long fails the group (a rank hung alive)
    collective_timeout_s: longest wait of one collective (a dispatch, a plan) before the group fails
    """

    host: str = "127.0.0.1"
    port: Port = 0
    metrics_port: Port = 0
    metrics_host: str = "0.0.0.0"
    model: str = "tiny"
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    engram_store: Literal["auto", "device", "host", "mmap"] = "auto"
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    batch_invariant: bool = False
    cache: list[str] = msgspec.field(default_factory=list)
    cache_timeout_s: PositiveFloat = 5.0
    chunk_size: Positive = 512
    grace_s: NonNegativeFloat = 60.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    ranks: Positive = 1
    nodes: Positive = 1
    node_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    master_addr: str = "127.0.0.1"
    master_port: Port = 29500
    rank_timeout_s: PositiveFloat = 5.0
    stall_timeout_s: PositiveFloat = 60.0
    collective_timeout_s: PositiveFloat = 300.0

    def __post_init__(self) -> None:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is outside a group of {self.nodes} nodes")

    @property
    def world_size(self) -> int:
        """W: the ranks of this replica's group, over all its nodes."""
        return self.ranks * self.nodes


def with_shared_settings(cls: S) -> S:
    """Append the shared settings' descriptions to a service's docstring (flags take their help from it; the
    service's own lines come first, so a setting it redescribes keeps its own text)."""
    shared = (ModelServiceConfig.__doc__ or "").split("\n\n", 1)[1]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + shared
    return cls
