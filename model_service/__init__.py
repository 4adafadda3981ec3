"""What the two model services (prefill_svc, decode_svc) share around the model: the common settings, loading and
warming a model part, prompt checks and request errors, the server life cycle, and typed access to the model's
state in cache_svc. Imports torch and the model: only the model services import this package."""
