"""The beat's upkeep of the stored schedules: :func:`sync_config` stores the ``beat_schedule``
entries at a beat's start, and :class:`StallSweep` re-arms the schedules no beat would fire
again (every beat runs one step of it every few seconds, ``Dispatcher.chores``).

Both go through :class:`~..schedules.api.Schedules` and its store, as the API does.
"""

from __future__ import annotations

import logging
from typing import Any

from ..exceptions import CorruptData
from ..schedules.api import Schedules
from ..schedules.spec import ScheduleSpec, can_plan, read_definition, read_state, what_runs
from ..store.connection import error_text

__all__ = ["STALL_AFTER_MS", "StallSweep", "sync_config"]

logger = logging.getLogger("celery_delayq.schedules.api")


def sync_config(schedules: Schedules, entries: dict[str, Any]) -> dict[str, list[str]]:
    """Make the stored ``origin="config"`` schedules match ``entries`` (``beat_schedule``).

    ``entries`` maps a name to a ``beat_schedule`` entry (dict or
    ``celery.beat.ScheduleEntry``). New entries are added, changed ones
    replaced, unchanged ones left alone (so N beats starting at once do
    not reset each other), and config schedules no longer in ``entries``
    deleted. Schedules made through the API are never touched. Interval
    entries are anchored at the epoch, so every beat computes the same
    points; the task is not checked against the app. Returns the names ``added``,
    ``updated``, ``removed`` and ``kept_by_api`` (a config entry whose name an API
    schedule already has).
    """
    report: dict[str, list[str]] = {"added": [], "updated": [], "removed": [], "kept_by_api": []}
    store = schedules.store
    for name, entry in entries.items():
        spec = ScheduleSpec(
            name=name,
            task=_field(entry, "task"),
            rule=_field(entry, "schedule"),
            args=_field(entry, "args"),
            kwargs=_field(entry, "kwargs"),
            options=_field(entry, "options"),
            origin="config",
            dst_gap=_field(entry, "dst_gap"),
            dst_fold=_field(entry, "dst_fold"),
            overlap=_field(entry, "overlap", "allow"),
        )
        definition = schedules.definition_of(spec, check_task=False, anchor_ms=0)
        existing, _ = store.schedule(name)
        if existing is not None:
            try:
                stored = read_definition(existing, name)
            except CorruptData as exc:  # beat_schedule names it: its entry takes the place
                logger.error("delayq: %s; replaced by its beat_schedule entry", exc)
                stored = {"origin": "config", "created": definition["updated"]}
            if stored.get("origin") != "config":
                report["kept_by_api"].append(name)
                continue
            if what_runs(stored) == what_runs(definition):
                store.mark_config_schedule(name)
                continue
            definition["created"] = stored["created"]
            schedules.put_definition(definition, "put")
            report["updated"].append(name)
        elif schedules.put_definition(definition, "add"):
            report["added"].append(name)
        store.mark_config_schedule(name)
    for name in sorted(store.config_schedule_names()):
        if name in entries:
            continue
        existing, _ = store.schedule(name)
        if existing is not None and _origin(existing, name) == "config":
            schedules.delete(name)
            report["removed"].append(name)
        store.mark_config_schedule(name, False)
    return report


def _field(entry: Any, key: str, default: Any = None) -> Any:
    """``key`` of a ``beat_schedule`` entry: a dict or a ``celery.beat.ScheduleEntry``
    (``default`` when it has none)."""
    return entry.get(key, default) if isinstance(entry, dict) else getattr(entry, key, default)


def _origin(existing: str, name: str) -> str:
    """``origin`` of a stored definition; ``"config"`` for one that does not read and whose
    name is in the config registry (the beat's sync then removes it)."""
    try:
        return str(read_definition(existing, name).get("origin", "api"))
    except CorruptData:
        return "config"


#: A schedule is *stalled* when its next run is more than this (ms) in the past and its point
#: is not stored: no beat will ever fire it (see :class:`StallSweep`).
STALL_AFTER_MS = 5_000


class StallSweep:
    """Finds stalled schedules and repairs them (:meth:`.Schedules.repair`), a bounded part of
    the schedule definitions at a time; every beat runs one (``Dispatcher.chores``).

    A schedule stalls when its current point is gone while the schedule waits for it: a job
    stored under the point's id took its place (which :func:`~..store.keys.is_point_id` now refuses),
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

    def step(self, now_ms: int) -> list[tuple[str, str]]:
        """Look at the next part of the definitions; repair and log each stalled schedule.
        Returns the ``(name, stalled point id)`` of those repaired."""
        shards, store = self.schedules.keys.shards, self.schedules.store
        repaired: list[tuple[str, str]] = []
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
        self, shard: int, found: list[tuple[str, str, str | None]], now_ms: int
    ) -> list[tuple[str, str]]:
        candidates: list[tuple[str, str, int, str]] = []
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
        repaired: list[tuple[str, str]] = []
        for (name, cur, due, missed), there in zip(candidates, stored, strict=True):
            if there:
                continue
            try:
                done = self.schedules.repair(name, cur, due)
            except Exception as exc:
                logger.error(
                    "delayq: schedule %r is stalled (its point %s is gone) and cannot be re-armed here: %s",
                    name,
                    cur,
                    error_text(exc),
                )
                continue
            if done:
                repaired.append((name, cur))
                logger.warning(
                    "delayq: schedule %r was stalled: its next run %s is %.0f s past and its point "
                    "is not stored; re-armed from the point after it (missed-run policy %r)",
                    name,
                    cur,
                    (now_ms - due) / 1000.0,
                    missed,
                )
        return repaired
