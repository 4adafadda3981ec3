"""The worker threads that prepare requests off the event loop: parsing, conversion, rendering and tokenisation of a
body take seconds for a body of megabytes, and the loop must answer /health, feed the streams in flight and take
small requests meanwhile.

Most of that time is the tokenizer's, which runs without the GIL (recipe/tokenizer.py), so the loop is not starved;
what holds the GIL (a body's JSON decode, the prompt's join) does so for tens of milliseconds at most. Bodies over
`LARGE_BODY_BYTES` share at most half of the threads, so a burst of huge bodies leaves the rest to small requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

T = TypeVar("T")
Args = TypeVarTuple("Args")

LARGE_BODY_BYTES = 1 << 20


class Workers:
    """`threads` worker threads; `run` one preparation on them."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._all = anyio.CapacityLimiter(threads)
        self._large = anyio.CapacityLimiter(max(1, threads // 2))

    async def run(self, body_bytes: int, work: Callable[[*Args], T], *args: *Args) -> T:
        """`work(*args)` on a worker thread, for a request whose body has `body_bytes` bytes."""
        if body_bytes <= LARGE_BODY_BYTES:
            return await anyio.to_thread.run_sync(work, *args, limiter=self._all)
        async with self._large:
            return await anyio.to_thread.run_sync(work, *args, limiter=self._all)
