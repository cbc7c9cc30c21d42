"""When a recurring schedule runs: cron (croniter), fixed intervals, and one-shots.

Every rule answers one question, :meth:`Rule.next_after`: the first execution
point strictly after a moment, in ms since the epoch (None when there is none).

Daylight saving time, for cron rules in a timezone that has it (the rule cron
users know from Vixie cron):

* **Spring forward** (a local hour does not exist): a job whose time falls in
  the missing hour runs once, at the first valid moment after it: the instant
  the clocks jump. 02:30 on a day when 02:00 jumps to 03:00 runs at 03:00:00,
  and so does 02:30:19 (a seconds field): the missing wall time is not kept,
  to the minute or to the second. However many of its times the missing hour
  held, never zero times and never more than once; a real point just after the
  jump (03:00:19 for ``19`` seconds and hours ``2,3``) still runs as well.
  A job whose hour field covers every hour (``*``, ``*/1``, ``0-23``) has no run
  in the missing hour (that hour never happened): ``30 * * * *`` runs at 01:30,
  then 03:30. A step over some of the hours is a fixed hour here:
  ``30 */2 * * *`` runs at 00:30, at 03:00 (its 02:30) and at 04:30.
* **Fall back** (a local hour happens twice): a job with a fixed hour runs once,
  in the first occurrence (02:30 daily runs at 02:30 summer time only), however
  many points the hour holds. A job whose hour field is ``*`` (or a step over
  the hours, e.g. ``*/2``) runs in both occurrences, since each is a real hour
  that passed. Never twice for the same wall-clock point of a fixed-hour job.
  "Fixed" means any hour field other than ``*`` and ``*/n`` (``2``, ``1-3``,
  ``0-23``).

>>> from datetime import datetime
>>> from zoneinfo import ZoneInfo
>>> paris = ZoneInfo("Europe/Paris")
>>> def runs(expr, start, count=3):
...     after = int(start.replace(tzinfo=paris).timestamp() * 1000)
...     points = CronRule(expr, "Europe/Paris").points_after(after, count)
...     return [datetime.fromtimestamp(t / 1000, paris).isoformat() for t in points]
>>> runs("30 2 * * *", datetime(2026, 10, 24, 12))
['2026-10-25T02:30:00+02:00', '2026-10-26T02:30:00+01:00', '2026-10-27T02:30:00+01:00']
>>> runs("30 2 * * * 19", datetime(2026, 3, 28, 12), 2)
['2026-03-29T03:00:00+02:00', '2026-03-30T02:30:19+02:00']
>>> runs("30 */2 * * *", datetime(2026, 3, 29, 0))
['2026-03-29T00:30:00+01:00', '2026-03-29T03:00:00+02:00', '2026-03-29T04:30:00+02:00']
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from ..due import MAX_DUE_MS
from ..exceptions import InvalidDueTime, InvalidSchedule

__all__ = ["CronRule", "IntervalRule", "OnceRule", "Rule", "parse_rule", "rule_from_json", "zone"]


def zone(name: str) -> ZoneInfo:
    """The IANA timezone ``name``; :class:`InvalidSchedule` when it is unknown."""
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(f"timezone must be an IANA name such as 'Europe/Paris', got {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidSchedule(f"unknown timezone {name!r} (IANA names, e.g. 'America/New_York')") from exc


class Rule:
    """Base of the rules; subclasses are frozen dataclasses with a JSON form."""

    kind = ""

    def next_after(self, after_ms: int) -> int | None:
        raise NotImplementedError

    def points_after(self, after_ms: int, count: int) -> list[int]:
        """The next ``count`` points after ``after_ms`` (fewer when the rule ends)."""
        points: list[int] = []
        t: int | None = after_ms
        while len(points) < count and t is not None:
            t = self.next_after(t)
            if t is not None:
                points.append(t)
        return points

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _fixed_hour(expr: str) -> bool:
    fields = expr.split()
    if len(fields) < 2:
        return False
    hour = fields[1]
    return not (hour == "*" or hour.startswith("*/"))


@functools.lru_cache(maxsize=1024)
def _every_hour(expr: str) -> bool:
    """Whether croniter reads the hour field as every hour (``*``, ``*/1``, ``0-23``): such a job
    has no run for a missing hour (spring). Falling back goes by :func:`_fixed_hour` instead."""
    return bool(croniter(expr).expanded[1][0] == "*")


@dataclass(frozen=True)
class CronRule(Rule):
    """A cron expression (5 fields, or 6 with seconds last, as croniter reads it) in a timezone."""

    expr: str
    tz: str = "UTC"
    kind = "cron"

    def __post_init__(self) -> None:
        zone(self.tz)
        if not isinstance(self.expr, str) or len(self.expr.split()) not in (5, 6):
            raise InvalidSchedule(
                f"cron expression must have 5 fields (or 6 with seconds last), got {self.expr!r}"
            )
        if not croniter.is_valid(self.expr):
            raise InvalidSchedule(f"malformed cron expression {self.expr!r}")
        if any(part[:1] in ("r", "R") for field in self.expr.split() for part in field.split(",")):
            # croniter draws a new random value on every call: each beat, each point would differ.
            raise InvalidSchedule(f"random ('R') cron fields are not supported: {self.expr!r}")

    def next_after(self, after_ms: int) -> int | None:
        tz = zone(self.tz)
        fixed = _fixed_hour(self.expr)
        it = croniter(self.expr, datetime.fromtimestamp(after_ms / 1000.0, tz))
        # Each turn returns, or skips a point croniter gives at or before the start (it can,
        # around a change of offset), or jumps past a whole repeated hour.
        for _ in range(1000):
            try:
                point: datetime = it.get_next(datetime)
            except CroniterBadDateError as exc:  # e.g. "0 0 31 2 *": valid fields, no such date
                raise InvalidSchedule(f"cron expression {self.expr!r} never matches a date") from exc
            point_ms = round(point.timestamp() * 1000)
            if point_ms <= after_ms:
                continue
            if fixed and _second_occurrence(point, tz):
                # Every point up to the end of the repeated hour's second occurrence is skipped:
                # go on from its last second, whatever the number of points in between.
                it = croniter(self.expr, datetime.fromtimestamp(_fold_end(point, tz) - 1, tz))
                continue
            if not _every_hour(self.expr):
                gap = _gap_before(point, after_ms, tz)
                if gap is not None and _matches_between(self.expr, *gap[1:]):
                    return gap[0] * 1000  # the missing time's run, at the first valid moment
            return int(point_ms)
        return None  # pragma: no cover - croniter always advances

    def to_json(self) -> dict[str, Any]:
        return {"type": "cron", "expr": self.expr, "tz": self.tz}

    def describe(self) -> str:
        return f"cron {self.expr!r} {self.tz}"


def _second_occurrence(point: datetime, tz: ZoneInfo) -> bool:
    """True when ``point`` is the later of two moments with the same local wall time."""
    wall = point.astimezone(tz).replace(tzinfo=None)
    first = wall.replace(tzinfo=tz, fold=0).utcoffset()
    second = wall.replace(tzinfo=tz, fold=1).utcoffset()
    if first == second:
        return False
    return point.astimezone(tz).utcoffset() == second


def _offset(t: int, tz: ZoneInfo) -> timedelta:
    offset = datetime.fromtimestamp(t, tz).utcoffset()
    assert offset is not None  # a ZoneInfo always has one
    return offset


def _change_after(lo: int, hi: int, tz: ZoneInfo) -> int:
    """The first second in ``(lo, hi]`` whose UTC offset is not ``lo``'s (``hi``'s differs).

    The zone's transitions fall on whole seconds; a bisection finds one in a few steps."""
    before = _offset(lo, tz)
    seconds = range(lo + 1, hi + 1)
    return seconds[bisect.bisect_left(seconds, True, key=lambda t: _offset(t, tz) != before)]


def _fold_end(point: datetime, tz: ZoneInfo) -> int:
    """The first second (since the epoch) after the repeated hour whose second occurrence
    holds ``point``: the clocks went back at ``change``, and the wall times of the
    ``back`` seconds after it already happened once."""
    t = math.floor(point.timestamp())
    wall = point.astimezone(tz).replace(tzinfo=None)
    first, second = (wall.replace(tzinfo=tz, fold=fold).utcoffset() for fold in (0, 1))
    assert first is not None and second is not None
    back = int((first - second).total_seconds())
    change = _change_after(t - back, t, tz)  # the first occurrence of this wall time is t - back
    return change + back


def _gap_before(point: datetime, after_ms: int, tz: ZoneInfo) -> tuple[int, datetime, datetime] | None:
    """When the clocks jumped forward less than a minute before ``point`` (and after
    ``after_ms``): the jump's second and the wall times it skipped, ``[start, end)``."""
    t = math.floor(point.timestamp())
    lo = max(after_ms // 1000, t - 60)
    if _offset(lo, tz) >= _offset(t, tz):
        return None
    jump = _change_after(lo, t, tz)
    skipped_from = datetime.fromtimestamp(jump - 1, tz).replace(tzinfo=None) + timedelta(seconds=1)
    return jump, skipped_from, datetime.fromtimestamp(jump, tz).replace(tzinfo=None)


def _matches_between(expr: str, start: datetime, end: datetime) -> bool:
    """Whether ``expr`` names a wall time in ``[start, end)`` (naive: no zone, no DST)."""
    following: datetime = croniter(expr, start - timedelta(seconds=1)).get_next(datetime)
    return following < end


@dataclass(frozen=True)
class IntervalRule(Rule):
    """Every ``every_ms`` milliseconds, on the grid anchored at ``anchor_ms``."""

    every_ms: int
    anchor_ms: int = 0
    kind = "interval"

    def __post_init__(self) -> None:
        if not isinstance(self.every_ms, int) or self.every_ms < 1:
            raise InvalidSchedule(f"interval must be at least 1 ms, got {self.every_ms!r}")

    def next_after(self, after_ms: int) -> int | None:
        if after_ms < self.anchor_ms:
            return self.anchor_ms
        return self.anchor_ms + ((after_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms

    def to_json(self) -> dict[str, Any]:
        return {"type": "interval", "every_ms": self.every_ms, "anchor_ms": self.anchor_ms}

    def describe(self) -> str:
        return f"every {self.every_ms / 1000:g} s"


@dataclass(frozen=True)
class OnceRule(Rule):
    """A single execution point."""

    at_ms: int
    kind = "once"

    def next_after(self, after_ms: int) -> int | None:
        return self.at_ms if self.at_ms > after_ms else None

    def to_json(self) -> dict[str, Any]:
        return {"type": "once", "at_ms": self.at_ms}

    def describe(self) -> str:
        return f"once at {datetime.fromtimestamp(self.at_ms / 1000, UTC).isoformat()}"


def _crontab_expr(value: Any) -> str:
    fields = ("_orig_minute", "_orig_hour", "_orig_day_of_month", "_orig_month_of_year", "_orig_day_of_week")
    parts = []
    for name in fields:
        part = getattr(value, name)
        if not isinstance(part, str | int):
            raise InvalidSchedule(f"crontab field {name[6:]} {part!r} cannot be stored; use a cron string")
        parts.append(str(part).replace(" ", ""))
    return " ".join(parts)


def parse_rule(spec: Any, tz: str = "UTC", anchor_ms: int = 0, app: Any = None) -> Rule:
    """A rule from what users write.

    * a cron string: ``"0 9 * * 1-5"`` (6 fields: seconds last);
    * ``celery.schedules.crontab(...)`` (its fields as written) and
      ``celery.schedules.schedule(timedelta)``;
    * a ``timedelta`` or a number of seconds: a fixed interval anchored at
      ``anchor_ms`` (creation time by default);
    * an aware ``datetime``: a one-shot (a naive one is read in ``tz``);
    * a mapping in the stored JSON form (``{"type": "cron", ...}``).
    """
    from celery.schedules import crontab, schedule

    if isinstance(spec, Rule):
        return spec
    if isinstance(spec, str):
        return CronRule(spec.strip(), tz)
    # Exact types only: a subclass may decide is_due() its own way, which a stored rule
    # could not honour (such entries stay in the beat's memory, see Scheduler).
    if type(spec) is crontab:
        return CronRule(_crontab_expr(spec), tz)
    if type(spec) is schedule:
        return _interval(spec.run_every, anchor_ms)
    if isinstance(spec, crontab | schedule):
        raise InvalidSchedule(
            f"{type(spec).__name__} is a custom schedule class; only crontab() and schedule() "
            "(or cron strings and intervals) can be stored"
        )
    if isinstance(spec, timedelta) or (isinstance(spec, int | float) and not isinstance(spec, bool)):
        return _interval(spec, anchor_ms)
    if isinstance(spec, datetime):
        if spec.tzinfo is None:
            spec = spec.replace(tzinfo=zone(tz))
        try:
            at_ms = round(spec.timestamp() * 1000)
        except (OverflowError, ValueError, OSError) as exc:
            raise InvalidSchedule(f"datetime {spec!r} is out of range: {exc}") from exc
        if at_ms > MAX_DUE_MS:
            raise InvalidSchedule(f"datetime {spec.isoformat()} is after 9999-12-31T23:59:59.999Z")
        return OnceRule(at_ms)
    if isinstance(spec, Mapping):
        return rule_from_json(spec)
    raise InvalidSchedule(
        f"cannot make a schedule rule from {type(spec).__name__} {spec!r}: use a cron string, "
        "crontab(), schedule(timedelta), a timedelta/seconds interval or a datetime"
    )


def _interval(value: Any, anchor_ms: int) -> IntervalRule:
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except OverflowError:  # an int past float's range
        seconds = math.inf
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidSchedule(f"interval must be a positive, finite number of seconds, got {seconds!r}")
    if seconds * 1000 > MAX_DUE_MS:
        raise InvalidSchedule(
            f"interval must be at most {MAX_DUE_MS // 1000} s (to year 9999), got {seconds!r}"
        )
    return IntervalRule(max(1, round(seconds * 1000)), anchor_ms)


def rule_from_json(data: Mapping[str, Any]) -> Rule:
    if not isinstance(data, Mapping):
        raise InvalidSchedule(f"malformed rule {data!r}: not a JSON object")
    kind = data.get("type")
    try:
        if kind == "cron":
            return CronRule(str(data["expr"]), str(data.get("tz", "UTC")))
        if kind == "interval":
            return IntervalRule(int(data["every_ms"]), int(data.get("anchor_ms", 0)))
        if kind == "once":
            return OnceRule(int(data["at_ms"]))
    except (KeyError, TypeError, ValueError, InvalidDueTime) as exc:
        raise InvalidSchedule(f"malformed rule {dict(data)!r}: {exc}") from exc
    raise InvalidSchedule(f"unknown rule type {kind!r}")
