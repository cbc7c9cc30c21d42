"""Clocks a test moves: :class:`WallClock`, a wall clock (``time.time``) the test can set
ahead, for a :class:`~celery_delayq.beat.dispatch.Dispatcher`'s ``wall`` (the clock it keeps
each shard's next due time on, as the server's)."""

from __future__ import annotations

import time


class WallClock:
    """``time.time()`` plus however far the test has moved it ahead (:meth:`advance`): real
    time goes on flowing, and a test that ended a lease on the server (``expire_leases``) moves
    the beat's clock past the lease too, instead of sleeping the reclaim TTL."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds
