"""Streamed batches (issue 28): ``DelayQ.open_batch`` opens a batch with no member, ``add``
stores members over time (from any process), ``seal`` ends the adding; the batch completes
once, after the seal, when every member ended. Real Redis, the real scripts (batch_open,
batch_grow, batch_seal, release, batch_cancel, batch_delete): members are moved by the store's
own claim, gate, hold and release calls, as a beat and a worker move them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_delayq import DelayQ
from celery_delayq.exceptions import BatchExists, BatchNotFound, BatchSealed, InvalidBatch
from celery_delayq.flow.batch import OpenBatch
from celery_delayq.flow.gate import GATE_HEADER, PARK_MS, batch_key, completion_id, member_id
from celery_delayq.store.facade import get_store
from tests.support.cli import as_json, invoke
from tests.support.gate import message, run_members
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parent.parent


def due_score(app: Celery, r: redis.Redis, job_id: str) -> float | None:
    """The job's score in its shard's due set (None: not there)."""
    store = get_store(app)
    return r.zscore(store.keys.shard(store.keys.shard_of(job_id)).due, job_id)


def test_members_added_over_time_complete_only_after_the_seal(app: Celery, r: redis.Redis) -> None:
    """Every member added so far ends before the seal: the batch is not complete (its
    on_complete stays parked); the seal completes it at once, in that call."""
    add = app.tasks["t.add"]
    batch = DelayQ(app).open_batch(on_complete=add.s(), batch_id="s1", concurrency_limit=5, priority=4)
    assert isinstance(batch, OpenBatch)
    assert batch.add([add.s(1, 1), add.s(2, 2)]) == [member_id("s1", 0), member_id("s1", 1)]
    assert batch.add([add.s(3, 3)]) == [member_id("s1", 2)]
    for i in range(3):  # each add gives the batch's limit and priority to its members
        headers, priority, _, _ = message(app, member_id("s1", i))
        assert headers[GATE_HEADER] == {"key": batch_key("s1"), "limit": 5, "priority": 4, "batch": "s1"}
        assert priority == 4
    state = batch.state()
    assert (state.total, state.waiting, state.sealed, state.done) == (3, 3, False, False)
    assert get_store(app).cancel_batch("s1") == 3  # every member ended (cancelled)
    state = batch.state()
    assert (state.cancelled, state.done, state.sealed) == (3, False, False)
    assert due_score(app, r, completion_id("s1")) == PARK_MS
    assert batch.seal() is True
    state = batch.state()
    assert (state.total, state.done, state.sealed) == (3, True, True)
    assert due_score(app, r, completion_id("s1")) != PARK_MS  # made due: on_complete is sent
    assert batch.seal() is False  # sealed already: nothing changes


def test_the_last_member_to_end_after_the_seal_completes_it_once(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    batch = dq.open_batch(on_complete=add.s(), batch_id="s2")
    ids = batch.add([add.s(i, i) for i in range(3)])
    run_members(app, ids)
    store = get_store(app)
    assert store.release(ids[0], batch_key("s2"), "succeeded", "s2").batch_done is False
    assert batch.seal() is True
    assert not batch.state().done
    assert store.release(ids[1], batch_key("s2"), "failed", "s2").batch_done is False
    assert store.release(ids[2], batch_key("s2"), "succeeded", "s2").batch_done is True
    state = batch.state()
    assert (state.total, state.succeeded, state.failed, state.waiting, state.done) == (3, 2, 1, 0, True)
    assert due_score(app, r, completion_id("s2")) != PARK_MS


def test_a_member_added_after_the_seal_is_refused_and_nothing_is_stored(app: Celery) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    batch = dq.open_batch(batch_id="s3")
    batch.add([add.s(1, 1)])
    assert batch.seal() is True
    with pytest.raises(BatchSealed, match="'s3' is sealed"):
        batch.add([add.s(2, 2)])
    assert batch.state().total == 1
    assert dq.get(member_id("s3", 1)) is None
    # a batch made whole by DelayQ.batch is sealed from the start; restored, it is no OpenBatch
    dq.batch([add.s(1, 1)], batch_id="whole")
    restored = dq.batch_result("whole")
    assert restored is not None and not isinstance(restored, OpenBatch)
    with pytest.raises(BatchSealed):
        OpenBatch("whole", app).add([add.s(2, 2)])
    assert dq.batch_result("whole").state().total == 1  # type: ignore[union-attr]


def test_bad_calls_are_refused_at_the_call(app: Celery) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    batch = dq.open_batch(batch_id="s4")
    with pytest.raises(BatchExists):
        dq.open_batch(batch_id="s4")
    with pytest.raises(InvalidBatch, match="at least one member"):
        batch.add([])
    with pytest.raises(InvalidBatch, match="expires=0"):
        dq.open_batch(expires=0)
    with pytest.raises(InvalidBatch, match="batch member 1"):
        batch.add([add.s(1, 1), add.s(1, 1).set(task_id="mine")])
    assert batch.state().total == 0  # nothing reserved for a refused add
    with pytest.raises(BatchNotFound):
        OpenBatch("nope", app).add([add.s(1, 1)])
    with pytest.raises(BatchNotFound):
        OpenBatch("nope", app).seal()


@pytest.mark.slow
def test_a_batch_never_sealed_is_visible_then_expires_and_never_completes(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    """The producer "dies" after adding (no seal): the batch shows as open in batches(), the
    CLI, the dashboard, with its expiry; each add pushes the expiry back. Once it passed, the
    sweep deletes it as ``delete --force`` does: the member waiting is cancelled, the one
    running runs on (its end counted nowhere: no batch record comes back), the parked
    on_complete is removed (never sent); a seal or add then: BatchNotFound."""
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    store = get_store(app)
    batch = dq.open_batch(on_complete=add.s(), batch_id="s5", expires=1.0)
    first = batch.state().expires_ms
    assert first is not None and first - batch.state().created_ms == 1000
    time.sleep(0.3)
    ids = batch.add([add.s(i, i) for i in range(3)])
    run_members(app, ids[:1])  # running
    assert store.cancel_batch("s5", [ids[1]]) == 1  # ended; ids[2] waits
    state = batch.state()
    assert state.expires_ms is not None and state.expires_ms >= first + 250  # pushed back
    [listed] = dq.batches()
    assert (listed.batch_id, listed.sealed, listed.total, listed.running) == ("s5", False, 3, 1)
    shown = as_json(invoke(app, "batch", "s5", "--json"))
    assert (shown["sealed"], shown["done"], shown["expires_ms"]) == (False, False, state.expires_ms)
    assert "open (not sealed)" in invoke(app, "batches").output
    assert "unless sealed by then" in invoke(app, "batch", "s5").output
    client = dashboard()
    assert "open (not sealed)" in client.get("/batches").text
    page = client.get("/batches/s5").text
    assert "open (not sealed)" in page and "unless sealed by then" in page
    assert client.get("/api/batches/s5").json()["sealed"] is False
    assert store.sweep_batches() == 0  # not expired yet
    assert dq.batch_result("s5") is not None
    time.sleep((state.expires_ms - store.server_now_ms()) / 1000 + 0.05)
    assert store.sweep_batches() == 1
    assert dq.batch_result("s5") is None and dq.batches() == []
    assert dq.get(completion_id("s5")) is None  # on_complete removed, never made due
    assert dq.get(ids[2]) is None  # the waiting member: cancelled
    assert dq.get(ids[0]) is not None  # the running one runs on
    assert store.release(ids[0], batch_key("s5"), "succeeded", "s5").batch_done is False
    assert dq.get(ids[0]) is None and store.batch_state("s5") is None
    assert not [k for k in r.keys("*") if "s5" in k and not k.endswith((":due", ":jobs", ":leases"))]
    with pytest.raises(BatchNotFound):
        batch.seal()
    with pytest.raises(BatchNotFound):
        batch.add([add.s(3, 3)])


ADDER = """
import sys, time
from tests.support.apps import add_task, make_app
from celery_delayq import DelayQ
url, start, rounds, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
app = make_app(url)
add = add_task(app)
batch = DelayQ(app).batch_result("race")
while time.time() < start:
    time.sleep(0.001)
ids = []
for n in range(rounds):
    ids += batch.add([add.s(n, i) for i in range(size)])
print(" ".join(ids))
"""


@pytest.mark.slow
def test_two_processes_adding_at_once_keep_the_counts_exact(app: Celery, redis_url: str) -> None:
    """Two processes add 40 calls of 5 members each, at once: 400 members, 400 distinct ids
    0..399, a total of 400; sealed, then all cancelled, it completes."""
    dq = DelayQ(app)
    batch = dq.open_batch(batch_id="race")
    start = time.time() + 1.5
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADDER, redis_url, str(start), "40", "5"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    ids = [job_id for out in outputs for job_id in out.split()]
    assert sorted(ids) == sorted(member_id("race", i) for i in range(400))
    assert batch.state().total == 400
    assert get_store(app).cancel_batch("race") == 400
    assert batch.seal() is True
    state = batch.state()
    assert (state.total, state.cancelled, state.done) == (400, 400, True)
