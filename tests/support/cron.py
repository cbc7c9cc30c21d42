"""An independent reference for when a cron rule runs: a walk over real instants in the zone.

``CronRule`` asks croniter for the next point and then applies the documented daylight
saving time rule (``celery_delayq/schedules/rules.py``'s docstring). This reference shares neither:
it takes from croniter only its reading of each field (``croniter(expr).expanded``: which
seconds, minutes, hours, days, months and weekdays), and finds the next point by walking
forward over real instants (whole seconds, UTC), reading each one's local wall time with
``zoneinfo``, and skipping ahead a field at a time where nothing can match. The DST rule is
applied as the docstring states it:

* a wall time that never happens (spring forward) runs nothing for a job whose hour field
  covers every hour (as croniter reads it: ``*``, ``*/1``, ``0-23``): that hour never
  happened. Any other job (``*/2`` included) runs once, at the first real instant after the
  missing range: the instant of the jump, to the second (03:00:00, whatever the missing
  time's minute and second).
* a wall time that happens twice (fall back) runs twice for an hour field that is ``*`` or a
  step over every hour (``*/n``), as written: each is a real moment, and walking instants
  sees both. It runs once, in the first occurrence (``fold == 0``), for any other
  ("fixed-hour") job.

Days follow cron's (and croniter's) rule: when both day-of-month and day-of-week are
restricted a day matching either runs; otherwise both must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter

_FULL = (range(60), range(24), range(1, 32), range(1, 13), range(7), range(60))


@dataclass(frozen=True)
class CronFields:
    """The values each field of a cron expression allows, as croniter reads them."""

    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 is Sunday, as in cron
    day_or: bool
    every_hour: bool  # the hour field reads as every hour (spring forward)
    fixed_hour: bool  # the hour field is neither ``*`` nor ``*/n`` (fall back)

    @classmethod
    def parse(cls, expr: str) -> CronFields:
        expanded = croniter(expr).expanded
        values = [
            sorted(_FULL[i]) if field[0] == "*" else sorted({int(v) for v in field})
            for i, field in enumerate(expanded)
        ]
        hour = expr.split()[1]
        return cls(
            seconds=tuple(values[5]) if len(values) > 5 else (0,),
            minutes=tuple(values[0]),
            hours=tuple(values[1]),
            days=frozenset(values[2]),
            months=frozenset(values[3]),
            weekdays=frozenset(v % 7 for v in values[4]),
            day_or=expanded[2][0] != "*" and expanded[4][0] != "*",
            every_hour=expanded[1][0] == "*",
            fixed_hour=not (hour == "*" or hour.startswith("*/")),
        )

    def date_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        dom, dow = day.day in self.days, day.isoweekday() % 7 in self.weekdays
        return (dom or dow) if self.day_or else (dom and dow)

    def next_wall(self, wall: datetime) -> datetime | None:
        """None when the (naive) wall time matches; else a later wall time, with no match
        strictly between the two."""
        day = wall.date()
        midnight = datetime.combine(day + timedelta(days=1), time())
        if not self.date_matches(day):
            return midnight
        if wall.hour not in self.hours:
            hour = next((h for h in self.hours if h > wall.hour), None)
            return midnight if hour is None else datetime.combine(day, time(hour))
        if wall.minute not in self.minutes:
            minute = next((m for m in self.minutes if m > wall.minute), None)
            if minute is None:
                return wall.replace(minute=0, second=0) + timedelta(hours=1)
            return wall.replace(minute=minute, second=0)
        if wall.second not in self.seconds:
            second = next((s for s in self.seconds if s > wall.second), None)
            if second is None:
                return wall.replace(second=0) + timedelta(minutes=1)
            return wall.replace(second=second)
        return None


def _offset(t: int, tz: ZoneInfo) -> timedelta | None:
    return datetime.fromtimestamp(t, tz).utcoffset()


def _first_instant_towards(wall: datetime, tz: ZoneInfo, t: int) -> int:
    """An instant after ``t`` and no later than the first instant after ``t`` whose local wall
    time reaches ``wall``: of the instants that ``wall`` names (``fold`` 0 and 1: one, two in
    a repeated hour, or the two offsets around a gap), the earliest after ``t``."""
    named = [int(wall.replace(tzinfo=tz, fold=fold).timestamp()) for fold in (0, 1)]
    after = [instant for instant in named if instant > t]
    return min(after) if after else t + 1


def _first_change(lo: int, hi: int, tz: ZoneInfo) -> int:
    """The first instant in ``(lo, hi]`` whose offset is not ``lo``'s (there must be one)."""
    before = _offset(lo, tz)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset(mid, tz) == before:
            lo = mid
        else:
            hi = mid
    return hi


def _fell_back(t: int, t2: int, tz: ZoneInfo) -> bool:
    before, after = _offset(t, tz), _offset(t2, tz)
    return before is not None and after is not None and after < before


def _spring_forward(t: int, t2: int, tz: ZoneInfo) -> int | None:
    """The instant in ``(t, t2]`` where the clocks jump forward, if they do."""
    before, after = _offset(t, tz), _offset(t2, tz)
    if before is None or after is None or after <= before:
        return None
    return _first_change(t, t2, tz)


def _gap_matches(fields: CronFields, tz: ZoneInfo, jump: int) -> bool:
    """Whether a wall time skipped by the jump forward at ``jump`` matches the fields."""
    wall = datetime.fromtimestamp(jump - 1, tz).replace(tzinfo=None) + timedelta(seconds=1)
    end = datetime.fromtimestamp(jump, tz).replace(tzinfo=None)
    while wall < end:
        following = fields.next_wall(wall)
        if following is None:
            return True
        wall = following
    return False


def reference_next(expr: str, tz: ZoneInfo, after_ms: int, horizon_days: int = 3660) -> int | None:
    """The first point of ``expr`` in ``tz`` strictly after ``after_ms`` (ms), per the
    documented rule; None when there is none within ``horizon_days``."""
    fields = CronFields.parse(expr)
    t = after_ms // 1000 + 1
    end = t + horizon_days * 86_400
    while t < end:
        local = datetime.fromtimestamp(t, tz)
        following = fields.next_wall(local.replace(tzinfo=None))
        if following is None:
            if not (fields.fixed_hour and local.fold == 1):
                return t * 1000
            t2 = t + 1  # a fixed-hour job skips the second occurrence
        else:
            t2 = _first_instant_towards(following, tz, t)
            if _fell_back(t, t2, tz):
                # The clocks go back in between: walk the repeated wall times again from there.
                t2 = _first_change(t, t2, tz)
        jump = _spring_forward(t, t2, tz)
        if jump is not None and not fields.every_hour and _gap_matches(fields, tz, jump):
            return jump * 1000  # a skipped wall time runs at the first moment after the gap
        t = t2
    return None


def offset_changes(tz: ZoneInfo, start_s: int, end_s: int, step_s: int = 6 * 3600) -> list[int]:
    """The instants (s) in ``[start_s, end_s)`` where ``tz``'s UTC offset changes (sampled
    every ``step_s``, then found to the second)."""
    found: list[int] = []
    t = start_s
    while t < end_s:
        t2 = t + step_s
        if _offset(t, tz) != _offset(t2, tz):
            found.append(_first_change(t, t2, tz))
        t = t2
    return found
