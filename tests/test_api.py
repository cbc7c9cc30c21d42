"""``DelayQ``: get / cancel / reschedule / pending / count / dead."""

from __future__ import annotations

import json
import random
import time
from datetime import UTC, datetime, timedelta

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.admin.jobs import PendingJob
from celery_delayq.exceptions import InvalidDueTime
from celery_delayq.store.facade import get_store
from tests.support.store import server_ms, snapshot

BASE = datetime(2031, 1, 1, tzinfo=UTC)


def claim_job(app: Celery, job_id: str, token: str = "beat-test") -> None:
    store = get_store(app)
    [result] = store.claim([store.keys.shard_of(job_id)], token)
    assert job_id in [j.id for j in result.jobs]


def test_get_waiting(app: Celery) -> None:
    res = app.tasks["t.add"].apply_at(BASE, (1, 2), queue="q1")
    job = DelayQ(app).get(res.id)
    assert job == PendingJob(
        id=res.id,
        task="t.add",
        due=BASE,
        state="waiting",
        shard=get_store(app).keys.shard_of(res.id),
        args=[1, 2],
        kwargs={},
        queue="q1",
        tries=0,
        lease_until=None,
    )


def test_get_leased_dead_missing(app: Celery, r: redis.Redis) -> None:
    due = datetime.fromtimestamp((server_ms(r) - 1000) / 1000, tz=UTC)
    res = app.tasks["t.add"].apply_at(due, kwargs={"x": 1, "y": 2})
    claim_job(app, res.id)
    dq = DelayQ(app)
    leased = dq.get(res.id)
    assert leased is not None
    assert (leased.state, leased.tries, leased.kwargs, leased.due) == ("leased", 1, {"x": 1, "y": 2}, due)
    assert leased.lease_until is not None and leased.lease_until > due

    record = {
        "reason": "test",
        "due": int(due.timestamp() * 1000),
        "tries": 1,
        "envelope": get_store(app).get(res.id).envelope,
    }  # type: ignore[union-attr]
    assert get_store(app).bury("beat-test", res.id, record)
    dead = dq.get(res.id)
    assert dead is not None
    assert (dead.state, dead.task, dead.kwargs, dead.due, dead.tries) == (
        "dead",
        "t.add",
        {"x": 1, "y": 2},
        due,
        1,
    )
    assert dict(dq.dead()) == {res.id: record}
    assert dq.get("missing") is None


def test_get_corrupt_envelope(app: Celery) -> None:
    keys = get_store(app).keys.for_job("bad")
    client = get_store(app).client
    client.zadd(keys.due, {"bad": 1_900_000_000_000})
    client.hset(keys.jobs, "bad", "{nope")
    job = DelayQ(app).get("bad")
    assert job is not None and job.task == "<corrupt envelope>" and job.args is None


def test_get_non_json_serializer_shows_the_reprs(app: Celery) -> None:
    res = app.tasks["t.add"].apply_at(BASE, (1, 2), serializer="pickle")
    job = DelayQ(app).get(res.id)
    assert job is not None and (job.args, job.kwargs) == ("(1, 2)", "{}")


def test_cancel(app: Celery, redis_url: str) -> None:
    add = app.tasks["t.add"]
    keep = add.apply_at(BASE, (1, 2))
    res = add.apply_at(BASE, (3, 4))
    dq = DelayQ(app)
    cancelled = dq.cancel(res.id)
    assert cancelled == "cancelled" and bool(cancelled) is True  # `if dq.cancel(id):` reads it
    assert dq.get(res.id) is None
    before = snapshot(redis_url)
    gone = dq.cancel(res.id)
    assert gone == "missing" and bool(gone) is False
    assert dq.cancel("never-existed") == "missing"
    assert snapshot(redis_url) == before
    assert dq.get(keep.id) is not None
    assert dq.count() == 1


def test_cancel_while_leased_removes_but_says_delivering(app: Celery) -> None:
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    claim_job(app, res.id)
    dq = DelayQ(app)
    delivering = dq.cancel(res.id)
    assert delivering == "delivering" and bool(delivering) is False
    assert dq.get(res.id) is None
    assert dq.count() == 0


def test_reschedule(app: Celery, redis_url: str) -> None:
    res = app.tasks["t.add"].apply_at(BASE, (1, 2))
    dq = DelayQ(app)
    for eta in (
        BASE + timedelta(days=1),
        (BASE + timedelta(days=2)).timestamp(),
        (BASE + timedelta(days=3)).isoformat(),
    ):
        moved = dq.reschedule(res.id, eta)
        assert moved == "moved" and bool(moved) is True
        job = dq.get(res.id)
        expected = (
            eta
            if isinstance(eta, datetime)
            else (
                datetime.fromtimestamp(eta, tz=UTC) if isinstance(eta, float) else datetime.fromisoformat(eta)
            )
        )
        assert job is not None and job.due == expected and job.args == [1, 2]
    before = snapshot(redis_url)
    assert dq.reschedule("missing", BASE) == "missing" and not dq.reschedule("missing", BASE)
    with pytest.raises(InvalidDueTime):
        dq.reschedule(res.id, float("nan"))
    assert snapshot(redis_url) == before


def test_reschedule_while_leased_is_refused(app: Celery) -> None:
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    claim_job(app, res.id)
    dq = DelayQ(app)
    before = dq.get(res.id)
    refused = dq.reschedule(res.id, BASE)
    assert refused == "delivering" and bool(refused) is False
    assert dq.get(res.id) == before


def test_pending_is_in_due_order_across_shards(app: Celery) -> None:
    add = app.tasks["t.add"]
    rng = random.Random(7)
    offsets = rng.sample(range(10_000), 60)
    results = [add.apply_at(BASE + timedelta(seconds=s), (s, 0)) for s in offsets]
    jobs = list(DelayQ(app).pending())
    assert len({job.shard for job in jobs}) > 4
    assert [job.due for job in jobs] == sorted(res.due for res in results if res.due)
    assert sorted(job.id for job in jobs) == sorted(res.id for res in results)
    assert all(job.args == [int((job.due - BASE).total_seconds()), 0] for job in jobs)
    assert DelayQ(app).count() == 60


def test_pending_window_task_and_limit(app: Celery) -> None:
    add = app.tasks["t.add"]

    @app.task(base=DelayedTask, name="t.other", shared=False)
    def other() -> None:
        return None

    for i in range(10):
        add.apply_at(BASE + timedelta(minutes=i), (i, 0))
        other.apply_at(BASE + timedelta(minutes=i, seconds=30))
    dq = DelayQ(app)

    window = list(dq.pending(start=BASE + timedelta(minutes=2), end=BASE + timedelta(minutes=5)))
    # inclusive at both ends
    assert [job.due for job in window] == [
        BASE + timedelta(minutes=m, seconds=s) for m in range(2, 6) for s in (0, 30)
    ][:-1]
    only_add = list(dq.pending(task="t.add"))
    assert [job.args[0] for job in only_add] == list(range(10))
    assert {job.task for job in dq.pending(task="t.other")} == {"t.other"}
    assert [job.args[0] for job in dq.pending(task="t.add", limit=3)] == [0, 1, 2]
    assert len(list(dq.pending(limit=5))) == 5
    start_ts = (BASE + timedelta(minutes=8)).timestamp()
    assert [job.task for job in dq.pending(start=start_ts)] == ["t.add", "t.other"] * 2
    assert list(dq.pending(task="t.nothing")) == []
    assert list(dq.pending(end=BASE - timedelta(seconds=1))) == []
    with pytest.raises(InvalidDueTime):
        list(dq.pending(start=float("inf")))


def test_pending_includes_leased_jobs(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    res = add.apply_at(time.time() - 1, (1, 2))
    later = add.apply_at(BASE, (3, 4))
    claim_job(app, res.id)
    jobs = list(DelayQ(app).pending())
    assert [(job.id, job.state) for job in jobs] == [(res.id, "leased"), (later.id, "waiting")]
    assert jobs[0].due == res.due and jobs[0].tries == 1


def test_count_and_dead(app: Celery) -> None:
    dq = DelayQ(app)
    assert dq.count() == 0
    assert list(dq.dead()) == []
    results = app.tasks["t.add"].apply_at_many([(BASE, (i, i), None) for i in range(25)])
    assert dq.count() == 25
    dq.cancel(results[0].id)
    assert dq.count() == 24
    store = get_store(app)
    past = app.tasks["t.add"].apply_at(time.time() - 1, (0, 0))
    claim_job(app, past.id)
    assert dq.count() == 25  # leased jobs count
    store.bury("beat-test", past.id, {"reason": "x", "envelope": "e"})
    assert dq.count() == 24
    assert [(job_id, json.dumps(rec)) for job_id, rec in dq.dead()] == [
        (past.id, json.dumps({"reason": "x", "envelope": "e"}))
    ]


def test_lateness_reads_the_histograms_the_beat_and_workers_write(app: Celery, r: redis.Redis) -> None:
    from celery_delayq.beat.dispatch import Dispatcher

    q = DelayQ(app)
    assert q.lateness("publish").count == 0
    app.tasks["t.add"].apply_in(0, (1, 2))
    dispatcher = Dispatcher(app)
    try:
        assert dispatcher.run_once() >= 0 and q.count() == 0
        dispatcher.chores(force=True)  # flushes the publish histogram
    finally:
        dispatcher.stop()
    assert q.lateness("publish").count == 1
    r.hset("delayq:lateness:start", mapping={"le:10": 2, "count": 2, "sum_ms": 7})
    start = q.lateness("start")
    assert (start.count, start.mean_ms, start.quantile(0.99)) == (2, 3.5, 10)
    with pytest.raises(ValueError, match="publish"):
        q.lateness("finish")
