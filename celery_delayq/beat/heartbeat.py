"""A beat's heartbeat: its entry in ``<prefix>:beats``, refreshed every ``HEARTBEAT_EVERY`` s,
and the pruning of entries of beats not seen for ``BEAT_FORGET_MS`` (by any beat).

The entry is JSON: token, host, pid, started_ms, seen_ms (the server's clock, never going
back), passes, published, dead_lettered, errors. ``celery delayq status`` reads them.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ..store.bounded import MAX_SMALL, load_json
from ..store.connection import error_text
from ..store.facade import Store
from .stats import DispatchStats

__all__ = ["BEAT_FORGET_MS", "HEARTBEAT_EVERY", "PRUNE_EVERY", "Heartbeat"]

logger = logging.getLogger(__name__)

#: Seconds between two heartbeats (this beat's entry in ``<prefix>:beats``).
HEARTBEAT_EVERY = 5.0

#: An entry of ``<prefix>:beats`` not refreshed for this long (ms) is removed by any beat.
BEAT_FORGET_MS = 600_000

#: Seconds between two looks for such entries (one HGETALL with a heartbeat).
PRUNE_EVERY = 60.0


class Heartbeat:
    """This beat's entry in ``<prefix>:beats``: when it is due, what it says, writing it."""

    def __init__(
        self,
        store: Store,
        token: str,
        stats: DispatchStats,
        server_now_ms: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.token = token
        self.stats = stats
        self.server_now_ms = server_now_ms
        self.clock = clock
        self.host = socket.gethostname()
        self.started_ms = int(wall() * 1000)
        # The last heartbeat's seen_ms: a heartbeat never goes back in time, although the
        # estimate of the server's clock (re-measured at each claim) may step back by a ms or so.
        self._seen_ms = 0
        self.due_at = 0.0  # clock time of the next heartbeat: the first pass writes one
        self.prune_at = 0.0  # clock time of the next look for forgotten beats
        self._failing = False

    def entry(self) -> dict[str, Any]:
        """This beat's entry in ``<prefix>:beats`` (the value is its JSON)."""
        stats = self.stats
        self._seen_ms = max(self._seen_ms, int(self.server_now_ms()))
        return {
            "token": self.token,
            "host": self.host,
            "pid": os.getpid(),
            "started_ms": self.started_ms,
            "seen_ms": self._seen_ms,
            "passes": stats.passes,
            "published": stats.published,
            "dead_lettered": stats.dead_lettered,
            "errors": stats.publish_errors + stats.errors,
        }

    def beat(self, force: bool = False) -> None:
        """Write the heartbeat when due (every HEARTBEAT_EVERY s; ``force``: now, with a prune).
        Never raises: one warning is logged until a write works again."""
        now = self.clock()
        if not (force or now >= self.due_at):
            return
        self.due_at = now + HEARTBEAT_EVERY
        prune = force or now >= self.prune_at
        try:
            self.write(prune)
        except Exception as exc:
            if not self._failing:
                logger.warning("delayq: cannot write this beat's heartbeat to Redis (%s)", error_text(exc))
            self._failing = True
        else:
            self._failing = False
            if prune:
                self.prune_at = now + PRUNE_EVERY

    def write(self, prune: bool) -> None:
        """One round trip: set this beat's entry (and read them all when ``prune``); then
        remove the entries not refreshed for BEAT_FORGET_MS, if any."""
        entry = self.entry()
        beats = self.store.write_heartbeat(self.token, entry, read_all=prune)
        if beats is None:
            return
        oldest = entry["seen_ms"] - BEAT_FORGET_MS
        gone = [token for token, raw in beats.items() if _seen_ms(raw) < oldest]
        if gone:
            self.store.forget_beats(*gone)
            logger.info(
                "delayq: forgot %d beat(s) not seen for %d min: %s",
                len(gone),
                BEAT_FORGET_MS // 60_000,
                ", ".join(gone),
            )

    def remove(self) -> None:
        """The beat stops: remove its entry (never raises)."""
        try:
            self.store.forget_beats(self.token)
        except Exception as exc:
            logger.warning(
                "delayq: cannot remove this beat's heartbeat (%s); it is forgotten after %d min",
                error_text(exc),
                BEAT_FORGET_MS // 60_000,
            )


def _seen_ms(raw: str) -> float:
    """``seen_ms`` of a heartbeat entry; 0 (forget it) for one that does not read."""
    try:
        return float(load_json(raw, "heartbeat", dict, MAX_SMALL)["seen_ms"])
    except (ValueError, KeyError, TypeError):
        return 0.0
