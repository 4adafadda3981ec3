"""Prometheus metrics of one prefill replica (names `v41mesh_prefill_*`; the HPA scales on the queue depth)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mesh.metrics import LATENCY_BUCKETS

TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
PASS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "v41mesh_prefill_"
        self.queue_depth = Gauge(p + "queue_depth", "Prompts waiting for the encoder", registry=registry)
        self.running = Gauge(p + "running", "Prompts in the encoder now (the batch)", registry=registry)
        self.requests = Counter(p + "requests", "Prefill RPCs by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=registry)
        self.tokens = Counter(p + "tokens", "Prompt tokens run through the encoder (not cached)", registry=registry)
        self.cache_hit_tokens = Counter(p + "cache_hit_tokens", "Prompt tokens taken from the cache", registry=registry)
        self.seconds = Histogram(
            p + "seconds", "Encoder time per prompt (tokens/s = tokens / seconds)", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            p + "batch_tokens", "Tokens run through the encoder per prompt", buckets=TOKEN_BUCKETS, registry=registry
        )
        self.pass_prompts = Histogram(
            p + "pass_prompts", "Prompts one encoder pass ran (a rank group: one a rank)", buckets=PASS_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.swa_restored = Counter(p + "swa_restored", "Prefixes resumed from an SWA record", registry=registry)
        self.bounded_replays = Counter(
            p + "bounded_replays", "Prefixes whose encoder rings were rebuilt by bounded replay", registry=registry
        )
        self.cache_errors = Counter(
            p + "cache_errors", "Cache writes that failed (the request is still served)", ["op"], registry=registry
        )
