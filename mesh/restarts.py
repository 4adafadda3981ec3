"""How often `mesh up` restarts a child that dies: a rate, never a lifetime count.

A child is restarted at most `max_restarts` times within any `window_s` seconds; a death beyond that stops the whole
mesh, so a crash loop ends with the child's log on screen instead of spinning. Each restart first waits `backoff_s`,
doubled for every restart of that child still inside the window and capped at `max_backoff_s`: a crash loop slows
down before it is stopped, while a child that dies once in a long while is back within `backoff_s`.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated

import msgspec

Seconds = Annotated[float, msgspec.Meta(ge=0)]


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 5
    window_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    backoff_s: Seconds = 1.0
    max_backoff_s: Seconds = 30.0


class RestartBudget:
    """One child's restarts against a `RestartPolicy`, on the caller's clock (seconds, only ever increasing)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.total = 0  # restarts since the mesh started, for the log lines
        self._times: deque[float] = deque()  # restarts inside the window, oldest first

    def recent(self, now: float) -> int:
        """Restarts within the last `window_s` seconds."""
        while self._times and self._times[0] <= now - self.policy.window_s:
            self._times.popleft()
        return len(self._times)

    def allows(self, now: float) -> bool:
        """Whether one more restart now stays within the rate."""
        return self.recent(now) < self.policy.max_restarts

    def delay(self, now: float) -> float:
        """How long to wait before the next restart."""
        return min(self.policy.backoff_s * 2 ** min(self.recent(now), 64), self.policy.max_backoff_s)

    def record(self, now: float) -> None:
        self._times.append(now)
        self.total += 1
