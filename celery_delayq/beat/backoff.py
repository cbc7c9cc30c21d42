"""The beat's one back-off policy: wait ``start`` s after a failure, doubling up to ``limit``.

Used for the broker (the dispatcher stops claiming while it is unreachable) and for Redis (the
Scheduler's tick waits after a failed one). The clock is injected (monotonic seconds).

>>> b = Backoff(0.5, 2.0, clock=lambda: 100.0)
>>> b.fail(), b.fail(), b.fail(), b.fail()
(0.5, 1.0, 2.0, 2.0)
>>> b.remaining(), b.reset(), b.delay, b.reset()
(2.0, True, 0.0, False)
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """Back-off after failures: ``start`` s, then doubling up to ``limit`` s; 0 once reset."""

    def __init__(self, start: float, limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.start = start
        self.limit = limit
        self.clock = clock
        self.delay = 0.0  # seconds; 0 while nothing fails
        self.retry_at = 0.0  # clock time before which the next try is not made

    def fail(self) -> float:
        """A failure: the next delay (``start``, then doubled, at most ``limit``)."""
        self.delay = min(self.limit, self.delay * 2) if self.delay else self.start
        self.retry_at = self.clock() + self.delay
        return self.delay

    def reset(self) -> bool:
        """A success: no more delay. Whether it was backing off."""
        was = bool(self.delay)
        self.delay = 0.0
        self.retry_at = 0.0
        return was

    def remaining(self) -> float:
        """Seconds still to wait before the next try (0 when none)."""
        return max(0.0, self.retry_at - self.clock())
