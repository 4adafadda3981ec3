"""A job's response: one prefill for all its choices, then one generation per choice, their decode messages turned
into the API's events by the recipe's stream processor (detokenise → parse → per-API events), the choices merged in
arrival order.

A stop sequence ends a choice inside the parser: its decode stream is stopped (cancel + Abort) at once. A decode
failure mid-stream ends the response with the API's error event (streaming) or a 503 (complete response). A
response closed before its end (client gone) stops every generation still running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec

from gateway.backends import Backends, Prompt
from gateway.errors import GatewayError, Kind
from gateway.generation import Generation
from gateway.job import Job, Model
from gateway.prefill import Prefilled, prefill
from mesh.logging import get_logger
from proto.decode.v1 import decode_pb2
from recipe import Event, MultiChoiceProcessor, StreamProcessor, Tokenizer, Usage

FINISH_REASONS = {decode_pb2.FINISH_REASON_STOP: "stop", decode_pb2.FINISH_REASON_LENGTH: "length"}

log = get_logger("gateway")


def decode_request(job: Job, choice: int) -> decode_pb2.GenerateRequest:
    """The decode settings of one choice (its own seed, so seeded choices differ from each other)."""
    s = job.request.sampling
    sampling = decode_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0)
    if s.seed is not None:
        sampling.seed = s.seed + choice
    return decode_pb2.GenerateRequest(
        sampling=sampling,
        stop_token_ids=job.request.stop_token_ids,
        max_tokens=job.max_tokens,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs if s.logprobs else 0,
        constraint=job.constraint,
    )


class Choices:
    """The stream processors of a response, one per choice, behind one interface."""

    def __init__(self, job: Job, tokenizer: Tokenizer) -> None:
        request = job.request
        self._multi = None
        if request.sampling.n > 1:
            self._multi = MultiChoiceProcessor(request, tokenizer=tokenizer)
            self.each: Sequence[StreamProcessor] = self._multi.choices
        else:
            self.each = [StreamProcessor(request, tokenizer=tokenizer)]

    def start(self, prompt_tokens: int, cached_tokens: int, fingerprint: str) -> list[Event]:
        return (self._multi or self.each[0]).start(prompt_tokens, cached_tokens, fingerprint)

    def push(self, choice: int, message: decode_pb2.GenerateResponse) -> list[Event]:
        logprobs = [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in message.logprobs] or None
        if self._multi is not None:
            return self._multi.push_tokens(choice, message.token_ids, logprobs)
        return self.each[0].push_tokens(message.token_ids, logprobs)

    def finish(self, choice: int, reason: str, usage: Usage) -> list[Event]:
        if self._multi is not None:
            return self._multi.finish(choice, reason, usage)  # type: ignore[arg-type]
        return self.each[0].finish(reason, usage)  # type: ignore[arg-type]

    def fail(self, message: str) -> list[Event]:
        return (self._multi or self.each[0]).fail(message)

    @property
    def finished(self) -> bool:
        return all(p.finished for p in self.each)

    def response(self) -> dict:
        return (self._multi or self.each[0]).response()


class Reply:
    """The response to one job. `open()` (errors raise: nothing was sent yet), then `events()` or `body()`,
    then `close()` (always: it stops what still runs and records the request). `keep`, when given, is awaited once
    every choice has finished, before the finishing events are yielded: what it keeps is there by the time the
    client has the response."""

    def __init__(
        self,
        job: Job,
        backends: Backends,
        tokenizer: Tokenizer,
        model: Model,
        arrived: float,
        keep: Callable[[Reply], Awaitable[None]] | None = None,
    ) -> None:
        self.job = job
        self.backends = backends
        self.model = model
        self.arrived = arrived
        n = job.request.sampling.n
        self.prompt = Prompt(job.request_id, job.token_ids, job.salt, job.affinity)
        self.prefilled: Prefilled | None = None
        self.generations = [Generation(backends, self._choice_prompt(i, n), decode_request(job, i)) for i in range(n)]
        self.choices = Choices(job, tokenizer)
        self.failure: GatewayError | None = None
        self.keep = keep
        self.output_ids: list[int] = []  # the first choice's generated tokens
        self.first_token_at: float | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False

    async def open(self) -> None:
        """Prefill the prompt once, then start decoding every choice from its own handoff record, up to each one's
        first message."""
        try:
            self.prefilled = await prefill(self.backends, self.prompt, len(self.generations))
            await self._open_decodes(self.prefilled)
        except GatewayError as failure:
            self.failure = failure
            raise

    async def events(self) -> AsyncIterator[Event]:
        """The response's events, in order (when not streaming: none; `body()` has the response). A failure ends
        them with the API's error event(s)."""
        first = self.generations[0]
        for event in self.choices.start(first.prompt_tokens, first.cached_tokens, self.model.system_fingerprint):
            yield event
        try:
            async for events in self._translated():
                for event in events:
                    yield event
        except GatewayError as failure:
            self.failure = failure
        except Exception:  # a bug: the client still gets its API's error event, the log the traceback
            log.exception("reply_failed", request_id=self.job.request_id)
            self.failure = GatewayError(Kind.INTERNAL, "The gateway failed mid-response; the error is logged.")
        if self.failure is not None:
            self._stop_all("choice_failed")
            for event in self.choices.fail(self.failure.message):
                yield event

    async def _translated(self) -> AsyncIterator[list[Event]]:
        """The events of each decode message as it arrives; GatewayError when a generation fails."""
        last_message_at = [self.arrived] * len(self.generations)
        metrics = self.backends.metrics
        async for choice, message in self._merged():
            if isinstance(message, GatewayError):
                raise message
            now = time.monotonic()
            if message.token_ids:
                metrics.decode_messages.inc()
                if self.first_token_at is None:
                    self.first_token_at = now
                    metrics.ttft.labels(self.job.api).observe(now - self.arrived)
                else:
                    metrics.itl.labels(self.job.api).observe(now - last_message_at[choice])
                last_message_at[choice] = now
            if choice == 0:
                self.output_ids += message.token_ids
            events = self.choices.push(choice, message)
            if message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED:
                events += self._finish(choice, message)
            elif self.choices.each[choice].finished:  # a stop sequence ended it inside the parser
                self._stop(choice, "stop_sequence")
            if self.choices.finished and self.keep is not None:
                await self.keep(self)
            yield events
            if self.choices.finished:
                return

    async def body(self) -> dict:
        """The complete response; GatewayError (503) if a generation failed."""
        async for _ in self.events():
            pass
        if self.failure is not None:
            raise GatewayError(Kind.UNAVAILABLE, self.failure.message)
        return self.choices.response()

    def close(self) -> str:
        """Stop what still runs, record the request once; returns its outcome (ok, error or cancelled)."""
        if self.failure is not None:
            outcome = "error"
        elif self.choices.finished:
            outcome = "ok"
        else:
            outcome = "cancelled"
        if self._closed:
            return outcome
        self._closed = True
        self._stop_all("client_disconnect")
        self._record(outcome)
        return outcome

    # -- internals -----------------------------------------------------------------------------------------

    def _choice_prompt(self, choice: int, n: int) -> Prompt:
        """Each choice decodes under a request id of its own (decode refuses a duplicate, and Abort names one)."""
        if n == 1:
            return self.prompt
        return msgspec.structs.replace(self.prompt, request_id=f"{self.prompt.request_id}-{choice}")

    async def _open_decodes(self, prefilled: Prefilled) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for choice, generation in enumerate(self.generations):
                    group.create_task(generation.open(prefilled, choice))
        except BaseExceptionGroup as group_error:
            first = next((e for e in group_error.exceptions if isinstance(e, GatewayError)), None)
            if first is None:
                raise
            raise first from None

    def _finish(self, choice: int, message: decode_pb2.GenerateResponse) -> list[Event]:
        u = message.usage
        metrics = self.backends.metrics
        metrics.draft_proposed.inc(u.draft_tokens_proposed)
        metrics.draft_accepted.inc(u.draft_tokens_accepted)
        generation = self.generations[choice]
        if u.bounded_replay and generation.fallback is not None:  # decode prefilled itself (else prefill counted it)
            metrics.bounded_replays.inc()
        reason = FINISH_REASONS.get(message.finish_reason)
        if reason is None:  # aborted by the replica itself (draining, out of memory)
            raise GatewayError(Kind.BACKEND_FAILED, "The decode replica aborted the generation.")
        prompt = u.prompt_tokens or generation.prompt_tokens
        return self.choices.finish(choice, reason, Usage(prompt, u.cached_tokens, u.completion_tokens))

    async def _merged(self) -> AsyncIterator[tuple[int, decode_pb2.GenerateResponse | GatewayError]]:
        """(choice, message) from every generation as they arrive; a broken stream yields its GatewayError."""
        if len(self.generations) == 1:
            try:
                async for message in self.generations[0].messages():
                    yield 0, message
            except GatewayError as error:
                yield 0, error
            return
        queue: asyncio.Queue[tuple[int, decode_pb2.GenerateResponse | GatewayError | None]] = asyncio.Queue()

        async def pump(choice: int, generation: Generation) -> None:
            try:
                async for message in generation.messages():
                    queue.put_nowait((choice, message))
            except GatewayError as error:
                queue.put_nowait((choice, error))
            queue.put_nowait((choice, None))

        self._pumps = [asyncio.get_running_loop().create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        running = len(self._pumps)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
            elif not self.choices.each[choice].finished:
                yield choice, item

    def _stop(self, choice: int, reason: str) -> None:
        self.generations[choice].stop(reason)
        if self._pumps:
            self._pumps[choice].cancel()

    def _stop_all(self, reason: str) -> None:
        for choice in range(len(self.generations)):
            self._stop(choice, reason)

    def _record(self, outcome: str) -> None:
        metrics, job = self.backends.metrics, self.job
        first = self.generations[0]
        duration = time.monotonic() - self.arrived
        metrics.requests.labels(job.api, outcome).inc()
        metrics.duration.labels(job.api).observe(duration)
        if outcome == "error" and self.failure is not None:
            metrics.errors.labels(self.failure.kind.label).inc()
        completion = sum(p.usage.completion_tokens for p in self.choices.each)
        if first.replica is not None:
            metrics.tokens(first.prompt_tokens, first.cached_tokens, completion)
        log.info(
            "request",
            request_id=job.request_id,
            api=job.api,
            stream=job.request.stream,
            outcome=outcome,
            prompt_tokens=first.prompt_tokens,
            cached_tokens=first.cached_tokens,
            completion_tokens=completion,
            ttft_s=None if self.first_token_at is None else round(self.first_token_at - self.arrived, 4),
            duration_s=round(duration, 4),
            prefill=None if self.prefilled is None else self.prefilled.replica,
            decode=[g.replica.name if g.replica else None for g in self.generations],
            fallback=first.fallback,
            error=None if self.failure is None else self.failure.message,
        )
