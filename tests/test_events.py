"""What Celery's monitoring events (and so Flower and ``celery events``) show for a delayq job.

A real ``celery worker -E`` and a delayq beat; an event receiver on the broker (as Flower
has). For each publish path (the atomic one, ``lua/deliver.lua`` pushing a hand-built
kombu message, and kombu's own), a plain job and a compressed one:

* the worker's ``task-received`` event has ``eta: None``: the worker runs the job at once
  and never holds it (Celery's event carries no headers, so ``delayq_due`` is not in it);
* the event's ``timestamp`` (Flower's "Received") is the due time plus the delivery
  lateness: the due time, as near as the beat delivers it;
* the message carries the ``delayq_due`` header (the task sees ``request.delayq_due``).

A plain Celery ETA task is sent alongside for contrast: its event carries its ``eta``.
docs/operations.md ("Flower and celery inspect") describes what each tool shows.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from tests.conftest import Procs, subprocess_env, wait_for
from tests.test_e2e import CLOCK_TOL, MAX_LATE, STARTUP, Producer, log_of

pytestmark = pytest.mark.e2e

AHEAD = 4.0  # seconds between scheduling and the due time


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "kombu"])
def test_task_received_event_of_a_delayq_job(
    procs: Procs, redis_url: str, r: redis.Redis, atomic: bool
) -> None:
    conf = json.dumps({"delayq_atomic_publish": atomic})
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=conf)
    procs.start("worker", env, "-E", pool="threads -c 2")
    procs.start("beat", env)
    events: list[dict[str, Any]] = []
    monitor = Celery("monitor", broker=redis_url, set_as_current=False)
    connection = monitor.connection()
    receiver = monitor.events.Receiver(connection, handlers={"*": events.append})
    # Until should_stop: it is checked after each event or each second without one.
    thread = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
    thread.start()
    producer = Producer(redis_url, redis_url)

    def received() -> dict[str, dict[str, Any]]:
        return {e["uuid"]: e for e in list(events) if e.get("type") == "task-received"}

    try:
        ready = wait_for(lambda: "ready." in log_of(procs, 0) and "delayq: beat" in log_of(procs, 1), STARTUP)
        assert ready, procs.logs()
        jobs = [producer.record.apply_in(AHEAD), producer.record.apply_in(AHEAD, compression="zlib")]
        celery_eta = datetime.now(UTC) + timedelta(seconds=AHEAD)
        celery_job = producer.plain.apply_async(eta=celery_eta)
        ids = {job.id for job in jobs} | {celery_job.id}
        done = wait_for(lambda: ids <= set(received()) and r.hlen("e2e:runs") == 3, STARTUP, 0.1)
        assert done, (received(), procs.logs())
    finally:
        receiver.should_stop = True
        thread.join(timeout=10)
        connection.release()
        producer.close()
    got = received()
    starts = {row["id"]: row for row in map(json.loads, r.lrange("e2e:starts", 0, -1))}
    for job in jobs:
        event = got[job.id]
        due = job.due.timestamp()
        assert event["eta"] is None, event  # the worker runs it at once: nothing to hold
        assert due - CLOCK_TOL <= event["timestamp"] <= due + MAX_LATE, (event, due)
        assert starts[job.id]["due"] == due  # the delayq_due header reached the task
    assert datetime.fromisoformat(got[celery_job.id]["eta"]) == celery_eta  # Celery's own ETA
    assert starts[celery_job.id]["due"] is None
