"""The Celery app that the flow-control end-to-end tests (``tests/test_flow_e2e.py``) run as real
``celery worker``/``celery beat`` processes.

Configured from the same environment as ``tests/apps/e2e_app.py`` (``DELAYQ_TEST_BROKER``,
``DELAYQ_TEST_STORE``, ``DELAYQ_TEST_CONF``; set by ``tests/support/stack.py``'s ``env_for``).

Every run of ``flow.work`` records, in the store's Redis, two JSON entries sharing a run token
(one per run, so a job that runs twice has two): ``RPUSH flow:starts {run, id, key, pid,
start}`` when it begins and ``RPUSH flow:ends {run, id, pid, end}`` when it is about to return
(``time.time()``; the worker gives the job's slot back after that). ``key`` is the gate key of
the message's ``delayq_gate`` header (None when the job is not gated); ``pid`` is the worker
process (the ``-P threads`` pool runs tasks in it). A run whose worker is SIGKILLed has a start
and no end. ``flow.done`` (a batch's ``on_complete``) records ``RPUSH flow:done {id, args, time}``.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery

from celery_delayq import DelayedTask

BROKER = os.environ.get("DELAYQ_TEST_BROKER", "redis://127.0.0.1:1/0")
STORE = os.environ.get("DELAYQ_TEST_STORE", BROKER)

app = Celery("flow", broker=BROKER)
app.conf.update(
    {
        "delayq_url": STORE,
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        **json.loads(os.environ.get("DELAYQ_TEST_CONF", "{}")),
    }
)


@functools.cache
def _recorder() -> redis.Redis:
    return redis.Redis.from_url(STORE)


@app.task(base=DelayedTask, bind=True, name="flow.work")
def work(self: Any, seconds: float = 0.0, *args: Any) -> None:
    """Record the start, sleep ``seconds``, record the end."""
    start = time.time()
    run = uuid.uuid4().hex
    gate = getattr(self.request, "delayq_gate", None)
    key = gate.get("key") if isinstance(gate, dict) else None
    pid = os.getpid()
    _recorder().rpush(
        "flow:starts", json.dumps({"run": run, "id": self.request.id, "key": key, "pid": pid, "start": start})
    )
    if seconds:
        time.sleep(float(seconds))
    _recorder().rpush(
        "flow:ends", json.dumps({"run": run, "id": self.request.id, "pid": pid, "end": time.time()})
    )


@app.task(base=DelayedTask, bind=True, name="flow.done")
def done(self: Any, *args: Any) -> None:
    """A batch's completion task: record its arguments (its own, then batch id and counts)."""
    record = {"id": self.request.id, "args": list(args), "time": time.time()}
    _recorder().rpush("flow:done", json.dumps(record))
