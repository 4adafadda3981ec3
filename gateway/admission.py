"""Admission control: at most `max_inflight` requests generate at once, up to `max_queue` more wait in FIFO order,
and the rest are refused at once with 429 and a Retry-After estimated from recent request durations.

A slot is a `Ticket`, released exactly once when the request's response ends (a streamed response holds it
until its last event). A waiter that gives up (timeout, client gone) just as a slot reaches it passes it on.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

from gateway.errors import GatewayError, Kind

MAX_RETRY_AFTER_S = 60
EWMA_WEIGHT = 0.2  # of the newest request duration in the running mean


class Ticket:
    """One admitted request's slot."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._started = admission.clock()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission.finished(self._admission.clock() - self._started)


class Admission:
    """A bounded FIFO of requests in front of `max_inflight` slots. `on_change(queued, inflight)` follows it."""

    def __init__(
        self,
        max_inflight: int,
        max_queue: int,
        queue_timeout_s: float,
        on_change: Callable[[int, int], None] = lambda queued, inflight: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.draining = False
        self._free = max_inflight
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._mean_duration_s = 1.0
        self._on_change = on_change
        self.clock = clock

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def inflight(self) -> int:
        return self.max_inflight - self._free

    def retry_after_s(self) -> int:
        """Seconds until the queue in front of a new request has likely drained."""
        wait = self._mean_duration_s * (self.queued + 1) / self.max_inflight
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))

    async def enter(self) -> Ticket:
        """A slot now, or after waiting in line; GatewayError(OVERLOADED) when the line is full or too slow."""
        if self.draining:
            raise GatewayError(Kind.UNAVAILABLE, "The gateway is shutting down; retry on another replica.")
        if self._free > 0 and not self._waiters:
            self._free -= 1
            self._changed()
            return Ticket(self)
        if len(self._waiters) >= self.max_queue:
            raise self._overloaded(f"all {self.max_inflight} slots are busy and {self.max_queue} requests wait")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._changed()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await asyncio.shield(waiter)
        except BaseException as exc:
            if waiter.done():
                self._hand_on()  # the slot arrived as we gave up
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            self._changed()
            if isinstance(exc, TimeoutError):
                raise self._overloaded(f"no slot became free within {self.queue_timeout_s:g} s") from None
            raise
        return Ticket(self)

    def finished(self, duration_s: float) -> None:
        """A ticket was released after `duration_s`: its slot goes to the next waiter."""
        self._mean_duration_s += EWMA_WEIGHT * (duration_s - self._mean_duration_s)
        self._hand_on()
        self._changed()

    def _hand_on(self) -> None:
        """Give a freed slot to the first live waiter, or back to the pool."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def _overloaded(self, why: str) -> GatewayError:
        retry = self.retry_after_s()
        message = f"The server is overloaded ({why}); retry in {retry} s."
        return GatewayError(Kind.OVERLOADED, message, retry_after_s=retry)

    def _changed(self) -> None:
        self._on_change(self.queued, self.inflight)
