"""Schedule rules (``celery_delayq.schedules.rules``): cron with timezones and the DST rule,
intervals, one-shots.

Every DST test runs on a fixed clock: ``next_after``/``points_after`` get an explicit
``after_ms``; nothing here depends on today's date except the 10,000-schedule test, which
checks ``Schedules.add`` from the real now. The random tests compare with an independent
reference (``tests/support/cron.py``: a walk over real instants with zoneinfo, applying the
documented DST rule), not with croniter's search or a copy of our DST code.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import time
import zoneinfo
from datetime import UTC, date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_delayq import Schedules
from celery_delayq.exceptions import InvalidSchedule, ScheduleError
from celery_delayq.schedules.rules import CronRule, IntervalRule, OnceRule, parse_rule, rule_from_json, zone
from tests.support.cron import offset_changes, reference_next

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def ms(dt: datetime) -> int:
    assert dt.tzinfo is not None
    return round(dt.timestamp() * 1000)


def local(tz: ZoneInfo, day: date, hour: int, minute: int = 0, second: int = 0, fold: int = 0) -> datetime:
    return datetime(day.year, day.month, day.day, hour, minute, second, tzinfo=tz, fold=fold)


def iso(point_ms: int, tz: ZoneInfo) -> str:
    return datetime.fromtimestamp(point_ms / 1000, tz).isoformat()


def points_on(rule: CronRule, day: date) -> list[int]:
    """Every point of ``rule`` whose local date is ``day`` (starting the search a day before,
    ending at the first point past it)."""
    tz = ZoneInfo(rule.tz)
    points: list[int] = []
    at: int | None = ms(local(tz, day - timedelta(days=1), 0))
    while (at := rule.next_after(at)) is not None:
        on = datetime.fromtimestamp(at / 1000, tz).date()
        if on > day:
            break
        if on == day:
            points.append(at)
    return points


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("", "must have 5 fields (or 6 with seconds last), got ''"),
        ("* * *", "must have 5 fields"),
        ("* * * * * * *", "must have 5 fields"),
        ("@daily", "must have 5 fields"),
        ("61 * * * *", "malformed cron expression '61 * * * *'"),
        ("* 24 * * *", "malformed cron expression"),
        ("* * 0 * *", "malformed cron expression"),
        ("* * * 13 *", "malformed cron expression"),
        ("* * * * 8", "malformed cron expression"),
        ("*/0 * * * *", "malformed cron expression"),
        ("abc * * * *", "malformed cron expression"),
        ("0 9 * * * 60", "malformed cron expression"),  # seconds (last) go to 59
        ("* * * * frisday", "malformed cron expression"),
        ("H * * * *", "malformed cron expression"),
        # Random fields would give every beat (and every call) a different time.
        ("R * * * *", "random"),
        ("0 R(8-10) * * *", "random"),
        # Syntactically fine, but no such date: refused, not a croniter error later.
        ("0 0 31 2 *", "never"),
        ("0 12 31 4,6,9,11 *", "never"),
    ],
)
def test_malformed_cron_is_refused_with_a_clear_message(expr: str, message: str) -> None:
    with pytest.raises(InvalidSchedule, match=re.escape(message)):
        rule = parse_rule(expr, "Europe/Paris")
        rule.next_after(ms(datetime(2026, 1, 1, tzinfo=UTC)))


def test_cron_errors_are_schedule_errors_and_value_errors() -> None:
    with pytest.raises(InvalidSchedule) as info:
        CronRule("61 * * * *")
    assert isinstance(info.value, ScheduleError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("tz", "message"),
    [
        ("Mars/Olympus_Mons", "unknown timezone 'Mars/Olympus_Mons'"),
        ("Europe/Pariss", "unknown timezone 'Europe/Pariss'"),
        ("../../etc/passwd", "unknown timezone"),
        ("", "timezone must be an IANA name"),
        (None, "timezone must be an IANA name"),
        (5, "timezone must be an IANA name"),
    ],
)
def test_unknown_timezone_is_refused(tz: Any, message: str) -> None:
    with pytest.raises(InvalidSchedule, match=re.escape(message)):
        CronRule("0 9 * * *", tz)
    with pytest.raises(InvalidSchedule, match=re.escape(message)):
        zone(tz)


@pytest.mark.parametrize(
    "spec",
    [0, -1, -0.5, float("nan"), float("inf"), timedelta(0), timedelta(seconds=-3)],
)
def test_bad_interval_is_refused(spec: Any) -> None:
    with pytest.raises(InvalidSchedule, match="interval must be a positive, finite number of seconds"):
        parse_rule(spec)


def test_bad_interval_in_other_forms() -> None:
    with pytest.raises(InvalidSchedule, match="interval must be a positive"):
        parse_rule(schedule(timedelta(0)))
    with pytest.raises(InvalidSchedule, match="interval must be at least 1 ms, got 0"):
        IntervalRule(0)
    with pytest.raises(InvalidSchedule, match="interval must be at least 1 ms"):
        IntervalRule(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="malformed rule"):
        rule_from_json({"type": "interval", "every_ms": "often"})
    with pytest.raises(InvalidSchedule, match="interval must be at least 1 ms"):
        rule_from_json({"type": "interval", "every_ms": -5})


@pytest.mark.parametrize("spec", [True, None, [1, 2], object(), b"* * * * *"])
def test_unsupported_rule_types(spec: Any) -> None:
    with pytest.raises(InvalidSchedule, match="cannot make a schedule rule from"):
        parse_rule(spec)


# -- cron: 5 and 6 fields -----------------------------------------------------------------------


def test_five_field_cron_in_a_timezone() -> None:
    tz = ZoneInfo("Europe/Paris")
    rule = CronRule("*/15 9-10 * * mon-fri", "Europe/Paris")
    friday_evening = local(tz, date(2026, 6, 5), 17, 50)
    points = rule.points_after(ms(friday_evening), 9)
    assert [iso(p, tz) for p in points] == [
        f"2026-06-08T{h:02d}:{m:02d}:00+02:00" for h in (9, 10) for m in (0, 15, 30, 45)
    ] + ["2026-06-09T09:00:00+02:00"]


def test_six_field_cron_has_seconds_last() -> None:
    tz = ZoneInfo("Asia/Tokyo")
    start = ms(local(tz, date(2026, 1, 1), 0))
    assert [iso(p, tz) for p in CronRule("0 9 * * * 30", "Asia/Tokyo").points_after(start, 2)] == [
        "2026-01-01T09:00:30+09:00",
        "2026-01-02T09:00:30+09:00",
    ]
    every_10s = CronRule("* * * * * */10", "Asia/Tokyo").points_after(start + 1, 4)
    assert [p - start for p in every_10s] == [10_000, 20_000, 30_000, 40_000]


def test_next_after_is_strictly_after() -> None:
    rule = CronRule("0 * * * *")
    at = ms(datetime(2026, 5, 1, 10, tzinfo=UTC))
    assert rule.next_after(at - 1) == at
    assert rule.next_after(at) == at + HOUR_MS
    assert rule.next_after(at + 1) == at + HOUR_MS


# -- Celery schedules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cron", "expr"),
    [
        (crontab(), "* * * * *"),
        (crontab(minute=0, hour=3), "0 3 * * *"),
        (crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), "*/15 9-17 * * mon-fri"),
        (crontab(minute="0", hour="0", day_of_month="1", month_of_year="*/3"), "0 0 1 */3 *"),
        (crontab(minute="0,30", hour="8-10, 14"), "0,30 8-10,14 * * *"),
        (crontab(minute=5, hour=4, day_of_week=0), "5 4 * * 0"),
    ],
)
def test_celery_crontab_becomes_the_same_cron(cron: crontab, expr: str) -> None:
    rule = parse_rule(cron, "America/New_York")
    assert rule == CronRule(expr, "America/New_York")


def test_celery_crontab_points() -> None:
    """The converted crontab fires when Celery's crontab says it should (Sunday is day 0)."""
    tz = ZoneInfo("America/New_York")
    rule = parse_rule(crontab(minute=5, hour=4, day_of_week=0), "America/New_York")
    points = rule.points_after(ms(local(tz, date(2026, 7, 1), 0)), 3)
    assert [iso(p, tz) for p in points] == [
        "2026-07-05T04:05:00-04:00",
        "2026-07-12T04:05:00-04:00",
        "2026-07-19T04:05:00-04:00",
    ]
    cron = crontab(minute=5, hour=4, day_of_week=0)
    for p in points:
        when = datetime.fromtimestamp(p / 1000, tz)
        assert when.minute in cron.minute and when.hour in cron.hour
        assert when.isoweekday() % 7 in cron.day_of_week


def test_crontab_with_non_string_fields_cannot_be_stored() -> None:
    with pytest.raises(InvalidSchedule, match=r"crontab field minute .* cannot be stored; use a cron string"):
        parse_rule(crontab(minute=[0, 30]))


def test_celery_schedule_becomes_an_anchored_interval() -> None:
    assert parse_rule(schedule(timedelta(seconds=90)), anchor_ms=1000) == IntervalRule(90_000, 1000)
    assert parse_rule(schedule(run_every=2.5), anchor_ms=7) == IntervalRule(2500, 7)
    assert parse_rule(timedelta(minutes=5), anchor_ms=3) == IntervalRule(300_000, 3)
    assert parse_rule(0.2, anchor_ms=0) == IntervalRule(200, 0)


# -- intervals and one-shots --------------------------------------------------------------------


def test_intervals_are_anchored() -> None:
    rule = IntervalRule(1000, anchor_ms=5500)
    assert rule.next_after(0) == 5500  # before the anchor: the anchor itself
    assert rule.next_after(5499) == 5500
    assert rule.next_after(5500) == 6500
    assert rule.next_after(6499) == 6500
    assert rule.next_after(6500) == 7500
    assert rule.next_after(1_000_000_123) == 1_000_000_500
    assert rule.points_after(5500, 3) == [6500, 7500, 8500]
    # Every beat computes the same grid, whatever moment it starts from.
    starts = random.Random(1).sample(range(5500, 10_000_000), 200)
    assert all((rule.next_after(s) - 5500) % 1000 == 0 for s in starts)
    assert all(0 < rule.next_after(s) - s <= 1000 for s in starts)


def test_once_rule() -> None:
    at = ms(datetime(2031, 3, 1, 12, tzinfo=UTC))
    rule = OnceRule(at)
    assert rule.next_after(at - 1) == at
    assert rule.next_after(at) is None
    assert rule.next_after(at + 1) is None
    assert rule.points_after(0, 5) == [at]
    assert parse_rule(datetime(2031, 3, 1, 12, tzinfo=UTC)) == rule
    # A naive datetime is read in the schedule's timezone.
    assert parse_rule(datetime(2031, 3, 1, 13), "Europe/Paris") == rule
    assert parse_rule(datetime(2031, 3, 1, 7), "America/New_York") == rule


@pytest.mark.parametrize(
    "rule",
    [
        CronRule("*/5 9-17 * * mon-fri", "Europe/Paris"),
        CronRule("0 0 * * * 30", "Australia/Sydney"),
        CronRule("30 2 * * *"),
        IntervalRule(1500, 123),
        IntervalRule(86_400_000),
        OnceRule(1_900_000_000_000),
    ],
)
def test_json_round_trip(rule: Any) -> None:
    data = json.loads(json.dumps(rule.to_json()))
    assert data["type"] == rule.kind
    again = rule_from_json(data)
    assert again == rule and type(again) is type(rule)
    assert parse_rule(data) == rule
    assert again.points_after(1_800_000_000_000, 3) == rule.points_after(1_800_000_000_000, 3)
    assert rule.describe()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"type": "cron"}, "malformed rule"),
        ({"type": "cron", "expr": "* *"}, "must have 5 fields"),
        ({"type": "cron", "expr": "* * * * *", "tz": "Nowhere/Land"}, "unknown timezone"),
        ({"type": "once"}, "malformed rule"),
        ({"type": "weekly"}, "unknown rule type 'weekly'"),
        ({}, "unknown rule type None"),
    ],
)
def test_malformed_json_rules(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSchedule, match=re.escape(message)):
        rule_from_json(data)


# -- daylight saving time, on fixed clocks --------------------------------------------------------

#: zone, spring-forward date, the local hour that does not exist that day,
#: fall-back date, the local hour that happens twice that day (2026).
DST_ZONES = [
    ("Europe/Paris", date(2026, 3, 29), 2, date(2026, 10, 25), 2),
    ("America/New_York", date(2026, 3, 8), 2, date(2026, 11, 1), 1),
    ("Australia/Sydney", date(2026, 10, 4), 2, date(2026, 4, 5), 2),  # southern hemisphere
]
DST_IDS = [z[0] for z in DST_ZONES]


def _exists(dt: datetime) -> bool:
    return dt.astimezone(UTC).astimezone(dt.tzinfo).replace(tzinfo=None) == dt.replace(tzinfo=None)


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
def test_dst_table_matches_the_tz_database(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int
) -> None:
    tz = ZoneInfo(name)
    assert not _exists(local(tz, spring, gap_hour, 30))
    assert _exists(local(tz, spring, gap_hour - 1, 59)) and _exists(local(tz, spring, gap_hour + 1, 0))
    first, second = local(tz, fall, dup_hour, 30, fold=0), local(tz, fall, dup_hour, 30, fold=1)
    assert first.utcoffset() != second.utcoffset()
    assert ms(second) - ms(first) == HOUR_MS


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
@pytest.mark.parametrize("minutes", ["30", "0", "59", "*/20", "10,40"])
def test_spring_forward_fixed_hour_in_the_gap_runs_once_at_the_first_valid_moment(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int, minutes: str
) -> None:
    tz = ZoneInfo(name)
    rule = CronRule(f"{minutes} {gap_hour} * * *", name)
    jump = local(tz, spring, gap_hour + 1, 0)  # the first valid moment after the missing hour
    assert points_on(rule, spring) == [ms(jump)]
    # The days around it keep their wall time.
    first_minute = int(minutes.split(",")[0].replace("*/20", "0"))
    for day in (spring - timedelta(days=1), spring + timedelta(days=1)):
        got = points_on(rule, day)
        assert got and got[0] == ms(local(tz, day, gap_hour, first_minute))
    # From any moment: never zero runs that day, never two (every 61 minutes from noon the day
    # before, every 7 from an hour before the jump to two hours after it).
    day_before = ms(local(tz, spring - timedelta(days=1), 12))
    next_day = points_on(rule, spring + timedelta(days=1))[0]
    near = ms(jump) - HOUR_MS
    far = range(day_before, near, 61 * 60_000 + 13)
    for after in [*far, *range(near, ms(jump) + 2 * HOUR_MS, 7 * 60_000 + 13)]:
        expected = ms(jump) if after < ms(jump) else next_day
        assert rule.next_after(after) == expected, iso(after, tz)


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
@pytest.mark.parametrize("minutes", ["30", "0", "15,45"])
def test_fall_back_fixed_hour_in_the_repeated_hour_runs_once(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int, minutes: str
) -> None:
    tz = ZoneInfo(name)
    rule = CronRule(f"{minutes} {dup_hour} * * *", name)
    wall = [int(m) for m in minutes.split(",")]
    # Once per wall-clock time, in the first occurrence (summer time) only.
    assert points_on(rule, fall) == [ms(local(tz, fall, dup_hour, m, fold=0)) for m in wall]
    following = ms(local(tz, fall + timedelta(days=1), dup_hour, wall[0]))
    # Started anywhere after the last first-occurrence point (including inside the second
    # occurrence, before its :30): the next run is the next day, never the second occurrence.
    last_first = ms(local(tz, fall, dup_hour, wall[-1], fold=0))
    for after in range(last_first, ms(local(tz, fall, dup_hour + 1, 0)) + HOUR_MS, 60_000 + 7):
        assert rule.next_after(after) == following, iso(after, tz)
    assert rule.next_after(ms(local(tz, fall, dup_hour, 0, fold=1)) - 1) == following


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
@pytest.mark.parametrize("expr", ["30 * * * *", "30 */1 * * *", "30 * * * * 0"])
def test_hourly_job_runs_in_both_occurrences_and_never_twice_for_one_instant(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int, expr: str
) -> None:
    tz = ZoneInfo(name)
    rule = CronRule(expr, name)
    points = points_on(rule, fall)
    assert len(points) == 25 and len(set(points)) == 25
    assert all(b - a == HOUR_MS for a, b in itertools.pairwise(points))
    assert ms(local(tz, fall, dup_hour, 30, fold=0)) in points
    assert ms(local(tz, fall, dup_hour, 30, fold=1)) in points
    # From inside the repeated hour, each occurrence comes next exactly once.
    first, second = ms(local(tz, fall, dup_hour, 30, fold=0)), ms(local(tz, fall, dup_hour, 30, fold=1))
    assert rule.next_after(first - 1) == first
    assert rule.next_after(first) == second
    assert rule.next_after(second) == second + HOUR_MS
    # Spring forward: 23 hours, all real, an hour apart.
    points = points_on(rule, spring)
    assert len(points) == 23
    assert all(b - a == HOUR_MS for a, b in itertools.pairwise(points))


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
@pytest.mark.parametrize("at", [(0, 0), (9, 0), (23, 45), (5, 30)])
def test_daily_jobs_outside_the_transition_keep_their_local_time(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int, at: tuple[int, int]
) -> None:
    tz = ZoneInfo(name)
    hour, minute = at
    rule = CronRule(f"{minute} {hour} * * *", name)
    for transition in (spring, fall):
        start = transition - timedelta(days=3)
        points = rule.points_after(ms(local(tz, start, 0)) - 1, 7)
        assert points == [ms(local(tz, start + timedelta(days=i), hour, minute)) for i in range(7)]
        offsets = {datetime.fromtimestamp(p / 1000, tz).utcoffset() for p in points}
        assert len(offsets) == 2  # the same wall time on both sides of the change


@pytest.mark.parametrize("day", [z[1] for z in DST_ZONES] + [z[3] for z in DST_ZONES])
def test_zone_without_dst_runs_every_day_and_every_hour(day: date) -> None:
    tz = ZoneInfo("Asia/Kolkata")
    assert {local(tz, day, h).utcoffset() for h in range(24)} == {timedelta(hours=5, minutes=30)}
    daily = CronRule("30 2 * * *", "Asia/Kolkata")
    assert points_on(daily, day) == [ms(local(tz, day, 2, 30))]
    hourly = CronRule("30 * * * *", "Asia/Kolkata")
    assert points_on(hourly, day) == [ms(local(tz, day, h, 30)) for h in range(24)]


# -- random schedules against an independent reference ---------------------------------------
#
# ``tests/support/cron.py`` finds each next point by walking real instants in the zone with
# zoneinfo and applying the DST rule as ``celery_delayq/schedules/rules.py``'s docstring states it; it
# takes only croniter's reading of the fields, nothing of its search or of our DST code.

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _field(rng: random.Random, lo: int, hi: int, star: float, names: list[str] | None = None) -> str:
    def value(v: int) -> str:
        if names and rng.random() < 0.5:
            return names[v - lo]
        return str(v)

    kind = rng.random()
    if kind < star:
        return "*"
    kind = rng.randrange(6)
    if kind == 0:
        return value(rng.randint(lo, hi))
    if kind == 1:
        a, b = sorted(rng.sample(range(lo, hi + 1), 2))
        return f"{value(a)}-{value(b)}"
    if kind == 2:
        return ",".join(value(v) for v in sorted(rng.sample(range(lo, hi + 1), rng.randint(2, 4))))
    if kind == 3:
        return f"*/{rng.randint(1, max(1, (hi - lo) // 2))}"
    if kind == 4:
        a, b = sorted(rng.sample(range(lo, hi + 1), 2))
        return f"{a}-{b}/{rng.randint(1, max(1, b - a))}"
    a, b = sorted(rng.sample(range(lo, hi + 1), 2))
    return f"{value(a)}-{value(b)},{value(rng.randint(lo, hi))}"


def random_cron(rng: random.Random) -> str:
    fields = [
        _field(rng, 0, 59, 0.15),
        _field(rng, 0, 23, 0.3),
        _field(rng, 1, 31, 0.7),
        _field(rng, 1, 12, 0.7, _MONTHS),
        _field(rng, 0, 6, 0.6, _DAYS),
    ]
    if rng.random() < 0.4:
        fields.append(_field(rng, 0, 59, 0.2))  # seconds, last
    return " ".join(fields)


#: How far the server's clock as the store reads it may stand behind this process's wall clock.
CLOCK_SKEW_MS = 50


@pytest.mark.slow
def test_four_thousand_random_schedules_match_the_reference(
    app: Celery, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Schedules.add`` from the real now, in random zones, against the reference."""
    rng = random.Random(20261121)
    zones = sorted(zoneinfo.available_timezones())
    schedules = Schedules(app)
    n = 4_000
    cases = [(f"r{i}", random_cron(rng), rng.choice(zones)) for i in range(n)]
    assert len({expr for _, expr, _ in cases}) > 3600  # really random
    assert sum(len(expr.split()) == 6 for _, expr, _ in cases) > 1200
    compared = window = never = 0
    started = time.monotonic()
    for start in range(0, n, 1000):
        batch = cases[start : start + 1000]
        windows: dict[str, tuple[int, int]] = {}
        for name, expr, tz in batch:
            # add() reads the server's clock (Store.server_now_ms: a TIME truncated to ms, plus
            # this process's monotonic clock since), which may stand a little behind time.time():
            # the window opens CLOCK_SKEW_MS earlier, or a rule firing every second met at a
            # second's edge fails by one second (seen once: '55 * * * * 24-36' at xx:55:32).
            before = int(time.time() * 1000) - CLOCK_SKEW_MS
            try:
                schedules.add(name, "t.noop", expr, tz=tz)
            except InvalidSchedule as exc:
                # Only an expression with no date at all (day 31 of 30-day months...).
                assert "never" in str(exc), (expr, tz, exc)
                assert reference_next(expr, ZoneInfo(tz), before) is None, (expr, tz)
                never += 1
                continue
            windows[name] = (before, int(time.time() * 1000))
        for name, expr, tz_name in batch:
            if name not in windows:
                assert schedules.get(name) is None
                continue
            stored = schedules.get(name)
            assert stored is not None and stored.next_run is not None, (expr, tz_name)
            got = ms(stored.next_run)
            tz = ZoneInfo(tz_name)
            before, after = windows[name]
            expected = reference_next(expr, tz, before)
            if got == expected or reference_next(expr, tz, after) == expected:
                # (the answer from just before the call is the answer for the whole call
                # unless a point fell inside it; then ours, computed later, is later)
                assert got == expected, (expr, tz_name, iso(got, tz), expected and iso(expected, tz))
                compared += 1
            else:
                # A point fell inside the add() call itself (second-level rules): the answer
                # is the reference's next point from some moment of that call.
                later = reference_next(expr, tz, after)
                assert later is not None and before < got <= later, (expr, tz_name)
                assert reference_next(expr, tz, got - 1) == got, (expr, tz_name)
                window += 1
    elapsed = time.monotonic() - started
    assert schedules.count() == n - never
    assert compared > 3600
    with capsys.disabled():
        print(
            f"\n[test_rules] random cron schedules: {n} generated, {compared} compared exactly with "
            f"the reference, {window} with a point inside the add() call, {never} refused as never matching; "
            f"{elapsed:.1f} s"
        )


_CHANGES: dict[str, list[int]] = {}


def _offset_changes(name: str) -> list[int]:
    """Instants (s) of 2026 and 2027 where the zone's UTC offset changes."""
    if name not in _CHANGES:
        start, end = (ms(datetime(year, 1, 1, tzinfo=UTC)) // 1000 for year in (2026, 2028))
        _CHANGES[name] = offset_changes(ZoneInfo(name), start, end, step_s=12 * 3600)
    return _CHANGES[name]


def dst_cases(rng: random.Random, n: int) -> list[tuple[str, str, int]]:
    """``n`` random ``(expr, zone, after_ms)`` with ``after_ms`` up to 30 hours before a change of
    the zone's offset, and mostly hour fields aimed at the changing hour, ``*`` or ``*/n``."""
    zones = sorted(zoneinfo.available_timezones())
    cases: list[tuple[str, str, int]] = []
    while len(cases) < n:
        name = rng.choice(zones)
        changes = _offset_changes(name)
        if not changes:
            continue
        change = rng.choice(changes)
        fields = random_cron(rng).split()
        kind = rng.random()
        if kind < 0.35:
            fields[1] = str(datetime.fromtimestamp(change - 1, ZoneInfo(name)).hour)
        elif kind < 0.55:
            fields[1] = "*"
        elif kind < 0.7:
            fields[1] = f"*/{rng.randint(1, 5)}"
        if rng.random() < 0.8:
            fields[2:5] = ["*", "*", "*"]  # every day: the change itself decides
        if rng.random() < 0.5:
            fields[0] = rng.choice(["*", "0", "30", "*/15", str(rng.randint(0, 59))])
        after = (change - rng.randint(0, 30 * 3600)) * 1000 + rng.randint(0, 999)
        cases.append((" ".join(fields), name, after))
    return cases


@pytest.mark.parametrize("n", [15, pytest.param(5000, marks=pytest.mark.slow)])
def test_random_schedules_around_dst_changes_match_the_reference(
    n: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``CronRule.next_after`` started just before a DST change, in every zone that has one."""
    rng = random.Random(20261124 + n)
    same = 0
    wrong: list[tuple[str, str, str, str | None, str | None]] = []
    for expr, name, after in dst_cases(rng, n):
        tz = ZoneInfo(name)
        try:
            got: int | None = CronRule(expr, name).next_after(after)
        except InvalidSchedule:
            got = None  # never matches
        expected = reference_next(expr, tz, after)
        if got == expected:
            same += 1
        else:
            wrong.append((expr, name, iso(after, tz), got and iso(got, tz), expected and iso(expected, tz)))
    assert not wrong, wrong[:10]
    if n > 1000:
        with capsys.disabled():
            print(
                f"\n[test_rules] {n} random cron schedules around DST changes: {same} equal to the reference"
            )


def test_fixed_hour_seconds_job_started_in_the_repeated_hour_runs_the_next_day() -> None:
    tz = ZoneInfo("America/New_York")
    # After the last point of the first occurrence (01:45:33 EDT): all 1080 points of the
    # second occurrence are skipped before the next day's 01:10:04.
    after = ms(local(tz, date(2026, 11, 1), 1, 48, 14, fold=0))
    expected = ms(local(tz, date(2026, 11, 2), 1, 10, 4))
    assert reference_next("10-45 1 * * * 4-33", tz, after) == expected
    assert CronRule("10-45 1 * * * 4-33", "America/New_York").next_after(after) == expected


@pytest.mark.parametrize(("name", "spring", "gap_hour", "fall", "dup_hour"), DST_ZONES, ids=DST_IDS)
@pytest.mark.parametrize("expr", ["0 {h} * * * 19", "10-45 {h} * * * 4-33", "30 {h},{h1} * * * 19"])
def test_spring_forward_job_with_seconds_in_the_gap_runs_once_at_the_jump(
    name: str, spring: date, gap_hour: int, fall: date, dup_hour: int, expr: str
) -> None:
    """The skipped time's run is at the first valid moment, 03:00:00, not 03:00:19 (its seconds
    kept); a real point of the hour after the gap still runs, once."""
    tz = ZoneInfo(name)
    rule = CronRule(expr.format(h=gap_hour, h1=gap_hour + 1), name)
    jump = ms(local(tz, spring, gap_hour + 1, 0))
    before = ms(local(tz, spring, gap_hour - 1, 0))
    assert rule.next_after(before) == reference_next(rule.expr, tz, before) == jump
    real = ms(local(tz, spring, gap_hour + 1, 30, 19))  # the hour after the gap's own point
    next_day = ms(local(tz, spring + timedelta(days=1), 0))
    following = rule.next_after(jump)
    assert following is not None
    assert following == real if "," in expr else following > next_day
