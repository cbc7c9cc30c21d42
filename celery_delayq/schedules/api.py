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

A schedule is defined by a :class:`~.spec.ScheduleSpec`, a frozen value checked when
it is built (:mod:`.spec`); :class:`Schedules` stores and manages them through
:class:`~celery_delayq.store.facade.Store`. The beat's side lives elsewhere: firing points per the
policy in :mod:`..beat.firing`, the ``beat_schedule`` sync and the stall sweep in
:mod:`..beat.upkeep`.

>>> from celery import Celery
>>> schedules = Schedules(Celery(broker="redis://127.0.0.1:6390/0"))
>>> point_id("nightly-report", 1_767_225_600_000)
'{nightly-report}@2026-01-01T00:00:00.000Z'
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from ..due import ms_to_datetime
from ..exceptions import CorruptData, InvalidSchedule, ScheduleExists, ScheduleNotFound, UnknownTask
from ..flow.gate import GATE_HEADER
from ..producer.build import build_envelope
from ..producer.result import ScheduledResult
from ..store.facade import Store, get_store
from ..store.jobs import EnqueueOutcome
from ..store.keys import iso_ms as _iso_ms
from ..store.keys import point_id
from .rules import OnceRule, parse_rule, rule_from_json
from .spec import UPDATABLE, Schedule, ScheduleSpec, check_name, overlap_key, read_definition, spec_of

__all__ = ["Schedules", "point_id"]

logger = logging.getLogger(__name__)


class Schedules:
    """Create, read, change and delete the recurring schedules of one app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store: Store = get_store(app)
        self.keys = self.store.keys

    # -- building ---------------------------------------------------------------------------

    def definition_of(
        self,
        spec: ScheduleSpec,
        check_task: bool = True,
        created_ms: int | None = None,
        anchor_ms: int | None = None,
    ) -> dict[str, Any]:
        """The definition to store for ``spec`` in this app (see :meth:`ScheduleSpec.to_stored`);
        :class:`UnknownTask` when ``check_task`` and the app has no such task."""
        if check_task and spec.task not in self.app.tasks:
            raise UnknownTask(
                f"task {spec.task!r} is not registered in this app; import its module first, "
                "or pass check_task=False",
                task=spec.task,
            )
        default_tz = self.app.conf.timezone or "UTC"
        return spec.to_stored(default_tz, self.store.server_now_ms(), created_ms, anchor_ms)

    def envelope_for(self, definition: dict[str, Any], at_ms: int) -> tuple[str, str]:
        """``(point id, envelope)`` of ``definition``'s point at ``at_ms``."""
        task = self.app.tasks.get(definition["task"]) or definition["task"]
        pid = point_id(definition["name"], at_ms)
        options = definition["options"]
        if definition.get("overlap", "allow") != "allow":
            # its run holds the schedule's slot: the worker renews it and gives it back
            # (flow/slots.py) as it does a capped job's
            headers = {
                **(options.get("headers") or {}),
                GATE_HEADER: {"key": overlap_key(definition["name"])},
            }
            options = {**options, "headers": headers}
        envelope = build_envelope(
            self.app,
            task,
            pid,
            at_ms,
            definition["args"],
            definition["kwargs"],
            options,
            max_payload=self.store.config.max_payload,
            schedule=(definition["name"], at_ms),
        )
        return pid, envelope

    def put_definition(
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
        return self.put_definition(read_definition(definition, name), "put")

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
        stored = read_definition(definition, name)
        return self.put_definition(stored, "put", after_ms=stalled_ms, stalled=stalled_id)

    def _raw(self, name: str) -> tuple[str | None, str | None]:
        return self.store.schedule(name)

    # -- the API ----------------------------------------------------------------------------

    def add(
        self, spec: ScheduleSpec | str | None = None, *parts: Any, check_task: bool = True, **fields: Any
    ) -> Schedule:
        """Create a schedule; :class:`ScheduleExists` when the name is taken.

        Takes a :class:`ScheduleSpec`, or its fields: ``add(name, task, rule, args=None,
        kwargs=None, *, tz=None, enabled=True, missed="once", max_missed=10, grace=60.0,
        options=None, origin="api", dst_gap=None, dst_fold=None, overlap="allow")``.
        ``rule``: a cron string (5 fields, or 6 with seconds last), ``crontab()``,
        ``schedule(timedelta)``, a ``timedelta`` or seconds (interval), or a datetime
        (one-shot). ``tz`` is an IANA timezone for cron rules (default: the
        app's ``timezone``, else UTC). ``options`` are ``apply_async``'s. With
        ``check_task``, the task must be registered in the app. Everything is validated,
        and the first message built, before anything is stored.
        """
        spec = spec_of("add", spec, parts, fields)
        definition = self.definition_of(spec, check_task)
        self._check_paused(definition)
        self._check_future(definition)
        if not self.put_definition(definition, "add"):
            taken = f"a schedule named {spec.name!r} exists; use upsert() or update()"
            raise ScheduleExists(taken, name=spec.name)
        return self._get_or_fail(spec.name)

    def upsert(
        self, spec: ScheduleSpec | str | None = None, *parts: Any, check_task: bool = True, **fields: Any
    ) -> Schedule:
        """Create or replace a schedule (its run history and creation time are kept); takes
        what :meth:`add` takes."""
        spec = spec_of("upsert", spec, parts, fields)
        existing, _ = self._raw(spec.name)
        definition = self.definition_of(spec, check_task, _created(existing, spec.name))
        self._check_paused(definition)
        self._check_future(definition)
        self.put_definition(definition, "put")
        return self._get_or_fail(spec.name)

    def get(self, name: str) -> Schedule | None:
        definition, state = self._raw(check_name(name))
        return Schedule.from_stored(definition, state) if definition else None

    def _get_or_fail(self, name: str) -> Schedule:
        schedule = self.get(name)
        if schedule is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        return schedule

    def update(self, name: str, **changes: Any) -> Schedule:
        """Change some fields (``rule``, ``args``, ``kwargs``, ``tz``, ``options``, ``missed``,
        ``max_missed``, ``grace``, ``enabled``, ``task``, ``dst_gap``, ``dst_fold``); the new rule
        counts from now. A cron keeps its DST choices when its rule changes to another cron
        (``"cron"`` puts today's rule back), and drops them when it becomes an interval or a
        one-shot."""
        current = self._get_or_fail(name)
        unknown = set(changes) - set(UPDATABLE)
        if unknown:
            raise InvalidSchedule(f"cannot update {sorted(unknown)}; fields are {sorted(UPDATABLE)}")
        if "rule" in changes and parse_rule(changes["rule"], current.tz).kind != "cron":
            # The DST choices of a cron that becomes an interval or a one-shot go with it.
            changes.setdefault("dst_gap", None)
            changes.setdefault("dst_fold", None)
        if "tz" in changes and "rule" not in changes and current.rule.kind == "cron":
            changes["rule"] = current.rule.to_json()["expr"]  # the same expression, in the new zone
        spec = current.to_spec(**changes)
        definition = self.definition_of(spec, "task" in changes, round(current.created.timestamp() * 1000))
        self.put_definition(definition, "put")
        return self._get_or_fail(name)

    def pause(self, name: str) -> Schedule:
        """Stop firing (the waiting point is removed); ``resume`` starts again from now."""
        return self.update(name, enabled=False)

    def resume(self, name: str) -> Schedule:
        return self.update(name, enabled=True)

    def delete(self, name: str) -> bool:
        """Delete the schedule and its waiting point; False when there was none."""
        return self.store.delete_schedule(check_name(name))

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
                            logger.error(
                                "delayq: schedule %r is not listed: %s (store it again "
                                "with upsert, or delete it)",
                                name,
                                exc,
                            )
                            continue
                        if task is not None and schedule.task != task:
                            continue
                        if enabled is not None and schedule.enabled != enabled:
                            continue
                        yield schedule
                if cursor == 0:
                    break

    def count(self) -> int:
        return self.store.count_schedules()


def _created(existing: str | None, name: str) -> Any:
    """The ``created`` time of a stored definition; None when there is none or it does not
    read (``upsert`` then replaces the corrupt entry as if it were new)."""
    if existing is None:
        return None
    try:
        return read_definition(existing, name).get("created")
    except CorruptData:
        return None
