"""The chosen DST rule of a cron (``dst_gap``, ``dst_fold``): what runs for a wall time the
clocks skip, and for one they repeat, across real transitions (Europe/Paris, America/New_York,
Australia/Lord_Howe, whose clocks move by 30 minutes).

The expected lists are written out by hand; the property tests compare with an oracle that
shares no code with ``CronRule``: a walk over every real second of a window, reading its wall
time with zoneinfo and the fields with ``tests/support/cron.py``'s ``CronFields``.
"""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from celery_delayq.exceptions import InvalidSchedule
from celery_delayq.schedules.rules import DST_FOLD, DST_GAP, CronRule, rule_from_json
from celery_delayq.schedules.spec import Schedule, ScheduleSpec
from tests.support.cron import CronFields, offset_changes


def runs(
    expr: str, tz: str, start: datetime, count: int, gap: str | None = None, fold: str | None = None
) -> list[str]:
    zone = ZoneInfo(tz)
    after = int(start.replace(tzinfo=zone).timestamp() * 1000)
    points = CronRule(expr, tz, gap, fold).points_after(after, count)
    return [datetime.fromtimestamp(t / 1000, zone).isoformat() for t in points]


PARIS, NY, LH = "Europe/Paris", "America/New_York", "Australia/Lord_Howe"

# (zone, expr, start, count, gap, expected): spring forward.
GAPS = [
    # Paris, 2026-03-29: 02:00 CET -> 03:00 CEST.
    (PARIS, "30 2 * * *", datetime(2026, 3, 28, 12), 2, "jump",
     ["2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"]),
    (PARIS, "30 2 * * *", datetime(2026, 3, 28, 12), 2, "skip",
     ["2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]),
    # An every-hour job: today's rule skips, "jump" runs the missing 02:30 at 03:00.
    (PARIS, "30 * * * *", datetime(2026, 3, 29, 1), 3, "jump",
     ["2026-03-29T01:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-29T03:30:00+02:00"]),
    (PARIS, "30 * * * *", datetime(2026, 3, 29, 1), 2, "skip",
     ["2026-03-29T01:30:00+01:00", "2026-03-29T03:30:00+02:00"]),
    # Several missing times run once at the jump, and 03:00's own point is the same one.
    (PARIS, "*/20 * * * *", datetime(2026, 3, 29, 1, 50), 3, "jump",
     ["2026-03-29T03:00:00+02:00", "2026-03-29T03:20:00+02:00", "2026-03-29T03:40:00+02:00"]),
    # New York, 2026-03-08: 02:00 EST -> 03:00 EDT.
    (NY, "15 2 * * *", datetime(2026, 3, 7, 12), 2, "jump",
     ["2026-03-08T03:00:00-04:00", "2026-03-09T02:15:00-04:00"]),
    (NY, "15 2 * * *", datetime(2026, 3, 7, 12), 1, "skip", ["2026-03-09T02:15:00-04:00"]),
    # Lord Howe, 2026-10-04: 02:00 +10:30 -> 02:30 +11 (a 30-minute gap).
    (LH, "15 2 * * *", datetime(2026, 10, 3, 12), 2, "jump",
     ["2026-10-04T02:30:00+11:00", "2026-10-05T02:15:00+11:00"]),
    (LH, "15 2 * * *", datetime(2026, 10, 3, 12), 1, "skip", ["2026-10-05T02:15:00+11:00"]),
    (LH, "45 2 * * *", datetime(2026, 10, 3, 12), 1, "skip", ["2026-10-04T02:45:00+11:00"]),
]  # fmt: skip

# Fall back.
FOLDS = [
    # Paris, 2026-10-25: 03:00 CEST -> 02:00 CET.
    (PARIS, "30 2 * * *", datetime(2026, 10, 24, 12), 2, "first",
     ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]),
    (PARIS, "30 2 * * *", datetime(2026, 10, 24, 12), 3, "both",
     ["2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00", "2026-10-26T02:30:00+01:00"]),
    (PARIS, "30 2 * * *", datetime(2026, 10, 24, 12), 2, "last",
     ["2026-10-25T02:30:00+01:00", "2026-10-26T02:30:00+01:00"]),
    # An every-hour job: today's rule runs both; "first" and "last" run one.
    (PARIS, "30 * * * *", datetime(2026, 10, 25, 1, 45), 3, "first",
     ["2026-10-25T02:30:00+02:00", "2026-10-25T03:30:00+01:00", "2026-10-25T04:30:00+01:00"]),
    (PARIS, "30 * * * *", datetime(2026, 10, 25, 1, 45), 3, "last",
     ["2026-10-25T02:30:00+01:00", "2026-10-25T03:30:00+01:00", "2026-10-25T04:30:00+01:00"]),
    # "last" from inside the first occurrence: the span's earlier wall times come again.
    (PARIS, "0,30 * * * *", datetime(2026, 10, 25, 2, 45), 3, "last",
     ["2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:00:00+01:00"]),
    (PARIS, "0,30 * * * *", datetime(2026, 10, 25, 2, 45), 4, "both",
     ["2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:00:00+01:00",
      "2026-10-25T03:30:00+01:00"]),
    # New York, 2026-11-01: 02:00 EDT -> 01:00 EST.
    (NY, "30 1 * * *", datetime(2026, 10, 31, 12), 3, "both",
     ["2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00", "2026-11-02T01:30:00-05:00"]),
    (NY, "30 1 * * *", datetime(2026, 10, 31, 12), 1, "last", ["2026-11-01T01:30:00-05:00"]),
    (NY, "30 1 * * *", datetime(2026, 10, 31, 12), 1, "first", ["2026-11-01T01:30:00-04:00"]),
    # Lord Howe, 2026-04-05: 02:00 +11 -> 01:30 +10:30 (30 minutes repeat).
    (LH, "45 1 * * *", datetime(2026, 4, 4, 12), 3, "both",
     ["2026-04-05T01:45:00+11:00", "2026-04-05T01:45:00+10:30", "2026-04-06T01:45:00+10:30"]),
    (LH, "45 1 * * *", datetime(2026, 4, 4, 12), 1, "last", ["2026-04-05T01:45:00+10:30"]),
    (LH, "45 1 * * *", datetime(2026, 4, 4, 12), 2, "first",
     ["2026-04-05T01:45:00+11:00", "2026-04-06T01:45:00+10:30"]),
    (LH, "15 1 * * *", datetime(2026, 4, 4, 12), 2, "both",  # 01:15 is not repeated
     ["2026-04-05T01:15:00+11:00", "2026-04-06T01:15:00+10:30"]),
]  # fmt: skip


@pytest.mark.parametrize(("tz", "expr", "start", "count", "gap", "expected"), GAPS)
def test_gap_choice(tz: str, expr: str, start: datetime, count: int, gap: str, expected: list[str]) -> None:
    assert runs(expr, tz, start, count, gap=gap) == expected


@pytest.mark.parametrize(("tz", "expr", "start", "count", "fold", "expected"), FOLDS)
def test_fold_choice(tz: str, expr: str, start: datetime, count: int, fold: str, expected: list[str]) -> None:
    assert runs(expr, tz, start, count, fold=fold) == expected


def test_seconds_field_in_the_gap_runs_at_the_jump_or_not() -> None:
    start = datetime(2026, 3, 29, 1, 59, 50)
    assert runs("* * * * * */20", PARIS, start, 3, gap="jump") == [
        "2026-03-29T03:00:00+02:00", "2026-03-29T03:00:20+02:00", "2026-03-29T03:00:40+02:00",
    ]  # fmt: skip
    assert runs("* * * * * 10", PARIS, start, 2, gap="skip") == [
        "2026-03-29T03:00:10+02:00", "2026-03-29T03:01:10+02:00",
    ]  # fmt: skip


def test_one_choice_keeps_todays_rule_for_the_other() -> None:
    # dst_fold chosen, dst_gap not: a fixed-hour job still runs a missing time at the jump.
    assert runs("30 2 * * *", PARIS, datetime(2026, 3, 28, 12), 1, fold="last") == [
        "2026-03-29T03:00:00+02:00"
    ]
    # dst_gap chosen: an every-hour job still runs both repeated hours (today's fold rule for it).
    assert runs("30 * * * *", PARIS, datetime(2026, 10, 25, 1, 45), 3, gap="skip") == [
        "2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:30:00+01:00",
    ]  # fmt: skip


def test_cron_is_todays_rule_and_is_not_stored() -> None:
    rule = CronRule("30 2 * * *", PARIS, "cron", "cron")
    assert rule == CronRule("30 2 * * *", PARIS)
    assert rule.to_json() == {"type": "cron", "expr": "30 2 * * *", "tz": PARIS}
    assert rule.describe() == "cron '30 2 * * *' Europe/Paris"
    chosen = CronRule("30 2 * * *", PARIS, "skip", "last")
    assert chosen.to_json() == {
        "type": "cron",
        "expr": "30 2 * * *",
        "tz": PARIS,
        "dst_gap": "skip",
        "dst_fold": "last",
    }
    assert rule_from_json(json.loads(json.dumps(chosen.to_json()))) == chosen
    assert chosen.describe() == "cron '30 2 * * *' Europe/Paris (DST gap skip, fold last)"
    assert CronRule("0 * * * *", PARIS, None, "both").describe_dst() == "gap cron, fold both"


@pytest.mark.parametrize(
    ("gap", "fold", "message"),
    [
        ("later", None, "dst_gap must be one of cron, jump, skip (or None), got 'later'"),
        ("Skip", None, "dst_gap must be one of cron, jump, skip (or None), got 'Skip'"),
        (None, "second", "dst_fold must be one of cron, first, both, last (or None), got 'second'"),
        (None, 1, "dst_fold must be one of cron, first, both, last (or None), got 1"),
        ("first", None, "dst_gap must be one of"),
    ],
)
def test_bad_choices_are_refused_at_definition(gap: object, fold: object, message: str) -> None:
    with pytest.raises(InvalidSchedule, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        CronRule("30 2 * * *", PARIS, gap, fold)  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ScheduleSpec(name="x", task="t", rule="30 2 * * *", dst_gap=gap, dst_fold=fold)  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="malformed rule"):
        rule_from_json({"type": "cron", "expr": "30 2 * * *", "dst_gap": gap, "dst_fold": fold})


def test_choice_on_a_rule_that_is_not_a_cron_is_refused() -> None:
    with pytest.raises(
        InvalidSchedule, match="dst_gap and dst_fold apply to cron rules only, not to interval rules"
    ):
        ScheduleSpec(name="x", task="t", rule=60, dst_gap="skip")
    ScheduleSpec(name="x", task="t", rule=60, dst_gap="cron", dst_fold="cron")  # the default: fine


def test_spec_stores_the_choice_with_the_rule_and_old_definitions_read_as_today() -> None:
    spec = ScheduleSpec(name="x", task="t", rule="30 2 * * *", tz=PARIS, dst_gap="skip", dst_fold="both")
    stored = spec.to_stored("UTC", 1_000)
    assert stored["rule"] == {
        "type": "cron",
        "expr": "30 2 * * *",
        "tz": PARIS,
        "dst_gap": "skip",
        "dst_fold": "both",
    }
    sch = Schedule.from_stored(json.dumps(stored), None)
    assert (sch.dst_gap, sch.dst_fold, sch.dst) == ("skip", "both", "gap skip, fold both")
    assert sch.to_json()["dst"] == "gap skip, fold both"
    # Changing another field keeps the choice; "cron" puts today's rule back.
    again = sch.to_spec(rule="0 3 * * *").to_stored("UTC", 2_000)
    assert again["rule"]["dst_gap"] == "skip"
    reset = sch.to_spec(dst_gap="cron").to_stored("UTC", 2_000)
    assert "dst_gap" not in reset["rule"] and reset["rule"]["dst_fold"] == "both"
    # A definition stored before the choice existed (no field): today's rule.
    old = dict(stored, rule={"type": "cron", "expr": "30 2 * * *", "tz": PARIS})
    sch = Schedule.from_stored(json.dumps(old), None)
    assert (sch.dst_gap, sch.dst_fold, sch.dst) == (None, None, "cron")
    assert sch.rule == CronRule("30 2 * * *", PARIS)
    interval = Schedule.from_stored(json.dumps(dict(stored, rule={"type": "interval", "every_ms": 5})), None)
    assert interval.dst == "" and interval.to_json()["dst_gap"] is None


# -- the oracle ------------------------------------------------------------------------------


def oracle(expr: str, tz: str, start_s: int, end_s: int, gap: str, fold: str) -> list[int]:
    """Every run in ``(start_s, end_s]`` (seconds), by walking each real second."""
    zone = ZoneInfo(tz)
    fields = CronFields.parse(expr)

    def matches(wall: datetime) -> bool:
        return (
            wall.second in fields.seconds
            and wall.minute in fields.minutes
            and wall.hour in fields.hours
            and fields.date_matches(wall.date())
        )

    out: list[int] = []
    previous = datetime.fromtimestamp(start_s, zone)
    for t in range(start_s + 1, end_s + 1):
        now = datetime.fromtimestamp(t, zone)
        wall = now.replace(tzinfo=None)
        jumped = now.utcoffset() != previous.utcoffset() and wall > previous.replace(tzinfo=None) + timedelta(
            seconds=1
        )
        run = False
        if jumped and gap == "jump":  # the wall times skipped between the two seconds
            skipped = previous.replace(tzinfo=None) + timedelta(seconds=1)
            while skipped < wall and not run:
                run = matches(skipped)
                skipped += timedelta(seconds=1)
        if matches(wall):
            twice = (
                wall.replace(tzinfo=zone, fold=0).utcoffset() != wall.replace(tzinfo=zone, fold=1).utcoffset()
            )
            if not twice or fold == "both" or (fold == "first") == (now.fold == 0):
                run = True
        if run:
            out.append(t)
        previous = now
    return out


WINDOWS = [
    (PARIS, datetime(2026, 3, 29, 0, 30)),
    (PARIS, datetime(2026, 10, 25, 1, 0)),
    (NY, datetime(2026, 3, 8, 0, 30)),
    (NY, datetime(2026, 11, 1, 0, 0)),
    (LH, datetime(2026, 4, 5, 0, 45)),
    (LH, datetime(2026, 10, 4, 1, 0)),
]
EXPRS = ["*/7 * * * *", "30 2 * * *", "15,45 1,2 * * *", "*/10 * * * * 5,35", "0 */2 * * *", "* * * * *"]


@pytest.mark.slow
@pytest.mark.parametrize(("tz", "start"), WINDOWS)
def test_every_choice_matches_the_oracle_and_is_strictly_increasing(tz: str, start: datetime) -> None:
    zone = ZoneInfo(tz)
    start_s = int(start.replace(tzinfo=zone).timestamp())
    end_s = start_s + 3 * 3600
    for expr, gap, fold in itertools.product(EXPRS, ("jump", "skip"), ("first", "both", "last")):
        expected = oracle(expr, tz, start_s, end_s, gap, fold)
        rule = CronRule(expr, tz, gap, fold)
        got: list[int] = []
        t = start_s * 1000
        while True:
            nxt = rule.next_after(t)
            assert nxt is not None and nxt > t
            if nxt > end_s * 1000:
                break
            got.append(nxt // 1000)
            t = nxt
        assert got == expected, (expr, gap, fold)
        assert len(set(got)) == len(got)
        # From any moment in between, the next point is the oracle's next one.
        for probe in range(start_s, end_s - 600, 617):
            following = next((x for x in expected if x > probe), None)
            if following is not None:
                assert rule.next_after(probe * 1000 + 250) == following * 1000, (expr, gap, fold, probe)


def test_choices_are_the_documented_ones() -> None:
    assert DST_GAP == ("cron", "jump", "skip")
    assert DST_FOLD == ("cron", "first", "both", "last")


def random_expr(rng: random.Random) -> str:
    """A cron expression whose points are a few minutes apart at most a few hours a day."""
    minute = rng.choice(["*/5", "*/7", "0,30", "15", "10-20/5", "*/13", "59"])
    hour = rng.choice(["*", "*/2", "0-3", "1,2", "2", "23,0,1", "1-4"])
    seconds = rng.choice([None, None, "0", "0,30", "*/20"])
    return f"{minute} {hour} * * *" + (f" {seconds}" if seconds else "")


@pytest.mark.slow
def test_random_rules_around_real_transitions_match_the_oracle() -> None:
    """Seeded random expressions, choices and zones (Sao Paulo's 2018 changes happened at
    midnight, so a whole day's first hour was skipped or repeated)."""
    rng = random.Random(2826)
    zones = ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "America/Sao_Paulo", "Europe/London"]
    start, end = (
        int(datetime(2018, 1, 1, tzinfo=UTC).timestamp()),
        int(datetime(2027, 1, 1, tzinfo=UTC).timestamp()),
    )
    changes = {tz: offset_changes(ZoneInfo(tz), start, end) for tz in zones}
    for _ in range(40):
        tz = rng.choice(zones)
        change = rng.choice(changes[tz])
        expr, gap, fold = (
            random_expr(rng),
            rng.choice(["jump", "skip"]),
            rng.choice(["first", "both", "last"]),
        )
        lo, hi = change - 2 * 3600, change + 2 * 3600
        expected = oracle(expr, tz, lo, hi, gap, fold)
        rule = CronRule(expr, tz, gap, fold)
        got = [p // 1000 for p in rule.points_after(lo * 1000, len(expected) + 1)]
        assert got[: len(expected)] == expected, (expr, tz, change, gap, fold)
        assert all(a < b for a, b in itertools.pairwise(got)), (expr, tz, gap, fold)
        assert len(got) == len(expected) + 1 and got[-1] > hi
