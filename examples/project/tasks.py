"""The project's tasks.

Each records its run in the store's Redis (``HINCRBY examples:project:runs <task id> 1`` and a
JSON line in ``examples:project:log``), so ``python -m examples.project`` can see what the
worker did. A real project would send the email or update the database here instead.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import redis

from celery_delayq import DelayedTask

from .celery import app

RUNS = "examples:project:runs"  # hash: task id -> how many times it ran
LOG = "examples:project:log"  # list: one JSON object per run


@functools.cache
def recorder() -> redis.Redis:
    """One client per process (created in the worker child, after any fork)."""
    return redis.Redis.from_url(app.conf.delayq_url, decode_responses=True)


def record(task: Any, **detail: Any) -> None:
    request = task.request
    due_ms = getattr(request, "delayq_due", None)  # set by the beat that published it, in ms
    entry = {
        "task": task.name.rsplit(".", 1)[-1],
        "id": request.id,
        "due": None if due_ms is None else due_ms / 1000,  # seconds, as "ran"
        "ran": time.time(),
        **detail,
    }
    pipe = recorder().pipeline(transaction=False)
    pipe.hincrby(RUNS, request.id, 1)
    pipe.rpush(LOG, json.dumps(entry))
    pipe.execute()


@app.task(base=DelayedTask, bind=True)
def send_reminder(self: Any, user: str, text: str) -> None:
    """Remind a user of something (scheduled one by one, at a time in the user's timezone)."""
    record(self, user=user, text=text)


@app.task(base=DelayedTask, bind=True)
def expire_trial(self: Any, account_id: int) -> None:
    """End an account's free trial (scheduled in bulk when trials are granted)."""
    record(self, account=account_id)


@app.task(bind=True)
def daily_digest(self: Any, team: str) -> None:
    """Send a team its digest (a recurring schedule; schedules need no DelayedTask base)."""
    record(self, team=team)


@app.task(bind=True)
def refresh_stats(self: Any, board: str) -> None:
    """Recompute a dashboard's figures (a recurring interval schedule)."""
    record(self, board=board)


@app.task(bind=True)
def purge_sessions(self: Any) -> None:
    """Drop expired sessions (from ``beat_schedule`` in celeryconfig.py)."""
    record(self)
