"""Conversation affinity: which replica a conversation's next turn goes back to, on any gateway.

A conversation is named by its session header when the client sends one (coding agents do), else by its opening:
the digest of its messages up to its first user message, which every later turn sends again (gateway/job.py). This
gateway remembers where each conversation it served went (LRU, a fixed count per role), which knows a turn the load
sent away from its owner; a conversation it never served goes to its rendezvous owner (gateway/rendezvous.py), the
same replica every other gateway picks for it.

Not the prompt's block keys: a conversation new here shares its first blocks with every other one (the V4.1 system
header, an agent's system prompt), so their deepest match would send it after another conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import msgspec

# Session identity headers of the clients that send one (serving-anchors §1: Dynamo, Claude Code, Codex, OpenCode).
SESSION_HEADERS = (
    "x-session-id",
    "session-id",
    "x-claude-code-session-id",
    "x-dynamo-session-id",
)


class AffinityKey(msgspec.Struct, frozen=True):
    """How a request names its conversation: an optional session id and the digest of its opening (routing), and its
    prompt's block keys (the previous turn's write-back: gateway/writebacks.py)."""

    session: str | None = None
    blocks: tuple[bytes, ...] = ()
    opening: bytes | None = None

    @property
    def conversation(self) -> bytes | None:
        """What names the conversation in every turn, on every gateway: its session, else its opening; None when it has
        neither (no user message). The tags keep a session from ever meaning the same as an opening."""
        if self.session is not None:
            return b"session:" + self.session.encode()
        return b"opening:" + self.opening if self.opening is not None else None


def session_of(headers: Mapping[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value[:256]
    return None


class AffinityTable:
    """Per role, conversation → name of the replica that last served it (LRU, at most `capacity` per role)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_role: dict[str, OrderedDict[bytes, str]] = {}

    def lookup(self, role: str, key: AffinityKey) -> str | None:
        """The replica that served the conversation here last; None for one new here (or nameless)."""
        conversation = key.conversation
        entries = self._by_role.get(role)
        return entries.get(conversation) if entries and conversation is not None else None

    def remember(self, role: str, key: AffinityKey, replica: str) -> None:
        conversation = key.conversation
        if conversation is None:
            return
        entries = self._by_role.setdefault(role, OrderedDict())
        entries[conversation] = replica
        entries.move_to_end(conversation)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, role: str, replica: str) -> None:
        """Drop a replica that left: its conversations go to their next rendezvous owner."""
        entries = self._by_role.get(role)
        if entries:
            for k in [k for k, name in entries.items() if name == replica]:
                del entries[k]
