"""The previous turn's write-back: a conversation's next turn waits for its decode stream to close (at most the wait),
other conversations never do."""

from __future__ import annotations

import asyncio

from gateway.affinity import AffinityKey
from gateway.writebacks import WriteBacks


def key(*blocks: bytes, session: str | None = None) -> AffinityKey:
    return AffinityKey(session, tuple(blocks))


def test_a_next_turn_waits_for_the_previous_turns_stream_to_close() -> None:
    async def scenario() -> None:
        writebacks = WriteBacks()
        closes = asyncio.Event()
        writebacks.track(key(b"a", b"b"), asyncio.create_task(closes.wait()))
        next_turn = asyncio.create_task(writebacks.settle(key(b"a", b"b", b"c"), wait_s=60))
        await asyncio.sleep(0)  # let it start waiting
        assert not next_turn.done()
        assert await writebacks.settle(key(b"x", b"y"), wait_s=60) is None  # another conversation: no wait
        assert await writebacks.settle(key(b"a"), wait_s=60) is None  # a prompt the turn extends, not its next turn
        closes.set()
        assert await next_turn is True
        assert await writebacks.settle(key(b"a", b"b", b"c"), wait_s=60) is None  # closed: forgotten

    asyncio.run(scenario())


def test_the_wait_is_bounded_and_sessions_match_whatever_the_prompt() -> None:
    async def scenario() -> None:
        writebacks = WriteBacks()
        never = asyncio.create_task(asyncio.Event().wait())
        writebacks.track(key(b"a", session="agent-1"), never)
        assert await writebacks.settle(key(b"z", session="agent-1"), wait_s=0.01) is False  # the wait ran out
        assert await writebacks.settle(key(b"z", session="agent-2"), wait_s=60) is None
        assert await writebacks.settle(key(b"a", b"b"), wait_s=0.01) is False  # its prompt's deepest block key
        writebacks.track(key(), asyncio.create_task(asyncio.Event().wait()))  # no key at all: nothing to wait for
        assert await writebacks.settle(key(), wait_s=60) is None
        never.cancel()

    asyncio.run(scenario())
