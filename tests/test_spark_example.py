"""examples/spark_reminders.py: a real Spark, a real Redis, a real worker and beat.

The due times the example computes in Spark SQL are checked against ``zoneinfo`` twice
over, in plain Python: by reading each preferred local time in both folds (every user),
and by walking a UTC clock minute by minute until the zone's wall clock shows (or jumps
over) that time (a sample, and every edge case). The pipeline runs in this process on
the session's Spark (``main(argv, spark=...)``), planned from a fixed instant half an
hour before Europe's next spring-forward, so that London's 01:xx and Berlin's 02:xx
users get a time that day skips.
"""

from __future__ import annotations

import csv
import json
import random
import time as clock
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery

from celery_delayq import DelayQ
from celery_delayq.store.facade import get_store
from examples import spark_reminders as ex
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.spark import spark

__all__ = ["spark"]  # a fixture, used by name

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.slow]

USERS = 10_000
SAMPLE = 20  # jobs the worker delivers


# -- the references, in plain Python -----------------------------------------------------------


def fold_reference(now: datetime, tz: str, hour: int, minute: int) -> tuple[date, datetime]:
    """The next reminder by PEP 495: the local time read with ``fold=0`` and ``fold=1``; the
    readings whose UTC instant shows that local time again are real (two on a fall-back day:
    the earlier one is taken); none is real on a spring-forward day, where ``fold=0`` reads it
    with the offset before the jump (moved forward by the gap)."""
    zone = ZoneInfo(tz)
    today = now.astimezone(zone).date()
    for day in (today, today + timedelta(days=1)):
        wall = datetime.combine(day, time(hour, minute))
        readings = [wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)]
        real = [r for r in readings if r.astimezone(zone).replace(tzinfo=None) == wall]
        due = min(real) if real else readings[0]
        if due > now:
            return day, due
    raise AssertionError("unreachable: tomorrow's reminder is always after now")


def walk_reference(now: datetime, tz: str, hour: int, minute: int) -> tuple[date, datetime]:
    """The next reminder found by walking UTC minutes from ``now``: the first minute whose wall
    clock shows ``hour:minute`` for the first time that day; or, where the wall clock jumps
    over it, the jump's instant plus how far past the start of the skipped span it lay."""
    zone = ZoneInfo(tz)
    step = timedelta(minutes=1)

    def wall(t: datetime) -> datetime:
        return t.astimezone(zone).replace(tzinfo=None)

    t = now.replace(second=0, microsecond=0) + step
    before = wall(t - step)
    for _ in range(3 * 24 * 60):
        local = wall(t)
        for day in sorted({before.date(), local.date()}):
            target = datetime.combine(day, time(hour, minute))
            if local == target:
                # a second showing of this wall time (fall-back day): its first one was earlier
                if not any(wall(t - timedelta(minutes=m)) == target for m in (30, 60, 120)):
                    return day, t
            elif local - before > step and before + step <= target < local:
                return day, t + (target - (before + step))
        before = local
        t += step
    raise AssertionError(f"no reminder found for {tz} {hour:02d}:{minute:02d} after {now}")


def eu_spring_forward_after(moment: datetime) -> datetime:
    """The first last-Sunday-of-March 01:00 UTC (Europe's clocks go forward) after ``moment``."""
    year = moment.year
    while True:
        last = date(year, 3, 31)
        sunday = last - timedelta(days=(last.weekday() + 1) % 7)
        change = datetime.combine(sunday, time(1, 0), tzinfo=UTC)
        if change > moment:
            return change
        year += 1


def _offset(tz: str, at: datetime) -> timedelta | None:
    return at.astimezone(ZoneInfo(tz)).utcoffset()


def _wall(at: datetime, tz: str) -> tuple[int, int]:
    local = at.astimezone(ZoneInfo(tz))
    return local.hour, local.minute


# -- the next-reminder function on DST edges ---------------------------------------------------

# zone, preferred local time, now, expected due (UTC), local date, wall clock at due
EDGES: list[tuple[str, str, str, str, str, str]] = [
    # New York, 2027-03-14: 02:00 EST -> 03:00 EDT. 02:30 does not exist: moved forward to 03:30.
    ("America/New_York", "02:30", "2027-03-14T05:00Z", "2027-03-14T07:30Z", "2027-03-14", "03:30"),
    # New York, 2026-11-01: 02:00 EDT -> 01:00 EST. 01:30 happens twice: the first (EDT) one.
    ("America/New_York", "01:30", "2026-11-01T04:00Z", "2026-11-01T05:30Z", "2026-11-01", "01:30"),
    # ... and planned between the two 01:30s: that day's reminder was the first one: tomorrow.
    ("America/New_York", "01:30", "2026-11-01T06:00Z", "2026-11-02T06:30Z", "2026-11-02", "01:30"),
    # the day after tomorrow's clock change: the reminder is at 09:00 EDT, not 09:00 EST
    ("America/New_York", "09:00", "2027-03-13T15:00Z", "2027-03-14T13:00Z", "2027-03-14", "09:00"),
    # London, 2027-03-28: 01:00 GMT -> 02:00 BST. 01:15 -> 02:15 BST.
    ("Europe/London", "01:15", "2027-03-28T00:00Z", "2027-03-28T01:15Z", "2027-03-28", "02:15"),
    # London, 2026-10-25: 02:00 BST -> 01:00 GMT. 01:30 twice: the BST one.
    ("Europe/London", "01:30", "2026-10-24T23:00Z", "2026-10-25T00:30Z", "2026-10-25", "01:30"),
    # Sydney, 2026-10-04 (southern spring): 02:00 AEST -> 03:00 AEDT. 02:30 -> 03:30.
    ("Australia/Sydney", "02:30", "2026-10-03T13:00Z", "2026-10-03T16:30Z", "2026-10-04", "03:30"),
    # Sydney, 2027-04-04 (southern autumn): 03:00 AEDT -> 02:00 AEST. 02:30 twice: the AEDT one.
    ("Australia/Sydney", "02:30", "2027-04-03T12:00Z", "2027-04-03T15:30Z", "2027-04-04", "02:30"),
    # Auckland, 2026-09-27: 02:00 NZST -> 03:00 NZDT. 02:00 itself is skipped: 03:00.
    ("Pacific/Auckland", "02:00", "2026-09-26T12:00Z", "2026-09-26T14:00Z", "2026-09-27", "03:00"),
    # Chatham (+12:45), 2026-09-27: 02:45 -> 03:45. 03:00 -> 04:00.
    ("Pacific/Chatham", "03:00", "2026-09-26T12:00Z", "2026-09-26T14:15Z", "2026-09-27", "04:00"),
    # Lord Howe moves by 30 minutes. 2026-10-04: 02:00 -> 02:30; 02:15 -> 02:45.
    ("Australia/Lord_Howe", "02:15", "2026-10-03T13:00Z", "2026-10-03T15:45Z", "2026-10-04", "02:45"),
    # 2027-04-04: 02:00 -> 01:30; 01:45 twice: the first (+11:00) one.
    ("Australia/Lord_Howe", "01:45", "2027-04-03T12:00Z", "2027-04-03T14:45Z", "2027-04-04", "01:45"),
    # no daylight saving: Kolkata (+05:30), Sao Paulo (none since 2019), UTC
    ("Asia/Kolkata", "09:00", "2027-03-28T00:30Z", "2027-03-28T03:30Z", "2027-03-28", "09:00"),
    ("America/Sao_Paulo", "08:00", "2026-11-21T12:00Z", "2026-11-22T11:00Z", "2026-11-22", "08:00"),
    ("UTC", "00:00", "2027-03-28T00:30Z", "2027-03-29T00:00Z", "2027-03-29", "00:00"),
    # exactly now is not "next": tomorrow
    ("UTC", "00:30", "2027-03-28T00:30Z", "2027-03-29T00:30Z", "2027-03-29", "00:30"),
]


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_next_reminder_on_dst_edges(spark: Any) -> None:
    from pyspark.sql import functions as F

    rows = [
        (i, tz, int(pref[:2]), int(pref[3:]), int(_utc(now).timestamp()))
        for i, (tz, pref, now, *_) in enumerate(EDGES)
    ]
    users = spark.createDataFrame(rows, "user_id bigint, timezone string, hour int, minute int, now_s bigint")
    got = (
        ex.with_next_reminder(users, F.timestamp_seconds("now_s"))
        .select("user_id", F.unix_seconds("due").alias("due_s"), "local_date", "local_time", "shifted",
                "crosses_dst")
        .orderBy("user_id")
        .collect()
    )  # fmt: skip
    assert len(got) == len(EDGES)
    for row, (tz, pref, now_text, due_text, local_date, local_time) in zip(got, EDGES, strict=True):
        now, due = _utc(now_text), _utc(due_text)
        hour, minute = int(pref[:2]), int(pref[3:])
        case = f"{tz} {pref} after {now_text}"
        assert (fold_reference(now, tz, hour, minute)) == (date.fromisoformat(local_date), due), case
        assert (walk_reference(now, tz, hour, minute)) == (date.fromisoformat(local_date), due), case
        assert datetime.fromtimestamp(row.due_s, UTC) == due, case
        assert (row.local_date, row.local_time) == (local_date, local_time), case
        assert row.shifted == (local_time != pref), case
        assert row.crosses_dst == (_offset(tz, now) != _offset(tz, due)), case


# -- the whole pipeline ------------------------------------------------------------------------


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    """An app of this process on the test's Redis (the example's own app reads the URL of
    the worker from its environment)."""
    application = make_app(redis_url, redis_url, task_ignore_result=True)
    yield application
    get_store(application).close()
    application.close()


def _run(spark: Any, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert ex.main(list(argv), spark=spark) == 0
    out = capsys.readouterr().out
    print(out)  # shown when the test fails
    return out


def test_pipeline_is_dst_correct_idempotent_and_delivered(
    spark: Any, redis_url: str, procs: Procs, producer: Celery, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    now = eu_spring_forward_after(datetime.now(UTC) + timedelta(days=2)) - timedelta(minutes=30)
    out_dir = tmp_path / "out"
    argv = ["--url", redis_url, "--users", str(USERS), "--out", str(out_dir), "--now", now.isoformat()]
    printed = _run(spark, capsys, *argv)

    # every user has one pending job, with the id and due time zoneinfo gives
    users = {r.user_id: r for r in ex.generate_users(spark, USERS).collect()}
    assert len(users) == USERS
    assert {u.timezone for u in users.values()} >= {
        "Europe/London", "America/New_York", "Australia/Sydney", "Asia/Kolkata", "America/Sao_Paulo",
        "Pacific/Auckland", "UTC",
    }  # fmt: skip
    expected = {uid: fold_reference(now, u.timezone, u.hour, u.minute) for uid, u in users.items()}
    expected_ids = {f"reminder:{uid}:{day.isoformat()}": uid for uid, (day, _) in expected.items()}
    dq = DelayQ(producer)
    jobs = {job.id: job for job in dq.pending(task=ex.TASK)}
    assert dq.count() == len(jobs) == USERS
    assert set(jobs) == set(expected_ids)
    for job_id, uid in expected_ids.items():
        job, user, (day, due) = jobs[job_id], users[uid], expected[uid]
        assert job.due == due, (job_id, user)
        assert job.state == "waiting"
        assert job.kwargs["user_id"] == uid and job.kwargs["timezone"] == user.timezone
        assert job.kwargs["local_date"] == day.isoformat()
        assert job.kwargs["local_time"] == f"{due.astimezone(ZoneInfo(user.timezone)):%H:%M}"

    # the DST change is really crossed: users whose preferred time the day skips, users whose
    # reminder comes after their clocks changed; a sample of them and of the rest by walking
    skipped = {uid for uid, (_, due) in expected.items()
               if _wall(due, users[uid].timezone) != (users[uid].hour, users[uid].minute)}  # fmt: skip
    crossing = {uid for uid, (_, due) in expected.items()
                if _offset(users[uid].timezone, now) != _offset(users[uid].timezone, due)}  # fmt: skip
    assert skipped and crossing - skipped, (len(skipped), len(crossing))
    assert {users[uid].timezone for uid in skipped} <= {"Europe/London", "Europe/Berlin"}
    assert (
        f"moved forward by the DST gap): {len(skipped)}; across a UTC-offset change: {len(crossing)}"
        in printed
    )
    rng = random.Random(11)
    walked = sorted(skipped) + rng.sample(sorted(crossing - skipped), 30) + rng.sample(sorted(users), 150)
    for uid in walked:
        u = users[uid]
        assert walk_reference(now, u.timezone, u.hour, u.minute) == expected[uid], u

    # the load per minute: one CSV row a minute for 24 h, the counts of the jobs due in them
    end = now + timedelta(hours=24)
    within = Counter(due.replace(second=0, microsecond=0) for _, due in expected.values() if now <= due < end)
    with (out_dir / ex.CSV_NAME).open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 24 * 60
    assert table[0]["minute"] == f"{now:%Y-%m-%dT%H:%MZ}"
    loads = {_utc(row["minute"]): int(row["jobs"]) for row in table}
    assert sum(loads.values()) == sum(within.values()) > 0
    assert loads == {m: within.get(m, 0) for m in loads}
    assert (out_dir / ex.PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"users: {USERS}" in printed and f"pending reminders: {USERS}" in printed
    assert f"due in the next 24 h: {sum(within.values())}" in printed
    busiest_minute, busiest = max(within.items(), key=lambda x: (x[1], -x[0].timestamp()))
    assert f"busiest minute: {busiest_minute:%Y-%m-%d %H:%M} UTC, {busiest} jobs" in printed

    # a second run keeps every job as it is: the same ids, the same stored envelopes
    store = get_store(producer)
    before = {job_id: store.get(job_id) for job_id in rng.sample(sorted(jobs), 50)}
    printed = _run(spark, capsys, *argv)
    assert f"pending reminders: {USERS}" in printed
    again = {job.id: job for job in dq.pending(task=ex.TASK)}
    assert set(again) == set(jobs) and dq.count() == USERS
    assert all(again[job_id].due == jobs[job_id].due for job_id in jobs)
    assert {job_id: store.get(job_id) for job_id in before} == before

    # a real worker and beat deliver a sample, moved to two seconds from now, once each
    env = subprocess_env(redis_url, redis_url, DELAYQ_EXAMPLE_URL=redis_url)
    procs.start("worker", env, app="examples.spark_reminders")
    procs.start("beat", env, app="examples.spark_reminders")
    by_user = {uid: job_id for job_id, uid in expected_ids.items()}
    chosen = sorted(skipped)[:5] + rng.sample(sorted(crossing - skipped), 5)
    chosen += rng.sample(sorted(set(users) - set(chosen)), SAMPLE - len(chosen))
    sample = {by_user[uid] for uid in chosen}
    when = datetime.now(UTC) + timedelta(seconds=2)
    assert all(dq.reschedule(job_id, when) for job_id in sample)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert wait_for(lambda: client.hlen(ex.RUNS) >= SAMPLE, 120, 0.2), procs.logs()
        clock.sleep(3.0)  # nothing else, and nothing twice
        assert client.hgetall(ex.RUNS) == dict.fromkeys(sample, "1"), procs.logs()
        sent = [json.loads(raw) for raw in client.lrange(ex.SENT, 0, -1)]
    finally:
        client.close()
    assert sorted((s["id"], s["user_id"]) for s in sent) == sorted((by_user[uid], uid) for uid in chosen)
    for s in sent:
        due = expected[s["user_id"]][1]
        assert (s["local_date"], s["local_time"], s["timezone"]) == (
            expected[s["user_id"]][0].isoformat(), f"{due.astimezone(ZoneInfo(s['timezone'])):%H:%M}",
            users[s["user_id"]].timezone,
        )  # fmt: skip
    assert dq.count() == USERS - SAMPLE
    assert not set(sample) & {job.id for job in dq.pending(task=ex.TASK)}


# -- users from Parquet ------------------------------------------------------------------------


def test_users_from_parquet(
    spark: Any, redis_url: str, producer: Celery, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the required columns; every edge zone at the hours its clock changes."""
    now = datetime(2027, 4, 3, 12, 0, tzinfo=UTC)  # the southern fall-back night
    zones = ["Australia/Sydney", "Australia/Lord_Howe", "Pacific/Auckland", "Pacific/Chatham", "UTC",
             "America/St_Johns", "Asia/Kathmandu"]  # fmt: skip
    rows = [(i, zones[i % len(zones)], 1 + i % 3, (i * 7) % 60) for i in range(1, 301)]
    path = str(tmp_path / "users.parquet")
    spark.createDataFrame(rows, "user_id bigint, timezone string, hour int, minute int").write.parquet(path)
    printed = _run(spark, capsys, "--url", redis_url, "--parquet", path, "--out", str(tmp_path / "out"),
                   "--now", "2027-04-03T12:00:00")  # fmt: skip
    assert "users: 300" in printed and "pending reminders: 300" in printed
    jobs = {job.id: job for job in DelayQ(producer).pending(task=ex.TASK)}
    assert len(jobs) == 300
    for uid, tz, hour, minute in rows:
        day, due = fold_reference(now, tz, hour, minute)
        job = jobs[f"reminder:{uid}:{day.isoformat()}"]
        assert job.due == due, (uid, tz, hour, minute)
        assert job.kwargs["name"] == f"user {uid}" and job.kwargs["locale"] == "en"

    for name, row, error in (
        ("hour.parquet", (1, "UTC", 24), r"1 row\(s\) without"),
        ("zone.parquet", (2, "Mars/Olympus", 8), "unknown time zones in the users table: Mars/Olympus"),
    ):
        bad = str(tmp_path / name)
        spark.createDataFrame([row], "user_id int, timezone string, hour int").write.parquet(bad)
        with pytest.raises(SystemExit, match=error):
            ex.main(["--url", redis_url, "--parquet", bad, "--out", str(tmp_path / "bad")], spark=spark)
    assert len(list(DelayQ(producer).pending(task=ex.TASK))) == 300
