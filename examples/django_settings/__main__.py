"""Show the delayq settings read from the ``CELERY_*`` names, and ``apply_async(countdown=...)``
going through delayq.

Run it from the repository root, with a worker and a beat running (see ``__init__.py``):

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    python -m examples.django_settings

It prints the effective delayq configuration, then calls ``apply_async`` the way existing
code does: with ``countdown=2`` (stored in delayq, since CELERY_DELAYQ_INTERCEPT_ETA is on),
without a countdown (published at once, as usual), and a task whose first attempt fails
and calls ``self.retry(countdown=1)`` (the retry is stored in delayq too). It waits (at most
60 s) until the worker has run each of them, and checks how.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

import redis

from celery_delayq import DelayQ, ScheduledResult
from celery_delayq.config import DelayQConfig

from .celery import app
from .tasks import LOG, RUNS, send_welcome, sync_account


def clock(seconds: float | None) -> str:
    return "-" if seconds is None else f"{datetime.fromtimestamp(seconds, UTC):%H:%M:%S.%f}"[:-3]


def due(result: Any) -> str:
    if isinstance(result, ScheduledResult):
        return f"due {result.due:%H:%M:%S} UTC"
    return "sent to the broker with an eta"  # CELERY_DELAYQ_INTERCEPT_ETA off


def main() -> int:
    config = DelayQConfig.from_app(app)
    print("effective delayq config (CELERY_DELAYQ_* in settings.py, DelayQConfig.from_app(app)):")
    for name in DelayQConfig.field_names():
        print(f"  {name:20} {getattr(config, name)!r}")
    client = redis.Redis.from_url(config.url, decode_responses=True)
    client.delete(RUNS, LOG)

    # Existing code, unchanged: a countdown. With the intercept on it is stored in delayq.
    later = send_welcome.apply_async((42,), countdown=2)
    job = DelayQ(app).get(later.id)
    print(
        f"apply_async(countdown=2) -> {type(later).__name__}, {due(later)}, "
        f"in delayq: {job.state if job else 'no'} (shard {job.shard if job else '-'} of {config.shards})"
    )
    # No countdown: published into the broker at once, exactly as without delayq.
    now = send_welcome.apply_async((43,))
    print(f"apply_async() -> {type(now).__name__}, in delayq: {'yes' if DelayQ(app).get(now.id) else 'no'}")
    # A task whose first attempt fails: self.retry(countdown=1) is stored in delayq too.
    sync = sync_account.apply_async((7,), countdown=1)
    print(f"sync_account.apply_async(countdown=1) -> {type(sync).__name__}, {due(sync)}")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = {str(task_id): int(n) for task_id, n in client.hgetall(RUNS).items()}
        if later.id in runs and now.id in runs and runs.get(sync.id, 0) >= 2:
            break
        time.sleep(0.1)
    time.sleep(1.0)  # a job that ran twice has had time to show up
    runs = {str(task_id): int(n) for task_id, n in client.hgetall(RUNS).items()}
    log: list[dict[str, Any]] = [json.loads(line) for line in client.lrange(LOG, 0, -1)]
    for e in log:
        if e["due"] is not None:  # request.eta is then its due time, set by DelayedTask
            via = "published by a delayq beat when due"
        elif e["eta"] is not None:
            via = f"a worker held it until its eta {e['eta']}"
        else:
            via = "published at once"
        print(
            f"ran: {e['task']}({e.get('user', e.get('account'))}) try {e['retries'] + 1}, "
            f"started {clock(e['ran'])} UTC: {via}"
        )

    attempts = [e for e in log if e["id"] == sync.id]
    ok = (
        config.intercept_eta
        and isinstance(later, ScheduledResult)
        and job is not None
        and not isinstance(now, ScheduledResult)
        and runs == {later.id: 1, now.id: 1, sync.id: 2}  # each once; the retry reuses its task's id
        and all(e["eta"] is None for e in log if e["due"] is None)  # nothing waited in a worker's memory
        and [e["due"] is not None for e in log if e["id"] == later.id] == [True]
        and [e["due"] is None for e in log if e["id"] == now.id] == [True]
        and [e["retries"] for e in attempts] == [0, 1]
        and all(e["due"] is not None for e in attempts)
    )
    print("ok" if ok else "unexpected result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
