"""The site's tasks, written as in a Django app: shared tasks with a DelayedTask base.

Each records its run in the store's Redis (``HINCRBY examples:django:runs <task id> 1`` and
a JSON line in ``examples:django:log``) so ``python -m examples.django_settings`` can check
what the worker did.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import redis
from celery import shared_task

from celery_delayq import DelayedTask, delayed_task

RUNS = "examples:django:runs"  # hash: task id -> how many times it ran
LOG = "examples:django:log"  # list: one JSON object per run


@functools.cache
def recorder(url: str) -> redis.Redis:
    """One client per process and URL (created in the worker child, after any fork)."""
    return redis.Redis.from_url(url)


def record(task: Any, **detail: Any) -> None:
    client = recorder(task.app.conf.delayq_url)  # in Django: settings.CELERY_DELAYQ_URL
    request = task.request
    due_ms = getattr(request, "delayq_due", None)  # set when a delayq beat published it, in ms
    entry = {
        "task": task.name.rsplit(".", 1)[-1],
        "id": request.id,
        "retries": request.retries,
        "due": None if due_ms is None else due_ms / 1000,  # seconds, as "ran"
        "eta": request.eta,  # Celery's own ETA, or the due time of a job a delayq beat published
        "ran": time.time(),
        **detail,
    }
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(RUNS, request.id, 1)
    pipe.rpush(LOG, json.dumps(entry))
    pipe.execute()


@delayed_task(bind=True)  # the same as @shared_task(base=DelayedTask, bind=True)
def send_welcome(self: Any, user_id: int) -> None:
    """Welcome a new user (the site calls send_welcome.apply_async((user_id,), countdown=...))."""
    record(self, user=user_id)


class TemporaryError(Exception):
    """A remote service that is briefly unavailable."""


@shared_task(base=DelayedTask, bind=True, max_retries=3)
def sync_account(self: Any, account_id: int) -> None:
    """Push an account to the billing service; the first attempt fails and retries in 1 s."""
    record(self, account=account_id)
    if self.request.retries == 0:
        raise self.retry(exc=TemporaryError("billing service unavailable"), countdown=1)
