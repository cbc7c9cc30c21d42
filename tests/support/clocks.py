"""Clocks a test moves: :class:`Clock`, a real clock (``time.time`` by default, or
``time.monotonic``) the test can set ahead, for a
:class:`~celery_delayq.beat.dispatch.Dispatcher`'s ``wall`` (the clock it keeps each shard's
next due time on, as the server's) or ``clock`` (its monotonic one: safety polls, chores)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Clock:
    """``base()`` plus however far the test has moved it ahead (:meth:`advance`): real time
    goes on flowing, and a test that ended a lease on the server (``expire_leases``) moves the
    beat's clock past the lease too, instead of sleeping the TTL."""

    def __init__(self, base: Callable[[], float] = time.time) -> None:
        self.base = base
        self.ahead = 0.0

    def __call__(self) -> float:
        return self.base() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds
