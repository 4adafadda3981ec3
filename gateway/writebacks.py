"""Write-backs in flight: a conversation's next turn waits for its previous turn's, so its prefill finds the SWA record.

decode sends a turn's final message at once, then writes the sequence back (its new blocks and the end-of-sequence
SWA record) and closes the stream only when that is done. An agent whose tool answers at once can send the next turn
before then; its prefill would find no record and rebuild the encoder window by bounded replay (approximate, and
slower). So the gateway keeps each finished turn's stream, until it closes, under the turn's conversation keys — its
session, and the deepest block key of its prompt (the next turn's prompt extends it, so it holds that key too) — and
a new turn whose keys match waits for those closes, at most `wait_s`, before its prefill.
"""

from __future__ import annotations

import asyncio

from gateway.affinity import AffinityKey


class WriteBacks:
    """Finished turns whose decode stream is still open, by conversation key (event loop only)."""

    def __init__(self) -> None:
        self._open: dict[str | bytes, set[asyncio.Task[None]]] = {}

    def track(self, key: AffinityKey, closed: asyncio.Task[None]) -> None:
        """A finished turn of conversation `key`; `closed` ends when its decode stream has closed."""
        names = _names(key)
        for name in names:
            self._open.setdefault(name, set()).add(closed)
        closed.add_done_callback(lambda done: self._forget(names, done))

    async def settle(self, key: AffinityKey, wait_s: float) -> bool | None:
        """Wait, at most `wait_s`, for the write-backs of this conversation's earlier turns: None when there is none in
        flight, True when they finished, False when the wait ran out."""
        tasks = self._of(key)
        if not tasks:
            return None
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        return not pending

    def _of(self, key: AffinityKey) -> set[asyncio.Task[None]]:
        """The open turns of this conversation: its session's, else those whose deepest block key it extends."""
        if key.session is not None and key.session in self._open:
            return set(self._open[key.session])
        for block in reversed(key.blocks):
            if block in self._open:
                return set(self._open[block])
        return set()

    def _forget(self, names: list[str | bytes], task: asyncio.Task[None]) -> None:
        for name in names:
            tasks = self._open.get(name)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._open[name]


def _names(key: AffinityKey) -> list[str | bytes]:
    """The keys a turn is kept under: its session and the deepest block key of its prompt."""
    return [name for name in (key.session, key.blocks[-1] if key.blocks else None) if name is not None]
