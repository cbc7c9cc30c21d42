"""The fence: a beat publishes a job it leased only while it surely still holds the lease.

A beat publishes a job it leased only while its local monotonic clock is short of
``base + FENCE_FRACTION x delayq_reclaim_ttl``, where ``base`` is the monotonic time taken just
before the claim (or the renew, lua/renew.lua) was sent. The server set the lease's expiry to
its own now + TTL after that moment, so the lease cannot have expired before base + TTL (the
server's clock runs at the local rate: NTP slews by at most 0.05 %). Past the fraction the
beat renews in Redis what it still holds, and drops the rest unpublished. The other half of
the TTL is the margin for what the fence cannot see: the publish or batch flush after the last
check (the residual window, measured in docs/guarantees.md) and a pause within it.

One :class:`Fence` per dispatcher; :meth:`Fence.start` at each claim. The clock is injected, and
so is the dispatcher's pause (:attr:`.dispatch.Dispatcher.pause`), called as each job is handed
to kombu and as messages reach the broker.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..store.connection import REDIS_ERRORS, error_text
from ..store.facade import Store
from .stats import DispatchStats

__all__ = ["FENCE_FRACTION", "FENCE_WINDOWS_KEPT", "Fence", "LeaseLost"]

logger = logging.getLogger(__name__)

#: Part of the lease (from the claim or renew being sent) within which a beat publishes without
#: asking Redis; past it, it renews first (see the module docstring).
FENCE_FRACTION = 0.5

#: Most residual windows (s, last fence check -> the broker has the bytes) a dispatcher keeps
#: for :meth:`Fence.window` (the most recent ones).
FENCE_WINDOWS_KEPT = 10_000


class LeaseLost(Exception):
    """Raised inside kombu's publish batch to discard it unsent: a job in it lost its lease."""


class Fence:
    """The leases of one pass: whether a job may be published now, renewing them when due."""

    def __init__(
        self,
        store: Store,
        token: str,
        stats: DispatchStats,
        clock: Callable[[], float] = time.monotonic,
        *,
        pause: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.store = store
        self.pause = pause  # the dispatcher's test seam: steps "handed" and "sent"
        self.token = token
        self.stats = stats
        self.clock = clock
        self.ttl = store.config.reclaim_ttl
        # Monotonic time before which this pass's leases are surely held; the pass's claimed
        # jobs by shard; ids found lost; ids dead-lettered (no lease left to renew); jobs in the
        # open kombu batch (buffered, not yet sent); when the last check passed.
        self.deadline = 0.0
        self.jobs: dict[int, list[str]] = {}
        self.lost: set[str] = set()
        self.buried: set[str] = set()
        self.buffered: list[str] = []
        #: ids of this pass already handed to the broker (sent, or in a flushed batch): a lease
        #: found lost later does not make them unpublished
        self.sent_ids: set[str] = set()
        self.checked_at = 0.0
        self.overran = 0  # messages of this pass sent after the lease may have expired
        #: residual windows (s): last fence check -> publish returned / batch flushed
        self.windows: deque[float] = deque(maxlen=FENCE_WINDOWS_KEPT)

    def claimed(self, sent_at: float) -> None:
        """A claim was sent at monotonic ``sent_at``: its leases are held until the fence."""
        self.deadline = sent_at + FENCE_FRACTION * self.ttl

    def start(self, jobs: dict[int, list[str]]) -> None:
        """A pass publishes ``jobs`` (ids by shard), claimed since :meth:`claimed`."""
        self.jobs = jobs
        self.lost, self.buried = set(), set()
        self.sent_ids = set()

    def open_batch(self) -> None:
        self.buffered = []
        self.overran = 0

    def check(self, job_id: str | None) -> bool:
        """Whether ``job_id`` may be published now (None: the open batch may be flushed).

        Within FENCE_FRACTION of the lease since the claim (or the last renew) was sent: yes,
        without asking Redis. Past it: :meth:`renew` every lease of the pass first; a job whose
        lease was lost is not published, and when one of them is already in the open kombu
        batch, raises :class:`LeaseLost` (the batch is discarded unsent)."""
        if self.clock() >= self.deadline:
            self.renew()
            if self.lost.intersection(self.buffered):
                raise LeaseLost
        self.checked_at = self.clock()
        return job_id is None or job_id not in self.lost

    def renew(self) -> None:
        """Renew, in one round trip (lua/renew.lua), the leases of this pass's jobs not yet
        found lost; those not held any more are added to the lost ones. A renew that fails or
        takes longer than the fence allows counts every job of the pass as lost."""
        gone = self.lost | self.buried
        ids = {shard: [i for i in jobs if i not in gone] for shard, jobs in self.jobs.items()}
        sent = self.clock()
        self.stats.renewals += 1
        try:
            held, _ = self.store.renew(self.token, {shard: jobs for shard, jobs in ids.items() if jobs})
        except REDIS_ERRORS as exc:
            logger.warning(
                "delayq: fence: cannot renew this beat's leases before publishing (%s); the rest of "
                "this pass is left unpublished and delivered after its lease (%.0f s)",
                error_text(exc),
                self.ttl,
            )
            held = {}
        self.deadline = sent + FENCE_FRACTION * self.ttl
        if self.clock() >= self.deadline:
            held = {}  # the renew itself took too long: nothing is sure any more
        self.lost.update(i for jobs in ids.values() for i in jobs if not held.get(i))

    def sent(self, job_id: str, buffering: bool) -> None:
        """``job_id`` was handed to kombu: kept in the open batch, or already sent."""
        if buffering:
            self.buffered.append(job_id)
        else:
            self.sent_ids.add(job_id)
        if self.pause is not None:
            self.pause("handed", job_id)
        if not buffering:
            self.published(1)

    def flushed(self) -> None:
        """The open kombu batch was sent."""
        self.sent_ids.update(self.buffered)
        self.published(len(self.buffered))

    def published(self, messages: int) -> None:
        """A publish returned, or a batch flush: keep its residual window (since the last fence
        check), and count the messages that reached the broker only after the lease may have
        expired (a publish that Celery retried, a stall in the window): they may run twice."""
        now = self.clock()
        self.windows.append(now - self.checked_at)
        if now >= self.deadline + (1 - FENCE_FRACTION) * self.ttl:
            self.overran += messages
        if self.pause is not None:
            self.pause("sent", messages)

    def window(self) -> tuple[int, float, float]:
        """``(count, p99 ms, max ms)`` of the residual windows kept (the last FENCE_WINDOWS_KEPT):
        the time from the last fence check to the end of a publish or batch flush."""
        windows = sorted(self.windows)
        if not windows:
            return 0, 0.0, 0.0
        p99 = windows[min(len(windows) - 1, math.ceil(0.99 * len(windows)) - 1)]
        return len(windows), p99 * 1000.0, windows[-1] * 1000.0

    def report(self, to_push: set[str]) -> None:
        """Count and log what the fence kept from the broker in this pass (``to_push``: the ids
        of the push path's jobs)."""
        # Lost jobs of the push path are push_claimed.lua's to drop (and count), not the fence's;
        # those this beat had sent before it found their lease lost were published.
        lost = self.lost.difference(to_push)
        fenced = len(lost.difference(self.sent_ids))
        early = len(lost.intersection(self.sent_ids))
        if early:
            logger.warning(
                "delayq: fence: %d job(s) this beat published in this pass were found re-claimed by "
                "another beat afterwards (this beat was paused or slowed inside its publish): the other "
                "beat published them too, and workers with delayq_start_check on run only the "
                "copy that starts first",
                early,
            )
        if fenced:
            self.stats.fenced += fenced
            self.stats.stale_acks += fenced
            logger.warning(
                "delayq: fence: %d claimed job(s) were not published: their lease was no longer "
                "this beat's when it was renewed before publishing (this beat was paused or slowed "
                "past %.0f%% of the lease, %.1f s)",
                fenced,
                FENCE_FRACTION * 100,
                self.ttl,
            )
        if self.overran:
            logger.warning(
                "delayq: fence: %d message(s) reached the broker after their lease may have expired "
                "(the publish or the batch flush took longer than the last %.0f%% of the lease, "
                "%.1f s); if another beat re-claimed them meanwhile they run twice",
                self.overran,
                (1 - FENCE_FRACTION) * 100,
                self.ttl,
            )

    def log_window(self) -> None:
        """Log the residual window (:meth:`window`) when anything went through kombu, once
        (the beat is stopping)."""
        count, p99, most = self.window()
        if count:
            logger.info(
                "delayq: fence: residual window (last lease check -> publish sent or batch flushed) "
                "over the last %d publishes/flushes: p99 %.1f ms, max %.1f ms; %d renewal(s), %d "
                "job(s) not published for a lost lease",
                count,
                p99,
                most,
                self.stats.renewals,
                self.stats.fenced,
            )
            self.windows.clear()  # logged once, however often the beat's stop() is called
