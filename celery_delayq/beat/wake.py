"""When to claim each shard: the wake subscription, the safety poll and the server's clock.

Between passes a beat sleeps until the earliest due time it knows of, on a pub/sub
subscription: the enqueue script publishes on the wake channel when it stores a job earlier
than the shard's wake marker, which wakes every beat at once (:meth:`Wake.on_wake`). Every
``delayq_max_sleep`` seconds the safety poll reads every shard's wake marker with the server's
clock (one round trip) and claims the shards whose marker is due, missing or unreadable
(:meth:`Wake.safety_poll`); after any lost subscription all shards are claimed, and while it
cannot be made again the safety poll runs every ``RESUBSCRIBE_EVERY`` s.

One :class:`Wake` per dispatcher (:mod:`.dispatch`), which tells it each claim's answer
(:meth:`Wake.claimed`, :meth:`Wake.retry`) and sleeps on :attr:`Wake.pubsub`. The clocks are
injected: ``clock`` (monotonic s) and ``wall`` (s).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

from ..store.beats import is_acl_refusal
from ..store.connection import REDIS_ERRORS, error_text
from ..store.facade import Store
from ..store.lua_formats import parse_wake
from .stats import DispatchStats

__all__ = ["MARKER_MARGIN_MS", "RESUBSCRIBE_EVERY", "Wake"]

logger = logging.getLogger(__name__)

#: The safety poll claims a shard whose wake marker is due within this (ms) of the server's
#: now: the clocks of a cluster's nodes differ by a little.
MARKER_MARGIN_MS = 1000.0

#: While the wake subscription cannot be made (its node is down, a primary failing over), the
#: beat tries again, and runs the safety poll, this often (s).
RESUBSCRIBE_EVERY = 1.0


class Wake:
    """When each shard may next have something due, as one beat knows it: from each claim,
    the wake messages and the safety poll; and the server's clock, measured at each of them."""

    def __init__(
        self,
        store: Store,
        stats: DispatchStats,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.store = store
        self.config = store.config
        self.stats = stats
        self.clock = clock
        self.wall = wall
        #: Earliest time (server ms) each shard may have something due; None: look now.
        self.next: list[float | None] = [None] * self.config.shards
        self.offset_ms = 0.0  # server clock - local clock, measured at each claim
        self.last_full = 0.0  # clock time of the last safety poll
        self._markers_failed = False  # the last safety poll could not read the markers (logged)
        #: The wake channel's pub/sub connection (None while there is none).
        self.pubsub: Any = None
        self._subscribe_at = 0.0  # clock time of the next attempt to subscribe
        self._subscription_failed = False  # since the last subscription made (logged once)

    def server_now_ms(self) -> float:
        return self.wall() * 1000.0 + self.offset_ms

    def measured(self, server_ms: float, sent: float, received: float) -> None:
        """The server said its time is ``server_ms`` between ``sent`` and ``received`` (wall s)."""
        self.offset_ms = server_ms - (sent + received) * 500.0

    def claimed(self, shard: int, next_ms: float | None, *, full: bool) -> None:
        """A claim of ``shard`` answered: its earliest due time left (server ms; None: nothing
        left in it, so until a wake message or the safety poll says otherwise), or, when the
        claimed batch was ``full``, look at it again at once."""
        if full:
            self.next[shard] = None
        else:
            self.next[shard] = float("inf") if next_ms is None else next_ms

    def retry(self, shards: list[int], at_ms: float) -> None:
        """The claim of ``shards`` failed: claim them again at ``at_ms`` (server ms)."""
        for shard in shards:
            self.next[shard] = at_ms

    def poll_every(self) -> float:
        """Seconds between two safety polls: ``delayq_max_sleep``, or ``RESUBSCRIBE_EVERY``
        while there is no wake subscription (no wake message can say what became due)."""
        if self.pubsub is None:
            return min(self.config.max_sleep, RESUBSCRIBE_EVERY)
        return self.config.max_sleep

    def shards_to_claim(self) -> list[int]:
        if self.clock() - self.last_full >= self.poll_every():
            self.last_full = self.clock()
            self.safety_poll()
        now = self.server_now_ms()
        shards = [i for i, nxt in enumerate(self.next) if nxt is None or nxt <= now]
        random.shuffle(shards)  # beats start on different shards
        return shards

    def safety_poll(self) -> None:
        """Every ``delayq_max_sleep`` s: learn what no wake message said (a lost message, a
        job another beat leased, a slot expiry) from the shards' wake markers, read with the
        server's clock in one round trip (:meth:`.Store.wake_markers`).

        The scripts keep each marker no later than its shard's earliest score (see
        ``lua/includes/wake.lua``), so a shard whose marker is in the future has nothing due
        before it: it is claimed then. A shard whose marker is due (within
        ``MARKER_MARGIN_MS``), missing or unreadable is claimed now, and the claim sets its
        marker again. When the markers cannot be read, every shard is claimed (that claim
        reports the error)."""
        if all(nxt is None for nxt in self.next):
            return  # every shard is claimed anyway
        sent = self.wall()
        try:
            now_ms, markers = self.store.wake_markers()
        except REDIS_ERRORS as exc:
            log = logger.debug if self._markers_failed else logger.warning
            self._markers_failed = True
            hint = " (the Redis ACL user needs +mget: see docs/security.md)" if is_acl_refusal(exc) else ""
            log(
                "delayq: the shards' wake markers could not be read (%s); every shard is claimed instead%s",
                error_text(exc),
                hint,
            )
            self.next = [None] * self.config.shards
            return
        self._markers_failed = False
        received = self.wall()
        self.measured(now_ms, sent, received)
        horizon = now_ms + MARKER_MARGIN_MS
        for shard, marker in enumerate(markers):
            current = self.next[shard]
            if marker is None or marker <= horizon:
                self.next[shard] = None
            elif current is not None:
                self.next[shard] = min(current, marker)

    def seconds_until_due(self) -> float:
        """Seconds until the earliest due time known (0: some shard must be looked at now),
        at most until the next safety poll and ``delayq_max_sleep``."""
        now = self.server_now_ms()
        known = [n for n in self.next if n is not None]
        if len(known) < len(self.next):
            return 0.0
        earliest = min(known) if known else now + self.config.max_sleep * 1000
        wait = (earliest - now) / 1000.0
        until_full = self.last_full + self.poll_every() - self.clock()
        return max(0.0, min(wait, until_full, self.config.max_sleep))

    def subscribe(self) -> Any:
        """The wake subscription; made now when there is none and an attempt is due. None while
        it cannot be made: the beat claims on the safety poll, every ``RESUBSCRIBE_EVERY`` s,
        and tries again as often (after a failover, on the slot's new owner: see
        :meth:`.Store.wake_subscription`). A failed subscription never stops a claim."""
        if self.pubsub is not None or self.clock() < self._subscribe_at:
            return self.pubsub
        try:
            self.pubsub = self.store.wake_subscription()
        except REDIS_ERRORS as exc:
            self.lost(exc)
            return None
        if self._subscription_failed:
            self._subscription_failed = False
            logger.warning("delayq: wake subscription made again; claiming on wake messages")
        # Anything enqueued before the subscription took effect: look at every shard.
        self.next = [None] * self.config.shards
        return self.pubsub

    def lost(self, exc: Exception) -> None:
        """The wake subscription failed (or could not be made): claim every shard now, then on
        the safety poll until it is made again; try again in ``RESUBSCRIBE_EVERY`` s. Logged
        once until a subscription is made."""
        if self.pubsub is not None:
            self.drop()  # every shard is claimed now
            self.store.refresh_slots()  # (a failed subscribe has refreshed it)
        self._subscribe_at = self.clock() + RESUBSCRIBE_EVERY
        log = logger.debug if self._subscription_failed else logger.warning
        self._subscription_failed = True
        log(
            "delayq: the wake subscription failed (%s); claiming on the safety poll every %.0f s "
            "while it is made again",
            error_text(exc),
            RESUBSCRIBE_EVERY,
        )

    def on_wake(self, data: Any) -> None:
        parsed = parse_wake(data)
        if parsed is None:
            return
        shard, due = parsed
        if 0 <= shard < len(self.next):
            current = self.next[shard]
            if current is None or due < current:
                self.next[shard] = due
                self.stats.wakeups += 1

    def drop(self) -> None:
        if self.pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                self.pubsub.close()
        self.pubsub = None
        self.next = [None] * self.config.shards
