"""The gateway's Prometheus metrics (served on its HTTP port at /metrics), named after the field's vocabulary:
queue depth, requests, TTFT / ITL, errors by kind, cached-token share, retries and fallbacks, cancellations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mesh.metrics import LATENCY_BUCKETS

PREFIX = "v41mesh_gateway_"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.queue_depth = gauge("queue_depth", "Requests waiting for an admission slot")
        self.inflight = gauge("inflight_requests", "Requests holding an admission slot")
        self.expected_wait = gauge(
            "expected_queue_wait_seconds", "How long a request arriving now would wait for service (admission)"
        )
        self.admission_refusals = counter(
            "admission_refusals", "Requests admission turned away, by reason", ("reason",)
        )
        self.requests = counter("requests", "Finished requests by API and outcome", ("api", "outcome"))
        self.errors = counter("errors", "Requests that ended in an error, by kind", ("kind",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token", ("api",))
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive decode messages", ("api",))
        self.duration = histogram("request_duration_seconds", "Arrival to last byte", ("api",))
        self.prefill_seconds = histogram("prefill_seconds", "Prefill calls that succeeded, as the gateway waited")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests")
        self.cached_tokens = counter("cached_prompt_tokens", "Prompt tokens whose KV came from the prefix cache")
        self.cached_share = gauge("cached_token_share", "cached_prompt_tokens_total / prompt_tokens_total")
        self.completion_tokens = counter("completion_tokens", "Generated tokens")
        self.retries = counter("retries", "Calls re-sent to another replica (or path)", ("role", "reason"))
        self.fallbacks = counter("fallbacks", "Requests decode prefilled itself, without reuse", ("reason",))
        self.cancellations = counter("cancellations", "Generations stopped early (decode aborted)", ("reason",))
        self.writeback_waits = counter(
            "writeback_waits", "Turns that waited for their previous turn's write-back, by outcome", ("outcome",)
        )
        self.writeback_wait = histogram("writeback_wait_seconds", "How long those turns waited (before their prefill)")
        self.bounded_replays = counter("bounded_replays", "Generations whose SWA state was rebuilt by bounded replay")
        self.decode_messages = counter("decode_messages", "Decode messages carrying tokens (one per engine step)")
        self.draft_proposed = counter("dspark_draft_tokens_proposed", "DSpark draft tokens proposed (decode usage)")
        self.draft_accepted = counter("dspark_draft_tokens_accepted", "DSpark draft tokens accepted (decode usage)")
        self.routed = counter("routed", "Routing decisions by what chose the replica", ("role", "reason"))
        self.replica_load = gauge("replica_load", "Routing load of each replica", ("role", "replica"))
        self.replica_up = gauge("replica_up", "1 if the replica answered its last load poll", ("role", "replica"))
        self.responses_stored = counter("responses_stored", "Responses kept for previous_response_id (store: true)")
        self.responses_continued = counter(
            "responses_continued", "Responses continued by previous_response_id, by where the previous one was found",
            ("source",),
        )  # fmt: skip
        self.previous_response_reuse = counter(
            "previous_response_reused_tokens", "Tokens of a continued response's prompt that repeat its previous turn's"
        )
        self.cache_up = gauge("cache_up", "1 if every cache shard answered its last health check")
        self._prompt_total = 0
        self._cached_total = 0

    def tokens(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(completion)
        self._prompt_total += prompt
        self._cached_total += cached
        if self._prompt_total:
            self.cached_share.set(self._cached_total / self._prompt_total)
