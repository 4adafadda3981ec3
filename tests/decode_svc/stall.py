"""A plan part that hangs on the followers of a rank group: their main thread waits while their heartbeat beats on
(run on every rank by `GroupCalls.run`, resolved by its module's name there: import it as tests.decode_svc.stall)."""

from __future__ import annotations

import time

from model import Transformer


def hang_on_followers(model: Transformer, seconds: float) -> None:
    if model.parallel.rank:
        time.sleep(seconds)
