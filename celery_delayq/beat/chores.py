"""What a beat does besides delivering, each on its own timer, at no Redis call per job.

:meth:`Chores.run` (after a pass and from the sleep, see :mod:`.dispatch`) flushes the due ->
publish lateness of what the beat published (:class:`..store.lateness.PublishLateness`), writes
its heartbeat (:mod:`.heartbeat`), runs every ``STALL_SWEEP_EVERY`` s one bounded step of the
sweep that finds and re-arms stalled schedules (:class:`.upkeep.StallSweep`), and every
``BATCH_SWEEP_EVERY`` s the sweep of expired batches (:meth:`.Store.sweep_batches`). None of it
ever raises: delivery must not stop because of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..schedules.api import Schedules
from ..store.connection import error_text
from ..store.facade import Store
from ..store.lateness import PublishLateness
from .heartbeat import Heartbeat
from .stats import DispatchStats
from .upkeep import StallSweep

__all__ = ["BATCH_SWEEP_EVERY", "STALL_SWEEP_EVERY", "Chores"]

logger = logging.getLogger(__name__)

#: Seconds between two steps of the sweep for stalled schedules (see :class:`.upkeep.StallSweep`).
STALL_SWEEP_EVERY = 10.0
#: Seconds between two sweeps of expired batches (:meth:`.Store.sweep_batches`): a finished
#: batch's hash expires by itself; its id and its key's record go at the next sweep.
BATCH_SWEEP_EVERY = 60.0


class Chores:
    """The chores of one dispatcher: its lateness flush and heartbeat, and the sweeps."""

    def __init__(
        self,
        app: Any,
        store: Store,
        stats: DispatchStats,
        lateness: PublishLateness,
        beat: Heartbeat,
        server_now_ms: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self.app = app
        self.store = store
        self.stats = stats
        self.publish_lateness = lateness
        self.beat = beat
        self.server_now_ms = server_now_ms
        self.clock = clock
        self._stalls: StallSweep | None = None  # built at its first step
        self._stall_sweep_at = 0.0  # clock time: the first run runs one
        self._batch_sweep_at = 0.0  # the same, for the sweep of expired batches

    def due_at(self) -> float:
        """Clock time of the next :meth:`run` work: the next heartbeat or stall sweep,
        or the next lateness flush when something waits to be flushed."""
        sweeps = min(self._stall_sweep_at, self._batch_sweep_at)
        return min(self.beat.due_at, sweeps, self.publish_lateness.due_at())

    def run(self, force: bool = False) -> None:
        """Flush the lateness histogram (at most every LATENESS_FLUSH_EVERY s), write the
        heartbeat (every HEARTBEAT_EVERY s) and, every PRUNE_EVERY s, remove the heartbeats
        of beats not seen for BEAT_FORGET_MS; ``force``: all of it now. Every
        STALL_SWEEP_EVERY s (not forced), one step of the sweep for stalled schedules; every
        BATCH_SWEEP_EVERY s, the sweep of expired batches.

        Never raises: delivery must not stop because of them. On a Redis error the
        observations are kept for the next flush, and one warning is logged until one works.
        """
        now = self.clock()
        self.publish_lateness.flush(force)
        self.beat.beat(force)
        if now >= self._stall_sweep_at:
            self._stall_sweep_at = now + STALL_SWEEP_EVERY
            self.sweep_stalls()
        if now >= self._batch_sweep_at:
            self._batch_sweep_at = now + BATCH_SWEEP_EVERY
            self.sweep_batches()

    def sweep_stalls(self) -> int:
        """One step of the sweep for stalled schedules (every STALL_SWEEP_EVERY s, from
        :meth:`run`): how many it re-armed. Never raises."""
        try:
            if self._stalls is None:
                self._stalls = StallSweep(Schedules(self.app))
            repaired = len(self._stalls.step(int(self.server_now_ms())))
        except Exception as exc:
            logger.warning(
                "delayq: the sweep for stalled schedules failed (%s); tried again in %.0f s",
                error_text(exc),
                STALL_SWEEP_EVERY,
            )
            return 0
        self.stats.stalls_repaired += repaired
        return repaired

    def sweep_batches(self) -> int:
        """Remove what is left of the finished batches whose time passed (every
        BATCH_SWEEP_EVERY s, from :meth:`run`): how many. Never raises."""
        try:
            return self.store.sweep_batches()
        except Exception as exc:
            logger.warning(
                "delayq: the sweep of expired batches failed (%s); tried again in %.0f s",
                error_text(exc),
                BATCH_SWEEP_EVERY,
            )
            return 0
