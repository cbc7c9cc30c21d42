"""Recurring schedules stored in Redis: cron and intervals with timezones, managed at run time.

A schedule is a named definition in its shard's ``schedules`` hash; its next
execution point is an ordinary job in the shard's due set, with the
deterministic id ``{<name>}@<point time>`` (the braces put it on the
schedule's shard). The beat that delivers a point computes the next one and
swaps them in the same script (``lua/fire.lua``): lazy unrolling, no scan, and
a crash between claim and ack gives at most one extra run of that point,
never a skipped one. Any number of beats can run.

Missed runs (the beats were down, or a point is delivered late) are handled by
each schedule's ``missed`` policy. A point counts as *missed* when it is more
than ``grace`` seconds late:

* ``"once"`` (default): run once for all the missed points, then continue
  with the next point in the future.
* ``"skip"``: do not run missed points; continue with the next future point.
* ``"all"``: run every missed point, at most ``max_missed`` of them (the most
  recent ones), then continue.

Everything about one schedule's lifetime is here (its definition and checks, the API, the
``beat_schedule`` sync and the stall sweep), which makes this module longer than 600 lines;
it reads and writes Redis only through :class:`~celery_delayq.store.Store`.

>>> from celery import Celery
>>> schedules = Schedules(Celery(broker="redis://127.0.0.1:6390/0"))
>>> point_id("nightly-report", 1_767_225_600_000)
'{nightly-report}@2026-01-01T00:00:00.000Z'
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .bounded import MAX_SMALL, load_json
from .build import build_envelope
from .due import MAX_DUE_MS, ms_to_datetime
from .exceptions import CorruptData, InvalidSchedule, ScheduleExists, ScheduleNotFound, UnknownTask
from .keys import iso_ms as _iso_ms
from .keys import point_id
from .options import short_repr
from .result import ScheduledResult
from .rules import CronRule, IntervalRule, OnceRule, Rule, parse_rule, rule_from_json, zone
from .store import EnqueueOutcome, Store

__all__ = [
    "MISSED_POLICIES",
    "Schedule",
    "ScheduleNotFound",
    "Schedules",
    "StallSweep",
    "next_point",
    "plan_point",
    "point_id",
]

logger = logging.getLogger(__name__)

MISSED_POLICIES = ("once", "skip", "all")
DEFINITION_VERSION = 1


def can_plan(definition: dict[str, Any]) -> bool:
    """Can the beat plan points from this stored definition: a rule that reads, and a missed-run
    policy it knows? A definition that reads but cannot plan stops its schedule (its point is
    dead-lettered as ``schedule stopped: ...``) until it is stored again."""
    try:
        rule_from_json(definition["rule"])
        int(definition["max_missed"])
        int(float(definition["grace"]) * 1000)
    except (KeyError, TypeError, ValueError, OverflowError):  # (InvalidSchedule is a ValueError)
        return False
    return definition.get("missed") in MISSED_POLICIES


def _grace_ok(grace: Any) -> bool:
    """Is ``grace`` a finite number of seconds >= 0 (at most the span to year 9999)?"""
    if isinstance(grace, bool) or not isinstance(grace, int | float):
        return False
    return 0 <= grace * 1000 <= MAX_DUE_MS  # False for NaN and infinities


def read_definition(raw: Any, name: str) -> dict[str, Any]:
    """A stored schedule definition decoded (bounded, see :mod:`.bounded`), or
    :class:`CorruptData` saying why it does not read."""
    data: dict[str, Any] = load_json(raw, f"definition of schedule {name!r}")
    return data


def read_state(raw: Any) -> dict[str, Any]:
    """A stored run state (history) decoded; ``{}`` when there is none or it does not read
    (the scripts reset such a state at the schedule's next write)."""
    if not raw:
        return {}
    try:
        data: dict[str, Any] = load_json(raw, "schedule run state", dict, MAX_SMALL)
    except CorruptData:
        return {}
    return data


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidSchedule(f"schedule name must be a non-empty string, got {name!r}")
    if any(c in name for c in "{}") or len(name) > 200:
        raise InvalidSchedule(f"schedule name must be at most 200 characters without braces, got {name!r}")
    return name


@dataclass(frozen=True)
class Schedule:
    """A stored schedule with its run history."""

    name: str
    task: str
    rule: Rule
    tz: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    enabled: bool
    missed: str
    max_missed: int
    grace: float
    origin: str
    created: datetime
    updated: datetime
    last_run: datetime | None = None
    last_task_id: str | None = None
    run_count: int = 0
    next_run: datetime | None = None
    spec: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_stored(cls, definition: str, state: str | None) -> Schedule:
        """The schedule stored as ``definition`` and run ``state``; :class:`CorruptData` when
        the definition does not read (a run state that does not read counts as no runs yet)."""
        data = load_json(definition, "schedule definition")
        run = read_state(state)
        try:
            return cls._from_stored(data, run)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, OSError) as exc:
            raise CorruptData(f"schedule definition field missing or malformed: {exc!r}") from None

    @classmethod
    def _from_stored(cls, data: dict[str, Any], run: dict[str, Any]) -> Schedule:
        return cls(
            name=data["name"],
            task=data["task"],
            rule=rule_from_json(data["rule"]),
            tz=data["tz"],
            args=list(data["args"]),
            kwargs=dict(data["kwargs"]),
            options=dict(data["options"]),
            enabled=bool(data["enabled"]),
            missed=data["missed"],
            max_missed=int(data["max_missed"]),
            grace=float(data["grace"]),
            origin=data.get("origin", "api"),
            created=ms_to_datetime(data["created"]),
            updated=ms_to_datetime(data["updated"]),
            last_run=ms_to_datetime(run["last_run"]) if run.get("last_run") else None,
            last_task_id=run.get("last_task_id"),
            run_count=int(run.get("runs", 0)),
            next_run=ms_to_datetime(run["next"]) if run.get("next") else None,
            spec=_spec(data),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of everything, times in ISO-8601."""
        out: dict[str, Any] = {
            "name": self.name,
            "task": self.task,
            "rule": self.rule.to_json(),
            "rule_text": self.rule.describe(),
            "tz": self.tz,
            "args": self.args,
            "kwargs": self.kwargs,
            "options": self.options,
            "enabled": self.enabled,
            "missed": self.missed,
            "max_missed": self.max_missed,
            "grace": self.grace,
            "origin": self.origin,
            "run_count": self.run_count,
            "last_task_id": self.last_task_id,
        }
        for name in ("created", "updated", "last_run", "next_run"):
            value = getattr(self, name)
            out[name] = value.isoformat() if value else None
        return out


def _spec(data: dict[str, Any]) -> dict[str, Any]:
    """The parts of a definition that decide what runs when (not times or origin)."""
    keys = ("task", "rule", "tz", "args", "kwargs", "options", "enabled", "missed", "max_missed", "grace")
    return {k: data.get(k) for k in keys}


def next_point(
    rule: Rule, point_ms: int, now_ms: int, missed: str, max_missed: int, grace_ms: int
) -> int | None:
    """The point to store after firing (or skipping) ``point_ms`` at ``now_ms``, per the policy.

    Points later than ``grace_ms`` are missed: ``"once"``/``"skip"`` continue from
    the first point after now, ``"all"`` from the ``max_missed``-th most recent
    missed point.

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


class Schedules:
    """Create, read, change and delete the recurring schedules of one app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store: Store = Store.for_app(app)
        self.keys = self.store.keys

    # -- building ---------------------------------------------------------------------------

    def _definition(
        self,
        name: str,
        task: Any,
        rule: Any,
        args: Any,
        kwargs: Any,
        tz: str | None,
        enabled: bool,
        missed: str,
        max_missed: int,
        grace: float,
        options: dict[str, Any] | None,
        origin: str,
        check_task: bool,
        created_ms: int | None = None,
    ) -> dict[str, Any]:
        name = _check_name(name)
        task_name = task if isinstance(task, str) else getattr(task, "name", None)
        if not isinstance(task_name, str) or not task_name:
            raise InvalidSchedule(f"task must be a task or a task name, got {task!r}")
        if check_task and task_name not in self.app.tasks:
            raise UnknownTask(
                f"task {task_name!r} is not registered in this app; import its module first, "
                "or pass check_task=False",
                task=task_name,
            )
        tz = tz or self.app.conf.timezone or "UTC"
        zone(tz)
        now_ms = self.store.server_now_ms()
        parsed = parse_rule(rule, tz, anchor_ms=created_ms or now_ms, app=self.app)
        if isinstance(parsed, CronRule):
            tz = parsed.tz  # a CronRule (or stored rule) given with its own zone runs in that zone
        if args is not None and not isinstance(args, list | tuple):
            raise InvalidSchedule(f"schedule {name!r}: args must be a list or tuple, got {args!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidSchedule(f"schedule {name!r}: kwargs must be a dict, got {kwargs!r}")
        if missed not in MISSED_POLICIES:
            raise InvalidSchedule(f"missed must be one of {MISSED_POLICIES}, got {missed!r}")
        if isinstance(max_missed, bool) or not isinstance(max_missed, int) or max_missed < 1:
            raise InvalidSchedule(f"max_missed must be a whole number >= 1, got {max_missed!r}")
        if not _grace_ok(grace):
            raise InvalidSchedule(f"grace must be a finite number of seconds >= 0, got {short_repr(grace)}")
        definition = {
            "v": DEFINITION_VERSION,
            "name": name,
            "task": task_name,
            "rule": parsed.to_json(),
            "tz": tz,
            "args": list(args or ()),
            "kwargs": dict(kwargs or {}),
            "options": dict(options or {}),
            "enabled": bool(enabled),
            "missed": missed,
            "max_missed": max_missed,
            "grace": float(grace),
            "origin": origin,
            "created": created_ms or now_ms,
            "updated": now_ms,
        }
        try:
            # Stored as JSON: normalise now (tuples become lists) so a definition compares
            # equal to what is read back, and refuse what JSON cannot hold.
            normal: dict[str, Any] = json.loads(json.dumps(definition))
        except (TypeError, ValueError) as exc:
            raise InvalidSchedule(
                f"schedule {name!r}: args, kwargs and options must be JSON-serializable: {exc}"
            ) from exc
        return normal

    def envelope_for(self, definition: dict[str, Any], at_ms: int) -> tuple[str, str]:
        """``(point id, envelope)`` of ``definition``'s point at ``at_ms``."""
        task = self.app.tasks.get(definition["task"]) or definition["task"]
        pid = point_id(definition["name"], at_ms)
        envelope = build_envelope(
            self.app,
            task,
            pid,
            at_ms,
            definition["args"],
            definition["kwargs"],
            definition["options"],
            max_payload=self.store.config.max_payload,
            schedule=(definition["name"], at_ms),
        )
        return pid, envelope

    def _put(
        self, definition: dict[str, Any], mode: str, after_ms: int | None = None, stalled: str = ""
    ) -> bool:
        """Store ``definition`` and its first point after ``after_ms`` (default: now); with
        ``stalled``, only if the schedule still waits for that point and it is not stored."""
        name = definition["name"]
        point: tuple[str, int, str] = ("", 0, "")
        if definition["enabled"]:
            rule = rule_from_json(definition["rule"])
            at = rule.next_after(self.store.server_now_ms() if after_ms is None else after_ms)
            if at is not None:
                pid, envelope = self.envelope_for(definition, at)
                point = (pid, at, envelope)
        stored = json.dumps(definition, separators=(",", ":"))
        return self.store.put_schedule(name, mode, stored, point, stalled)

    def _check_paused(self, definition: dict[str, Any]) -> None:
        """A schedule created paused stores no message: build one anyway, so arguments that do
        not fit the task are refused now (as for an enabled one), not at resume."""
        if not definition["enabled"]:
            self.envelope_for(definition, self.store.server_now_ms())

    def _check_future(self, definition: dict[str, Any]) -> None:
        rule = rule_from_json(definition["rule"])
        if isinstance(rule, OnceRule) and rule.at_ms <= self.store.server_now_ms():
            raise InvalidSchedule(
                f"schedule {definition['name']!r}: the one-shot time is in the past; "
                "use task.apply_at() to run a task once now"
            )

    def rearm(self, name: str) -> bool:
        """Store a fresh next point (counted from now) for ``name``; False when it is gone.

        The beat calls this when a point could not be delivered and was
        dead-lettered, so the schedule goes on with its next run.
        """
        definition, _ = self._raw(name)
        if definition is None:
            return False
        return self._put(read_definition(definition, name), "put")

    def repair(self, name: str, stalled_id: str, stalled_ms: int) -> bool:
        """Re-arm a stalled schedule: one whose current point ``stalled_id`` (due at
        ``stalled_ms``) is in the past and no longer stored, so no beat will ever fire it.

        The point after it is stored, due in the past, so the beats deliver it at once and
        the schedule's missed-run policy decides what runs (as after any downtime). In one
        script, and only if the schedule still waits for ``stalled_id`` and no job with that
        id is stored: False when it does not (a beat fired it, or it was changed, meanwhile).
        """
        definition, _ = self._raw(name)
        if definition is None:
            return False
        return self._put(read_definition(definition, name), "put", after_ms=stalled_ms, stalled=stalled_id)

    def _raw(self, name: str) -> tuple[str | None, str | None]:
        return self.store.schedule(name)

    # -- the API ----------------------------------------------------------------------------

    def add(
        self,
        name: str,
        task: Any,
        rule: Any,
        args: Any = None,
        kwargs: Any = None,
        *,
        tz: str | None = None,
        enabled: bool = True,
        missed: str = "once",
        max_missed: int = 10,
        grace: float = 60.0,
        options: dict[str, Any] | None = None,
        check_task: bool = True,
        origin: str = "api",
    ) -> Schedule:
        """Create a schedule; :class:`ScheduleExists` when the name is taken.

        ``rule``: a cron string (5 fields, or 6 with seconds last), ``crontab()``,
        ``schedule(timedelta)``, a ``timedelta`` or seconds (interval), or a
        datetime (one-shot). ``tz`` is an IANA timezone for cron rules (default:
        the app's ``timezone``, else UTC). ``options`` are ``apply_async``'s.
        Everything is validated, and the first message built, before anything
        is stored.
        """
        definition = self._definition(
            name,
            task,
            rule,
            args,
            kwargs,
            tz,
            enabled,
            missed,
            max_missed,
            grace,
            options,
            origin,
            check_task,
        )
        self._check_paused(definition)
        self._check_future(definition)
        if not self._put(definition, "add"):
            raise ScheduleExists(f"a schedule named {name!r} exists; use upsert() or update()", name=name)
        return self._get_or_fail(name)

    def upsert(
        self,
        name: str,
        task: Any,
        rule: Any,
        args: Any = None,
        kwargs: Any = None,
        *,
        tz: str | None = None,
        enabled: bool = True,
        missed: str = "once",
        max_missed: int = 10,
        grace: float = 60.0,
        options: dict[str, Any] | None = None,
        check_task: bool = True,
        origin: str = "api",
    ) -> Schedule:
        """Create or replace a schedule (its run history is kept)."""
        existing, _ = self._raw(_check_name(name))
        created = _created(existing, name)
        definition = self._definition(
            name,
            task,
            rule,
            args,
            kwargs,
            tz,
            enabled,
            missed,
            max_missed,
            grace,
            options,
            origin,
            check_task,
            created,
        )
        self._check_paused(definition)
        self._check_future(definition)
        self._put(definition, "put")
        return self._get_or_fail(name)

    def get(self, name: str) -> Schedule | None:
        definition, state = self._raw(_check_name(name))
        return Schedule.from_stored(definition, state) if definition else None

    def _get_or_fail(self, name: str) -> Schedule:
        schedule = self.get(name)
        if schedule is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        return schedule

    def update(self, name: str, **changes: Any) -> Schedule:
        """Change some fields (``rule``, ``args``, ``kwargs``, ``tz``, ``options``, ``missed``,
        ``max_missed``, ``grace``, ``enabled``, ``task``); the new rule counts from now."""
        current = self._get_or_fail(name)
        allowed = {
            "task",
            "rule",
            "args",
            "kwargs",
            "tz",
            "options",
            "missed",
            "max_missed",
            "grace",
            "enabled",
        }
        unknown = set(changes) - allowed
        if unknown:
            raise InvalidSchedule(f"cannot update {sorted(unknown)}; fields are {sorted(allowed)}")
        rule: Any = changes.get("rule", current.rule)
        tz = changes.get("tz", current.tz)
        if "tz" in changes and "rule" not in changes and current.rule.kind == "cron":
            rule = current.rule.to_json()["expr"]
        definition = self._definition(
            name,
            changes.get("task", current.task),
            rule,
            changes.get("args", current.args),
            changes.get("kwargs", current.kwargs),
            tz,
            changes.get("enabled", current.enabled),
            changes.get("missed", current.missed),
            changes.get("max_missed", current.max_missed),
            changes.get("grace", current.grace),
            changes.get("options", current.options),
            current.origin,
            "task" in changes,
            round(current.created.timestamp() * 1000),
        )
        self._put(definition, "put")
        return self._get_or_fail(name)

    def pause(self, name: str) -> Schedule:
        """Stop firing (the waiting point is removed); ``resume`` starts again from now."""
        return self.update(name, enabled=False)

    def resume(self, name: str) -> Schedule:
        return self.update(name, enabled=True)

    def delete(self, name: str) -> bool:
        """Delete the schedule and its waiting point; False when there was none."""
        return self.store.delete_schedule(_check_name(name))

    def run_now(self, name: str) -> ScheduledResult:
        """Run the schedule's task once now, outside its rule (the schedule is unchanged)."""
        current = self._get_or_fail(name)
        definition = read_definition(self._raw(name)[0] or "{}", name)
        now_ms = self.store.server_now_ms()
        task_id = "{" + current.name + "}@run-now-" + _iso_ms(now_ms)
        task = self.app.tasks.get(current.task) or current.task
        envelope = build_envelope(
            self.app,
            task,
            task_id,
            now_ms,
            definition["args"],
            definition["kwargs"],
            definition["options"],
            max_payload=self.store.config.max_payload,
        )
        ((status, due),) = self.store.enqueue([(task_id, now_ms, envelope)])
        return ScheduledResult(
            task_id,
            app=self.app,
            task_name=current.task,
            due=ms_to_datetime(due),
            created=status is not EnqueueOutcome.KEPT,
        )

    def list(
        self, task: str | None = None, enabled: bool | None = None, page_size: int = 500
    ) -> Iterator[Schedule]:
        """Every schedule (optionally of one task, or only enabled/paused ones), shard by shard."""
        for shard in range(self.keys.shards):
            cursor = 0
            while True:
                cursor, found = self.store.schedule_page(shard, cursor, page_size)
                if found:
                    for name, definition, state in found:
                        try:
                            schedule = Schedule.from_stored(definition, state)
                        except CorruptData as exc:
                            logger.error("delayq: schedule %r is not listed: %s (store it again "
                                         "with upsert, or delete it)", name, exc)
                            continue
                        if task is not None and schedule.task != task:
                            continue
                        if enabled is not None and schedule.enabled != enabled:
                            continue
                        yield schedule
                if cursor == 0:
                    break

    def sync_config(self, entries: dict[str, Any]) -> dict[str, builtins.list[str]]:
        """Make the stored ``origin="config"`` schedules match ``entries`` (``beat_schedule``).

        ``entries`` maps a name to a ``beat_schedule`` entry (dict or
        ``celery.beat.ScheduleEntry``). New entries are added, changed ones
        replaced, unchanged ones left alone (so N beats starting at once do
        not reset each other), and config schedules no longer in ``entries``
        deleted. Schedules made through the API are never touched. Interval
        entries are anchored at the epoch, so every beat computes the same
        points. Returns the names ``added``, ``updated``, ``removed`` and
        ``kept_by_api`` (a config entry whose name an API schedule already has).
        """
        report: dict[str, builtins.list[str]] = {"added": [], "updated": [], "removed": [], "kept_by_api": []}
        store = self.store
        for name, entry in entries.items():
            get = entry.get if isinstance(entry, dict) else lambda k, d=None, e=entry: getattr(e, k, d)
            options = dict(get("options") or {})
            definition = self._definition(
                name,
                get("task"),
                get("schedule"),
                get("args"),
                get("kwargs"),
                None,
                True,
                "once",
                10,
                60.0,
                options,
                "config",
                False,
                created_ms=0,
            )
            rule = parse_rule(get("schedule"), definition["tz"], anchor_ms=0)
            if isinstance(rule, IntervalRule):
                definition["rule"] = rule.to_json()
            existing, _ = self._raw(name)
            if existing is not None:
                try:
                    stored = read_definition(existing, name)
                except CorruptData as exc:  # beat_schedule names it: its entry takes the place
                    logger.error("delayq: %s; replaced by its beat_schedule entry", exc)
                    stored = {"origin": "config", "created": definition["updated"]}
                if stored.get("origin") != "config":
                    report["kept_by_api"].append(name)
                    continue
                if _spec(stored) == _spec(definition):
                    store.mark_config_schedule(name)
                    continue
                definition["created"] = stored["created"]
                self._put(definition, "put")
                report["updated"].append(name)
            else:
                definition["created"] = definition["updated"]
                if self._put(definition, "add"):
                    report["added"].append(name)
            store.mark_config_schedule(name)
        for name in sorted(store.config_schedule_names()):
            if name in entries:
                continue
            existing, _ = self._raw(name)
            if existing is not None and _origin(existing, name) == "config":
                self.delete(name)
                report["removed"].append(name)
            store.mark_config_schedule(name, False)
        return report

    def count(self) -> int:
        return self.store.count_schedules()


#: A schedule is *stalled* when its next run is more than this (ms) in the past and its point
#: is not stored: no beat will ever fire it (see :class:`StallSweep`).
STALL_AFTER_MS = 5_000


class StallSweep:
    """Finds stalled schedules and repairs them (:meth:`Schedules.repair`), a bounded part of
    the schedule definitions at a time; every beat runs one (``Dispatcher.chores``).

    A schedule stalls when its current point is gone while the schedule waits for it: a job
    stored under the point's id took its place (which :func:`~.keys.is_point_id` now refuses),
    or a point that was dead-lettered could not be re-armed. Each :meth:`step` reads at most
    one ``HSCAN`` page (``page`` names) per shard, at most one lap of the shards, continuing
    where the last step stopped, with the run states of the names found (``HMGET``); only a
    schedule whose next run is over :data:`STALL_AFTER_MS` past costs one more read (is its
    point stored?) and, when it is stalled, the repair script. A lap starts with one look
    whether any shard holds a schedule (:meth:`.Store.may_hold_schedules`): with none, that
    is the whole step, so an idle beat with no schedules costs one command a step.
    """

    def __init__(self, schedules: Schedules, page: int = 500) -> None:
        self.schedules = schedules
        self.page = page
        self._shard = 0
        self._cursor = 0

    def step(self, now_ms: int) -> builtins.list[tuple[str, str]]:
        """Look at the next part of the definitions; repair and log each stalled schedule.
        Returns the ``(name, stalled point id)`` of those repaired."""
        shards, store = self.schedules.keys.shards, self.schedules.store
        repaired: builtins.list[tuple[str, str]] = []
        if self._shard == 0 and self._cursor == 0 and not store.may_hold_schedules():
            return repaired
        for _ in range(shards):
            shard = self._shard
            self._cursor, found = store.schedule_page(shard, self._cursor, self.page)
            if found:
                repaired.extend(self._repair(shard, found, now_ms))
            if self._cursor == 0:
                self._shard = (self._shard + 1) % shards
                if self._shard == 0:
                    break  # one lap at most per step
            else:
                break  # a big shard: the next step goes on from here
        return repaired

    def _repair(
        self, shard: int, found: builtins.list[tuple[str, str, str | None]], now_ms: int
    ) -> builtins.list[tuple[str, str]]:
        candidates: builtins.list[tuple[str, str, int, str]] = []
        for name, raw, state in found:
            try:
                definition = read_definition(raw, name)
            except CorruptData:
                continue  # a definition that does not read is not this sweep's to mend
            run = read_state(state)
            if not (isinstance(definition, dict) and definition.get("enabled") and isinstance(run, dict)):
                continue
            if not can_plan(definition):
                continue  # its point was dead-lettered as "schedule stopped" (firing.py): nor this
            cur, due = run.get("cur"), run.get("next")
            if isinstance(cur, str) and isinstance(due, int | float) and due < now_ms - STALL_AFTER_MS:
                candidates.append((name, cur, int(due), str(definition.get("missed"))))
        if not candidates:
            return []
        stored = self.schedules.store.are_stored(shard, [cur for _, cur, _, _ in candidates])
        repaired: builtins.list[tuple[str, str]] = []
        for (name, cur, due, missed), there in zip(candidates, stored, strict=True):
            if there:
                continue
            try:
                done = self.schedules.repair(name, cur, due)
            except Exception as exc:
                logger.error("delayq: schedule %r is stalled (its point %s is gone) and cannot be "
                             "re-armed here: %r", name, cur, exc)
                continue
            if done:
                repaired.append((name, cur))
                logger.warning(
                    "delayq: schedule %r was stalled: its next run %s is %.0f s past and its point "
                    "is not stored; re-armed from the point after it (missed-run policy %r)",
                    name, cur, (now_ms - due) / 1000.0, missed,
                )
        return repaired


def _created(existing: str | None, name: str) -> Any:
    """The ``created`` time of a stored definition; None when there is none or it does not
    read (``upsert`` then replaces the corrupt entry as if it were new)."""
    if existing is None:
        return None
    try:
        return read_definition(existing, name).get("created")
    except CorruptData:
        return None


def _origin(existing: str, name: str) -> str:
    """``origin`` of a stored definition; ``"config"`` for one that does not read and whose
    name is in the config registry (the beat's sync then removes it)."""
    try:
        return str(read_definition(existing, name).get("origin", "api"))
    except CorruptData:
        return "config"
