"""The demo's Celery app, run by the demo (:mod:`.demo`) as a real worker and beat
(``celery -A celery_delayq.devtools.demo_app worker|beat``).

Configured from the environment the demo sets for its child processes:
``DELAYQ_DEMO_URL`` (Redis: broker, store and the run record),
``DELAYQ_DEMO_PREFIX`` (key prefix of this run), ``DELAYQ_DEMO_QUEUE`` and
``DELAYQ_DEMO_TASK_MS`` (how long each run works, ``--task-ms``).
Each run of ``demo.ping`` records ``HINCRBY <prefix>:runs <id> 1`` and
``RPUSH <prefix>:lateness <start - due in ms>``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from ..producer.task import DelayedTask

URL = os.environ.get("DELAYQ_DEMO_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("DELAYQ_DEMO_PREFIX", "delayq-demo")
QUEUE = os.environ.get("DELAYQ_DEMO_QUEUE", "delayq-demo")
TASK_S = float(os.environ.get("DELAYQ_DEMO_TASK_MS", "0")) / 1000.0

app = Celery("delayq_demo", broker=URL, set_as_current=False)
app.conf.update(
    delayq_url=URL,
    delayq_prefix=PREFIX,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=32,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_recorder: redis.Redis | None = None


def _client() -> redis.Redis:
    global _recorder
    if _recorder is None:
        _recorder = redis.Redis.from_url(URL)
    return _recorder


@app.task(base=DelayedTask, bind=True, name="demo.ping")  # type: ignore[untyped-decorator]
def ping(self: Any, n: int) -> None:
    """Record that job ``n`` ran, and how late it started."""
    start = time.time()
    due = getattr(self.request, "delayq_due", None)
    pipe = _client().pipeline(transaction=False)
    pipe.hincrby(f"{PREFIX}:runs", self.request.id, 1)
    if due is not None:
        pipe.rpush(f"{PREFIX}:lateness", round(start * 1000.0 - float(due), 3))  # (due: ms)
    pipe.execute()
    if TASK_S > 0:
        time.sleep(TASK_S)  # the job's "work", after its start was recorded
