"""End to end: real ``celery worker`` and ``celery beat -S celery_delayq.Scheduler`` processes.

The worker and beat run ``tests/apps/e2e_app.py``; each task run records
``HINCRBY e2e:runs <id> 1`` and ``RPUSH e2e:starts {id, start, due, retries, eta}``
in the store Redis. The test process is the producer: a fresh app per test
(:class:`Producer`) with DelayedTasks of the same names and signatures. The helpers these
tests share with the other end-to-end modules are in ``tests/support/stack.py``.

Run with ``-s`` to see the lateness figures (start - due) these tests print.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_delayq import DelayedTask, ScheduledResult
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.store.facade import get_store
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import (
    CLOCK_TOL,
    MAX_LATE,
    STARTUP,
    Producer,
    assert_alive,
    check_exactly_once,
    delete_queue,
    log_of,
    producers,
    rabbitmq_or_skip,
    runs,
    spread,
    start_stack,
    starts,
    starts_by_id,
    warm_up,
)
from tests.support.store import server_ms

__all__ = ["producers"]  # a fixture, used by name

pytestmark = pytest.mark.e2e


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.slow
def test_1000_jobs_over_5s_run_exactly_once(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)

    # Due from 5 s on: the beat is running, so all 1000 must still be waiting when counted.
    results = producer.record.apply_at_many(spread(1000, time.time() + 5.0, 5.0))
    assert producer.dq.count() == 1000
    late = check_exactly_once(r, producer, procs, results, 60, "1000 jobs over 5 s (Redis)")
    assert max(late) < MAX_LATE, f"some jobs waited for the safety poll\n{procs.logs()}"


def test_job_2s_ahead_starts_promptly_after_a_wake(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """A job stored 2 s ahead of an idle, sleeping beat starts on time: the beat is woken.

    The beat's safety poll (delayq_max_sleep) is 20 s, so a start within the bound
    (``DELAYQ_WAKE_BOUND``, default 2 s, generous for a loaded CI machine) proves the
    wake-up path, not the poll. Run with ``-s`` for the measured lateness.
    """
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)
    time.sleep(2.0)  # the beat settles into its sleep: this measures the wake-up

    res = producer.record.apply_at(time.time() + 2.0)
    assert wait_for(lambda: r.hexists("e2e:runs", res.id), 30), procs.logs()
    rec = starts_by_id(r)[res.id]
    assert rec["due"] is not None and res.due is not None
    assert abs(rec["due"] - res.due.timestamp()) < 0.002
    lateness = rec["start"] - rec["due"]
    print(f"\nE2E lateness 1 job 2 s ahead (idle beat): {lateness * 1000:.1f} ms")
    bound = float(os.environ.get("DELAYQ_WAKE_BOUND", "2.0"))
    assert -CLOCK_TOL <= lateness <= bound, f"lateness {lateness * 1000:.1f} ms\n{procs.logs()}"
    assert runs(r) == {res.id: 1}


def test_jobs_whose_wake_message_was_lost_run_at_the_safety_poll(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """A real beat (``delayq_max_sleep`` 2 s) and worker. Three jobs stored an hour ahead (the
    beat hears of them) are made due now behind the beat's back: with the marker lowered as
    enqueue.lua does (its wake message lost), deleted, or spoiled. The safety poll reads the
    markers and claims their shards: each runs once, within a few polls."""
    conf = {"delayq_max_sleep": 2.0}
    producer = producers(redis_url, redis_url, **conf)
    start_stack(procs, subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf)))
    warm_up(producer, r, procs)
    keys = get_store(producer.app).keys
    jobs = [producer.record.apply_in(3600) for _ in range(3)]
    time.sleep(0.5)  # the beat heard the wake messages: it sleeps towards the safety poll
    now_ms = server_ms(r)
    for res, marker in zip(jobs, (str(now_ms), None, "spoiled"), strict=True):
        shard = keys.for_job(res.id)
        r.zadd(shard.due, {res.id: now_ms})
        if marker is None:
            r.delete(shard.wake)
        else:
            r.set(shard.wake, marker)
    ran = wait_for(lambda: all(r.hexists("e2e:runs", res.id) for res in jobs), 15)
    assert ran, procs.logs()
    assert runs(r) == {res.id: 1 for res in jobs}


def test_cancelled_job_never_runs(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)

    due = time.time() + 5.0  # the beat is running: the victim must still wait when cancelled
    others = producer.record.apply_at_many([(due + i * 0.01, (i,), None) for i in range(20)])
    victim = producer.record.apply_at(due + 0.05, args=("victim",))
    assert producer.dq.get(victim.id) is not None
    assert victim.cancel() == "cancelled"
    assert producer.dq.get(victim.id) is None
    assert victim.cancel() == "missing"  # already gone

    assert wait_for(lambda: r.hlen("e2e:runs") >= len(others), 30), procs.logs()
    time.sleep(max(0.0, due + 1.5 - time.time()))  # well past the cancelled job's due
    assert runs(r) == {res.id: 1 for res in others}
    assert producer.dq.count() == 0
    assert list(producer.dq.dead()) == []


@pytest.mark.slow
def test_an_id_with_a_uniqueness_window_runs_once_until_the_window_ends(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """``unique_for``: ids scheduled again while waiting are kept, and again after they ran are
    taken (stored and run no more); an id whose short window ended is stored and runs again."""
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)
    record = producer.record
    due = time.time() + 1.0
    ids = [f"uniq-{i}" for i in range(20)]
    first = [record.apply_at(due, (i,), task_id=i, unique_for=600) for i in ids]
    short = record.apply_at(due, ("short",), task_id="uniq-short", unique_for=4)
    assert {res.outcome for res in [*first, short]} == {"new"}
    assert {record.apply_at(due, (i,), task_id=i, unique_for=600).outcome for i in ids} == {"kept"}
    assert wait_for(lambda: r.hlen("e2e:runs") >= 21, 30), procs.logs()
    again = [record.apply_at(time.time(), (i,), task_id=i, unique_for=600) for i in ids]
    assert {(res.outcome, res.due) for res in again} == {("taken", None)}
    assert producer.dq.count() == 0
    # the short window ends 4 s after its store (the server's clock): then the id is free
    time.sleep(max(0.0, due + 4.5 - time.time()))
    rerun = record.apply_at(time.time(), ("short",), task_id="uniq-short", unique_for=4)
    assert rerun.outcome == "new"
    assert wait_for(lambda: runs(r).get("uniq-short") == 2, 30), procs.logs()
    time.sleep(1.0)  # nothing else comes
    assert runs(r) == {**{i: 1 for i in ids}, "uniq-short": 2}


@pytest.mark.slow
def test_debounced_and_throttled_calls_run_once_a_key(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """``debounce``: four calls a key, 0.2 s apart, wait 1.5 s: each key runs once, the last
    call's job, no sooner than its wait after that call. ``throttle``: four calls a key within
    its period: the first call's job runs, the others were told ``throttled``."""
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)
    record = producer.record
    last: dict[str, ScheduledResult] = {}
    called: dict[str, float] = {}
    earlier: list[str] = []
    kept: list[str] = []
    for round_ in range(4):
        for user in range(10):
            key = f"user:{user}"
            called[key] = time.time()
            res = record.apply_async((user, round_), debounce=(key, 1.5))
            assert res.outcome == ("new" if round_ == 0 else "debounced")
            if key in last:
                earlier.append(last[key].id)
            last[key] = res
            throttled = record.apply_async((user, round_), throttle=(f"t:{user}", 600))
            assert throttled.outcome == ("new" if round_ == 0 else "throttled")
            if round_ == 0:
                kept.append(throttled.id)
        time.sleep(0.2)
    expected = {res.id: 1 for res in last.values()} | {job_id: 1 for job_id in kept}
    assert wait_for(lambda: r.hlen("e2e:runs") >= len(expected), 30), procs.logs()
    time.sleep(1.0)  # nothing else comes
    assert runs(r) == expected
    assert not set(earlier) & set(runs(r))
    started = starts_by_id(r)
    for key, res in last.items():  # trailing: due a wait after the key's last call, not before
        assert started[res.id]["start"] >= called[key] + 1.5 - CLOCK_TOL, started[res.id]
    assert producer.dq.count() == 0


def test_rescheduled_jobs_run_at_their_new_time(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)

    t0 = time.time()
    later = producer.record.apply_at(t0 + 2.0, args=("later",))
    earlier = producer.record.apply_at(t0 + 5.0, args=("earlier",))
    assert later.reschedule(t0 + 4.0) == "moved"
    assert earlier.reschedule(t0 + 2.0) == "moved"
    later_job, earlier_job = producer.dq.get(later.id), producer.dq.get(earlier.id)
    assert later_job is not None and earlier_job is not None
    assert abs(later_job.due.timestamp() - (t0 + 4.0)) < 0.002
    assert abs(earlier_job.due.timestamp() - (t0 + 2.0)) < 0.002

    assert wait_for(lambda: r.hlen("e2e:runs") >= 2, 30), procs.logs()
    time.sleep(max(0.0, t0 + 6.0 - time.time()))  # past both old due times
    assert runs(r) == {later.id: 1, earlier.id: 1}
    got = starts_by_id(r)
    moved_later, moved_earlier = got[later.id], got[earlier.id]
    assert abs(moved_later["due"] - (t0 + 4.0)) < 0.002
    assert abs(moved_earlier["due"] - (t0 + 2.0)) < 0.002
    # Not at the old time 2 s, but at the new one, 4 s.
    assert moved_later["start"] >= t0 + 4.0 - CLOCK_TOL, moved_later
    assert moved_later["start"] < t0 + 4.0 + MAX_LATE, moved_later
    # At the new time 2 s, well before the old one, 5 s.
    assert t0 + 2.0 - CLOCK_TOL <= moved_earlier["start"] < t0 + 2.0 + MAX_LATE, moved_earlier
    assert producer.dq.count() == 0


@pytest.mark.slow
def test_two_beats_2000_jobs_run_exactly_once(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url), beats=2)
    warm_up(producer, r, procs)

    results = producer.record.apply_at_many(spread(2000, time.time() + 2.0, 5.0))
    label = "2000 jobs over 5 s, 2 beats (Redis)"
    late = check_exactly_once(r, producer, procs, results, 90, label)
    assert max(late) < MAX_LATE, f"some jobs waited for the safety poll\n{procs.logs()}"


@pytest.mark.rabbitmq
def test_rabbitmq_broker_300_jobs_run_exactly_once(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    broker = rabbitmq_or_skip()
    queue = f"delayq-e2e-{uuid.uuid4().hex[:12]}"
    # broker_heartbeat=0: with AMQP heartbeats on, the worker's warm shutdown takes ~9 s.
    conf = {"task_default_queue": queue, "broker_heartbeat": 0}
    try:
        producer = producers(broker, redis_url, **conf)
        env = subprocess_env(broker, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
        start_stack(procs, env)
        warm_up(producer, r, procs)

        results = producer.record.apply_at_many(spread(300, time.time() + 2.0, 3.0))
        late = check_exactly_once(
            r, producer, procs, results, 60, "300 jobs over 3 s (RabbitMQ broker, Redis store)"
        )
        assert max(late) < MAX_LATE, f"some jobs waited for the safety poll\n{procs.logs()}"
        assert f"Connected to {broker.replace('guest:guest', 'guest:**')}" in log_of(procs, 0)
    finally:
        procs.stop_all()
        delete_queue(broker, queue)


def test_intercept_eta_routes_retry_and_countdown_through_delayq(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    conf = {"delayq_intercept_eta": True}
    producer = producers(redis_url, redis_url, **conf)
    start_stack(procs, subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf)))
    warm_up(producer, r, procs)

    # apply_async(countdown=) of a DelayedTask is stored, not sent to the broker.
    t0 = time.time()
    delayed = producer.record.apply_async(args=("countdown",), countdown=2)
    t1 = time.time()
    assert isinstance(delayed, ScheduledResult)
    job = producer.dq.get(delayed.id)
    assert job is not None and job.state == "waiting" and job.task == "e2e.record"
    assert job.args == ["countdown"]
    assert producer.dq.count() == 1
    # due: the moment of apply_async + 2 s, in whole ms
    assert t0 + 2.0 - 0.002 <= job.due.timestamp() <= t1 + 2.0 + 0.002, (t0, t1, job.due)

    # e2e.flaky, sent straight to the broker, retries itself with retry(countdown=3): the
    # retry waits in the store for 3 s, long enough to be seen there on a loaded machine.
    flaky = producer.flaky.apply_async(kwargs={"fail_times": 1, "countdown": 3.0})
    assert not isinstance(flaky, ScheduledResult)
    # Between the failed run and the retry, the retry waits in the store under the same id.
    seen = wait_for(
        lambda: producer.dq.get(flaky.id) is not None or r.hget("e2e:runs", flaky.id) == "2",
        30,
        0.01,
    )
    stored = producer.dq.get(flaky.id)
    assert seen and stored is not None, f"the retry was not seen in the store\n{procs.logs()}"
    assert stored.task == "e2e.flaky" and stored.kwargs == {"fail_times": 1, "countdown": 3.0}

    assert wait_for(lambda: runs(r).get(flaky.id) == 2 and delayed.id in runs(r), 30), procs.logs()
    time.sleep(1.0)
    assert runs(r) == {flaky.id: 2, delayed.id: 1}
    recs = starts(r)
    tries = sorted((s for s in recs if s["id"] == flaky.id), key=lambda s: s["retries"])
    assert [s["retries"] for s in tries] == [0, 1]
    first, retry = tries
    assert first["due"] is None  # sent directly, not through delayq
    assert retry["due"] is not None  # published by the beat
    # due: retry time + 3 s, in whole ms (so up to 1 ms before first start + 3 s)
    assert 3.0 - 0.002 <= retry["due"] - first["start"] < 5.0, (first, retry)
    assert retry["due"] - CLOCK_TOL <= retry["start"] < retry["due"] + MAX_LATE, retry
    assert retry["start"] - first["start"] >= 3.0 - 0.002 - CLOCK_TOL, (first, retry)

    (countdown_run,) = (s for s in recs if s["id"] == delayed.id)
    assert delayed.due is not None
    assert abs(countdown_run["due"] - delayed.due.timestamp()) < 0.002
    assert countdown_run["start"] >= t0 + 2.0 - CLOCK_TOL
    assert countdown_run["due"] - CLOCK_TOL <= countdown_run["start"] < countdown_run["due"] + MAX_LATE
    assert producer.dq.count() == 0


def test_unknown_task_and_corrupt_envelope_are_dead_lettered(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)

    @producer.app.task(base=DelayedTask, name="e2e.unknown", shared=False)
    def unknown(x: int) -> None:
        return None

    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)

    due = time.time() + 5.0  # the beat is running: the corrupt write must land before its claim
    good = producer.record.apply_at_many([(due + i * 0.02, (i,), None) for i in range(20)])
    stranger = unknown.apply_at(due + 0.1, args=(1,))
    corrupt = producer.record.apply_at(due + 0.2, args=("corrupt",))
    store = get_store(producer.app)
    jobs_key = store.keys.for_job(corrupt.id).jobs
    assert r.hexists(jobs_key, corrupt.id)
    r.hset(jobs_key, corrupt.id, '{"v": 1, "task": "e2e.record", "body": ')
    assert producer.dq.count() == 22

    assert wait_for(lambda: store.count_dead() >= 2 and r.hlen("e2e:runs") >= 20, 30), procs.logs()
    time.sleep(1.0)
    assert runs(r) == {res.id: 1 for res in good}
    dead = dict(producer.dq.dead())
    assert set(dead) == {stranger.id, corrupt.id}
    assert dead[stranger.id]["task"] == "e2e.unknown"
    assert "'e2e.unknown' is not registered in the beat's app" in dead[stranger.id]["reason"]
    assert dead[corrupt.id]["reason"].startswith("corrupt envelope: envelope is not JSON")
    assert dead[corrupt.id]["envelope"] == '{"v": 1, "task": "e2e.record", "body": '
    for res in (stranger, corrupt):
        job = producer.dq.get(res.id)
        assert job is not None and job.state == "dead"
    assert producer.dq.count() == 0
    assert_alive(procs)


def test_beat_schedule_entries_keep_firing(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    conf = {"beat_schedule": {"p": {"task": "e2e.plain", "schedule": 1.0}}}
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf)))
    warm_up(producer, r, procs)

    t0 = time.time()
    job = producer.record.apply_at(t0 + 3.0)  # a delayq job due in the middle

    def plain_starts() -> list[dict[str, Any]]:
        return [s for s in starts(r) if s["id"] != job.id]

    done = wait_for(lambda: r.hexists("e2e:runs", job.id) and len(plain_starts()) >= 3, 30, 0.1)
    recs = starts(r)
    plain = [s for s in recs if s["id"] != job.id]
    assert done, f"e2e.plain ran {len(plain)} times, the job {runs(r).get(job.id, 0)}\n{procs.logs()}"
    # beat_schedule entries are stored as recurring schedules: each run is an execution
    # point with a deterministic id and its due time, and no point runs twice.
    assert all(s["id"].startswith("{p}@") and s["due"] is not None for s in plain), plain
    assert len({s["id"] for s in plain}) == len(plain)
    assert len(plain) >= 3, f"e2e.plain ran {len(plain)} times\n{procs.logs()}"
    assert runs(r)[job.id] == 1
    (mine,) = (s for s in recs if s["id"] == job.id)
    assert mine["due"] - CLOCK_TOL <= mine["start"] < mine["due"] + MAX_LATE
    assert_alive(procs)


def test_beat_warns_at_start_when_redis_may_evict_jobs(procs: Procs) -> None:
    """A real beat on a Redis with ``maxmemory-policy allkeys-lru``: it starts, says why that
    policy can lose jobs, and keeps running."""
    with EmbeddedRedis(extra_args=["--maxmemory-policy", "allkeys-lru"]) as server:
        url = server.url + "/0"
        procs.start("beat", subprocess_env(url, url))
        warned = wait_for(lambda: "maxmemory-policy is 'allkeys-lru'" in log_of(procs, 0), STARTUP, 0.1)
        log = log_of(procs, 0)
        assert warned, log
        assert "may evict scheduled jobs; set it to 'noeviction'" in log
        assert wait_for(lambda: "delayq: beat" in log_of(procs, 0), STARTUP, 0.1)
        assert_alive(procs)
        procs.stop_all()
