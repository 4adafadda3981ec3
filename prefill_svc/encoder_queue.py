"""The encoder thread and the prompts waiting for it.

One thread runs torch (the encoder saturates the device by itself; several would only fight over it). A prompt takes
its place in the queue when it is admitted — while its cached prefix is fetched — and leaves it when the thread
reaches it; `depth` is the HPA's scaling signal. A prompt whose caller went away before its turn is dropped without
running, whether its cancellation reached the executor first or the thread reached the prompt first.

One pass of the thread runs up to `width` prompts together: the first waiting and those submitted behind it (a rank
group of W prefills W prompts at once, one on each rank); each caller gets its own prompt's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from model_service.ranks import Outcome
from model_service.runtime import RequestError
from prefill_svc.metrics import PrefillMetrics

Runner = Callable[[list[Any]], list[Outcome]]  # jobs of one pass → each job's outcome, in order


class Place:
    """One prompt's place in the queue."""

    def __init__(self, queue: EncoderQueue, tokens: int) -> None:
        self.queue = queue
        self.tokens = tokens
        self.started = False
        self.abandoned = False
        self.job: Any = None
        self.outcome: Outcome | None = None  # set by the pass that ran it
        self.seconds = 0.0  # that pass's

    async def run(self, job: Any) -> Any:
        """Run `job` on the encoder thread after the prompts ahead of it → its value (or its error raised)."""
        queue = self.queue
        with queue.lock:
            self.job = job
            queue.submitted.append(self)

        def work() -> Any:
            with queue.lock:
                if self.abandoned:  # its caller is gone: nobody awaits this
                    raise asyncio.CancelledError
                batch = queue.take(self) if not self.started else []
            if batch:
                queue.run(batch)
            assert self.outcome is not None
            if self.outcome.error is not None:
                raise self.outcome.error
            return self.outcome.value

        return await asyncio.get_running_loop().run_in_executor(queue.executor, work)


class EncoderQueue:
    def __init__(self, max_waiting: int, metrics: PrefillMetrics, runner: Runner, width: int = 1) -> None:
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.runner, self.width = runner, width
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self.lock = threading.Lock()
        self.depth = 0  # admitted, not yet on the thread
        self.running = 0
        self.pending_tokens = 0  # tokens of the waiting prompts
        self.submitted: list[Place] = []  # waiting places whose job is known, in order

    @contextlib.contextmanager
    def place(self, tokens: int) -> Iterator[Place]:
        """A place in the queue for a prompt of `tokens` tokens; RESOURCE_EXHAUSTED when `max_waiting` wait already."""
        with self.lock:
            if self.depth >= self.max_waiting:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.depth} prompts are already waiting on this prefill replica",
                    "overloaded",
                )
            self._move(waiting=1, tokens=tokens)
        place = Place(self, tokens)
        try:
            yield place
        finally:
            with self.lock:
                if not place.started:
                    place.abandoned = True
                    self._move(waiting=-1, tokens=-tokens)
                    if place in self.submitted:
                        self.submitted.remove(place)

    def take(self, first: Place) -> list[Place]:
        """On the thread, under the lock: `first` and up to width − 1 places submitted behind it leave the queue for
        the encoder."""
        batch = [first, *[p for p in self.submitted if p is not first][: self.width - 1]]
        for place in batch:
            self.submitted.remove(place)
            place.started = True
            self._move(waiting=-1, tokens=-place.tokens)
        self.running += len(batch)
        self.metrics.running.set(self.running)
        self.metrics.pass_prompts.observe(len(batch))
        return batch

    def run(self, batch: list[Place]) -> None:
        """On the thread: one pass over the batch's jobs; each place gets its outcome."""
        started = time.monotonic()
        try:
            outcomes = self.runner([place.job for place in batch])
        except Exception as exc:  # the pass as a whole failed: every prompt of it did
            outcomes = [Outcome(error=exc)] * len(batch)
        finally:
            with self.lock:
                self.running -= len(batch)
                self.metrics.running.set(self.running)
        for place, outcome in zip(batch, outcomes, strict=True):
            place.outcome, place.seconds = outcome, time.monotonic() - started

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _move(self, waiting: int, tokens: int) -> None:
        self.depth += waiting
        self.pending_tokens += tokens
        self.metrics.queue_depth.set(self.depth)
