"""What a schedule is: the :class:`ScheduleSpec` a caller writes, checked when it is built, its
stored form (the definition in the shard's ``schedules`` hash, JSON), and the stored
:class:`Schedule` read back with its run history.

Nothing here talks to Redis: :class:`~.api.Schedules` stores specs, the beat reads
definitions (:mod:`..beat.firing`, :mod:`..beat.upkeep`).

>>> spec = ScheduleSpec(name="report", task="proj.report", rule=3600)
>>> spec.tz is None, spec.enabled, spec.max_missed
(True, True, 10)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from ..due import MAX_DUE_MS, ms_to_datetime
from ..exceptions import CorruptData, InvalidSchedule
from ..producer.options import short_repr
from ..store.bounded import MAX_SMALL, load_json
from .rules import CronRule, Rule, check_dst, parse_rule, rule_from_json, zone

__all__ = ["MISSED_POLICIES", "OVERLAP_POLICIES", "Schedule", "ScheduleSpec", "overlap_key"]

#: The missed-run policies (see :mod:`.api`).
MISSED_POLICIES = ("once", "skip", "all")
#: What a point does when a run of its schedule is still in flight (docs/schedules.md,
#: "Overlapping runs"): run anyway, be skipped, wait for it to end (one point waits at most:
#: a schedule stores one point), or revoke it and run.
OVERLAP_POLICIES = ("allow", "skip", "buffer_one", "cancel_previous")
#: The version of the stored definition (its ``v``).
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
    return (
        definition.get("missed") in MISSED_POLICIES and definition.get("overlap", "allow") in OVERLAP_POLICIES
    )


def overlap_key(name: str) -> str:
    """The flow-control key whose one slot the runs of schedule ``name`` hold when it has an
    overlap policy: the name itself, so the slot lives on the schedule's shard (its points'
    ids carry the name's hash tag, ``{name}@...``), as a capped job's slot lives on its key's.

    >>> overlap_key("nightly-report")
    'nightly-report'
    """
    return name


def check_overlap(name: str, policy: Any) -> str:
    """``policy`` when schedule ``name`` may have it: one of :data:`OVERLAP_POLICIES`, and a
    policy but "allow" only for a name without ``|`` (it names the slot's key);
    :class:`InvalidSchedule` otherwise."""
    if policy not in OVERLAP_POLICIES:
        raise InvalidSchedule(
            f"overlap must be one of {', '.join(OVERLAP_POLICIES)}, got {short_repr(policy)}"
        )
    if policy != "allow" and "|" in name:
        raise InvalidSchedule(
            f"schedule {name!r}: overlap={policy!r} needs a name without '|' (its runs hold "
            "the slot of the flow-control key of its name)"
        )
    return str(policy)


def _grace_ok(grace: Any) -> bool:
    """Is ``grace`` a finite number of seconds >= 0 (at most the span to year 9999)?"""
    if isinstance(grace, bool) or not isinstance(grace, int | float):
        return False
    return 0 <= grace * 1000 <= MAX_DUE_MS  # False for NaN and infinities


def read_definition(raw: Any, name: str) -> dict[str, Any]:
    """A stored schedule definition decoded (bounded, see :mod:`..store.bounded`), or
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


def check_name(name: Any) -> str:
    """``name`` when it can name a schedule (it is a key, and part of each point's id);
    :class:`InvalidSchedule` otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidSchedule(f"schedule name must be a non-empty string, got {name!r}")
    if any(c in name for c in "{}") or len(name) > 200:
        raise InvalidSchedule(f"schedule name must be at most 200 characters without braces, got {name!r}")
    return name


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What a schedule is defined by: everything :meth:`.Schedules.add` and
    :meth:`.Schedules.upsert` store, each default written here once, checked when it is built.

    A bad field raises what ``add()`` raises for it (:class:`InvalidSchedule`, with the same
    message), at construction. ``task`` may be a task object: its name is kept. ``rule`` is
    kept as given (a cron string, ``crontab()``, ``schedule()``, a ``timedelta`` or seconds,
    a ``datetime``, a rule object, or a rule's ``to_json()`` dict); it is read in the
    schedule's zone, and an interval anchored, when it is stored (:meth:`to_stored`).
    ``tz=None`` stands for the app's ``timezone``, else UTC. What only the app can tell (is
    the task registered, do the arguments fit it) is checked by ``add()``/``upsert()``.

    >>> spec = ScheduleSpec(name="digest", task="proj.digest", rule="0 18 * * 1-5", args=["paris"])
    >>> spec.args, spec.missed, spec.grace
    (('paris',), 'once', 60.0)
    >>> ScheduleSpec(name="digest", task="proj.digest", rule="0 18 * *")
    Traceback (most recent call last):
      ...
    celery_delayq.exceptions.InvalidSchedule: cron expression must have 5 fields ... got '0 18 * *'
    """

    name: str
    task: str
    rule: Any
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    tz: str | None = None
    enabled: bool = True
    missed: str = "once"
    max_missed: int = 10
    grace: float = 60.0
    options: Mapping[str, Any] = field(default_factory=dict)
    origin: str = "api"
    #: a cron's rule for a wall time that does not exist: "jump", "skip", "cron" (today's rule),
    #: or None (the rule's own choice, if it is a CronRule that has one; else today's rule)
    dst_gap: str | None = None
    #: a cron's rule for a wall time that exists twice: "first", "both", "last", "cron", or None
    dst_fold: str | None = None
    #: what a point does while a run of the schedule is in flight: one of OVERLAP_POLICIES
    overlap: str = "allow"

    def __post_init__(self) -> None:
        name = check_name(self.name)
        task = self.task if isinstance(self.task, str) else getattr(self.task, "name", None)
        if not isinstance(task, str) or not task:
            raise InvalidSchedule(f"task must be a task or a task name, got {self.task!r}")
        if self.tz:
            zone(self.tz)
        rule = parse_rule(self.rule, self.tz or "UTC")  # its errors now; read again in its zone when stored
        check_dst(self.dst_gap, self.dst_fold)  # kept as given: "cron" resets a rule's own choice
        chosen = {self.dst_gap, self.dst_fold} - {None, "cron"}
        if chosen and not isinstance(rule, CronRule):
            raise InvalidSchedule(
                f"schedule {name!r}: dst_gap and dst_fold apply to cron rules only, not to {rule.kind} rules"
            )
        args, kwargs = self.args, self.kwargs
        if args is not None and not isinstance(args, list | tuple):
            raise InvalidSchedule(f"schedule {name!r}: args must be a list or tuple, got {args!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidSchedule(f"schedule {name!r}: kwargs must be a dict, got {kwargs!r}")
        if self.missed not in MISSED_POLICIES:
            raise InvalidSchedule(f"missed must be one of {MISSED_POLICIES}, got {self.missed!r}")
        check_overlap(name, self.overlap)
        max_missed = self.max_missed
        if isinstance(max_missed, bool) or not isinstance(max_missed, int) or max_missed < 1:
            raise InvalidSchedule(f"max_missed must be a whole number >= 1, got {max_missed!r}")
        if not _grace_ok(self.grace):
            grace = short_repr(self.grace)
            raise InvalidSchedule(f"grace must be a finite number of seconds >= 0, got {grace}")
        # Copies, so the caller's lists and dicts are not shared with the spec.
        normal = {
            "name": name,
            "task": task,
            "args": tuple(args or ()),
            "kwargs": dict(kwargs or {}),
            "options": dict(self.options or {}),
            "enabled": bool(self.enabled),
            "grace": float(self.grace),
        }
        try:  # stored as JSON: refuse now what JSON cannot hold
            json.dumps([normal["args"], normal["kwargs"], normal["options"]])
        except (TypeError, ValueError) as exc:
            raise InvalidSchedule(
                f"schedule {name!r}: args, kwargs and options must be JSON-serializable: {exc}"
            ) from exc
        for key, value in normal.items():
            object.__setattr__(self, key, value)

    def to_stored(
        self, default_tz: str, now_ms: int, created_ms: int | None = None, anchor_ms: int | None = None
    ) -> dict[str, Any]:
        """The definition stored for this spec (the JSON of its entry in ``schedules``).

        ``default_tz`` is the zone when the spec has none (the app's); ``now_ms`` the server
        time, stored as ``updated`` (and ``created`` when ``created_ms`` is not given); an
        interval given as a duration is anchored at ``anchor_ms`` (default: the creation
        time). A :class:`CronRule` given with its own zone runs in that zone.
        """
        tz = self.tz or default_tz
        zone(tz)
        created = created_ms or now_ms
        parsed = parse_rule(self.rule, tz, anchor_ms=created if anchor_ms is None else anchor_ms)
        if isinstance(parsed, CronRule):
            tz = parsed.tz
            if self.dst_gap is not None or self.dst_fold is not None:  # the spec's choice wins
                gap = parsed.dst_gap if self.dst_gap is None else self.dst_gap
                fold = parsed.dst_fold if self.dst_fold is None else self.dst_fold
                parsed = CronRule(parsed.expr, parsed.tz, gap, fold)
        definition = {
            "v": DEFINITION_VERSION,
            "name": self.name,
            "task": self.task,
            "rule": parsed.to_json(),
            "tz": tz,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "options": dict(self.options),
            "enabled": self.enabled,
            "missed": self.missed,
            "max_missed": self.max_missed,
            "grace": self.grace,
            "origin": self.origin,
            "created": created,
            "updated": now_ms,
        }
        if self.overlap != "allow":  # absent: "allow" (as stored before the choice existed)
            definition["overlap"] = self.overlap
        # Normalised as JSON reads it back (tuples become lists), so it compares equal to it.
        stored: dict[str, Any] = json.loads(json.dumps(definition))
        return stored


#: The fields of a :class:`ScheduleSpec`, in order.
SPEC_FIELDS = tuple(f.name for f in fields(ScheduleSpec))

#: What ``add()``/``upsert()`` take by position, in order: the first fields of a spec.
POSITIONAL = ("name", "task", "rule", "args", "kwargs")

#: The fields :meth:`.Schedules.update` changes (not the name, not the origin).
UPDATABLE = (
    "task", "rule", "args", "kwargs", "tz", "options", "missed", "max_missed", "grace", "enabled",
    "dst_gap", "dst_fold", "overlap",
)  # fmt: skip


def spec_of(call: str, spec: Any, parts: tuple[Any, ...], given: dict[str, Any]) -> ScheduleSpec:
    """The spec of a call of ``Schedules.<call>(spec, *parts, **given)``: ``spec`` itself, or one
    built from the fields given (the first ones by position, as :data:`POSITIONAL`)."""
    if isinstance(spec, ScheduleSpec):
        if parts or given:
            raise TypeError(f"Schedules.{call}() takes a ScheduleSpec or its fields, not both")
        return spec
    positional = (spec, *parts) if spec is not None or parts else ()
    if len(positional) > len(POSITIONAL):
        raise TypeError(
            f"Schedules.{call}() takes at most {len(POSITIONAL)} positional arguments "
            f"({', '.join(POSITIONAL)}) but {len(positional)} were given"
        )
    for key in given:
        if key not in SPEC_FIELDS:
            raise TypeError(f"Schedules.{call}() got an unexpected keyword argument {key!r}")
        if key in POSITIONAL[: len(positional)]:
            raise TypeError(f"Schedules.{call}() got multiple values for argument {key!r}")
    return ScheduleSpec(**dict(zip(POSITIONAL, positional, strict=False)), **given)


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
    #: the cron rule's DST choices (None: today's rule, "cron"; always None for other rules)
    dst_gap: str | None = None
    dst_fold: str | None = None
    #: what a point does while a run is in flight (OVERLAP_POLICIES; "allow" when stored without)
    overlap: str = "allow"

    @property
    def dst(self) -> str:
        """The DST rule in words (``"cron"``, or e.g. ``"gap skip, fold last"``); ``""`` for a
        rule that is not a cron."""
        return self.rule.describe_dst() if isinstance(self.rule, CronRule) else ""

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
        rule = rule_from_json(data["rule"])
        return cls(
            name=data["name"],
            task=data["task"],
            rule=rule,
            dst_gap=rule.dst_gap if isinstance(rule, CronRule) else None,
            dst_fold=rule.dst_fold if isinstance(rule, CronRule) else None,
            tz=data["tz"],
            args=list(data["args"]),
            kwargs=dict(data["kwargs"]),
            options=dict(data["options"]),
            enabled=bool(data["enabled"]),
            missed=data["missed"],
            max_missed=int(data["max_missed"]),
            grace=float(data["grace"]),
            origin=data.get("origin", "api"),
            overlap=data.get("overlap", "allow"),
            created=ms_to_datetime(data["created"]),
            updated=ms_to_datetime(data["updated"]),
            last_run=ms_to_datetime(run["last_run"]) if run.get("last_run") else None,
            last_task_id=run.get("last_task_id"),
            run_count=int(run.get("runs", 0)),
            next_run=ms_to_datetime(run["next"]) if run.get("next") else None,
        )

    def to_spec(self, **changes: Any) -> ScheduleSpec:
        """This schedule's definition as a :class:`ScheduleSpec`, with ``changes`` (spec fields)
        in place of its own; checked as a whole, once."""
        return ScheduleSpec(**{**{name: getattr(self, name) for name in SPEC_FIELDS}, **changes})

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
            "dst_gap": self.dst_gap,
            "dst_fold": self.dst_fold,
            "dst": self.dst,
            "overlap": self.overlap,
            "run_count": self.run_count,
            "last_task_id": self.last_task_id,
        }
        for name in ("created", "updated", "last_run", "next_run"):
            value = getattr(self, name)
            out[name] = value.isoformat() if value else None
        return out


def what_runs(definition: dict[str, Any]) -> dict[str, Any]:
    """The parts of a stored definition that decide what runs when (not times or origin)."""
    return {k: definition.get(k) for k in UPDATABLE}
