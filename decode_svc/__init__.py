"""decode.v1.Decode: the full model and DSpark behind a continuous-batching engine, fed by prefill handoffs (or raw
token ids), streaming tokens, writing finished sequences back to cache_svc. See docs/services.md."""
