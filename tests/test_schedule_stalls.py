"""Schedules cannot be stalled (issue 13, item 5), against a real Redis.

A schedule's execution point is an ordinary stored job with the id ``{<name>}@<time>``. A job
stored under that id while the point waits or is held took the point's place, and the schedule
stopped for good: enabled, its ``next_run`` in the past, nothing stored, nothing logged. Here:

* a point id is refused on every way a job is stored (``ReservedTaskId``), and nothing is stored;
* a retry of a schedule's run (``self.retry(countdown=...)`` with ``delayq_intercept_eta``) keeps
  its task id in the message but is stored under an id of its own, and never touches the point;
* a stalled schedule is found by the beats' sweep, re-armed by its missed-run policy, logged and
  counted (``delayq_schedules_repaired_total``).

The end-to-end run with a real worker and beat is in ``tests/test_e2e_schedules.py``
(``test_a_schedule_with_a_retrying_task_under_load_runs_every_point``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
import redis
from celery import Celery

import celery_delayq
from celery_delayq import DelayQ, Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.metrics import DispatcherCollector
from celery_delayq.beat.upkeep import STALL_AFTER_MS
from celery_delayq.exceptions import ReservedTaskId
from celery_delayq.schedules.api import point_id
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from celery_delayq.store.keys import is_point_id
from celery_delayq.store.scripts import SCRIPTS

NAME = "tick"


def point_of(app: Celery, name: str = NAME) -> tuple[str, dict[str, Any]]:
    """The schedule's current point id and its stored record, as ``DelayQ.get`` sees it."""
    schedule = Schedules(app).get(name)
    assert schedule is not None and schedule.next_run is not None
    pid = point_id(name, round(schedule.next_run.timestamp() * 1000))
    record = get_store(app).get(pid)
    assert record is not None
    return pid, {"envelope": record.envelope, "due": record.due_ms, "state": record.state}


def stored_ids(r: redis.Redis) -> set[str]:
    ids: set[str] = set()
    for key in r.scan_iter("delayq:*:due"):
        ids.update(r.zrange(key, 0, -1))
    return ids


# -- 1. a point id is reserved -------------------------------------------------------------------


def test_a_point_id_is_refused_by_every_way_of_storing_a_job(app: Celery, r: redis.Redis) -> None:
    app.conf.delayq_intercept_eta = True
    Schedules(app).add(NAME, "t.noop", 3600)  # a point an hour away, waiting
    pid, before = point_of(app)
    other = point_id("no-such-schedule", int(time.time() * 1000) + 60_000)  # the form is enough
    add = app.tasks["t.add"]
    calls = {
        "apply_at": lambda tid: add.apply_at(time.time() + 5, (1, 2), task_id=tid),
        "apply_at replace": lambda tid: add.apply_at(time.time() + 5, (1, 2), task_id=tid, replace=True),
        "apply_in": lambda tid: add.apply_in(5, (1, 2), task_id=tid),
        "apply_in replace": lambda tid: add.apply_in(5, (1, 2), task_id=tid, replace=True),
        "apply_async countdown (intercepted)": lambda tid: add.apply_async((1, 2), task_id=tid, countdown=5),
        "apply_async eta (intercepted)": lambda tid: add.apply_async(
            (1, 2), task_id=tid, eta=time.time() + 5
        ),
        "celery_delayq.apply_at(signature)": lambda tid: celery_delayq.apply_at(
            add.s(1, 2).set(task_id=tid), time.time() + 5, replace=True
        ),
        "Store.enqueue (several jobs)": lambda tid: get_store(app).enqueue(
            [("plain-1", 1, "{}"), (tid, 1, "{}")], replace=True
        ),
    }
    ids_before = stored_ids(r)
    for what, call in calls.items():
        for tid in (pid, other):
            with pytest.raises(ReservedTaskId, match="is reserved") as caught:
                call(tid)
            assert tid in str(caught.value), what
    # apply_at_many takes no task_id option, and refuses a point id in an item
    with pytest.raises(celery_delayq.exceptions.InvalidOptions, match="takes no task_id option"):
        add.apply_at_many([(time.time() + 5, (1, 2), {})], task_id=pid)
    with pytest.raises(ReservedTaskId, match="is reserved"):  # nor as an item's own id
        add.apply_at_many([(time.time() + 5, (1, 2), {}, "x"), (time.time() + 5, (1, 2), {}, pid)])
    # Nothing was stored, and the point is untouched.
    assert stored_ids(r) == ids_before == {pid}
    assert point_of(app) == (pid, before)
    assert decode_envelope(before["envelope"]).schedule is not None
    # cancel refuses it too (as before), through the same test of the id
    with pytest.raises(celery_delayq.exceptions.InvalidSchedule, match="next run of schedule"):
        DelayQ(app).cancel(pid)
    # Ids that only look alike are ordinary ids.
    for tid in (f"{pid}:retry-1", "{tick}@run-now-2026-01-01T00:00:00.000Z", "{tick}@later", "tick@x"):
        assert not is_point_id(tid)
        assert add.apply_at(time.time() + 5, (1, 2), task_id=tid).id == tid


# -- 2. a retry of a schedule's run has its own id ----------------------------------------------


@pytest.mark.slow
def test_a_retry_of_a_points_run_is_stored_under_its_own_id_and_keeps_its_task_id(
    app: Celery, r: redis.Redis
) -> None:
    """What Celery's ``Task.retry`` sends for a run of a point: the same task id, ``retries=n``
    and a countdown. The point, held by a beat at that moment, is not touched."""
    app.conf.delayq_intercept_eta = True
    Schedules(app).add(NAME, "t.add", 1, args=(1, 2))
    store = get_store(app)
    pid, _ = point_of(app)
    shard = store.keys.shard_of(pid)
    time.sleep(1.2)  # the point is due: a beat claims (leases) it
    [claimed] = store.claim([shard], "beat-a")
    assert [job.id for job in claimed.jobs] == [pid]
    lease = r.hget(store.keys.shard(shard).leases, pid)
    for n in (1, 2):
        result = app.tasks["t.add"].apply_async((1, 2), task_id=pid, countdown=30, retries=n)
        assert result.id == pid  # AsyncResult(point id) follows the retries, as in Celery
        retry = store.get(f"{pid}:retry-{n}")
        assert retry is not None and retry.state == "waiting"
        envelope = decode_envelope(retry.envelope)
        assert envelope.headers["id"] == pid and envelope.headers["retries"] == n
        assert envelope.schedule is None
    # The point is still held by the beat, unchanged: its fire advances the schedule.
    assert r.hget(store.keys.shard(shard).leases, pid) == lease
    assert decode_envelope(claimed.jobs[0].envelope).schedule is not None
    done = SCRIPTS["fire"](
        store.client,
        store.keys.shard(shard).core,
        ["beat-a", pid, NAME, claimed.jobs[0].due_ms, pid, "", 0, "", store.keys.wake_channel, shard],
    )
    assert done == 1


# -- 3. a stalled schedule is found, re-armed, logged and counted -------------------------------


def seed_stall(app: Celery, r: redis.Redis, name: str, late_s: float) -> tuple[str, int]:
    """What a job stored under the point's id left behind: the schedule waits for a point that
    is ``late_s`` in the past and is no longer stored."""
    store = get_store(app)
    pid, _ = point_of(app, name)
    shard = store.keys.shard(store.keys.shard_of(pid))
    r.zrem(shard.due, pid)
    r.hdel(shard.jobs, pid)
    stalled_ms = int((time.time() - late_s) * 1000)
    stalled_ms -= stalled_ms % 1000
    stalled = point_id(name, stalled_ms)
    state = json.loads(r.hget(shard.history, name) or "{}")
    state.update(cur=stalled, next=stalled_ms)
    r.hset(shard.history, name, json.dumps(state))
    return stalled, stalled_ms


def repaired_metric(dispatcher: Dispatcher) -> float:
    for family in DispatcherCollector(dispatcher, read_every=0).collect():
        if family.name == "delayq_schedules_repaired":
            return float(family.samples[0].value)
    raise AssertionError("no delayq_schedules_repaired metric")


@pytest.mark.slow
def test_a_stalled_schedule_is_repaired_by_its_missed_run_policy_logged_and_counted(
    app: Celery, r: redis.Redis, dispatchers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.delayq_max_sleep = 0.1  # the beat below, driven by run_once, claims every shard often
    schedules = Schedules(app)
    schedules.add(NAME, "t.noop", "* * * * * *")  # each second; the point after the stalled one
    # is within grace when repaired: it runs, and the schedule catches up point by point
    schedules.add("hourly", "t.noop", "0 * * * *", missed="skip")  # past grace: skipped
    schedules.add("healthy", "t.noop", 1)
    stalled, stalled_ms = seed_stall(app, r, NAME, late_s=20)
    _, hourly_ms = seed_stall(app, r, "hourly", late_s=3 * 3600)
    healthy_before = point_of(app, "healthy")
    beat = dispatchers(app)
    assert repaired_metric(beat) == 0
    with caplog.at_level(logging.WARNING, logger="celery_delayq.schedules.api"):
        assert beat.sweep_stalls() == 2
    lines = [rec.getMessage() for rec in caplog.records if "was stalled" in rec.getMessage()]
    assert len(lines) == 2, lines
    assert any(f"schedule 'tick' was stalled: its next run {stalled} is 2" in line for line in lines), lines
    assert any("'hourly'" in line and "'skip'" in line for line in lines), lines
    assert beat.stats.stalls_repaired == 2 and repaired_metric(beat) == 2
    # Re-armed from the point after the stalled one, due at once; the healthy one untouched.
    tick = schedules.get(NAME)
    assert tick is not None and tick.next_run is not None
    assert round(tick.next_run.timestamp() * 1000) == tick.rule.next_after(stalled_ms) == stalled_ms + 1000
    hourly = schedules.get("hourly")
    assert hourly is not None and hourly.next_run is not None
    assert round(hourly.next_run.timestamp() * 1000) == hourly.rule.next_after(hourly_ms)
    assert point_of(app, "healthy")[0] == healthy_before[0]
    # A second sweep finds nothing: the points are stored.
    assert beat.sweep_stalls() == 0 and beat.stats.stalls_repaired == 2
    # The beat delivers the re-armed points; each schedule then runs in the future again.
    runs = (tick.run_count, hourly.run_count)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beat.run_once()
        tick, hourly = schedules.get(NAME), schedules.get("hourly")
        assert tick is not None and hourly is not None and tick.next_run and hourly.next_run
        if min(tick.next_run.timestamp(), hourly.next_run.timestamp()) > time.time() - 1:
            break
        time.sleep(0.05)
    assert tick.next_run.timestamp() > time.time() - 2 and hourly.next_run.timestamp() > time.time()
    assert tick.run_count > runs[0]  # "once", within grace: its points ran
    assert hourly.run_count == runs[1]  # "skip": the missed point did not run
    assert beat.sweep_stalls() == 0


@pytest.mark.slow
def test_the_sweep_leaves_a_late_point_that_is_stored_and_a_paused_schedule(
    app: Celery, r: redis.Redis, dispatchers: Any
) -> None:
    schedules = Schedules(app)
    schedules.add(NAME, "t.noop", 1)
    schedules.add("paused", "t.noop", 1)
    seed_stall(app, r, "paused", late_s=60)
    schedules.pause("paused")
    time.sleep(STALL_AFTER_MS / 1000 + 1.5)  # the point is late, but stored: no beat ran
    pid, record = point_of(app)
    beat = dispatchers(app)
    assert beat.sweep_stalls() == 0
    assert point_of(app) == (pid, record)
    # The repair script itself refuses when the point is stored (a beat fired it meanwhile).
    assert schedules.repair(NAME, pid, record["due"]) is False
    assert point_of(app) == (pid, record)


def test_a_beat_sweeps_from_its_chores(app: Celery, r: redis.Redis, dispatchers: Any) -> None:
    Schedules(app).add(NAME, "t.noop", 60)
    seed_stall(app, r, NAME, late_s=30)
    beat = dispatchers(app)
    beat.run_once()  # the first pass runs the chores: heartbeat, first sweep step
    assert beat.stats.stalls_repaired == 1
