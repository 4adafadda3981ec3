"""The decode service's one typed configuration (flags and DECODE_SVC_* environment variables)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

ENV_PREFIX = "DECODE_SVC"

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class DecodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Decode service: the full model and DSpark, continuous batching, write-back of finished sequences to cache_svc.

    host: address to listen on
    port: gRPC port (0 picks a free port, logged at start)
    metrics_port: Prometheus /metrics port (0 disables it)
    metrics_host: address of the metrics endpoint
    model: a preset (tiny, small) or a checkpoint directory
    seed: weight seed of a preset model (the same seed on every prefill and decode replica)
    device: auto, cpu, cuda or cuda:N
    dtype: auto (bfloat16 on a GPU, float32 on the CPU), float32, float64, bfloat16 or float16
    threads: torch CPU threads (0 = torch's default)
    cache: cache_svc addresses, host:port[,host:port...] (empty: no reuse and no write-back; token_ids prompts only)
    cache_timeout_s: deadline of every cache RPC
    max_batch: sequences decoded together; more wait in the queue
    max_queue: sequences waiting for a batch slot; more are refused with RESOURCE_EXHAUSTED
    speculation: DSpark speculative decoding (a request may still turn it off)
    max_draft: most drafts verified per sequence and step (at most the model's DSpark block size)
    draft_threshold: keep drafts while the running product of their confidences stays at or above this
    chunk_size: prompt tokens per encoder forward when decode prefills a prompt itself
    grace_s: seconds running generations get to finish after SIGTERM
    log_level: debug, info, warning or error
    """

    host: str = "127.0.0.1"
    port: Port = 7003
    metrics_port: Port = 9103
    metrics_host: str = "0.0.0.0"
    model: str = "tiny"
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache: list[str] = msgspec.field(default_factory=list)
    cache_timeout_s: PositiveFloat = 5.0
    max_batch: Positive = 32
    max_queue: Positive = 128
    speculation: bool = True
    max_draft: Positive = 5
    draft_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    chunk_size: Positive = 512
    grace_s: Annotated[float, msgspec.Meta(ge=0)] = 170.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
