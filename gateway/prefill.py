"""A request's prefill, run once for all its choices: the encoder half over the prompt, and one handoff record per
choice (a decode consumes the record it restores, so n choices need n records of the one prefill).

    ─ the conversation's previous turn still writing back → wait for it first (gateway/writebacks.py)
    ─ a replica down or overloaded → the next replica
    ─ all down, or the cache down  → no records: every choice's decode prefills from the token ids (no reuse;
                                     counted as a fallback per choice)
    ─ the prompt is invalid        → 400
"""

from __future__ import annotations

import time

import grpc
import msgspec

from gateway.backends import DOWN, Backends, Prompt, describe
from gateway.errors import GatewayError, Kind
from gateway.replicas import ReplicaState
from mesh.logging import get_logger
from proto.prefill.v1 import prefill_pb2

log = get_logger("gateway")


class Prefilled(msgspec.Struct, frozen=True):
    """What the prefill gives a request's choices."""

    prompt_tokens: int
    cached_tokens: int
    handles: list[bytes | None]  # one per choice; None: that choice's decode prefills from the token ids
    fallback: str | None = None  # why a choice has no handle
    replica: str | None = None  # the prefill replica that served it


async def prefill(backends: Backends, prompt: Prompt, choices: int) -> Prefilled:
    """Prefill `prompt` once, with a handoff record for each of the request's `choices`."""
    await _settle(backends, prompt)
    if backends.cache.down:
        return _fall_back(backends, prompt, choices, "cache_unavailable", "no cache shard answers its health check")
    s = backends.settings
    tried: set[str] = set()
    last = "no prefill replica is available"
    for _ in range(1 + s.retries):
        state = backends.router.pick("prefill", prompt.affinity, tried)
        if state is None:
            break
        tried.add(state.name)
        try:
            return await _prefill_on(backends, state, prompt, choices)
        except grpc.aio.AioRpcError as exc:
            code, last = exc.code(), f"prefill replica {state.name}: {describe(exc)}"
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise GatewayError(Kind.BAD_REQUEST, f"The prompt was refused: {exc.details()}") from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:  # its cache is unreachable: so is everyone's
                return _fall_back(backends, prompt, choices, "prefill_cache_unavailable", last)
            if code in DOWN:
                backends.router.pools["prefill"].failed(state)
            backends.metrics.retries.labels("prefill", code.name.lower()).inc()
            log.warning("prefill_failed", request_id=prompt.request_id, error=last)
    if not s.prefill_fallback:
        raise GatewayError(Kind.UNAVAILABLE, f"No prefill replica could serve the request ({last}).")
    return _fall_back(backends, prompt, choices, "prefill_unavailable", last)


async def _settle(backends: Backends, prompt: Prompt) -> None:
    """Let the conversation's previous turn finish writing its SWA record first (gateway/writebacks.py)."""
    wait_s = backends.settings.writeback_wait_s
    if wait_s <= 0:
        return
    started = time.monotonic()
    settled = await backends.writebacks.settle(prompt.affinity, wait_s)
    if settled is not None:
        backends.metrics.writeback_waits.labels("settled" if settled else "timeout").inc()
        backends.metrics.writeback_wait.observe(time.monotonic() - started)


async def _prefill_on(backends: Backends, state: ReplicaState, prompt: Prompt, choices: int) -> Prefilled:
    """One Prefill call on `state` (AioRpcError when it fails)."""
    s, metrics = backends.settings, backends.metrics
    request = prefill_pb2.PrefillRequest(
        request_id=prompt.request_id,
        token_ids=prompt.token_ids,
        cache_salt=prompt.salt,
        handoff_lease_s=s.handoff_lease_s,
        handoffs=choices,
    )
    started = time.monotonic()
    answer = await state.stub.Prefill(request, timeout=s.prefill_timeout_s)
    metrics.prefill_seconds.observe(time.monotonic() - started)
    backends.router.served("prefill", prompt.affinity, state)
    if answer.bounded_replay:
        metrics.bounded_replays.inc()
    # A replica that predates `handoffs` writes one record, named by `handle` alone: the other choices decode from
    # the token ids rather than fail.
    handles: list[bytes | None] = [bytes(h) for h in answer.handles[:choices]] or [bytes(answer.handle)]
    missing = choices - len(handles)
    fallback = None
    if missing:
        fallback = "handoffs_missing"
        backends.fall_back(prompt.request_id, fallback, f"prefill replica {state.name} wrote {len(handles)}", missing)
    return Prefilled(
        answer.prompt_tokens, answer.cached_tokens, handles + [None] * missing, fallback=fallback, replica=state.name
    )


def _fall_back(backends: Backends, prompt: Prompt, choices: int, reason: str, why: str) -> Prefilled:
    backends.fall_back(prompt.request_id, reason, why, choices)
    return Prefilled(len(prompt.token_ids), 0, [None] * choices, fallback=reason)
