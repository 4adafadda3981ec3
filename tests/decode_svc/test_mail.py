"""A step's tokens reach the streams' event loop in one wake-up for the whole batch (`decode_svc.sequence.Mail`),
each stream's items in the order the engine put them; a failure goes out at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from driven import driven_engine

from decode_svc.sequence import Delta, End, Failure
from model import PrefillOutput, Transformer, encode_prefill


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the callbacks other threads hand it: each one writes to its self-pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> asyncio.Handle:
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_a_steps_tokens_reach_every_stream_in_one_wake_up_of_the_loop(
    models: tuple[Transformer, Transformer], prompt: Callable[[int], list[int]]
) -> None:
    encoder, model = models
    loop = CountingLoop()
    with driven_engine(model, loop=loop) as driven:
        prompts = [prompt(n) for n in (3, 5, 9, 12)]
        seqs = [driven.submit(ids, 3, handoff=encode_prefill(encoder, ids)) for ids in prompts]
        driven.engine.iterate()  # the four join (their first tokens, one wake-up) and take one step (another)
        assert loop.wakeups == 2
        first = [driven.received(seq) for seq in seqs]
        assert [[type(item) for item in items] for items in first] == [[Delta, Delta]] * 4

        driven.engine.iterate()  # the last step: each row's third token and its End, in one wake-up
        assert loop.wakeups == 3
        last = [driven.received(seq) for seq in seqs]
        assert [[type(item) for item in items] for items in last] == [[Delta, End]] * 4
        for seq, head, tail in zip(seqs, first, last, strict=True):
            assert [t for item in [*head, tail[0]] for t in item.tokens] == seq.output
            assert len(seq.output) == 3


def test_a_failure_reaches_its_stream_in_a_wake_up_of_its_own(
    models: tuple[Transformer, Transformer], prompt: Callable[[int], list[int]]
) -> None:
    encoder, model = models
    loop = CountingLoop()
    with driven_engine(model, loop=loop) as driven:
        ids = [prompt(n) for n in (4, 20)]
        running = driven.submit(ids[0], 8, handoff=encode_prefill(encoder, ids[0]))
        driven.engine.iterate()
        driven.received(running)
        broken = encode_prefill(encoder, ids[1])
        unfit = PrefillOutput(broken.blocks[1:], broken.encoder_state, 0, 0, False, False)  # block 0 is missing
        arrival = driven.submit(ids[1], 8, handoff=unfit)
        wakeups = loop.wakeups
        driven.engine.iterate()  # the arrival fails to join (its failure sent then), the running row steps
        assert loop.wakeups == wakeups + 2
        (failure,) = driven.received(arrival)
        assert isinstance(failure, Failure)
        assert "decode could not restore the prompt" in failure.message
        assert [type(item) for item in driven.received(running)] == [Delta]
