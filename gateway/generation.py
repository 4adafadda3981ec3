"""One choice's generation: a decode stream from its handoff record of the request's prefill (gateway/prefill.py),
with every failure handled where it happens.

    ─ before the first message: down, overloaded or handoff lost → the next replica, with the prompt's token ids
    ─ after it: the stream ends with the API's error

Every call has a deadline: the whole decode stream `request_timeout_s`, and each decode message must come within
`stall_timeout_s` of the previous one, so a frozen replica cannot hang a client. `stop()` cancels the decode stream
and sends Abort, so the replica frees the sequence at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.backends import DOWN, Backends, Prompt, describe
from gateway.errors import GatewayError, Kind
from gateway.prefill import Prefilled
from gateway.replicas import ReplicaState
from mesh.logging import get_logger
from proto.decode.v1 import decode_pb2

ABORT_TIMEOUT_S = 2.0

log = get_logger("gateway")


class Generation:
    """Decode for one choice. `open()` runs until the first decode message; `messages()` yields the decode stream
    (that first message included) and raises GatewayError(BACKEND_FAILED) if it breaks."""

    def __init__(self, backends: Backends, prompt: Prompt, request: decode_pb2.GenerateRequest) -> None:
        self.backends = backends
        self.prompt = prompt
        self.request = request  # sampling, stop ids, budget; the prompt and ids are set per attempt
        self.prompt_tokens = len(prompt.token_ids)
        self.cached_tokens = 0
        self.fallback: str | None = None  # why decode prefilled the prompt itself
        self.replica: ReplicaState | None = None
        self._call: Any = None
        self._first: decode_pb2.GenerateResponse | None = None
        self._deadline = time.monotonic() + backends.settings.request_timeout_s

    async def open(self, prefilled: Prefilled, choice: int) -> None:
        """Start decoding from this choice's handoff record of `prefilled` (or the token ids, when it has none)."""
        handle = prefilled.handles[choice]
        self.prompt_tokens, self.cached_tokens = prefilled.prompt_tokens, prefilled.cached_tokens
        self.fallback = prefilled.fallback if handle is None else None
        self._first = await self._open_decode(handle)

    async def messages(self) -> AsyncIterator[decode_pb2.GenerateResponse]:
        assert self._first is not None, "open() first"
        message = self._first
        while True:
            final = message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED
            if final and self._call is not None:  # finished: nothing to stop any more, its write-back under way
                call, self._call = self._call, None
                if self.backends.settings.writeback_wait_s > 0:
                    closing = self.backends.spawn(_closed(call, self.backends.settings.writeback_wait_s))
                    self.backends.writebacks.track(self.prompt.affinity, closing)
            yield message
            if final or self._call is None:
                return
            message = await self._next()

    def stop(self, reason: str) -> None:
        """Cancel the decode stream and abort the sequence on its replica (idempotent; nothing once finished)."""
        call, self._call = self._call, None
        if call is None:  # finished, failed, or never started
            return
        call.cancel()
        self.backends.metrics.cancellations.labels(reason).inc()
        self._abort(self.replica, reason)

    # -- decode --------------------------------------------------------------------------------------------

    async def _open_decode(self, handle: bytes | None) -> decode_pb2.GenerateResponse:
        """Start the decode stream and wait for its first message, moving to another replica on failure."""
        b, s = self.backends, self.backends.settings
        tried: set[str] = set()
        last, overloaded = "no decode replica is available", False
        for _ in range(1 + s.retries):
            state = b.router.pick("decode", self.prompt.affinity, tried)
            if state is None:
                break
            tried.add(state.name)
            remaining = max(0.0, self._deadline - time.monotonic())
            call = state.stub.Generate(self._decode_request(handle), timeout=remaining)
            # Without a handle decode prefills the whole prompt before its first message: give it prefill's time.
            first_within = s.stall_timeout_s if handle is not None else max(s.stall_timeout_s, s.prefill_timeout_s)
            try:
                first = await asyncio.wait_for(call.read(), first_within)
            except asyncio.CancelledError:  # the client left while we waited
                call.cancel()
                self._abort(state, "client_disconnect")
                raise
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise GatewayError(Kind.BAD_REQUEST, f"The request was refused: {exc.details()}") from None
                reason, last = code.name.lower(), f"decode replica {state.name}: {describe(exc)}"
                if code == grpc.StatusCode.NOT_FOUND and handle is not None:
                    # The handoff record expired or was consumed by a replica that died: not this replica's fault.
                    tried.discard(state.name)
                    handle, self.fallback = None, "handoff_lost"
                    b.fall_back(self.prompt.request_id, self.fallback, last)
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = True
                elif code in DOWN:
                    b.router.pools["decode"].failed(state)
            except TimeoutError:
                call.cancel()
                self._abort(state, "first_token_timeout")
                b.router.pools["decode"].failed(state)
                reason = "first_token_timeout"
                last = f"decode replica {state.name} sent nothing for {first_within:g} s"
            else:
                if first is not grpc.aio.EOF:
                    self._call, self.replica = call, state
                    b.router.served("decode", self.prompt.affinity, state)
                    return first
                reason, last = "no_message", f"decode replica {state.name} ended the stream without a message"
            b.metrics.retries.labels("decode", reason).inc()
            log.warning("decode_failed", request_id=self.prompt.request_id, error=last)
        if overloaded:
            raise GatewayError(Kind.OVERLOADED, f"Every decode replica is full ({last}).", retry_after_s=1)
        raise GatewayError(Kind.UNAVAILABLE, f"No decode replica could serve the request ({last}).")

    def _decode_request(self, handle: bytes | None) -> decode_pb2.GenerateRequest:
        request = decode_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.request_id = self.prompt.request_id
        request.cache_salt = self.prompt.salt
        request.prompt_tokens = self.prompt_tokens
        if handle is not None:
            request.handle = handle
            request.cached_tokens = self.cached_tokens
        else:
            request.token_ids.ids.extend(self.prompt.token_ids)
            request.cached_tokens = self.cached_tokens = 0
        return request

    async def _next(self) -> decode_pb2.GenerateResponse:
        """The next decode message; GatewayError(BACKEND_FAILED) when the stream breaks, stalls or ends early."""
        state, s = self.replica, self.backends.settings
        assert state is not None
        try:
            message = await asyncio.wait_for(self._call.read(), s.stall_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._call = None
            if exc.code() in DOWN:
                self.backends.router.pools["decode"].failed(state)
            raise GatewayError(
                Kind.BACKEND_FAILED, f"The decode replica {state.name} failed mid-generation ({describe(exc)})."
            ) from None
        except TimeoutError:
            self.stop("stalled")
            self.backends.router.pools["decode"].failed(state)
            raise GatewayError(
                Kind.BACKEND_FAILED, f"The decode replica {state.name} sent nothing for {s.stall_timeout_s:g} s."
            ) from None
        if message is grpc.aio.EOF:
            self._call = None
            raise GatewayError(Kind.BACKEND_FAILED, f"The decode replica {state.name} ended the stream early.")
        return message

    def _abort(self, state: ReplicaState | None, reason: str) -> None:
        if state is None:
            return
        request_id = self.prompt.request_id
        log.info("decode_abort", request_id=request_id, replica=state.name, reason=reason)
        self.backends.spawn(_send_abort(state, request_id))


async def _closed(call: Any, wait_s: float) -> None:
    """Until decode closes a finished stream, which it does once the sequence's write-back is done (at most wait_s)."""
    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
        await asyncio.wait_for(call.read(), wait_s)


async def _send_abort(state: ReplicaState, request_id: str) -> None:
    await state.stub.Abort(decode_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
