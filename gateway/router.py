"""Routing: the least-loaded replica, unless the conversation's own replica is within `slack` of it.

Pure cache affinity hot-spots a replica and pure load balancing scatters a conversation's state; every project
in the field ended with affinity bounded by load (serving-anchors summary). Ties on load rotate, so idle replicas
share new conversations instead of the first one taking them all.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

from gateway.affinity import AffinityKey, AffinityTable
from gateway.discovery import Role
from gateway.replicas import ReplicaPool, ReplicaState


class Router:
    def __init__(self, pools: dict[Role, ReplicaPool], affinity: AffinityTable, slack: float) -> None:
        self.pools = pools
        self.affinity = affinity
        self.slack = slack
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
        owner = self.affinity.lookup(role, key)
        own = next((s for s in candidates if s.name == owner), None)
        chosen = own if own is not None and own.load <= best.load + self.slack else best
        chosen.sent_since_poll += 1
        return chosen

    def served(self, role: Role, key: AffinityKey, state: ReplicaState) -> None:
        """`state` served this conversation: its next turn prefers it."""
        self.affinity.remember(role, key, state.name)
