"""The Celery app that end-to-end tests run as real ``celery worker``/``celery beat`` processes.

Configured from the environment (set by ``tests/support/processes.py``):
``DELAYQ_TEST_BROKER`` (broker URL), ``DELAYQ_TEST_STORE`` (delayq Redis URL,
also where tasks record their runs), optional ``DELAYQ_TEST_CONF`` (JSON of
extra app settings) and optional ``DELAYQ_TEST_RECORD`` (Redis URL where runs are
recorded instead of the store: the reliability tests restart the store's server and
must not lose the records with it).

Every task run is recorded in the store's Redis (or ``DELAYQ_TEST_RECORD``):
``HINCRBY e2e:runs <task id> 1`` and ``RPUSH e2e:starts <json {id, start, due, retries, eta}>``
(start: worker clock, s; eta: ``request.eta``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from celery_delayq import DelayedTask

BROKER = os.environ.get("DELAYQ_TEST_BROKER", "redis://127.0.0.1:1/0")
STORE = os.environ.get("DELAYQ_TEST_STORE", BROKER)
RECORD = os.environ.get("DELAYQ_TEST_RECORD") or STORE

app = Celery("e2e", broker=BROKER)
app.conf.update(
    {
        "delayq_url": STORE,
        "broker_connection_retry_on_startup": True,
        "worker_prefetch_multiplier": 16,
        "task_ignore_result": True,
        # Last: may override the above (the canvas tests keep results, for chords).
        **json.loads(os.environ.get("DELAYQ_TEST_CONF", "{}")),
    }
)

_client: redis.Redis | None = None


def recorder() -> redis.Redis:
    """The client that records runs: the tests' instrument, so it retries a connection that the
    server closed or refused for up to ~6 s (a CI soak once lost one run's record to "Connection
    closed by server" during redis-py's handshake, while the task itself ran)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(
            RECORD,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 10),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
    return _client


#: One run's record, once: a pipeline that redis-py retries after a lost reply would count the
#: run twice (a CI soak saw it: the one run of 4,000 that took 0.16 s, not 0.05, was counted two
#: runs, with one "received" line in every worker log). The run's own token makes a retry a no-op.
_RECORD_ONCE = """
if redis.call('SADD', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
  redis.call('RPUSH', KEYS[2], ARGV[3])
end
"""


def _record(task: Any) -> None:
    start = time.time()
    due = getattr(task.request, "delayq_due", None)  # ms since the epoch
    due = None if due is None else due / 1000.0  # recorded in seconds, as "start"
    eta = task.request.eta  # the message's eta header (an ISO string), or None
    started = json.dumps(
        {
            "id": task.request.id,
            "start": start,
            "due": due,
            "retries": task.request.retries,
            "eta": eta if eta is None else str(eta),
        }
    )
    client = recorder()
    client.eval(
        _RECORD_ONCE,
        3,
        "e2e:runs",
        "e2e:starts",
        "e2e:run-tokens",
        uuid.uuid4().hex,
        task.request.id,
        started,
    )


@app.task(base=DelayedTask, bind=True, name="e2e.record")
def record(self: Any, *args: Any, **kwargs: Any) -> None:
    _record(self)


@app.task(base=DelayedTask, bind=True, name="e2e.flaky", max_retries=3)
def flaky(self: Any, fail_times: int = 1, countdown: float = 1.0) -> None:
    """Fails ``fail_times`` times, retrying with ``self.retry(countdown=...)``, then records."""
    _record(self)
    if self.request.retries < fail_times:
        raise self.retry(countdown=countdown)


@app.task(bind=True, name="e2e.plain")
def plain(self: Any) -> None:
    """A task that is not a DelayedTask (used by beat_schedule tests)."""
    _record(self)


@app.task(
    base=DelayedTask,
    bind=True,
    name="e2e.record_late",
    acks_late=True,
    reject_on_worker_lost=True,
)
def record_late(self: Any, *args: Any, **kwargs: Any) -> None:
    """``e2e.record`` acked only after it ran (``acks_late``): a message whose worker is
    SIGKILLed before the ack stays in the broker's unacked set and is delivered again
    (on the Redis broker, once ``visibility_timeout`` has passed). Used by the worker-kill
    soak in ``tests/test_reliability.py``. A ``hold`` keyword (seconds) keeps the task
    running that long after it recorded its start, so that a kill finds messages unacked."""
    _record(self)
    hold = kwargs.get("hold")
    if hold:
        time.sleep(float(hold))


@app.task(bind=True, name="e2e.plain_record")
def plain_record(self: Any, *args: Any, **kwargs: Any) -> None:
    """``e2e.record`` on a plain Task (not a DelayedTask): the canvas tests schedule it through
    ``celery_delayq.apply_at(signature, ...)``, which works for any task of the app."""
    _record(self)


# -- hooks of the paused-beat experiment (tests/test_fencing.py) ------------------------------

if os.environ.get("DELAYQ_TEST_PUBLISH_RECEIVER"):
    from celery.signals import after_task_publish

    @after_task_publish.connect(weak=False)
    def _published(**kwargs: Any) -> None:
        """A receiver that does nothing: connected, it takes every job off the push path."""


if os.environ.get("DELAYQ_TEST_STOP_IN_PUBLISH") or os.environ.get("DELAYQ_TEST_STOP_AFTER_CLAIM"):
    import signal

    from celery_delayq.beat import dispatch

    _STOP_PUBLISHED = int(os.environ.get("DELAYQ_TEST_STOP_IN_PUBLISH") or 0)
    _STOP_AT = int(os.environ.get("DELAYQ_TEST_STOP_AFTER_CLAIM") or 0)
    _sent: list[int] = []
    _stopped: list[bool] = []

    def _stop(step: str, detail: Any) -> None:
        """Through the dispatcher's pause seam, SIGSTOP this beat once (the test sends SIGCONT),
        recording ``e2e:stopped`` first: with DELAYQ_TEST_STOP_AFTER_CLAIM, the first time a pass
        claimed at least that many jobs (how many, before any is published); with
        DELAYQ_TEST_STOP_IN_PUBLISH, once this beat has handed that many messages to the broker
        (one by one, or in a flushed batch), inside its publish phase (how many)."""
        if step == "claimed" and _STOP_AT and not _stopped and len(detail) >= _STOP_AT:
            _stopped.append(True)
            recorder().set("e2e:stopped", len(detail))
            os.kill(os.getpid(), signal.SIGSTOP)
        elif step == "sent" and _STOP_PUBLISHED:
            _sent.append(detail)
            if sum(_sent) >= _STOP_PUBLISHED and not recorder().get("e2e:stopped"):
                recorder().set("e2e:stopped", sum(_sent))
                os.kill(os.getpid(), signal.SIGSTOP)

    dispatch.Dispatcher.pause = staticmethod(_stop)
