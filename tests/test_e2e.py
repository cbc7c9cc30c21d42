"""End to end: real ``celery worker`` and ``celery beat -S celery_delayq.Scheduler`` processes.

The worker and beat run ``tests/apps/e2e_app.py``; each task run records
``HINCRBY e2e:runs <id> 1`` and ``RPUSH e2e:starts {id, start, due, retries, eta}``
in the store Redis. The test process is the producer: a fresh app per test
(:class:`Producer`) with DelayedTasks of the same names and signatures.

Run with ``-s`` to see the lateness figures (start - due) these tests print.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_delayq import DelayedTask, DelayQ, ScheduledResult
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.store import get_store
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env

pytestmark = pytest.mark.e2e

RABBITMQ_HOST, RABBITMQ_PORT = "127.0.0.1", 5672

#: Worker and store share this machine's clock: a job may start this much "before" its due.
CLOCK_TOL = 0.010
#: Time for a worker or beat to start on a loaded 2-core machine.
STARTUP = 60.0
#: Bulk tests print their lateness rather than gate it; this only catches jobs that were
#: delivered by the safety poll (delayq_max_sleep, 20 s) instead of on time.
MAX_LATE = 15.0


# -- helpers ---------------------------------------------------------------------------------


class Producer:
    """A producer app in the test process, with the e2e app's task names and signatures."""

    def __init__(self, broker: str, store: str, **conf: Any) -> None:
        self.app = app = make_app(broker, store, task_ignore_result=True, **conf)

        @app.task(base=DelayedTask, bind=True, name="e2e.record", shared=False)
        def record(self: Any, *args: Any, **kwargs: Any) -> None:
            return None

        @app.task(base=DelayedTask, bind=True, name="e2e.flaky", max_retries=3, shared=False)
        def flaky(self: Any, fail_times: int = 1, countdown: float = 1.0) -> None:
            return None

        @app.task(bind=True, name="e2e.plain", shared=False)
        def plain(self: Any) -> None:
            return None

        self.record = record
        self.flaky = flaky
        self.plain = plain
        self.dq = DelayQ(app)

    def close(self) -> None:
        get_store(self.app).close()
        self.app.close()


@pytest.fixture
def producers() -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(broker: str, store: str, **conf: Any) -> Producer:
        producer = Producer(broker, store, **conf)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close()


def runs(r: redis.Redis) -> dict[str, int]:
    return {k: int(v) for k, v in r.hgetall("e2e:runs").items()}


def starts(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(s) for s in r.lrange("e2e:starts", 0, -1)]


def starts_by_id(r: redis.Redis) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in starts(r)}


def log_of(procs: Procs, index: int) -> str:
    return procs.procs[index][1].read_text(errors="replace")


def assert_alive(procs: Procs) -> None:
    for proc, log in procs.procs:
        assert proc.poll() is None, f"{log.name} exited with {proc.returncode}\n{procs.logs()}"


def start_stack(procs: Procs, env: dict[str, str], beats: int = 1) -> None:
    """A worker and ``beats`` beats; returns once every beat has set up its dispatcher."""
    procs.start("worker", env)
    for _ in range(beats):
        procs.start("beat", env)
    beat_indexes = range(1, 1 + beats)
    ready = wait_for(
        lambda: all("delayq: beat" in log_of(procs, i) for i in beat_indexes), STARTUP, 0.1
    )
    assert ready, f"beat(s) did not start\n{procs.logs()}"


def warm_up(producer: Producer, r: redis.Redis, procs: Procs) -> None:
    """Run one delayq job through beat and worker, then forget it: both are up and idle."""
    job = producer.record.apply_in(0, task_id=f"warmup-{uuid.uuid4().hex}")
    ran = wait_for(lambda: r.hexists("e2e:runs", job.id), STARTUP, 0.05)
    assert ran, f"warm-up job did not run; in the store: {producer.dq.get(job.id)}\n{procs.logs()}"
    r.delete("e2e:runs", "e2e:starts")


def lateness_line(label: str, late_s: list[float]) -> str:
    ms = sorted(x * 1000.0 for x in late_s)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, max(0, round(p / 100.0 * len(ms)) - 1))]

    return (
        f"E2E lateness {label}: p50={pct(50):.1f} ms p99={pct(99):.1f} ms "
        f"max={ms[-1]:.1f} ms min={ms[0]:.1f} ms"
    )


def check_exactly_once(
    r: redis.Redis,
    producer: Producer,
    procs: Procs,
    results: list[ScheduledResult],
    timeout: float,
    label: str,
) -> list[float]:
    """Every job ran exactly once, none before its due; print and return the lateness (s)."""
    ids = {res.id for res in results}
    assert len(ids) == len(results)
    done = wait_for(lambda: r.hlen("e2e:runs") >= len(ids), timeout, 0.1)
    assert done, f"{r.hlen('e2e:runs')}/{len(ids)} ran\n{procs.logs()}"
    # A late duplicate (a job published twice) would show up here.
    time.sleep(1.0)
    counts = runs(r)
    assert set(counts) == ids
    assert sorted(set(counts.values())) == [1], {k: v for k, v in counts.items() if v != 1}
    records = starts(r)
    assert len(records) == len(ids)
    due_of = {res.id: res.due.timestamp() for res in results if res.due is not None}
    late: list[float] = []
    for rec in records:
        assert rec["due"] is not None, rec  # published by a beat: the delayq_due header is set
        assert abs(rec["due"] - due_of[rec["id"]]) < 0.002, (rec, due_of[rec["id"]])
        assert rec["start"] >= rec["due"] - CLOCK_TOL, f"ran before its due: {rec}"
        late.append(rec["start"] - rec["due"])
    # Everything delivered was acked: nothing is left to be delivered again.
    assert producer.dq.count() == 0
    assert list(producer.dq.dead()) == []
    for i in range(1, len(procs.procs)):
        assert "no longer leased" not in log_of(procs, i)
    assert_alive(procs)
    print("\n" + lateness_line(label, late))
    return late


def spread(n: int, start: float, seconds: float) -> list[tuple[float, tuple[int], None]]:
    return [(start + seconds * i / n, (i,), None) for i in range(n)]


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
    assert victim.cancel() is True
    assert producer.dq.get(victim.id) is None
    assert victim.cancel() is False  # already gone

    assert wait_for(lambda: r.hlen("e2e:runs") >= len(others), 30), procs.logs()
    time.sleep(max(0.0, due + 1.5 - time.time()))  # well past the cancelled job's due
    assert runs(r) == {res.id: 1 for res in others}
    assert producer.dq.count() == 0
    assert list(producer.dq.dead()) == []


def test_rescheduled_jobs_run_at_their_new_time(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url))
    warm_up(producer, r, procs)

    t0 = time.time()
    later = producer.record.apply_at(t0 + 2.0, args=("later",))
    earlier = producer.record.apply_at(t0 + 5.0, args=("earlier",))
    assert later.reschedule(t0 + 4.0) is True
    assert earlier.reschedule(t0 + 2.0) is True
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


def rabbitmq_or_skip(host: str = RABBITMQ_HOST, port: int = RABBITMQ_PORT) -> str:
    """The broker URL, or skip the test when no RabbitMQ answers on ``host:port``."""
    url = f"amqp://guest:guest@{host}:{port}//"
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ broker: {host}:{port} does not answer ({exc})")
    try:
        with Connection(url, connect_timeout=5) as conn:
            conn.connect()
    except Exception as exc:
        pytest.skip(f"no RabbitMQ broker: cannot open an AMQP connection to {url} ({exc!r})")
    return url


def _delete_queue(broker: str, name: str) -> None:
    with Connection(broker, connect_timeout=5) as conn:
        channel = conn.channel()
        channel.queue_delete(name)
        channel.exchange_delete(name)


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
        _delete_queue(broker, queue)

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

    assert wait_for(lambda: store.count_dead() >= 2 and r.hlen("e2e:runs") >= 20, 30), (
        procs.logs()
    )
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
