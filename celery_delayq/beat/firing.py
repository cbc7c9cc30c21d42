"""Firing schedule points: a claimed job that is a schedule's point is published per the
schedule's missed-run policy, then ``lua/fire.lua`` acks it and stores the next point.

The beat's side of :mod:`..schedules.api`: :func:`plan_point` applies a schedule's missed-run
policy to a point delivered late; :meth:`ScheduleFiring.publish` publishes the points of a
pass and returns the fire calls; :meth:`ScheduleFiring.settle` runs them once the publishes
reached the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..exceptions import CorruptData
from ..schedules.api import Schedules
from ..schedules.rules import Rule, rule_from_json
from ..store.bounded import MAX_SMALL, load_json
from ..store.connection import error_text
from ..store.delivery import ClaimedJob
from ..store.envelope import Envelope
from ..store.facade import Store
from ..store.schedules import FireOutcome
from .publish import Outcome, Publisher, Publishing
from .push import PushPath
from .stats import DispatchStats

__all__ = ["FireCall", "ScheduleFiring", "next_point", "plan_point"]

logger = logging.getLogger(__name__)


def next_point(
    rule: Rule, point_ms: int, now_ms: int, missed: str, max_missed: int, grace_ms: int
) -> int | None:
    """The point to store after firing (or skipping) ``point_ms`` at ``now_ms``, per the policy.

    Points later than ``grace_ms`` are missed: ``"once"``/``"skip"`` continue from
    the first point after now, ``"all"`` from the ``max_missed``-th most recent
    missed point.

    >>> from celery_delayq.schedules.rules import IntervalRule
    >>> rule = IntervalRule(1000)
    >>> next_point(rule, 5000, 5003, "once", 10, 60_000)  # on time: the next point
    6000
    >>> next_point(rule, 5000, 30_000, "once", 10, 60_000)  # late, within grace: catch up
    6000
    >>> next_point(rule, 5000, 500_000, "once", 10, 60_000)  # after downtime: the future
    501000
    >>> next_point(rule, 5000, 500_000, "all", 3, 60_000)  # the 3 most recent missed points
    437000
    """
    following = rule.next_after(point_ms)
    if following is None or following >= now_ms - grace_ms:
        return following
    if missed == "all":
        recent = _last_points_before(rule, now_ms - grace_ms, max_missed, point_ms)
        return recent[0] if recent else following
    return rule.next_after(now_ms)


def plan_point(
    rule: Rule, point_ms: int, now_ms: int, missed: str, max_missed: int, grace_ms: int
) -> tuple[bool, int | None]:
    """``(publish this point?, the point to store next)`` for a point delivered at ``now_ms``.

    A point later than ``grace_ms`` is missed: ``"once"`` publishes it (one run
    for all the missed points), ``"skip"`` does not, ``"all"`` publishes it only
    when it is among the ``max_missed`` most recent missed points.

    >>> from celery_delayq.schedules.rules import IntervalRule
    >>> rule = IntervalRule(1000)
    >>> plan_point(rule, 5000, 5003, "skip", 10, 60_000)
    (True, 6000)
    >>> plan_point(rule, 5000, 500_000, "skip", 10, 60_000)
    (False, 501000)
    >>> plan_point(rule, 5000, 500_000, "all", 3, 60_000)
    (False, 437000)
    """
    publish = True
    if now_ms - point_ms > grace_ms:
        if missed == "skip":
            publish = False
        elif missed == "all":
            newer = _last_points_before(rule, now_ms - grace_ms, max_missed, point_ms)
            publish = len(newer) < max_missed
    return publish, next_point(rule, point_ms, now_ms, missed, max_missed, grace_ms)


def _last_points_before(rule: Rule, end_ms: int, count: int, floor_ms: int) -> list[int]:
    """The last ``count`` points in ``(floor_ms, end_ms)``, looking back in growing spans."""
    span = 60_000
    while True:
        start = max(floor_ms, end_ms - span)
        points: list[int] = []
        t = rule.next_after(start)
        while t is not None and t < end_ms:
            points.append(t)
            if len(points) > count:
                points.pop(0)
            t = rule.next_after(t)
        if len(points) >= count or start == floor_ms:
            return points
        span *= 8


@dataclass(frozen=True)
class FireCall:
    """One call of ``lua/fire.lua``: ack point ``job_id`` of schedule ``name`` (due ``at_ms``),
    record ``published`` (its id, or "" when not published), store the next point."""

    shard: int
    job_id: str
    name: str
    at_ms: int
    published: str
    next_id: str
    next_due: int
    next_envelope: str

    def args(self) -> list[Any]:
        return [
            self.job_id,
            self.name,
            self.at_ms,
            self.published,
            self.next_id,
            self.next_due,
            self.next_envelope,
        ]


class ScheduleFiring:
    """The schedule points of a beat's passes."""

    def __init__(
        self, app: Any, store: Store, token: str, stats: DispatchStats, server_now_ms: Callable[[], float]
    ) -> None:
        self.app = app
        self.store = store
        self.token = token
        self.stats = stats
        self.server_now_ms = server_now_ms
        self._schedules: Schedules | None = None

    @property
    def schedules(self) -> Schedules:
        if self._schedules is None:
            self._schedules = Schedules(self.app)
        return self._schedules

    def publish(
        self,
        publishing: Publishing,
        push_path: PushPath,
        publisher: Publisher,
        points: list[tuple[int, ClaimedJob, Envelope]],
        sent: list[int],
    ) -> list[FireCall]:
        """Publish due schedule points (per their missed-run policy) with ``publisher`` (never the
        push path: a pass on it logs once that they leave it), adding
        the due times of those published to ``sent``; return the fire calls that ack them and
        advance each schedule (run by :meth:`settle` once the publishes reached the broker)."""
        names: list[tuple[int, str]] = []
        for shard, _, envelope in points:
            assert envelope.schedule is not None
            names.append((shard, envelope.schedule[0]))
        definitions = self.store.schedule_definitions(names)
        calls: list[FireCall] = []
        max_payload = publishing.config.max_payload
        for (shard, job, envelope), raw in zip(points, definitions, strict=True):
            assert envelope.schedule is not None
            name, at_ms = envelope.schedule
            published = ""
            next_id, next_due, next_envelope = "", 0, ""
            try:
                # A definition holds the arguments as JSON values, not as the envelope's text:
                # twice the envelope's bound leaves room for that.
                limit = 2 * max_payload + MAX_SMALL
                definition = load_json(raw, f"definition of schedule {name!r}", dict, limit) if raw else None
            except CorruptData as exc:
                # Nothing to plan from: the point goes to the dead letters with the reason, and
                # the schedule stays stopped until it is stored again (upsert, or the beat's sync).
                self.stats.corrupt["definition"] += 1
                publishing.bury(job, f"schedule stopped: {exc}", envelope)
                continue
            if definition is not None and definition.get("enabled"):
                now_ms = int(self.server_now_ms())
                try:
                    rule = rule_from_json(definition["rule"])
                    publish_it, nxt = plan_point(
                        rule,
                        at_ms,
                        now_ms,
                        definition["missed"],
                        int(definition["max_missed"]),
                        int(float(definition["grace"]) * 1000),
                    )
                except Exception as exc:
                    # A definition that reads but cannot plan a point (an interval of 0 ms, an
                    # unknown rule type, a missing policy): as one that does not read, the point
                    # goes to the dead letters with the reason and the schedule stays stopped.
                    self.stats.corrupt["definition"] += 1
                    publishing.bury(
                        job,
                        f"schedule stopped: the rule or policy of schedule {name!r} cannot plan a "
                        f"point ({error_text(exc)})",
                        envelope,
                    )
                    continue
                if not publish_it:
                    logger.info("delayq: schedule %r skipped its point %s (missed-run policy)", name, job.id)
                else:
                    if push_path.pushing:
                        push_path.leaves_push("schedule points")
                    outcome = publisher.publish(shard, job, envelope)
                    if outcome is Outcome.OUTAGE:
                        break
                    if outcome is Outcome.BURIED:
                        # The point is in the dead letters; the schedule goes on from now.
                        try:
                            self.schedules.rearm(name)
                        except Exception as exc:
                            logger.error(
                                "delayq: schedule %r has no next run: its point was dead-lettered and "
                                "a new one cannot be built here: %r",
                                name,
                                exc,
                            )
                        continue
                    if outcome is not Outcome.SENT:
                        continue  # retried after its lease
                    published = job.id
                    sent.append(at_ms)
                if nxt is not None:
                    try:
                        next_id, next_envelope = self.schedules.envelope_for(definition, nxt)
                        next_due = nxt
                    except Exception as exc:  # a definition that no longer builds: say so, stop it
                        logger.error("delayq: schedule %r cannot build its next point: %r", name, exc)
            calls.append(FireCall(shard, job.id, name, at_ms, published, next_id, next_due, next_envelope))
        return calls

    def settle(self, calls: list[FireCall]) -> None:
        """Ack the published points and store the next ones (lua/fire.lua, one pipeline)."""
        if not calls:
            return
        results = self.store.fire(self.token, [(call.shard, call.args()) for call in calls])
        for call, result in zip(calls, results, strict=True):
            if result is FireOutcome.STALE:
                self.stats.stale_acks += 1
            elif result is FireOutcome.HISTORY_RESET:
                self.stats.corrupt["history"] += 1
                logger.error(
                    "delayq: schedule %r had a run state (history) that does not read; it was "
                    "reset (run count and last run lost) and the schedule goes on",
                    call.name,
                )
