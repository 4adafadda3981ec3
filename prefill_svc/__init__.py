"""prefill.v1.Prefill: runs the encoder half of the model over prompts and hands them to decode through cache_svc.
See docs/services.md; what it shares with decode_svc lives in model_service."""
