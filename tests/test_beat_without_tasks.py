"""A beat whose app does not import a task's module, with real worker and beat processes.

* A **retry** of such a task (``self.retry(countdown=...)`` under ``delayq_intercept_eta``) is
  published by name, as ``send_task`` would, with the routing captured when the worker stored
  it: the worker that retried it runs it, as plain Celery's worker would.
* Any other job of a task the beat does not know goes to the dead letters
  (``delayq_dead_letter_unknown``), and its result is FAILURE with the reason, so the caller
  does not wait for good.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis
from celery.exceptions import NotRegistered

from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import STARTUP, Producer, log_of, producers, runs, starts

__all__ = ["producers"]  # a fixture, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_retry_runs_and_an_unknown_job_fails_its_result_when_the_beat_lacks_the_task(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    conf = {"delayq_intercept_eta": True, "result_backend": redis_url, "task_ignore_result": False}
    producer = producers(redis_url, redis_url, delayq_intercept_eta=True, result_backend=redis_url)
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    procs.start("worker", env)
    procs.start("beat", env, app="tests.apps.bare_beat_app")
    assert wait_for(lambda: "delayq: beat" in log_of(procs, 1), STARTUP, 0.1), procs.logs()

    # Sent straight to the broker; the worker's retry(countdown=1) goes through delayq.
    flaky = producer.flaky.apply_async(kwargs={"fail_times": 1, "countdown": 1.0})
    # Stored for a task the beat does not import; not a retry.
    stranger = producer.record.apply_in(0.5, args=("stranger",))

    assert wait_for(lambda: runs(r).get(flaky.id) == 2, 60), procs.logs()
    assert flaky.get(timeout=30) is None  # SUCCESS: not left at RETRY
    tries = sorted((s for s in starts(r) if s["id"] == flaky.id), key=lambda s: s["retries"])
    assert [s["retries"] for s in tries] == [0, 1]
    assert tries[1]["due"] is not None  # the retry came through the beat

    with pytest.raises(NotRegistered, match=r"'e2e\.record' is not registered in the beat's app"):
        producer.app.AsyncResult(stranger.id).get(timeout=30)
    dead = dict(producer.dq.dead())
    assert set(dead) == {stranger.id}
    assert "not registered in the beat's app" in dead[stranger.id]["reason"]
    time.sleep(0.5)
    assert stranger.id not in runs(r)
