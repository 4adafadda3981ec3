"""The gateway's one typed configuration (flags and GATEWAY_* environment variables)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

ENV_PREFIX = "GATEWAY"
DEFAULT_MODEL_NAME = "DeepSeek-V4.1-Flash"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """HTTP (OpenAI Chat Completions / Responses, Anthropic Messages) and gRPC front door of the mesh.

    host: address to listen on (HTTP and gRPC)
    port: HTTP port (0 picks a free one, logged at start)
    grpc_port: gateway.v1.Gateway gRPC port (0 picks a free one)
    prefill: prefill replica addresses, host:port, comma-separated
    decode: decode replica addresses, host:port, comma-separated
    cache: cache shard addresses, the same fixed list every client uses (watched for health only)
    discovery: static (the address lists) or kubernetes (watch the EndpointSlices of the prefill/decode Services)
    namespace: Kubernetes namespace of the Services (default: the pod's own)
    api_key: when set, every API request must carry it (Authorization: Bearer or x-api-key)
    model_name: the model name served (listed by /v1/models; accepted next to the official names)
    tokenizer: a tokenizer.json (default: the DeepSeek V4 tokenizer with the V4.1 names)
    max_inflight: requests generating at once; more wait in the queue
    max_queue: requests waiting for a slot; more are refused with 429 and Retry-After
    queue_timeout_s: the longest wait for a slot before a 429
    max_queue_wait_s: refuse at once (429) a request expected to wait longer than this for service (0: no bound)
    max_body_bytes: largest request body accepted (413 above it)
    prepare_threads: worker threads that convert, render and tokenise requests off the event loop
    max_output_tokens: cap on any request's output budget (0: the model's context)
    prefix_reuse: reuse cached prefixes; off gives every request its own cache salt (a cold run)
    prefill_fallback: when no prefill replica can serve, decode prefills the prompt itself (no reuse)
    retries: further replicas tried after a replica fails before its first token
    prefill_timeout_s: deadline of one Prefill call
    stall_timeout_s: the longest wait for the next decode message before the stream is declared dead
    request_timeout_s: deadline of a whole generation
    handoff_lease_s: how long a handoff record waits for its decode (0: the prefill's default)
    writeback_wait_s: how long a conversation's next turn waits for its previous turn's write-back (0: never)
    load_interval_s: how often every replica's load (GetLoad) and the cache's health are polled
    inhibit_s: a replica that failed a call gets no new work for this long
    affinity_entries: conversations whose replica is remembered, per role (one unknown here goes to its hashed owner)
    affinity_slack: extra load (requests per batch slot) a conversation's own replica may carry before another is chosen
    response_store: the sqlite file of stored Responses, shared by the gateways given it (empty: memory, lost at exit)
    response_retention_h: how long a stored response stays retrievable and continuable (the KV's retention)
    compact_max_tokens: output budget of the summary /v1/responses/compact writes
    websocket_max_s: how long one Responses WebSocket connection may stay open
    grace_s: seconds in-flight requests get to finish after SIGTERM
    log_level: debug, info, warning or error
    """

    host: str = "127.0.0.1"
    port: Port = 8000
    grpc_port: Port = 8001
    prefill: list[str] = []
    decode: list[str] = []
    cache: list[str] = []
    discovery: Literal["static", "kubernetes"] = "static"
    namespace: str | None = None
    api_key: str = ""
    model_name: str = DEFAULT_MODEL_NAME
    tokenizer: str = ""
    max_inflight: Positive = 64
    max_queue: NonNegative = 256
    queue_timeout_s: Seconds = 30.0
    max_queue_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    max_body_bytes: Positive = 16 << 20
    prepare_threads: Positive = 4
    max_output_tokens: NonNegative = 0
    prefix_reuse: bool = True
    prefill_fallback: bool = True
    retries: NonNegative = 2
    prefill_timeout_s: Seconds = 120.0
    stall_timeout_s: Seconds = 60.0
    request_timeout_s: Seconds = 1800.0
    handoff_lease_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    writeback_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    load_interval_s: Seconds = 0.5
    inhibit_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    affinity_entries: Positive = 100_000
    affinity_slack: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    response_store: str = ""
    response_retention_h: Annotated[float, msgspec.Meta(gt=0)] = 72.0
    compact_max_tokens: Positive = 1024
    websocket_max_s: Seconds = 3600.0
    grace_s: Annotated[float, msgspec.Meta(ge=0)] = 170.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
