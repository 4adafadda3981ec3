"""Admission control: bounded slots, a bounded FIFO queue, 429 with Retry-After when the queue is full or a new
request's expected wait (from the measured service rate) passes its bound, hand-over on give-up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest
from decode_replicas import Decodes, wait_until
from gateway_helpers import InProcessGateway, refusing_address

from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, Kind

MODEL = "DeepSeek-V4.1-Flash"


def run(coro):
    return asyncio.run(coro)


def test_slots_then_queue_then_429_with_retry_after() -> None:
    async def scenario() -> None:
        changes: list[tuple[int, int]] = []
        admission = Admission(2, 1, 30.0, on_change=lambda q, i: changes.append((q, i)))
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


async def serve(admission: Admission, now: list[float], service_s: float, count: int = 4) -> None:
    """`count` requests, one after another, each served for `service_s` after its first decode message."""
    for _ in range(count):
        ticket = await admission.enter()
        now[0] += 1.0  # prefill: not service time
        ticket.started()
        now[0] += service_s
        ticket.release()


def test_retry_after_is_the_expected_wait_from_the_measured_service_rate() -> None:
    async def scenario() -> None:
        now = [0.0]
        admission = Admission(2, 100, 30.0, clock=lambda: now[0])
        assert admission.service_rate() is None  # nothing measured yet
        assert admission.retry_after_s() == 1
        await serve(admission, now, 8.0)
        assert admission.service_rate() == 2 / 8.0  # 2 slots, 8 s each
        held = [await admission.enter(), await admission.enter()]
        assert admission.expected_wait_s() == 4.0  # one slot frees every 4 s
        waiters = [asyncio.create_task(admission.enter()) for _ in range(5)]
        await asyncio.sleep(0)
        assert admission.retry_after_s() == 24  # behind 5 waiting and 2 in service: 6 departures, 4 s apart
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for ticket in held:
            ticket.release()
        assert (admission.queued, admission.inflight) == (0, 0)

    run(scenario())


def test_a_request_expected_to_wait_too_long_is_refused_at_once() -> None:
    async def scenario() -> None:
        now = [0.0]
        refusals: list[str] = []
        admission = Admission(2, 100, 30.0, max_wait_s=10.0, on_refused=refusals.append, clock=lambda: now[0])
        await serve(admission, now, 8.0)
        held = [await admission.enter(), await admission.enter()]
        waiting = [asyncio.create_task(admission.enter()) for _ in range(2)]  # expected 4 s, then 8 s
        await asyncio.sleep(0)
        assert admission.queued == 2
        with pytest.raises(GatewayError) as refused:
            await admission.enter()  # the third in line would wait 12 s
        assert refused.value.kind is Kind.OVERLOADED
        assert "wait about 12.0 s for service; the bound is 10 s" in refused.value.message
        assert refused.value.retry_after_s == 12
        assert refusals == ["queue_wait"]
        assert admission.queued == 2  # refused at once, never queued
        held[0].release()  # a slot frees: the first waiter is served, the line is one shorter
        await waiting[0]
        assert admission.expected_wait_s() == 8.0
        for task in waiting[1:]:
            task.cancel()
        await asyncio.gather(*waiting[1:], return_exceptions=True)

    run(scenario())


def test_the_decode_replicas_capacity_and_load_set_the_wait() -> None:
    """Slots free in this gateway do not make the mesh free: with one decode batch slot busy with three sequences
    (other gateways' among them), a request waits for three services though nothing is in line here."""

    async def scenario() -> None:
        now = [0.0]
        refusals: list[str] = []
        admission = Admission(64, 100, 30.0, max_wait_s=10.0, on_refused=refusals.append, clock=lambda: now[0])
        await serve(admission, now, 4.0)
        admission.observe(capacity=1, load=3.0)
        assert admission.expected_wait_s() == 12.0
        with pytest.raises(GatewayError):
            await admission.enter()
        assert refusals == ["queue_wait"]
        admission.observe(capacity=8, load=3.0)  # more replicas answer: room in the batch
        assert admission.expected_wait_s() == 0.0
        (await admission.enter()).release()
        admission.observe(capacity=0, load=0.0)  # no replica answers: this gateway's own 64 slots are the measure
        assert admission.service_rate() == 64 / 4.0

    run(scenario())


def test_nothing_is_refused_for_its_wait_before_service_is_measured() -> None:
    """Until four requests were served (first decode message to end), the wait is unknown: only the queue bounds."""

    async def scenario() -> None:
        now = [0.0]
        admission = Admission(1, 100, 30.0, max_wait_s=0.001, clock=lambda: now[0])
        for _ in range(10):  # failed before their first decode message: no service time
            ticket = await admission.enter()
            now[0] += 5.0
            ticket.release()
        await serve(admission, now, 2.0, count=3)
        held = await admission.enter()
        waiter = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        assert admission.queued == 1  # queued, not refused
        held.started()
        now[0] += 2.0
        held.release()  # the fourth service time
        ticket = await waiter
        assert admission.service_rate() == 1 / 2.0
        with pytest.raises(GatewayError):
            await admission.enter()  # now measured: 2 s > 0.001 s
        ticket.release()

    run(scenario())


@pytest.fixture(scope="module")
def one_slot_decode() -> Iterator[Decodes]:
    """One real decode replica (the tiny model) that decodes one sequence at a time."""
    replica = Decodes(1, max_batch=1)
    yield replica
    replica.stop()


def test_a_gateway_refuses_by_expected_wait_with_429_and_retry_after(one_slot_decode: Decodes) -> None:
    """Through the gateway, on a real decode replica with one batch slot: once services are measured, a request
    arriving while that slot is busy would wait about one service, over the bound, and is refused at once in the
    API's shape; the refusal is counted by its reason."""
    with ExitStack() as held:
        cfg = GatewayConfig(port=0, grpc_port=0, prefill=[refusing_address(held)], decode=one_slot_decode.addresses,
                            load_interval_s=0.1, max_queue_wait_s=0.001)  # fmt: skip
        gateway = InProcessGateway(cfg)
        held.callback(gateway.stop)
        wait_until(lambda: httpx.get(gateway.base_url + "/health").json()["ready"], "the gateway to be ready")
        client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)
        request = {"model": MODEL, "extra_body": {"thinking": {"type": "disabled"}}, "temperature": 0}
        for _ in range(4):  # four services measured
            client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2, **request)
        assert refusals(gateway) == 0
        # The replicas' load is polled: wait until the mesh is seen idle, so only the stream below keeps it busy.
        wait_until(lambda: expected_wait_s(gateway) == 0.0, "the gateway to see the mesh idle")
        # Greedy on the seeded tiny model: this answer runs to its budget, so the slot stays busy while it streams.
        with client.chat.completions.create(
            messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=1000, stream=True, **request
        ) as stream:
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(
                    messages=[{"role": "user", "content": "me too"}], max_tokens=2, **request
                )
        assert "for service; the bound is 0.001 s" in refused.value.message
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refusals(gateway) == 1


def expected_wait_s(gateway: InProcessGateway) -> float | None:
    return gateway.server.registry.get_sample_value("v41mesh_gateway_expected_queue_wait_seconds")


def refusals(gateway: InProcessGateway) -> float:
    value = gateway.server.registry.get_sample_value(
        "v41mesh_gateway_admission_refusals_total", {"reason": "queue_wait"}
    )
    return value or 0.0
