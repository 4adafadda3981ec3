"""Admission control: at most `max_inflight` requests hold a slot at once, up to `max_queue` more wait in FIFO order,
and a request is refused at once with 429 and a Retry-After when the queue is full, or when it would wait longer
than `max_wait_s` for service. A waiter that gets no slot within `queue_timeout_s` is refused too.

The expected wait comes from the measured service rate. The mesh serves C requests at once (the decode replicas'
batch slots as they report them, at most `max_inflight`), and a request holds its place for S seconds on average
(measured: from its first decode message to its end, a running mean), so a busy mesh finishes C / S requests a
second. A new request with n requests in the mesh before it waits (n + 1 − C) · S / C when that is positive: those
in line here, plus those in service — this gateway's slots in use, or what the decode replicas report running and
queued when that is more (other gateways share them). Slots free here do not mean the mesh is free: requests
admitted beyond what decode can batch wait inside decode, so they count. Until S is measured nothing is refused
for its wait.

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
SERVICE_WEIGHT = 0.2  # of the newest service time in the running mean
MIN_SERVED = 4  # service times measured before the wait is estimated from them


class Ticket:
    """One admitted request's slot."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._started_at: float | None = None
        self._released = False

    def started(self) -> None:
        """The request's first decode message arrived: its service time runs from now."""
        if self._started_at is None:
            self._started_at = self._admission.clock()

    def release(self) -> None:
        if not self._released:
            self._released = True
            served = None if self._started_at is None else self._admission.clock() - self._started_at
            self._admission.finished(served)


class Admission:
    """A bounded FIFO of requests in front of `max_inflight` slots. `on_change(queued, inflight)` follows it;
    `on_refused(reason)` hears of every refusal: queue_full, queue_wait, queue_timeout or draining."""

    def __init__(
        self,
        max_inflight: int,
        max_queue: int,
        queue_timeout_s: float,
        max_wait_s: float = 0.0,
        on_change: Callable[[int, int], None] = lambda queued, inflight: None,
        on_refused: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.max_wait_s = max_wait_s
        self.draining = False
        self._free = max_inflight
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._service_s = 0.0
        self._served = 0
        self._capacity = max_inflight
        self._mesh_load = 0.0
        self._on_change = on_change
        self._on_refused = on_refused
        self.clock = clock

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def inflight(self) -> int:
        return self.max_inflight - self._free

    def observe(self, capacity: int, load: float) -> None:
        """What the decode replicas report: their batch slots in all and the sequences they hold, running and queued
        (a capacity of 0, no replica answering, leaves this gateway's slots as the measure)."""
        self._capacity = min(self.max_inflight, capacity) if capacity > 0 else self.max_inflight
        self._mesh_load = load

    def service_rate(self) -> float | None:
        """Requests a second a busy mesh finishes (None until enough service times are measured)."""
        if self._served < MIN_SERVED:
            return None
        return self._capacity / max(self._service_s, 1e-3)

    def expected_wait_s(self) -> float:
        """Seconds a request arriving now would wait for service (0 while the service rate is unknown)."""
        rate = self.service_rate()
        if rate is None:
            return 0.0
        before = self.queued + max(self.inflight, self._mesh_load)
        return max(0.0, before + 1 - self._capacity) / rate

    def retry_after_s(self) -> int:
        """Seconds until a new request would likely be served at once."""
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.expected_wait_s())))

    async def enter(self) -> Ticket:
        """A slot now, or after waiting in line; GatewayError(OVERLOADED) when the line is full or too slow."""
        if self.draining:
            self._on_refused("draining")
            raise GatewayError(Kind.UNAVAILABLE, "The gateway is shutting down; retry on another replica.")
        wait = self.expected_wait_s()
        if self.max_wait_s and wait > self.max_wait_s:
            why = f"a new request would wait about {wait:.1f} s for service; the bound is {self.max_wait_s:g} s"
            raise self._overloaded("queue_wait", why)
        if self._free > 0 and not self._waiters:
            self._free -= 1
            self._changed()
            return Ticket(self)
        if len(self._waiters) >= self.max_queue:
            why = f"all {self.max_inflight} slots are busy and {self.max_queue} requests wait"
            raise self._overloaded("queue_full", why)
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
                why = f"no slot became free within {self.queue_timeout_s:g} s"
                raise self._overloaded("queue_timeout", why) from None
            raise
        return Ticket(self)

    def finished(self, served_s: float | None) -> None:
        """A ticket was released, `served_s` after its first decode message (None: it never had one); its slot goes
        to the next waiter."""
        if served_s is not None:
            weight = SERVICE_WEIGHT if self._served else 1.0
            self._service_s += weight * (served_s - self._service_s)
            self._served += 1
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

    def _overloaded(self, reason: str, why: str) -> GatewayError:
        self._on_refused(reason)
        retry = self.retry_after_s()
        message = f"The server is overloaded ({why}); retry in {retry} s."
        return GatewayError(Kind.OVERLOADED, message, retry_after_s=retry)

    def _changed(self) -> None:
        self._on_change(self.queued, self.inflight)
