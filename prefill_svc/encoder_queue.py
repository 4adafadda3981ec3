"""The encoder thread and the prompts waiting for it.

One thread runs torch (the encoder saturates the device by itself; several would only fight over it). Prompts wait in
arrival order; `depth` is the HPA's scaling signal. A prompt whose caller went away before its turn is dropped
without running, whether its cancellation reached the executor first or the thread reached the prompt first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prefill_svc.metrics import PrefillMetrics

T = TypeVar("T")


class _Job:
    __slots__ = ("abandoned", "started")

    def __init__(self) -> None:
        self.started = False
        self.abandoned = False


class EncoderQueue:
    def __init__(self, max_waiting: int, metrics: PrefillMetrics) -> None:
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self._lock = threading.Lock()
        self.depth = 0  # waiting for the thread
        self.running = 0
        self.pending_tokens = 0  # tokens of the waiting prompts

    def full(self) -> bool:
        return self.depth >= self.max_waiting

    async def run(self, fn: Callable[[], T], tokens: int) -> T:
        """Run `fn` on the encoder thread after the prompts ahead of it."""
        job = _Job()
        self._enter(tokens)

        def work() -> T:
            with self._lock:
                if job.abandoned:  # its caller is gone: nobody awaits this
                    raise asyncio.CancelledError
                job.started = True
                self._start(tokens)
            try:
                return fn()
            finally:
                with self._lock:
                    self.running -= 1
                    self.metrics.running.set(self.running)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            with self._lock:
                if not job.started:
                    job.abandoned = True
                    self._leave(tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _enter(self, tokens: int) -> None:
        with self._lock:
            self.depth += 1
            self.pending_tokens += tokens
            self.metrics.queue_depth.set(self.depth)

    def _leave(self, tokens: int) -> None:
        self.depth -= 1
        self.pending_tokens -= tokens
        self.metrics.queue_depth.set(self.depth)

    def _start(self, tokens: int) -> None:
        self._leave(tokens)
        self.running += 1
        self.metrics.running.set(self.running)
