"""Recurring schedules: a per-second cron in a timezone and an interval, managed at run time.

Run it (from the repository root, with a Redis at DELAYQ_EXAMPLE_URL):

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.schedules worker -l info
    celery -A examples.schedules beat -S celery_delayq.Scheduler -l info
    python -m examples.schedules

The last command creates two schedules, lists them, pauses and updates one,
waits until the worker has recorded a few runs of each, prints them with their
deterministic task ids and the run history, and deletes the schedules.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any
from zoneinfo import ZoneInfo

import redis
from celery import Celery

from celery_delayq import Schedules

URL = os.environ.get("DELAYQ_EXAMPLE_URL", "redis://127.0.0.1:6379/0")
RUNS = "examples:schedules:runs"
CRON, INTERVAL = "tick-tokyo", "tick-interval"

app = Celery("schedules", broker=URL)
app.conf.update(delayq_url=URL, task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(bind=True, name="examples.tick")
def tick(self: Any, label: str) -> None:
    """Record the run (any task works: schedules need no DelayedTask base)."""
    due_ms = getattr(self.request, "delayq_due", None)  # the point's time, in ms
    record = {
        "label": label,
        "id": self.request.id,
        "due": None if due_ms is None else due_ms / 1000,  # seconds, as "ran"
        "ran": time.time(),
    }
    redis.Redis.from_url(URL).rpush(RUNS, json.dumps(record))


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS, 0, -1)]


def main() -> int:
    client = redis.Redis.from_url(URL, decode_responses=True)
    client.delete(RUNS)
    schedules = Schedules(app)
    for name in (CRON, INTERVAL):
        schedules.delete(name)  # left over from an interrupted run: start clean

    # Every second (6 fields: seconds last), read in Tokyo time; late runs are skipped.
    cron = schedules.add(CRON, tick, "* * * * * *", args=("cron",), tz="Asia/Tokyo", missed="skip")
    # Every 2 s, on a grid anchored at this moment.
    schedules.add(INTERVAL, tick, timedelta(seconds=2), args=("interval",))
    assert cron.next_run is not None
    print(f"{CRON} next run in Tokyo: {cron.next_run.astimezone(ZoneInfo('Asia/Tokyo')):%H:%M:%S %Z}")

    for s in schedules.list(task=tick.name):
        print(f"schedule: {s.name} ({s.rule.describe()}), enabled={s.enabled}, next {s.next_run}")

    # Pause the interval, change its arguments and period, and resume it.
    paused = schedules.pause(INTERVAL)
    print(f"paused {paused.name}: next_run={paused.next_run}")
    schedules.update(INTERVAL, args=("interval-1.5s",), rule=timedelta(seconds=1.5))
    resumed = schedules.resume(INTERVAL)
    print(f"resumed {resumed.name} ({resumed.rule.describe()}, args {resumed.args}), next {resumed.next_run}")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        labels = [r["label"] for r in runs(client)]
        if labels.count("cron") >= 3 and labels.count("interval-1.5s") >= 2:
            break
        time.sleep(0.1)

    recorded = runs(client)
    for r in recorded:
        late_ms = (r["ran"] - r["due"]) * 1000 if r["due"] is not None else float("nan")
        print(f"ran: {r['label']:14} {r['id']}  started {late_ms:.0f} ms after its point")
    for name in (CRON, INTERVAL):
        s = schedules.get(name)
        assert s is not None
        print(f"history: {name}: {s.run_count} runs, last {s.last_task_id}")

    deleted = [schedules.delete(name) for name in (CRON, INTERVAL)]
    print(f"deleted: {deleted}, left: {[s.name for s in schedules.list(task=tick.name)]}")

    ids = [r["id"] for r in recorded]
    cron_runs = [r for r in recorded if r["label"] == "cron"]
    interval_runs = [r for r in recorded if r["label"] == "interval-1.5s"]
    ok = (
        len(cron_runs) >= 3
        and len(interval_runs) >= 2
        and len(set(ids)) == len(ids)  # each point ran once
        and all(r["id"].startswith("{" + CRON + "}@") for r in cron_runs)
        and all(r["id"].startswith("{" + INTERVAL + "}@") for r in interval_runs)
        and not any(r["label"] == "interval" for r in recorded)  # paused and updated before its 1st run
        and all(deleted)
        and schedules.get(CRON) is None
    )
    print("ok" if ok else "unexpected result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
