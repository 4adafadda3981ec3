"""The stored-Responses table: a response is found by its id until its retention passes, by every store that opens
the same file, and not after it is deleted."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from gateway.response_store import ResponseStore, Turn

HOUR = 3600.0


def turn(response_id: str) -> Turn:
    return Turn(response_id, [{"type": "message"}], [], {"id": response_id}, "salt", [1, 2, 3])


def test_a_turn_lives_for_the_retention_in_every_store_on_the_file(tmp_path: Path) -> None:
    now = [1000.0]
    path = str(tmp_path / "responses.sqlite3")
    writer = ResponseStore(path, 72 * HOUR, clock=lambda: now[0])
    reader = ResponseStore(path, 72 * HOUR, clock=lambda: now[0])  # another gateway given the same path

    async def scenario() -> None:
        await writer.put(turn("resp_a"))
        assert await reader.get("resp_a") == turn("resp_a")
        now[0] += 72 * HOUR - 1
        assert await reader.get("resp_a") is not None
        now[0] += 1
        assert await reader.get("resp_a") is None  # expired with the KV it would have continued on
        assert await reader.delete("resp_a") is False
        await writer.put(turn("resp_b"))  # a write purges what has expired
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT id FROM responses").fetchall() == [("resp_b",)]
        assert await reader.delete("resp_b") is True
        assert await writer.get("resp_b") is None

    asyncio.run(scenario())
    writer.close()
    reader.close()
