"""Whether a beat keeps up: how long the due work it publishes waited (``delayq_behind_warning``).

After each pass the dispatcher gives :meth:`Behind.passed` the lateness of the latest job or
schedule point the pass published (ms; the jobs flow control held back count from when they
were let go, as in the publish lateness). That is how far behind the beat is: a beat that
publishes what falls due as fast as it falls due publishes it within milliseconds, and one
given more due work than it can publish falls further behind at each pass. A pass that
published nothing found nothing due: 0. The last figure is the gauge
``delayq_behind_seconds`` (:mod:`.metrics`).

When the figure goes over the threshold, one warning says how far behind the beat is and that
another beat on the same store shares the load (docs/scaling.md); it is not said again until
the beat has caught up (under half the threshold: one info line), so a streak is one warning.

>>> b = Behind(2.0, "delayq_behind_warning")
>>> b.passed(3500.0), b.passed(4000.0), b.seconds, b.passed(500.0), b.warned
(True, False, 4.0, False, False)
"""

from __future__ import annotations

import logging

__all__ = ["Behind"]

logger = logging.getLogger(__name__)


class Behind:
    """One beat's last lateness of what it published, and its streak of being behind."""

    def __init__(self, threshold: float | None, setting: str) -> None:
        #: seconds (``delayq_behind_warning``); None: never warn
        self.threshold = threshold
        #: the setting's name as the user spells it (in the warning)
        self.setting = setting
        #: the latest published job's lateness in the last pass, in seconds
        self.seconds = 0.0
        #: whether the beat is in a streak it warned about
        self.warned = False
        #: warnings logged since the start (one per streak)
        self.streaks = 0

    def passed(self, late_ms: float) -> bool:
        """A pass published work whose latest job waited ``late_ms`` (0: nothing published);
        returns whether this pass began a streak (and logged its warning)."""
        self.seconds = max(0.0, late_ms) / 1000.0
        threshold = self.threshold
        if threshold is None:
            return False
        if not self.warned and self.seconds > threshold:
            self.warned = True
            self.streaks += 1
            logger.warning(
                "delayq: this beat is behind: due work waited %.1f s to be published (%s = %g s); "
                "it falls due faster than this beat publishes it: another beat on the same store "
                "shares the load (docs/scaling.md)",
                self.seconds,
                self.setting,
                threshold,
            )
            return True
        if self.warned and self.seconds <= threshold / 2:
            self.warned = False
            logger.info("delayq: this beat has caught up (due work waited %.3f s)", self.seconds)
        return False
