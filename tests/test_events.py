"""What Celery's monitoring events (and so Flower and ``celery events``) show for a delayq job.

A real ``celery worker -E`` and a delayq beat; an event receiver on the broker (as Flower
has). For each publish path (the push one, ``lua/push_claimed.lua`` pushing a hand-built
kombu message, and kombu's own), a plain job and a compressed one.

By default (``delayq_publish_eta`` off):

* the worker's ``task-received`` event has ``eta: None``: the worker runs the job at once
  and never holds it (Celery's event carries no headers, so ``delayq_due`` is not in it);
* the event's ``timestamp`` (Flower's "Received") is the due time plus the delivery
  lateness: the due time, as near as the beat delivers it;
* the message carries the ``delayq_due`` header (the task sees ``request.delayq_due``).

With ``delayq_publish_eta`` on, the event's ``eta`` (what Flower shows) and the task's
``request.eta`` are the due time, to the millisecond; the task still starts on time; the
worker's lateness recorder counts those messages; and a ``retry(countdown=...)`` under
``delayq_intercept_eta`` gets its own due time, not the eta of the attempt it retries.

A plain Celery ETA task is sent alongside for contrast: its event carries its ``eta``.
docs/operations.md ("Flower and celery inspect") describes what each tool shows.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.events.state import State

from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import CLOCK_TOL, MAX_LATE, STARTUP, Producer, log_of
from tests.support.store import stored_lateness

pytestmark = pytest.mark.e2e

AHEAD = 4.0  # seconds between scheduling and the due time


@contextlib.contextmanager
def stack_with_events(
    procs: Procs, redis_url: str, conf: dict[str, Any]
) -> Iterator[tuple[Producer, list[dict[str, Any]]]]:
    """A worker run with ``-E`` and a beat (app settings ``conf``), a producer, and the list
    the events the worker sends are appended to (by a receiver on the broker, as Flower's)."""
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    procs.start("worker", env, "-E", pool="threads -c 2")
    procs.start("beat", env)
    events: list[dict[str, Any]] = []
    monitor = Celery("monitor", broker=redis_url, set_as_current=False)
    connection = monitor.connection()
    receiver = monitor.events.Receiver(connection, handlers={"*": events.append})
    # Until should_stop: it is checked after each event or each second without one.
    thread = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
    thread.start()
    producer = Producer(redis_url, redis_url, **conf)
    try:
        ready = wait_for(lambda: "ready." in log_of(procs, 0) and "delayq: beat" in log_of(procs, 1), STARTUP)
        assert ready, procs.logs()
        yield producer, events
    finally:
        receiver.should_stop = True
        thread.join(timeout=10)
        connection.release()
        producer.close()


def received(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The ``task-received`` events by task id, in order (a retry has the id of its task)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for event in list(events):
        if event.get("type") == "task-received":
            out.setdefault(event["uuid"], []).append(event)
    return out


def starts_by_id(r: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in map(json.loads, r.lrange("e2e:starts", 0, -1)):
        out.setdefault(row["id"], []).append(row)
    return out


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def flower_etas(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Each task's ``eta`` as Flower keeps it: in Celery's ``events.State``, whose
    ``Task`` fields are what Flower's task page and ``/api/tasks`` show."""
    state = State()
    for event in events:
        state.event(dict(event))
    return {task_id: task.eta for task_id, task in state.tasks.items()}


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_task_received_event_of_a_delayq_job(
    procs: Procs, redis_url: str, r: redis.Redis, push: bool
) -> None:
    with stack_with_events(procs, redis_url, {"delayq_push": push}) as (producer, events):
        jobs = [producer.record.apply_in(AHEAD), producer.record.apply_in(AHEAD, compression="zlib")]
        celery_eta = datetime.now(UTC) + timedelta(seconds=AHEAD)
        celery_job = producer.plain.apply_async(eta=celery_eta)
        ids = {job.id for job in jobs} | {celery_job.id}
        done = wait_for(lambda: ids <= set(received(events)) and r.hlen("e2e:runs") == 3, STARTUP, 0.1)
        assert done, (received(events), procs.logs())
    got = received(events)
    starts = starts_by_id(r)
    flower = flower_etas(events)
    for job in jobs:
        assert flower[job.id] is None
        (event,) = got[job.id]
        due = job.due.timestamp()
        assert event["eta"] is None, event  # the worker runs it at once: nothing to hold
        assert due - CLOCK_TOL <= event["timestamp"] <= due + MAX_LATE, (event, due)
        (start,) = starts[job.id]
        assert start["due"] == pytest.approx(due, abs=1e-6)  # the delayq_due header reached the task
        assert abs(seconds(start["eta"]) - due) < 0.0005, start  # request.eta: set by DelayedTask
    assert datetime.fromisoformat(got[celery_job.id][0]["eta"]) == celery_eta  # Celery's own ETA
    assert starts[celery_job.id][0]["due"] is None


RETRY_AFTER = 3.0  # the countdown of e2e.flaky's retry


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_with_publish_eta_flower_sees_the_due_time_and_the_worker_does_not_hold_the_job(
    procs: Procs, redis_url: str, r: redis.Redis, push: bool
) -> None:
    conf = {
        "delayq_push": push,
        "delayq_publish_eta": True,
        "delayq_intercept_eta": True,
        "delayq_record_lateness": True,
    }
    with stack_with_events(procs, redis_url, conf) as (producer, events):
        jobs = [producer.record.apply_in(AHEAD), producer.record.apply_in(AHEAD, compression="zlib")]
        # Delivered with an eta, it retries itself under intercept: the retry is a new job.
        flaky = producer.flaky.apply_in(AHEAD, kwargs={"fail_times": 1, "countdown": RETRY_AFTER})
        celery_eta = datetime.now(UTC) + timedelta(seconds=AHEAD)
        celery_job = producer.plain.apply_async(eta=celery_eta)  # not a DelayedTask: Celery's ETA
        ids = {job.id for job in jobs} | {celery_job.id}

        def finished() -> bool:
            got = received(events)
            return ids <= set(got) and len(got.get(flaky.id, [])) == 2 and r.hlen("e2e:runs") == 4

        assert wait_for(finished, STARTUP + AHEAD + RETRY_AFTER, 0.1), (received(events), procs.logs())
        # The workers' recorder flushes once a second: both jobs and both flaky runs.
        histogram = lambda: stored_lateness(r).count  # noqa: E731
        assert wait_for(lambda: histogram() >= 4, 15, 0.1), histogram()
    got = received(events)
    starts = starts_by_id(r)
    flower = flower_etas(events)
    for job in jobs:
        assert flower[job.id] == got[job.id][0]["eta"]  # what Flower shows as ETA
    for job in [*jobs, flaky]:
        due = job.due.timestamp()
        event = got[job.id][0]
        assert abs(seconds(event["eta"]) - due) < 0.0005, (event, due)  # the due time, to the ms
        start = min(starts[job.id], key=lambda s: s["retries"])
        assert start["due"] == due
        assert abs(seconds(start["eta"]) - due) < 0.0005, start  # request.eta: the due time
        # Not held by the worker: it started when the beat delivered it.
        assert due - CLOCK_TOL <= start["start"] < due + MAX_LATE, (start, due)
    # The retry: a job of its own, due RETRY_AFTER s after the failed run, with that as its eta.
    first, retry = sorted(starts[flaky.id], key=lambda s: s["retries"])
    assert (first["retries"], retry["retries"]) == (0, 1)
    assert RETRY_AFTER - 0.002 <= retry["due"] - first["start"] < RETRY_AFTER + MAX_LATE, (first, retry)
    assert abs(seconds(retry["eta"]) - retry["due"]) < 0.0005, retry
    assert abs(seconds(got[flaky.id][1]["eta"]) - retry["due"]) < 0.0005, got[flaky.id]
    assert retry["due"] - CLOCK_TOL <= retry["start"] < retry["due"] + MAX_LATE, retry
    assert stored_lateness(r).count == 4  # not Celery's own ETA task
    assert datetime.fromisoformat(got[celery_job.id][0]["eta"]) == celery_eta
    assert starts[celery_job.id][0]["due"] is None
