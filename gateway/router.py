"""Routing: the least-loaded replica, unless the conversation's own replica is within `slack` of it.

Pure cache affinity hot-spots a replica and pure load balancing scatters a conversation's state; every project
in the field ended with affinity bounded by load (serving-anchors summary). A conversation's own replica is the one
this gateway's affinity table remembers (it knows where a turn the slack sent away from the owner went), else its
rendezvous owner among the live replicas (gateway/rendezvous.py): what every gateway computes alike, so a turn that
lands on a gateway that never saw the conversation still goes where the others sent it. Ties on load rotate, so idle
replicas share requests that name no conversation instead of the first one taking them all.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection

from gateway import rendezvous
from gateway.affinity import AffinityKey, AffinityTable
from gateway.discovery import Role
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool, ReplicaState


class Reason(enum.StrEnum):
    """What chose the replica (the `reason` of `routed_total`)."""

    TABLE = "table"  # the replica this gateway remembers for the conversation
    HASH = "hash"  # the conversation's rendezvous owner
    SLACK = "slack"  # the least loaded: the conversation's own replica was more than `slack` busier
    LOAD = "load"  # the least loaded: the request names no conversation (no session header, no user message)


class Router:
    def __init__(
        self, pools: dict[Role, ReplicaPool], affinity: AffinityTable, slack: float, metrics: GatewayMetrics
    ) -> None:
        self.pools = pools
        self.affinity = affinity
        self.slack = slack
        self._routed = metrics.routed
        self._turn = itertools.count()
        for role, pool in pools.items():
            pool.on_leave = lambda name, role=role: affinity.forget(role, name)

    def pick(self, role: Role, key: AffinityKey, exclude: Collection[str] = ()) -> ReplicaState | None:
        """The replica for the next `role` call of this conversation; None when no replica may take work."""
        pool = self.pools[role]
        candidates = pool.routable(exclude)
        if not candidates and role == "decode":
            # Decode has no fallback: rather than refusing, try replicas a stale poll or a past failure ruled out
            # (a restarted pool answers before the next poll notices; a dead one refuses the connection at once).
            candidates = pool.routable(exclude, ignore_health=True)
        if not candidates:
            return None
        start = next(self._turn) % len(candidates)
        best = min(candidates[start:] + candidates[:start], key=lambda s: s.load)
        own = self._own(role, key, candidates)
        if own is not None and own[0].load <= best.load + self.slack:
            chosen, reason = own
        else:
            chosen, reason = best, Reason.LOAD if own is None else Reason.SLACK
        self._routed.labels(role, reason).inc()
        chosen.sent_since_poll += 1
        return chosen

    def served(self, role: Role, key: AffinityKey, state: ReplicaState) -> None:
        """`state` served this conversation: its next turn prefers it."""
        self.affinity.remember(role, key, state.name)

    def _own(self, role: Role, key: AffinityKey, candidates: list[ReplicaState]) -> tuple[ReplicaState, Reason] | None:
        """The conversation's own replica among `candidates`, and how it is known: the remembered one, else its
        rendezvous owner over the candidates (a replica that is down or already tried hands its conversations to
        their next owner, the same one on every gateway); None when the request names no conversation."""
        by_name = {s.name: s for s in candidates}
        remembered = self.affinity.lookup(role, key)
        if remembered is not None and remembered in by_name:
            return by_name[remembered], Reason.TABLE
        conversation = key.conversation
        if conversation is None:
            return None
        return by_name[rendezvous.owner(conversation, by_name)], Reason.HASH
