"""Write-back: what a sequence adds to the cache — its new complete blocks, and at its end the SWA record that makes
the next turn of the conversation an exact prefix hit.

The engine hands an export over and goes on; the writes run as tasks on the event loop, started before the sequence's
final message is queued, so a slow or unreachable cache never delays a token. The sequence keeps its tasks: its
stream closes once they are done (service.py), after the final message, so a caller that waits for the close — the
gateway, before the conversation's next turn — knows the next turn will find what this one wrote. Failures are
counted and logged, never raised: the next turn then recomputes (or bounded-replays) what is missing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from decode_svc.metrics import DecodeMetrics
from decode_svc.sequence import Sequence
from mesh.logging import bind_request
from model import EncoderState, GlobalKVBlock
from model_service.kvstore import KVStore


class WriteBack:
    def __init__(
        self, store: KVStore | None, loop: asyncio.AbstractEventLoop, metrics: DecodeMetrics, log: Any
    ) -> None:
        self.store = store
        self.loop = loop
        self.metrics = metrics
        self.log = log
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(
        self, seq: Sequence, token_ids: list[int], blocks: list[GlobalKVBlock], state: EncoderState | None
    ) -> None:
        """From the engine thread: write `blocks` (keyed over `token_ids`) and, if given, the SWA record at its end."""
        if self.store is None or (not blocks and state is None):
            return
        args = (seq.request_id, seq.params.salt, token_ids, blocks, state)
        try:
            self.loop.call_soon_threadsafe(self._spawn, seq, *args)
        except RuntimeError:  # the loop is gone: the replica stopped
            self.metrics.writebacks.labels("dropped").inc()

    def _spawn(self, seq: Sequence, *args: Any) -> None:
        """On the loop, before the sequence's final message (queued after this by the engine thread)."""
        task = self.loop.create_task(self._write(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        seq.writebacks.append(task)

    async def _write(
        self,
        request_id: str,
        salt: bytes,
        token_ids: list[int],
        blocks: list[GlobalKVBlock],
        state: EncoderState | None,
    ) -> None:
        assert self.store is not None
        started = time.monotonic()
        keys = self.store.keys(token_ids, salt)
        writes = []
        if blocks:
            writes.append(self.store.put_blocks([keys[block.index] for block in blocks], blocks))
        if state is not None:
            writes.append(self.store.put_swa_record(token_ids, salt, state))
        results = await asyncio.gather(*writes, return_exceptions=True)
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        self.metrics.writebacks.labels("failed" if errors else "ok").inc()
        self.metrics.writeback_seconds.observe(time.monotonic() - started)
        with bind_request(request_id=request_id):
            if errors:
                self.log.warning("writeback_failed", errors=errors, blocks=len(blocks), record=state is not None)
            else:
                self.log.debug("writeback", blocks=len(blocks), record=state is not None, tokens=len(token_ids))

    async def drain(self) -> None:
        """Wait for the writes in flight (at shutdown)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
