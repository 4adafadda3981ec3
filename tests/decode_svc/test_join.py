"""Prompts the engine takes in at one iteration join their lane in one decoder bounded replay forward, and decode
exactly as each does alone (greedy, and seeded sampling): several arrivals, ragged prompt lengths (shorter and longer
than the window), both lanes, a batch already running. A prompt that cannot be restored fails alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from driven import GREEDY, Driven, driven_engine

from decode_svc.sequence import Failure, Sampling, Sequence, State
from model import PrefillOutput, Transformer, encode_prefill

SEEDED = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=5)


@dataclass(frozen=True)
class Request:
    length: int
    sampling: Sampling = GREEDY
    speculate: bool = True


# W = 8 on tiny: two prompts of one length below it (one replay forward), one of another, three longer ones.
REQUESTS = [
    Request(3),
    Request(21, SEEDED),
    Request(3, SEEDED),
    Request(6, speculate=False),
    Request(40),
    Request(8, SEEDED, speculate=False),
]
LIMIT = 5  # above what one iteration can emit (the join's token, two drafts, the bonus): no arrival ends in it


def generate(driven: Driven, handoff: PrefillOutput, ids: list[int], r: Request | None = None) -> Sequence:
    r = r or Request(len(ids))
    return driven.submit(ids, LIMIT, handoff=handoff, sampling=r.sampling, speculate=r.speculate)


def joins(driven: Driven, lane: str) -> tuple[float, float]:
    """(joins, prompts joined) in a lane so far."""
    return tuple(driven.metric(f"join_size_{x}", {"lane": lane}) for x in ("count", "sum"))


@pytest.mark.parametrize("speculation", [True, False])
def test_arrivals_of_one_iteration_join_in_one_forward_per_lane_and_decode_as_each_alone(
    models: tuple[Transformer, Transformer], prompt: Callable[[int], list[int]], speculation: bool
) -> None:
    encoder, model = models
    assert min(r.length for r in REQUESTS) < model.args.sliding_window < max(r.length for r in REQUESTS)
    ids = [prompt(r.length) for r in REQUESTS]
    handoffs = [encode_prefill(encoder, x) for x in ids]
    settings = {"max_batch": 8, "max_queue": 8, "speculation": speculation, "max_draft": 2, "draft_policy": "full"}

    alone = []
    for handoff, x, r in zip(handoffs, ids, REQUESTS, strict=True):
        with driven_engine(model, **settings) as driven:
            seq = generate(driven, handoff, x, r)
            driven.run_to_end(seq)
            alone.append(seq.output)

    with driven_engine(model, **settings) as driven:
        running = driven.submit(prompt(11), limit=100)  # a batch already decoding when the others arrive
        driven.engine.iterate()
        arrivals = [generate(driven, h, x, r) for h, x, r in zip(handoffs, ids, REQUESTS, strict=True)]
        lanes = {"speculative": 4, "plain": 2} if speculation else {"plain": 6}

        before, tokens = {lane: joins(driven, lane) for lane in lanes}, len(running.output)
        driven.engine.iterate()
        assert all(seq.state is State.RUNNING and seq.output for seq in arrivals)
        assert len(running.output) > tokens  # the joins did not cost it its step
        for lane, n in lanes.items():  # one join of all the lane's arrivals
            assert joins(driven, lane) == (before[lane][0] + 1, before[lane][1] + n)
        assert driven.metric("admit_wait_seconds_count") == 1 + len(REQUESTS)
        driven.run_to_end(*arrivals)
        assert [seq.output for seq in arrivals] == alone


def test_a_prompt_that_cannot_be_restored_fails_alone(
    models: tuple[Transformer, Transformer], prompt: Callable[[int], list[int]]
) -> None:
    encoder, model = models
    ids = [prompt(n) for n in (20, 37, 21)]
    handoffs = [encode_prefill(encoder, x) for x in ids]
    with driven_engine(model, max_batch=4) as driven:
        alone = []
        for handoff, x in zip(handoffs, ids, strict=True):
            seq = generate(driven, handoff, x)
            driven.run_to_end(seq)
            alone.append(seq.output)
        broken = handoffs[1]
        unfit = PrefillOutput(broken.blocks[1:], broken.encoder_state, 0, 0, False, False)  # block 0 is missing
        arrivals = [generate(driven, h, x) for h, x in zip([handoffs[0], unfit, handoffs[2]], ids, strict=True)]
        driven.engine.iterate()
        assert driven.metric("join_size_sum", {"lane": "plain"}) == 3 + 2  # alone, then the batch's two good ones
        assert arrivals[1].state is State.FAILED
        (failure,) = driven.received(arrivals[1])
        assert isinstance(failure, Failure)
        assert "decode could not restore the prompt" in failure.message
        driven.run_to_end(arrivals[0], arrivals[2])
        assert [arrivals[0].output, arrivals[2].output] == [alone[0], alone[2]]
        assert driven.engine.running == 0
