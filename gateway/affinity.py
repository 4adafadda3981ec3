"""Conversation affinity: remember which replica served a conversation, so its next turn goes back there.

A conversation is recognised by a session header when the client sends one (coding agents do), otherwise by
its prompt's block keys: the next turn's prompt extends this one, so the deepest block key already seen names
the replica that wrote that prefix's state (its blocks and end-of-sequence SWA record). Entries are kept in
LRU order up to a fixed count per role. A gateway that never saw the conversation has no entry: it names the
conversation by what every turn shares (`AffinityKey.conversation`) and asks gateway/rendezvous.py for its owner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import msgspec

# Session identity headers of the clients that send one (serving-anchors §1: Dynamo, Claude Code, Codex, OpenCode).
SESSION_HEADERS = (
    "x-session-id",
    "session-id",
    "x-claude-code-session-id",
    "x-dynamo-session-id",
)


class AffinityKey(msgspec.Struct, frozen=True):
    """How a request names its conversation: an optional session id and its prompt's block keys."""

    session: str | None = None
    blocks: tuple[bytes, ...] = ()

    @property
    def conversation(self) -> bytes | None:
        """What names the conversation in every turn, on every gateway: its session, else its prompt's first block key
        (each next turn's prompt extends this one, so it starts with the same block); None for a prompt shorter than a
        block. The tags keep a session from ever meaning the same as a block key."""
        if self.session is not None:
            return b"session:" + self.session.encode()
        return b"prefix:" + self.blocks[0] if self.blocks else None


def session_of(headers: Mapping[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value[:256]
    return None


class AffinityTable:
    """Per role, key → name of the replica that last served it (LRU, at most `capacity` keys per role)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_role: dict[str, OrderedDict[str | bytes, str]] = {}

    def lookup(self, role: str, key: AffinityKey) -> str | None:
        """The replica of the session, else of the deepest block key seen; None for a new conversation."""
        entries = self._by_role.get(role)
        if not entries:
            return None
        if key.session is not None and key.session in entries:
            return entries[key.session]
        for block in reversed(key.blocks):
            name = entries.get(block)
            if name is not None:
                return name
        return None

    def remember(self, role: str, key: AffinityKey, replica: str) -> None:
        entries = self._by_role.setdefault(role, OrderedDict())
        keys: Sequence[str | bytes] = (*key.blocks, key.session) if key.session is not None else key.blocks
        for k in keys:
            entries[k] = replica
            entries.move_to_end(k)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, role: str, replica: str) -> None:
        """Drop a replica that left: its conversations start over on load."""
        entries = self._by_role.get(role)
        if entries:
            for k in [k for k, name in entries.items() if name == replica]:
                del entries[k]
