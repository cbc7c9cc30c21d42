"""Schedule one-off, recurring and bulk jobs in the example project, then check what the worker ran.

Run it from the repository root, with a worker and a beat running (see README.md here):

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    python -m examples.project

It schedules reminders in users' timezones, a trial expiry, a weekday digest (cron in
Europe/Paris) and a 2-second interval, 3,000 trial expiries in one call; lists what is
pending; cancels one job and moves another; waits (at most 60 s) until the worker has run
every job that should run, and checks that each ran exactly once. Ada's reminder (tomorrow
09:00 in Tokyo) and the digest stay stored: run it again and the reminder is kept
(``created=False``: its id is derived from the user and the day).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import redis

from celery_delayq import DelayQ, Schedules
from celery_delayq.config import DelayQConfig

from .celery import app
from .tasks import LOG, RUNS, daily_digest, expire_trial, refresh_stats, send_reminder

BULK = 3000
STATS, DIGEST, PURGE = "refresh-stats", "digest-paris", "purge-expired-sessions"  # PURGE: celeryconfig


def utc(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%H:%M:%S} UTC"


def counts(client: redis.Redis) -> dict[str, int]:
    """Task id -> how many times the worker ran it (the tasks write this hash)."""
    return {str(task_id): int(n) for task_id, n in client.hgetall(RUNS).items()}


def points(runs: dict[str, int], schedule: str) -> list[str]:
    """Task ids of a schedule's runs: a point's id is ``{name}@<its time>``."""
    return sorted(task_id for task_id in runs if task_id.startswith("{" + schedule + "}@"))


def main() -> int:
    config = DelayQConfig.from_app(app)
    client = redis.Redis.from_url(config.url, decode_responses=True)
    client.delete(RUNS, LOG)
    dq = DelayQ(app)
    schedules = Schedules(app)
    print(f"store: {config.url}, prefix {config.prefix!r}, {config.shards} shards (celeryconfig.py)")

    # -- one-off jobs -------------------------------------------------------------------------
    # At a wall-clock time in the user's timezone: tomorrow 09:00 in Tokyo. The id names the
    # user and the day, so scheduling it twice keeps one job (created=False the second time).
    tokyo = ZoneInfo("Asia/Tokyo")
    nine = (datetime.now(tokyo) + timedelta(days=1)).replace(hour=9, minute=0, second=0, microsecond=0)
    ada = send_reminder.apply_at(
        nine, args=("ada", "team breakfast at 9:30"), task_id=f"reminder:ada:{nine:%Y-%m-%d}"
    )
    print(
        f"one-off: ada's reminder at {nine:%a %H:%M %Z} her time = {ada.due:%a %H:%M} UTC, "
        f"id {ada.id}, created={ada.created}"
    )
    # Any aware datetime works: two seconds from now, as Bob's clock in New York reads it.
    bob_at = datetime.now(ZoneInfo("America/New_York")) + timedelta(seconds=2)
    bob = send_reminder.apply_at(bob_at, args=("bob", "your export is ready"))
    print(f"one-off: bob's reminder at {bob_at:%H:%M:%S %Z} his time = {utc(bob.due)}")
    # After a delay.
    cy = send_reminder.apply_in(timedelta(hours=1), args=("cy", "call the bank"))
    trial = expire_trial.apply_in(timedelta(days=14), args=(8,))
    print(
        f"one-off: cy's reminder in 1 h ({utc(cy.due)}), "
        f"trial of account 8 ends {trial.due:%Y-%m-%d %H:%M} UTC"
    )

    # -- recurring schedules (stored in Redis; beats fire each point once) ------------------------
    digest = schedules.upsert(DIGEST, daily_digest, "0 18 * * 1-5", args=("paris",), tz="Europe/Paris")
    stats = schedules.upsert(STATS, refresh_stats, timedelta(seconds=2), args=("sales",))
    assert digest.next_run is not None and stats.next_run is not None
    print(
        f"recurring: {DIGEST} ({digest.rule.describe()}), next "
        f"{digest.next_run.astimezone(ZoneInfo(digest.tz)):%a %d %b %H:%M %Z}"
    )
    print(f"recurring: {STATS} ({stats.rule.describe()}), next {utc(stats.next_run)}")

    # -- bulk: 3,000 trials ending over 3 s, stored in a few round trips ---------------------------
    start = datetime.now(UTC) + timedelta(seconds=1)
    items = [(start + timedelta(milliseconds=i), (1000 + i,), None) for i in range(BULK)]
    began = time.perf_counter()
    bulk = expire_trial.apply_at_many(items)
    took = time.perf_counter() - began
    print(
        f"bulk: {len(bulk):,} trial expiries due {utc(bulk[0].due)} to {utc(bulk[-1].due)}, "
        f"stored in {took:.2f} s"
    )

    # -- look at what is pending ------------------------------------------------------------------
    print(f"pending: {dq.count():,} jobs; reminders:")
    for job in dq.pending(task=send_reminder.name):
        print(f"  {job.due:%Y-%m-%d %H:%M:%S} UTC  {job.args[0]:4} {job.state:8} {job.id}")

    # -- change your mind: account 8 upgraded, cy wants the reminder now ---------------------------
    cancelled = dq.cancel(trial.id)
    moved_to = datetime.now(UTC) + timedelta(seconds=2)
    moved = dq.reschedule(cy.id, moved_to)
    print(f"cancelled trial expiry {trial.id}: {cancelled}")
    print(f"moved cy's reminder to {utc(moved_to)}: {moved}")

    # -- wait until the worker has run what it should ---------------------------------------------
    expected = {bob.id, cy.id, *(result.id for result in bulk)}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = counts(client)
        if expected <= runs.keys() and len(points(runs, STATS)) >= 2 and points(runs, PURGE):
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a job that ran twice, or should not have run, has had time to show up
    runs = counts(client)
    log = [json.loads(line) for line in client.lrange(LOG, 0, -1)]
    schedules.delete(STATS)  # the demo's fast interval; the digest and ada's reminder stay

    once = sum(1 for task_id in expected if runs.get(task_id) == 1)
    print(f"ran exactly once: {once:,} of {len(expected):,} one-off and bulk jobs")
    for entry in log:
        if entry["task"] == "send_reminder":
            late = (entry["ran"] - entry["due"]) * 1000
            print(f"ran: {entry['user']}'s reminder ({entry['text']}), {late:.0f} ms after its due time")
    trial_lateness = [(e["ran"] - e["due"]) * 1000 for e in log if e["task"] == "expire_trial"]
    if trial_lateness:
        print(
            f"ran: {len(trial_lateness):,} trial expiries, median "
            f"{statistics.median(trial_lateness):.0f} ms after their due time"
        )
    print(
        f"ran: {STATS} {len(points(runs, STATS))} times, {PURGE} (beat_schedule) "
        f"{len(points(runs, PURGE))} times"
    )
    stored = dq.get(ada.id)
    print(
        f"not run: cancelled trial expiry: {trial.id not in runs}; ada's reminder: "
        f"{stored.state if stored else 'gone'}, due {ada.due:%Y-%m-%d %H:%M} UTC"
    )

    scheduled = set(points(runs, STATS)) | set(points(runs, PURGE))
    ok = (
        cancelled
        and moved
        and once == len(expected)
        and all(n == 1 for n in runs.values())  # schedule points too: each once
        and set(runs) == expected | scheduled  # nothing else ran (not the cancelled job, not ada's)
        and len(points(runs, STATS)) >= 2
        and len(points(runs, PURGE)) >= 1
        and stored is not None
        and stored.state == "waiting"
    )
    print("ok" if ok else "unexpected result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
