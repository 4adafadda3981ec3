"""The encoder thread and the prompts waiting for it.

One thread runs torch (the encoder saturates the device by itself; several would only fight over it). A prompt takes
its place in the queue when it is admitted — while its cached prefix is fetched — and leaves it when the thread
reaches it; `depth` is the HPA's scaling signal. A prompt whose caller went away before its turn is dropped without
running, whether its cancellation reached the executor first or the thread reached the prompt first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from model_service.runtime import RequestError
from prefill_svc.metrics import PrefillMetrics

T = TypeVar("T")


class Place:
    """One prompt's place in the queue."""

    def __init__(self, queue: EncoderQueue, tokens: int) -> None:
        self.queue = queue
        self.tokens = tokens
        self.started = False
        self.abandoned = False

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the encoder thread after the prompts ahead of it."""
        queue = self.queue

        def work() -> T:
            with queue.lock:
                if self.abandoned:  # its caller is gone: nobody awaits this
                    raise asyncio.CancelledError
                self.started = True
                queue.start(self.tokens)
            try:
                return fn()
            finally:
                queue.done()

        return await asyncio.get_running_loop().run_in_executor(queue.executor, work)


class EncoderQueue:
    def __init__(self, max_waiting: int, metrics: PrefillMetrics) -> None:
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self.lock = threading.Lock()
        self.depth = 0  # admitted, not yet on the thread
        self.running = 0
        self.pending_tokens = 0  # tokens of the waiting prompts

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

    def start(self, tokens: int) -> None:
        """On the thread, under the lock: a prompt leaves the queue for the encoder."""
        self._move(waiting=-1, tokens=-tokens)
        self.running += 1
        self.metrics.running.set(self.running)

    def done(self) -> None:
        with self.lock:
            self.running -= 1
            self.metrics.running.set(self.running)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _move(self, waiting: int, tokens: int) -> None:
        self.depth += waiting
        self.pending_tokens += tokens
        self.metrics.queue_depth.set(self.depth)
