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

A schedule can choose another rule for each change (:data:`DST_GAP`, :data:`DST_FOLD`):
``dst_gap="jump"`` (any job, every-hour ones too, runs a missing time once, at the jump) or
``"skip"`` (no run), and ``dst_fold="first"``, ``"both"`` or ``"last"`` (which occurrences of
a repeated time run, whatever the hour field). ``None`` or ``"cron"`` is the rule above; a
choice left out keeps it for that change.

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

__all__ = [
    "DST_FOLD",
    "DST_GAP",
    "CronRule",
    "IntervalRule",
    "OnceRule",
    "Rule",
    "parse_rule",
    "rule_from_json",
    "zone",
]


#: What a cron does with a wall time that does not exist (spring forward): ``"cron"`` (today's
#: rule, the default: see the module), ``"jump"`` (run once, at the instant the clocks jump),
#: ``"skip"`` (no run).
DST_GAP = ("cron", "jump", "skip")
#: What a cron does with a wall time that exists twice (fall back): ``"cron"`` (today's rule, the
#: default), ``"first"`` (run in the first occurrence only), ``"both"``, ``"last"`` (the second only).
DST_FOLD = ("cron", "first", "both", "last")


def check_dst(gap: Any, fold: Any) -> tuple[str | None, str | None]:
    """``(gap, fold)`` normalised (``None`` for ``"cron"``, today's rule); :class:`InvalidSchedule`
    naming the choices when one is not among them."""
    if gap is not None and gap not in DST_GAP:
        raise InvalidSchedule(f"dst_gap must be one of {', '.join(DST_GAP)} (or None), got {short(gap)}")
    if fold is not None and fold not in DST_FOLD:
        raise InvalidSchedule(f"dst_fold must be one of {', '.join(DST_FOLD)} (or None), got {short(fold)}")
    return (None if gap == "cron" else gap), (None if fold == "cron" else fold)


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    #: the rule for a missing wall time (:data:`DST_GAP`); None: today's rule ("cron")
    dst_gap: str | None = None
    #: the rule for a repeated wall time (:data:`DST_FOLD`); None: today's rule ("cron")
    dst_fold: str | None = None
    kind = "cron"

    def __post_init__(self) -> None:
        zone(self.tz)
        gap, fold = check_dst(self.dst_gap, self.dst_fold)
        object.__setattr__(self, "dst_gap", gap)
        object.__setattr__(self, "dst_fold", fold)
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
        if self.dst_gap is not None or self.dst_fold is not None:
            on_gap = self.dst_gap or ("skip" if _every_hour(self.expr) else "jump")
            on_fold = self.dst_fold or ("first" if _fixed_hour(self.expr) else "both")
            return _next_by_wall(self.expr, zone(self.tz), after_ms, on_gap, on_fold)
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
        out: dict[str, Any] = {"type": "cron", "expr": self.expr, "tz": self.tz}
        if self.dst_gap is not None:  # absent: today's rule (as stored before the choice existed)
            out["dst_gap"] = self.dst_gap
        if self.dst_fold is not None:
            out["dst_fold"] = self.dst_fold
        return out

    def describe(self) -> str:
        text = f"cron {self.expr!r} {self.tz}"
        return (
            text if self.dst_gap is None and self.dst_fold is None else f"{text} (DST {self.describe_dst()})"
        )

    def describe_dst(self) -> str:
        """The DST rule in words: ``"cron"`` (today's rule), or the choices, e.g.
        ``"gap skip, fold last"`` (a choice not made reads ``cron``)."""
        if self.dst_gap is None and self.dst_fold is None:
            return "cron"
        return f"gap {self.dst_gap or 'cron'}, fold {self.dst_fold or 'cron'}"


#: How far (seconds) ahead a change of offset is looked for: more than any zone's DST shift.
_NEAR = 4 * 3600


def _wall(t: int, tz: ZoneInfo) -> datetime:
    """The naive local wall time of second ``t``."""
    return datetime.fromtimestamp(t, tz).replace(tzinfo=None)


def _instants(wall: datetime, tz: ZoneInfo, gap: str, fold: str) -> tuple[str, list[int], int]:
    """How the naive wall time ``wall`` maps to instants (seconds since the epoch) in ``tz``:
    ``("one", [t], 0)`` when it exists once; ``("gap", [], end)`` or ``("gap", [jump], end)``
    (``gap`` skip or jump) when the clocks skip it, ``end`` the first wall time after the gap as
    seconds of the naive clock; ``("fold", instants, end)`` when it exists twice (the first,
    the last or both, per ``fold``), ``end`` the first wall time after the repeated span."""
    t0 = math.floor(wall.replace(tzinfo=tz, fold=0).timestamp())
    t1 = math.floor(wall.replace(tzinfo=tz, fold=1).timestamp())
    if t0 == t1:
        return "one", [t0], 0
    lo, hi = min(t0, t1), max(t0, t1)
    change = _change_after(lo, hi, tz)  # the instant the offset changes
    if _wall(t0, tz) == wall.replace(microsecond=0):  # exists twice: fold=0 is the earlier one
        end = _naive_seconds(_wall(change - 1, tz)) + 1  # the repeated span ends where it began
        chosen = {"first": [t0], "last": [t1], "both": [t0, t1]}[fold]
        return "fold", chosen, end
    end = _naive_seconds(_wall(change, tz))
    return "gap", ([] if gap == "skip" else [change]), end


def _naive_seconds(wall: datetime) -> int:
    return math.floor(wall.replace(tzinfo=UTC).timestamp())


def _from_naive_seconds(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def _next_by_wall(expr: str, tz: ZoneInfo, after_ms: int, gap: str, fold: str) -> int | None:
    """The first instant (ms) strictly after ``after_ms`` at which ``expr`` runs in ``tz`` with
    the explicit choices ``gap`` and ``fold``.

    The wall times ``expr`` names (local time without DST, after the local time of
    ``after_ms``) are taken in order, each mapped to its instants (:func:`_instants`); the
    first that has one after ``after_ms`` has the earliest (a span the rule runs nothing in
    is stepped over at once). One more candidate: while the clocks are in the first
    occurrence of a span they will repeat, the second occurrence of the span's first wall
    time (``fold`` both or last), which can be earlier than the next wall time's instant."""
    after_s = after_ms // 1000
    local = _wall(after_s, tz)
    candidates: list[int] = []
    if fold in ("both", "last") and _offset(after_s + _NEAR, tz) < _offset(after_s, tz):
        change = _change_after(after_s, after_s + _NEAR, tz)
        repeat_from = _wall(change, tz)  # the wall time the clocks go back to
        if repeat_from <= local:  # already in the span's first occurrence
            first = _cron_next(expr, repeat_from - timedelta(seconds=1))
            if first <= local:
                candidates.append(math.floor(first.replace(tzinfo=tz, fold=1).timestamp()))
    it = croniter(expr, local)
    for _ in range(100_000):
        wall = _get_next(it, expr)
        kind, instants, end = _instants(wall, tz, gap, fold)
        later = [t for t in instants if t * 1000 > after_ms]
        if later:
            candidates.append(min(later))
            break
        if kind != "one":  # nothing in this span after after_ms: go on from its end
            it = croniter(expr, _from_naive_seconds(end - 1))
    return min(candidates) * 1000 if candidates else None


def _get_next(it: croniter, expr: str) -> datetime:
    try:
        wall: datetime = it.get_next(datetime)
    except CroniterBadDateError as exc:  # e.g. "0 0 31 2 *": valid fields, no such date
        raise InvalidSchedule(f"cron expression {expr!r} never matches a date") from exc
    return wall


def _cron_next(expr: str, start: datetime) -> datetime:
    return _get_next(croniter(expr, start), expr)


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
            return CronRule(
                str(data["expr"]), str(data.get("tz", "UTC")), data.get("dst_gap"), data.get("dst_fold")
            )
        if kind == "interval":
            return IntervalRule(int(data["every_ms"]), int(data.get("anchor_ms", 0)))
        if kind == "once":
            return OnceRule(int(data["at_ms"]))
    except (KeyError, TypeError, ValueError, InvalidDueTime) as exc:
        raise InvalidSchedule(f"malformed rule {dict(data)!r}: {exc}") from exc
    raise InvalidSchedule(f"unknown rule type {kind!r}")
