"""Prometheus metrics of one decode replica (names `v41mesh_decode_*`; the HPA scales on the queue depth).

Mean DSpark accepted length per verify (bonus token included) = (draft_accepted_tokens + speculative_row_steps) /
speculative_row_steps; acceptance rate = draft_accepted_tokens / draft_proposed_tokens. What the scheduler decided:
draft_steps_total{plan} (plain, draft, probe) before a step, verify_width once drafted (0: the draft was not worth
verifying), draft_trust{rows,draws} how far its forecasts have held lately for a batch bucket of all-greedy rows
(draws="greedy") or with a sampled row ("sampled"): realised over promised speed-up.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mesh.metrics import LATENCY_BUCKETS

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WIDTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "v41mesh_decode_"

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=registry)

        self.queue_depth = Gauge(p + "queue_depth", "Sequences waiting for a batch slot", registry=registry)
        self.running = Gauge(p + "running", "Sequences in the running batch", registry=registry)
        self.rank_rows = Gauge(
            p + "rank_rows", "Sequences each rank of a rank group holds (every lane)", ("rank",), registry=registry
        )
        self.requests = counter("requests", "Generate RPCs by outcome", ("outcome",))
        self.tokens = counter("tokens", "Tokens generated (decode tokens/s = its rate)")
        self.ttft = histogram("ttft_seconds", "Generate arrival → first token sent", LATENCY_BUCKETS)
        self.itl = histogram("itl_seconds", "Gap between successive token messages of a stream", LATENCY_BUCKETS)
        self.step = histogram("step_seconds", "One engine step of a lane", LATENCY_BUCKETS, ("lane",))
        self.batch_size = histogram("batch_size", "Sequences in a lane's step", BATCH_BUCKETS, ("lane",))
        self.admit_wait = histogram(
            "admit_wait_seconds", "Prompt ready → taken in by the engine (after its step)", LATENCY_BUCKETS
        )
        self.join = histogram(
            "join_seconds", "Restore + decoder bounded replay of a lane's joining prompts", LATENCY_BUCKETS, ("lane",)
        )
        self.join_size = histogram("join_size", "Prompts joining a lane in one replay", BATCH_BUCKETS, ("lane",))
        self.bounded_replays = counter("bounded_replays", "Prompts whose encoder rings came from a bounded replay")
        self.local_prefills = counter("local_prefills", "Prompts decode prefilled itself", ("reason",))
        self.local_prefill_chunks = counter(
            "local_prefill_chunks", "Chunks of local prefill run between two engine steps (at most one per iteration)"
        )
        self.draft_proposed = counter("draft_proposed_tokens", "DSpark drafts verified")
        self.draft_accepted = counter("draft_accepted_tokens", "DSpark drafts accepted")
        self.speculative_steps = counter("speculative_row_steps", "Sequence-steps decoded by draft + verify")
        self.draft_steps = counter("draft_steps", "Speculative-lane steps by the scheduler's plan", ("plan",))
        self.verify_width = histogram("verify_width", "Drafts per row a drafted step verified", WIDTH_BUCKETS)
        self.draft_trust = Gauge(
            p + "draft_trust",
            "Realised over promised speed-up of recent drafted steps, by batch bucket and draws (scheduler)",
            ("rows", "draws"),
            registry=registry,
        )
        self.constrained = counter("constrained", "Generations under an output constraint, by grammar", ("grammar",))
        self.grammar_compile = histogram("grammar_compile_seconds", "Compiling an output constraint", LATENCY_BUCKETS)
        self.aborts = counter("aborts", "Generations ended before their end", ("reason",))
        self.writebacks = counter("writebacks", "Write-backs to the cache by outcome", ("outcome",))
        self.writeback_seconds = histogram("writeback_seconds", "Blocks + SWA record write-back", LATENCY_BUCKETS)
