"""Canvas end to end: one real ``celery worker`` and one ``celery beat -S celery_delayq.Scheduler``
shared by this module's tests, a Redis result backend (chords need one).

Each shape is sent the two ways a user can: ``apply_async(countdown=)`` with
``delayq_intercept_eta`` on (tasks with ``DelayedTask`` as base), and
``celery_delayq.apply_at(signature, eta)`` (here on a plain task). Plain Celery
5.7, measured with the same worker and intercept off, runs: every group member
after the countdown; every chord header member after it and the callback once,
after all of them; a chain's first task after it and the rest right after;
a group member with its own ``.set(countdown=)`` after that countdown and the
others at once. The tests check each member ran exactly once, not before its
due time, and (for a delayed message) that a beat published it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.result import AsyncResult

import celery_delayq
from celery_delayq import DelayedTask, DelayQ
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.store.facade import get_store
from tests.support.apps import forget_subscriptions, make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Worker and store share this machine's clock: a job may start this much "before" its due.
CLOCK_TOL = 0.010
#: Time for a worker or beat to start on a loaded 2-core machine.
STARTUP = 60.0
#: Jobs are due this far ahead: the beat is running, so each is stored well before its due.
AHEAD = 5.0


@dataclass
class Stack:
    app: Celery
    record: Any  # e2e.record, a DelayedTask
    plain: Any  # e2e.plain_record, a plain Task
    r: redis.Redis
    procs: Procs


@pytest.fixture(scope="module")
def stack(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    url = redis_server.url + "/0"
    conf = {
        "task_ignore_result": False,
        "result_backend": redis_server.url + "/1",
        "delayq_intercept_eta": True,
    }
    procs = Procs(Path(tmp_path_factory.mktemp("canvas")))
    env = subprocess_env(url, url, DELAYQ_TEST_CONF=json.dumps(conf))
    app = make_app(url, url, **conf)

    @app.task(base=DelayedTask, bind=True, name="e2e.record", shared=False)
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @app.task(bind=True, name="e2e.plain_record", shared=False)
    def plain(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    try:
        procs.start("worker", env, "-Q", "celery,canvas")
        procs.start("beat", env)
        ready = wait_for(lambda: "delayq: beat" in procs.procs[1][1].read_text(errors="replace"), STARTUP)
        assert ready, f"beat did not start\n{procs.logs()}"
        warm = record.apply_in(0, task_id=f"warmup-{uuid.uuid4().hex}")
        assert wait_for(lambda: client.hexists("e2e:runs", warm.id), STARTUP), procs.logs()
        client.delete("e2e:runs", "e2e:starts")
        yield Stack(app, record, plain, client, procs)
    finally:
        procs.stop_all()
        forget_subscriptions(app)
        get_store(app).close()
        app.close()
        client.flushall()
        client.close()


def chain_ids(result: AsyncResult) -> list[str]:
    """The ids of a chain's tasks, first to last, from the last task's result."""
    ids = []
    node: AsyncResult | None = result
    while node is not None:
        ids.append(node.id)
        node = node.parent
    return ids[::-1]


def wait_runs(stack: Stack, ids: list[str]) -> dict[str, dict[str, Any]]:
    """Wait for ``ids`` to run; check each ran exactly once; return its start record."""
    done = wait_for(lambda: all(stack.r.hexists("e2e:runs", i) for i in ids), 60, 0.1)
    assert done, f"not run: {[i for i in ids if not stack.r.hexists('e2e:runs', i)]}\n{stack.procs.logs()}"
    time.sleep(1.0)  # a late duplicate would show up here
    counts = {i: int(stack.r.hget("e2e:runs", i) or 0) for i in ids}
    assert set(counts.values()) == {1}, counts
    records = {}
    for raw in stack.r.lrange("e2e:starts", 0, -1):
        rec = json.loads(raw)
        if rec["id"] in counts:
            records[rec["id"]] = rec
    return records


def assert_delayed(rec: dict[str, Any], not_before: float, due: float | None = None) -> None:
    """Published by a beat (the ``delayq_due`` header is set) and started no earlier than due."""
    assert rec["due"] is not None, f"not published by a beat: {rec}"
    if due is not None:
        assert abs(rec["due"] - due) < 0.002, (rec, due)
    assert rec["start"] >= not_before - CLOCK_TOL, f"ran before its due ({not_before}): {rec}"


def check_shapes(stack: Stack, shapes: dict[str, Any], not_before: float, due: float | None) -> None:
    group_ids = [r.id for r in shapes["group"].results]
    header_ids = [r.id for r in shapes["chord"].parent.results]
    callback_id = shapes["chord"].id
    link_ids = chain_ids(shapes["chain"])
    single_id = shapes["single"].id
    assert len(link_ids) == 3
    recs = wait_runs(stack, [*group_ids, *header_ids, callback_id, *link_ids, single_id])
    for i in [*group_ids, *header_ids, single_id, link_ids[0]]:
        assert_delayed(recs[i], not_before, due)
    # The chord's callback: once, after every header member (the worker publishes it).
    assert recs[callback_id]["start"] >= max(recs[i]["start"] for i in header_ids)
    # The chain's rest follows its first task, as Celery chains do.
    starts = [recs[i]["start"] for i in link_ids]
    assert starts == sorted(starts), starts
    assert DelayQ(stack.app).count() == 0


def test_intercepted_canvas_with_countdown(stack: Stack) -> None:
    record = stack.record
    sent = time.time()
    shapes = {
        "group": group(record.s("g", i) for i in range(3)).apply_async(countdown=AHEAD),
        "chord": chord([record.s("h", i) for i in range(3)], record.s("cb")).apply_async(countdown=AHEAD),
        "chain": chain(record.s("a"), record.s("b"), record.s("c")).apply_async(countdown=AHEAD),
        "single": record.s("x").set(queue="canvas", priority=3).apply_async(countdown=AHEAD),
    }
    # A group of members with their own countdown, and one without (run at once, as in Celery).
    own = group(record.s("s", 1).set(countdown=AHEAD), record.s("s", 2)).apply_async()
    assert DelayQ(stack.app).count() == 3 + 3 + 1 + 1 + 1  # one job per delayed task message
    check_shapes(stack, shapes, sent + AHEAD, None)
    recs = wait_runs(stack, [r.id for r in own.results])
    assert_delayed(recs[own.results[0].id], sent + AHEAD)
    assert recs[own.results[1].id]["due"] is None  # no countdown: published at once by Celery


def test_apply_at_any_signature(stack: Stack) -> None:
    plain = stack.plain
    due = time.time() + AHEAD
    shapes = {
        "group": celery_delayq.apply_at(group(plain.s("g", i) for i in range(3)), due),
        "chord": celery_delayq.apply_at(chord([plain.s("h", i) for i in range(3)], plain.s("cb")), due),
        "chain": celery_delayq.apply_at(chain(plain.s("a"), plain.s("b"), plain.s("c")), due),
        "single": celery_delayq.apply_at(plain.s("x").set(queue="canvas", priority=3), due),
    }
    pending = {job.id: job for job in DelayQ(stack.app).pending()}
    assert len(pending) == 3 + 3 + 1 + 1
    assert pending[shapes["single"].id].queue == "canvas"
    check_shapes(stack, shapes, due, due)
