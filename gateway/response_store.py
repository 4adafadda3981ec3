"""Stored Responses (`store: true`): what `previous_response_id`, `GET /v1/responses/{id}` and its `input_items`
read, kept in one sqlite file for the KV's retention.

Why a table and not the cache service: the cache service keeps KV blocks (content-addressed, on SSD) and volatile
SWA and handoff records (host DRAM, TTL minutes); a stored response is neither, must outlive a cache restart and
be found by its id. An sqlite file (stdlib, WAL journal) is durable across gateway restarts, and every gateway
that opens the same path (a shared volume) sees the same responses; a record is retrievable for `retention_s`,
like the conversation's KV blocks, then purged.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable

import msgspec

SCHEMA = "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, expires_at REAL NOT NULL, turn BLOB NOT NULL)"


class Turn(msgspec.Struct, frozen=True):
    """A finished response and what its continuation needs.

    items: the conversation through this response (its previous responses' items, its input, its output), the
        input a `previous_response_id` continuation starts from.
    input_items: this request's own input items (`GET /v1/responses/{id}/input_items`).
    response: the response object (`GET /v1/responses/{id}`).
    salt: the cache salt its prompt was keyed with, so its continuation finds the same blocks.
    token_ids: its prompt and generated token ids, the sequence the KV cache holds for it.
    """

    id: str
    items: list[dict]
    input_items: list[dict]
    response: dict
    salt: str
    token_ids: list[int]


class ResponseStore:
    """Turns by response id in an sqlite file (":memory:" when `path` is empty), each for `retention_s`; calls run
    on a thread, never on the event loop."""

    def __init__(self, path: str, retention_s: float, clock: Callable[[], float] = time.time) -> None:
        self.retention_s = retention_s
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path or ":memory:", timeout=10.0, check_same_thread=False, isolation_level=None)
        if path:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)

    async def get(self, response_id: str) -> Turn | None:
        """The turn stored under `response_id`, unless it was deleted or its retention passed."""
        row = await asyncio.to_thread(self._query, "SELECT turn FROM responses WHERE id = ? AND expires_at > ?",
                                      (response_id, self._clock()))  # fmt: skip
        return None if row is None else msgspec.msgpack.decode(row[0], type=Turn)

    async def put(self, turn: Turn) -> None:
        """Keep `turn` for the retention, and purge what has expired."""
        now = self._clock()
        encoded = msgspec.msgpack.encode(turn)
        await asyncio.to_thread(self._write, [
            ("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (turn.id, now + self.retention_s, encoded)),
            ("DELETE FROM responses WHERE expires_at <= ?", (now,)),
        ])  # fmt: skip

    async def delete(self, response_id: str) -> bool:
        """Forget a response; False if none (live) was stored under the id."""
        deleted = await asyncio.to_thread(self._write, [
            ("DELETE FROM responses WHERE id = ? AND expires_at > ?", (response_id, self._clock())),
        ])  # fmt: skip
        return deleted > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _query(self, sql: str, args: tuple) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _write(self, statements: list[tuple[str, tuple]]) -> int:
        """Run the statements in one transaction; the rows the first one changed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                changed = [self._db.execute(sql, args).rowcount for sql, args in statements]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return changed[0]
