"""prefill.v1.Prefill: runs the encoder half of the model over prompts and hands them to decode through cache_svc.

Public modules other services use: `prefill_svc.kvstore` (model state in the cache: blocks, SWA records, the handoff
record) and `prefill_svc.runtime` (model loading from a --model spec, prompt validation). See docs/services.md.
"""
