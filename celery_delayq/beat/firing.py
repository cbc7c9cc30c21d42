"""Firing schedule points: a claimed job that is a schedule's point is published per the
schedule's missed-run policy (and, for a schedule with an overlap policy, per what
``lua/overlap.lua`` says of the run in flight), then ``lua/fire.lua`` acks it and stores the
next point.

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
from ..flow.gate import GATE_TOKEN
from ..schedules.api import Schedules
from ..schedules.rules import Rule, rule_from_json
from ..schedules.spec import OVERLAP_POLICIES, overlap_key
from ..store.bounded import MAX_SMALL, load_json
from ..store.connection import REDIS_ERRORS, error_text, redis_error_kind
from ..store.delivery import ClaimedJob
from ..store.envelope import Envelope
from ..store.facade import Store
from ..store.schedules import FireOutcome, OverlapAnswer
from .publish import Outcome, Publisher, Publishing
from .push import PushPath
from .stats import DispatchStats

__all__ = ["FireCall", "ScheduleFiring", "next_point", "plan_point"]

logger = logging.getLogger(__name__)

#: The longest a point waiting for a run in flight to end (overlap ``buffer_one``) waits before
#: a beat looks again: it runs within this of the run's end.
OVERLAP_POLL_MS = 1000


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
    #: the lease token to fire with: "" for the beat's own; "gate" for a point of a schedule
    #: with an overlap policy, which ``lua/overlap.lua`` handed to its slot
    token: str = ""

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
            token = ""  # fired with this beat's token, unless overlap.lua handed the point on
            if definition is not None and definition.get("enabled"):
                now_ms = int(self.server_now_ms())
                try:
                    rule = rule_from_json(definition["rule"])
                    overlap = definition.get("overlap", "allow")
                    if overlap not in OVERLAP_POLICIES:
                        raise ValueError(f"unknown overlap policy {overlap!r}")
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
                said = False  # the skip is logged already
                if overlap != "allow":
                    answer = self._ask_overlap(shard, job, name, overlap)
                    if answer is None or answer.decision in ("not-held", "wait"):
                        continue  # kept for its lease (a Redis error), another beat's, or waits
                    if answer.decision == "skip":
                        publish_it, said = False, True
                        logger.info(
                            "delayq: schedule %r skipped its point %s: its run %s is still in flight "
                            "(overlap skip)",
                            name,
                            job.id,
                            ", ".join(answer.running),
                        )
                    else:
                        token = GATE_TOKEN  # overlap.lua handed the point to the slot's scripts
                        if answer.waited:  # buffer_one: it runs now, however late, once, and
                            # the points that came due while it waited are folded into it
                            publish_it, nxt = True, rule.next_after(now_ms)
                        elif not publish_it:  # the missed-run policy skips it: no run holds the slot
                            self._give_back(job.id, name)
                        if answer.decision == "cancel" and publish_it:
                            self._revoke(name, job.id, answer.running)
                if not publish_it:
                    if not said:
                        logger.info(
                            "delayq: schedule %r skipped its point %s (missed-run policy)", name, job.id
                        )
                else:
                    if push_path.pushing:
                        push_path.leaves_push("schedule points")
                    outcome = publisher.publish(shard, job, envelope)
                    if outcome is Outcome.OUTAGE:
                        break
                    if outcome is Outcome.BURIED:
                        if token:
                            self._give_back(job.id, name)
                        # The point is in the dead letters; the schedule goes on from now.
                        try:
                            self.schedules.rearm(name)
                        except Exception as exc:
                            logger.error(
                                "delayq: schedule %r has no next run: its point was dead-lettered and "
                                "a new one cannot be built here: %s",
                                name,
                                error_text(exc),
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
                        logger.error(
                            "delayq: schedule %r cannot build its next point: %s", name, error_text(exc)
                        )
            calls.append(
                FireCall(shard, job.id, name, at_ms, published, next_id, next_due, next_envelope, token)
            )
        return calls

    def _ask_overlap(self, shard: int, job: ClaimedJob, name: str, policy: str) -> OverlapAnswer | None:
        """``lua/overlap.lua``'s answer for a due point of schedule ``name`` with overlap
        ``policy``; None on a Redis error (logged: the point keeps this beat's lease and is
        claimed again after it)."""
        try:
            answer = self.store.overlap(
                self.token,
                shard,
                job.id,
                overlap_key(name),
                policy,
                int(self.store.config.start_ttl * 1000),
                OVERLAP_POLL_MS,
            )
        except REDIS_ERRORS as exc:
            self.stats.redis_errors[redis_error_kind(exc)] += 1
            self.stats.overlap["error"] += 1
            logger.error(
                "delayq: schedule %r: cannot look whether a run of it is in flight (%s); its point "
                "%s is claimed again after its lease (%.0f s)",
                name,
                error_text(exc),
                job.id,
                self.store.config.reclaim_ttl,
            )
            return None
        self.stats.overlap[answer.decision] += 1
        return answer

    def _give_back(self, job_id: str, name: str) -> None:
        """Give back the slot ``lua/overlap.lua`` took for point ``job_id``, which is not
        published (skipped by the missed-run policy, or dead-lettered). Never raises: a slot
        not given back expires after ``delayq_start_ttl``."""
        try:
            self.store.release(job_id, overlap_key(name), "failed", None)
        except REDIS_ERRORS as exc:
            logger.error(
                "delayq: schedule %r: the slot of its unpublished point %s cannot be given back "
                "(%s); its next runs wait up to delayq_start_ttl (%.0f s) for it to expire",
                name,
                job_id,
                error_text(exc),
                self.store.config.start_ttl,
            )

    def _revoke(self, name: str, job_id: str, running: tuple[str, ...]) -> None:
        """Overlap ``cancel_previous``: revoke the runs in flight of schedule ``name`` (a worker
        terminates a running one, with the prefork pool, and drops one it has not started) and
        say so. Never raises: a revoke the broker cannot take is logged, and the new point runs
        all the same."""
        ids = [run for run in running if run != job_id]
        if not ids:
            return
        logger.warning(
            "delayq: schedule %r: its point %s revokes the run(s) still in flight: %s (overlap "
            "cancel_previous)",
            name,
            job_id,
            ", ".join(ids),
        )
        try:
            self.app.control.revoke(ids, terminate=True)
        except Exception as exc:
            logger.error("delayq: schedule %r: cannot revoke %s: %s", name, ", ".join(ids), error_text(exc))

    def settle(self, calls: list[FireCall]) -> None:
        """Ack the published points and store the next ones (lua/fire.lua, one pipeline)."""
        if not calls:
            return
        own = [call for call in calls if not call.token]
        handed = [call for call in calls if call.token]
        results = self.store.fire(self.token, [(call.shard, call.args()) for call in own])
        if handed:
            results += self.store.fire(GATE_TOKEN, [(call.shard, call.args()) for call in handed])
        for call, result in zip(own + handed, results, strict=True):
            if result is FireOutcome.STALE:
                self.stats.stale_acks += 1
            elif result is FireOutcome.HISTORY_RESET:
                self.stats.corrupt["history"] += 1
                logger.error(
                    "delayq: schedule %r had a run state (history) that does not read; it was "
                    "reset (run count and last run lost) and the schedule goes on",
                    call.name,
                )
