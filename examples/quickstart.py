"""A minimal celery-delayq project: one task, one-off jobs, a cancel and a reschedule.

Run it (from the repository root, with a Redis at DELAYQ_EXAMPLE_URL):

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.quickstart worker -l info
    celery -A examples.quickstart beat -S celery_delayq.Scheduler -l info
    python -m examples.quickstart

The last command schedules four reminders over the next few seconds, cancels
one, moves one later, and waits until the worker has run the three that remain.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime, timedelta

import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ

URL = os.environ.get("DELAYQ_EXAMPLE_URL", "redis://127.0.0.1:6379/0")
DONE = "examples:quickstart:reminded"

app = Celery("quickstart", broker=URL)
app.conf.update(delayq_url=URL, task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(base=DelayedTask, name="examples.remind")
def remind(user: str, text: str) -> None:
    """Pretend to notify ``user``; record it so the example can see it ran."""
    redis.Redis.from_url(URL).rpush(DONE, f"{datetime.now(UTC):%H:%M:%S.%f} {user}: {text}")


def main() -> int:
    client = redis.Redis.from_url(URL, decode_responses=True)
    client.delete(DONE)
    now = datetime.now(UTC)
    a = remind.apply_at(now + timedelta(seconds=1), args=("ada", "stand-up in 5 minutes"))
    b = remind.apply_in(2, args=("bob", "your trial ends tomorrow"))
    c = remind.apply_in(timedelta(seconds=3), args=("cy", "this one is cancelled"))
    d = remind.apply_in(3, args=("dee", "moved to 5 s from now"))
    assert c.cancel()
    assert d.reschedule(now + timedelta(seconds=5))
    print(f"scheduled {a.id} at {a.due:%H:%M:%S.%f}, {b.id} at {b.due:%H:%M:%S.%f}")
    print(f"pending now: {DelayQ(app).count()} (one cancelled, one moved to {d.due:%H:%M:%S.%f})")
    deadline = time.monotonic() + 60
    while client.llen(DONE) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the cancelled one must not show up
    for line in client.lrange(DONE, 0, -1):
        print("ran:", line)
    ok = client.llen(DONE) == 3 and not any("cancelled" in x for x in client.lrange(DONE, 0, -1))
    print("ok" if ok else "unexpected result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
