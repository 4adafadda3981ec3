"""The prefill service's one typed configuration (flags and PREFILL_SVC_* environment variables)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from model_service.config import (
    ModelServiceConfig,
    NonNegativeFloat,
    Port,
    Positive,
    PositiveFloat,
    with_shared_settings,
)

ENV_PREFIX = "PREFILL_SVC"


@with_shared_settings
class PrefillConfig(ModelServiceConfig, frozen=True, kw_only=True):
    """Prefill service: the encoder half over prompts, global KV blocks and handoff records into cache_svc.

    cache: cache_svc addresses, host:port[,host:port...] (required; the same list, in the same order, on every client)
    cache_retry_s: after the cache failed a handoff write, answer FAILED_PRECONDITION this long without trying
    max_queue: prompts waiting for the encoder at once; more are refused with RESOURCE_EXHAUSTED
    handoff_lease_s: how long a handoff record waits for a decode when the request does not say
    max_handoff_lease_s: longest lease a request may ask for
    max_handoffs: most handoff records one request may ask for (one per choice: at least the gateway's largest n)
    """

    port: Port = 7002
    metrics_port: Port = 9102
    cache: Annotated[list[str], msgspec.Meta(min_length=1)]
    cache_retry_s: NonNegativeFloat = 2.0
    max_queue: Positive = 64
    handoff_lease_s: PositiveFloat = 30.0
    max_handoff_lease_s: PositiveFloat = 300.0
    max_handoffs: Positive = 16
