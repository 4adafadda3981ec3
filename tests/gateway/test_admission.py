"""Admission control: bounded slots, a bounded FIFO queue, 429 with Retry-After, hand-over on give-up."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission
from gateway.errors import GatewayError, Kind


def run(coro):
    return asyncio.run(coro)


def test_slots_then_queue_then_429_with_retry_after() -> None:
    async def scenario() -> None:
        changes: list[tuple[int, int]] = []
        admission = Admission(2, 1, 30.0, lambda q, i: changes.append((q, i)))
        first, second = await admission.enter(), await admission.enter()
        waiting = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        assert (admission.queued, admission.inflight) == (1, 2)
        with pytest.raises(GatewayError) as refused:
            await admission.enter()
        assert refused.value.kind is Kind.OVERLOADED
        assert refused.value.retry_after_s is not None
        assert refused.value.retry_after_s >= 1
        assert refused.value.headers() == {"retry-after": str(refused.value.retry_after_s)}
        first.release()
        third = await waiting  # the freed slot went to the waiter, not back to the pool
        assert (admission.queued, admission.inflight) == (0, 2)
        first.release()  # a second release of the same ticket changes nothing
        assert admission.inflight == 2
        second.release()
        third.release()
        assert (admission.queued, admission.inflight) == (0, 0)
        assert changes[-1] == (0, 0)

    run(scenario())


def test_fifo_order() -> None:
    async def scenario() -> None:
        admission = Admission(1, 10, 30.0)
        held = await admission.enter()
        order: list[int] = []

        async def wait(i: int) -> None:
            ticket = await admission.enter()
            order.append(i)
            ticket.release()

        tasks = [asyncio.create_task(wait(i)) for i in range(5)]
        await asyncio.sleep(0)
        held.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]

    run(scenario())


def test_queue_timeout_is_a_429_and_leaves_no_waiter() -> None:
    async def scenario() -> None:
        admission = Admission(1, 5, 0.05)
        held = await admission.enter()
        with pytest.raises(GatewayError) as refused:
            await admission.enter()
        assert refused.value.kind is Kind.OVERLOADED
        assert "within 0.05 s" in refused.value.message
        assert admission.queued == 0
        held.release()
        assert admission.inflight == 0

    run(scenario())


def test_a_cancelled_waiter_gives_up_its_place_and_a_slot_it_was_handed() -> None:
    async def scenario() -> None:
        admission = Admission(1, 5, 30.0)
        held = await admission.enter()
        gone = asyncio.create_task(admission.enter())
        after = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        assert admission.queued == 2
        held.release()  # the slot is handed to `gone` ...
        gone.cancel()  # ... which is cancelled before it runs: the slot must reach `after`
        with pytest.raises(asyncio.CancelledError):
            await gone
        ticket = await asyncio.wait_for(after, 1)
        assert (admission.queued, admission.inflight) == (0, 1)
        ticket.release()
        assert admission.inflight == 0

    run(scenario())


def test_draining_refuses_with_503() -> None:
    async def scenario() -> None:
        admission = Admission(4, 4, 30.0)
        admission.draining = True
        with pytest.raises(GatewayError) as refused:
            await admission.enter()
        assert refused.value.kind is Kind.UNAVAILABLE
        assert refused.value.kind.status == 503

    run(scenario())


def test_retry_after_follows_the_queue_and_recent_durations() -> None:
    async def scenario() -> None:
        now = [0.0]
        admission = Admission(2, 100, 30.0, clock=lambda: now[0])
        assert admission.retry_after_s() == 1
        for _ in range(40):  # requests have been taking 8 s
            ticket = await admission.enter()
            now[0] += 8.0
            ticket.release()
        assert admission.retry_after_s() == 4  # 8 s for the one in front / 2 slots
        held = [await admission.enter(), await admission.enter()]
        waiters = [asyncio.create_task(admission.enter()) for _ in range(5)]
        await asyncio.sleep(0)
        assert admission.retry_after_s() == 24  # 8 s x (5 waiting + 1) / 2 slots
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for ticket in held:
            ticket.release()
        assert (admission.queued, admission.inflight) == (0, 0)

    run(scenario())
