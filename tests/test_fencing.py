"""Fencing a paused beat (issue 13, item 1): a beat never publishes a job whose lease it may
have lost.

**The paused-beat experiment**, on every publish path, with real ``celery beat`` and
``celery worker`` processes of ``tests/apps/e2e_app.py``: ``JOBS`` jobs are due at once; beat A
claims them all and stops itself (SIGSTOP, the app's ``DELAYQ_TEST_STOP_AFTER_CLAIM`` hook)
between its claim and its publish; beat B, started then, re-claims them once A's leases expire
(``RECLAIM_TTL``) and delivers them; when every job has run and A has been stopped for more than
``PAUSE`` s, A is resumed (SIGCONT). No job runs twice and none is lost.

Paths: kombu (``delayq_push=False``), push (the push path: the broker is the store's Redis),
push with an ``after_task_publish`` receiver connected in the beat (every job takes
``send_task_message``), gzip-compressed messages, and RabbitMQ (skipped when no RabbitMQ answers
on 127.0.0.1:5672).

Then unit tests of the fence with in-process dispatchers. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.fence import FENCE_FRACTION
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.devtools.embedded import free_port
from celery_delayq.schedules.api import Schedules
from celery_delayq.store.facade import get_store
from tests.support.metrics import scrape, value
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import (
    Producer,
    broker_backlog,
    env_for,
    log_of,
    producers,
    rabbitmq_or_skip,
    runs,
    start_stack,
    warm_up,
)
from tests.support.stack import (
    delete_queue as _delete_queue,
)
from tests.support.store import published_ids

__all__ = ["producers"]  # a fixture, used by name

#: Jobs due at once: one pass of beat A claims them all (batch 500 x 16 shards).
JOBS = 2000
#: A short lease, so that B re-claims what A holds within seconds.
RECLAIM_TTL = 3.0
#: How long A stays stopped at least: well past its leases.
PAUSE = 3 * RECLAIM_TTL
#: Waits on a loaded 2-core machine.
TIMEOUT = 90.0


def resume_after_b(
    procs: Procs, env: dict[str, str], r: redis.Redis, broker: str, queue: str, said: str
) -> tuple[dict[str, int], float, bool, bool]:
    """Beat A (process 1) has stopped itself: start beat B, let it deliver every job, keep A
    stopped past ``PAUSE``, resume it, wait until A's log has ``said`` (or an ack of what it no
    longer held) and the broker is drained. ``(runs by id, A's pause in s, A said something,
    A is alive)``."""
    stopped_at = time.monotonic()
    beat_a = procs.procs[1][0]
    try:
        procs.start("beat", env)  # beat B
        ran = wait_for(lambda: len(runs(r)) >= JOBS, TIMEOUT, 0.2)
        assert ran, f"{len(runs(r))} of {JOBS} ran while A was stopped\n{procs.logs()}"
        time.sleep(max(0.0, PAUSE - (time.monotonic() - stopped_at)))
        paused = time.monotonic() - stopped_at
    finally:
        os.kill(beat_a.pid, signal.SIGCONT)
    # A goes on with its pass (publish, then ack); give it time, then let the worker drain.
    done = wait_for(lambda: "no longer leased" in log_of(procs, 1) or said in log_of(procs, 1), 30, 0.1)
    time.sleep(3.0)
    wait_for(lambda: broker_backlog(broker, queue) == (0, 0), 60, 0.2)
    time.sleep(1.0)
    return runs(r), paused, bool(done), beat_a.poll() is None


def paused_beat(
    broker: str,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
    label: str,
    conf: dict[str, Any],
    receiver: bool = False,
    queue: str = "celery",
    fenced_by_script: bool = False,
) -> None:
    conf = {"delayq_reclaim_ttl": RECLAIM_TTL, **conf}
    env = env_for(broker, redis_url, conf)
    stopping = {**env, "DELAYQ_TEST_STOP_AFTER_CLAIM": str(JOBS // 2)}
    if receiver:
        stopping["DELAYQ_TEST_PUBLISH_RECEIVER"] = "1"
        env = {**env, "DELAYQ_TEST_PUBLISH_RECEIVER": "1"}
    producer = producers(broker, redis_url, **conf)
    start_stack(procs, stopping, beats=1)  # worker 0, beat A 1
    warm_up(producer, r, procs)
    results = producer.record.apply_at_many([(time.time() + 2.0, (i,), None) for i in range(JOBS)])
    ids = {res.id for res in results}
    held = wait_for(lambda: r.get("e2e:stopped"), TIMEOUT, 0.05)
    assert held, f"beat A never claimed {JOBS // 2} jobs at once\n{procs.logs()}"
    counts, paused, done, a_alive = resume_after_b(procs, env, r, broker, queue, "fence")
    duplicates = {job_id: n for job_id, n in counts.items() if n > 1}
    lost = ids - set(counts)
    said_lines = [line for line in log_of(procs, 1).splitlines() if "fence" in line or "no longer" in line]
    print(
        f"\nFENCING paused beat, {label}: jobs={JOBS} held by A when stopped={int(held)} "
        f"paused={paused:.1f} s (TTL {RECLAIM_TTL:g} s): duplicates={len(duplicates)} lost={len(lost)}; "
        f"A said: {said_lines[-3:]}"
    )
    procs.stop_all()  # each beat logs its fence figures as it stops
    windows = [
        line.split("delayq: fence: ")[1]
        for line in log_of(procs, 2).splitlines()
        if "residual window" in line
    ]
    print(f"  beat B ({label}): {windows[-1] if windows else 'published nothing through kombu'}")
    assert done, f"beat A did nothing visible after SIGCONT\n{procs.logs()}"
    # What A held it dropped unpublished: by its fence (kombu's publish), or by push_claimed.lua.
    said = (
        f"{int(held)} claimed job(s) were no longer leased to this beat when pushed"
        if fenced_by_script
        else f"fence: {int(held)} claimed job(s) were not published"
    )
    assert said in log_of(procs, 1), procs.logs()
    assert not lost, f"{len(lost)} lost"
    assert duplicates == {}, f"{len(duplicates)} job(s) ran twice"
    assert a_alive, procs.logs()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("label", "conf", "receiver"),
    [
        ("kombu", {"delayq_push": False}, False),
        # the beat's own push path (push_claimed.lua): with delayq_push_on_claim on, push.lua pushes
        # every job of a shape it has a template for, and no beat holds any (tests/test_push.py)
        ("push", {"delayq_push_on_claim": False}, False),
        ("push+receiver", {"delayq_push_on_claim": False}, True),
        ("compressed", {"task_compression": "gzip"}, False),
    ],
)
def test_paused_beat_publishes_nothing_stale_redis_broker(
    label: str,
    conf: dict[str, Any],
    receiver: bool,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
) -> None:
    paused_beat(
        redis_url, redis_url, r, procs, producers, label, conf, receiver, fenced_by_script=label == "push"
    )


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.rabbitmq
@pytest.mark.timeout(240)
def test_paused_beat_publishes_nothing_stale_rabbitmq(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    broker = rabbitmq_or_skip()
    queue = f"delayq-fence-{uuid.uuid4().hex[:12]}"
    # broker_heartbeat=0: with AMQP heartbeats on, the worker's warm shutdown takes ~9 s. No
    # remote control: its exclusive pidbox queue (w0@<host>.celery.pidbox) would clash with a
    # worker of another test run on the same RabbitMQ.
    conf = {"task_default_queue": queue, "broker_heartbeat": 0, "worker_enable_remote_control": False}
    try:
        paused_beat(broker, redis_url, r, procs, producers, "rabbitmq", conf, queue=queue)
    finally:
        procs.stop_all()
        _delete_queue(broker, queue)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_paused_beat_does_not_republish_its_schedule_point(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """The same experiment with a recurring schedule (a point every 2 s) on the push path,
    where schedule points take kombu's publish: A stops right after claiming a point, B takes
    it over and goes on with the schedule, A is resumed: no point runs twice."""
    conf = {"delayq_reclaim_ttl": RECLAIM_TTL}
    env = env_for(redis_url, redis_url, conf)
    producer = producers(redis_url, redis_url, **conf)
    Schedules(producer.app).add("every-2s", "e2e.record", 2.0)
    start_stack(procs, {**env, "DELAYQ_TEST_STOP_AFTER_CLAIM": "1"}, beats=1)  # worker 0, A 1
    assert wait_for(lambda: r.get("e2e:stopped"), TIMEOUT, 0.05), procs.logs()
    stopped_at = time.monotonic()
    beat_a = procs.procs[1][0]
    try:
        procs.start("beat", env)  # beat B
        time.sleep(PAUSE)
    finally:
        os.kill(beat_a.pid, signal.SIGCONT)
    time.sleep(4.0)  # A's pass, then two more points by B
    counts = runs(r)
    print(
        f"\nFENCING paused beat, schedule point: A stopped {time.monotonic() - stopped_at - 4:.1f} s; "
        f"points run {len(counts)}, twice {sum(1 for n in counts.values() if n > 1)}"
    )
    assert "fence: 1 claimed job(s) were not published" in log_of(procs, 1), procs.logs()
    assert len(counts) >= PAUSE / 2 - 1, counts  # B kept the schedule going
    assert all(job_id.startswith("{every-2s}@") for job_id in counts), counts
    assert {job_id: n for job_id, n in counts.items() if n > 1} == {}
    assert beat_a.poll() is None, procs.logs()


# -- the fence in-process (kombu's publish batch on a Redis broker) ---------------------------

#: A short lease for the in-process tests: the fence's deadline is half of it.
SHORT_TTL = 0.6


def pause_before_publish(
    dispatcher: Dispatcher, seconds: float, then: Callable[[], Any] | None = None
) -> None:
    """Make ``dispatcher``'s next pass stall ``seconds`` between its claim and its publish (a GC
    pause, a stopped process), then run ``then`` (another beat's pass) before it goes on."""

    def stalled(step: str, detail: Any) -> None:
        if step != "claimed":
            return
        dispatcher.pause = None
        time.sleep(seconds)
        if then is not None:
            then()

    dispatcher.pause = stalled


def kombu_apps(app_factory: Callable[..., Any]) -> tuple[Any, Any]:
    conf = {"delayq_push": False, "delayq_reclaim_ttl": SHORT_TTL, "delayq_shards": 4}
    return app_factory(**conf), app_factory(**conf)


@pytest.mark.slow
def test_a_beat_whose_leases_were_taken_over_publishes_none_of_them(
    app_factory: Callable[..., Any], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app_a, app_b = kombu_apps(app_factory)
    ids = [
        res.id
        for res in app_a.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(20)])
    ]
    a, b = dispatchers(app_a), dispatchers(app_b)
    pause_before_publish(a, SHORT_TTL * 1.5, b.run_once)  # past the lease: B re-claims and delivers
    a.run_once()
    assert sorted(published_ids(r)) == sorted(ids)  # each once: B's
    assert (b.stats.published, b.stats.acked) == (20, 20)
    assert (a.stats.claimed, a.stats.published, a.stats.fenced, a.stats.renewals) == (20, 0, 20, 1)
    assert a.stats.stale_acks == 20 and a.fence_window()[0] == 0
    server = serve_metrics(a, free_port())
    try:
        page = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert value(page, "delayq_fenced", "delayq_fenced_total") == 20
    assert value(page, "delayq_lease_renewals", "delayq_lease_renewals_total") == 1


def test_a_batch_older_than_the_fence_is_renewed_and_published_when_still_held(
    app_factory: Callable[..., Any], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app_a, _ = kombu_apps(app_factory)
    ids = [
        res.id
        for res in app_a.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(20)])
    ]
    a = dispatchers(app_a)
    # Past FENCE_FRACTION of the lease, not past the lease: nobody else took the jobs.
    pause_before_publish(a, SHORT_TTL * (FENCE_FRACTION + 1) / 2)
    a.run_once()
    assert sorted(published_ids(r)) == sorted(ids)
    assert (a.stats.published, a.stats.acked, a.stats.fenced, a.stats.renewals) == (20, 20, 0, 1)
    count, p99, most = a.fence_window()
    assert count == 1 and 0 <= p99 <= most  # one batch flush, after one check


@pytest.mark.slow
def test_a_lease_lost_while_its_message_waits_in_the_batch_discards_the_batch(
    app_factory: Callable[..., Any], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The stall falls between two publishes into kombu's batch: the first message is buffered,
    its lease is lost meanwhile: the whole batch is discarded unsent, nothing of A's is acked."""
    app_a, app_b = kombu_apps(app_factory)
    ids = [
        res.id
        for res in app_a.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(5)])
    ]
    a, b = dispatchers(app_a), dispatchers(app_b)
    handed: list[str] = []

    def stall_after_first(step: str, detail: Any) -> None:
        """A stalls once its first message is in kombu's batch."""
        if step == "handed":
            handed.append(detail)
            if len(handed) == 1:
                time.sleep(SHORT_TTL * 1.5)
                b.run_once()

    a.pause = stall_after_first
    a.run_once()
    assert sorted(published_ids(r)) == sorted(ids)  # each once: B's
    assert len(handed) == 1  # the second publish found the leases lost, and went no further
    assert (a.stats.published, a.stats.acked, a.stats.fenced) == (0, 0, 5)


@pytest.mark.slow
def test_a_paused_beat_does_not_publish_a_schedule_point_taken_over(
    app_factory: Callable[..., Any], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app_a, app_b = kombu_apps(app_factory)
    Schedules(app_a).add("every-second", app_a.tasks["t.add"], 1.0, (1, 2))
    assert wait_for(
        lambda: (
            get_store(app_a).server_now_ms()
            > Schedules(app_a).get("every-second").next_run.timestamp() * 1000
        ),
        5,
    )  # type: ignore[union-attr]
    a, b = dispatchers(app_a), dispatchers(app_b)
    pause_before_publish(a, SHORT_TTL * 1.5, b.run_once)
    a.run_once()
    assert len(published_ids(r)) == 1  # B's
    assert (a.stats.published, a.stats.fenced) == (0, 1)
    assert Schedules(app_a).get("every-second").run_count == 1  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_flush_that_ends_after_the_lease_is_reported(
    app_factory: Callable[..., Any],
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The residual window the fence cannot close: a stall inside the batch flush itself. The
    messages go out (the fence checked before the flush), and the beat says they may run twice."""
    from kombu.transport.redis import PublishBatch

    app_a, _ = kombu_apps(app_factory)
    app_a.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(3)])
    flush = PublishBatch.flush

    def slow_flush(self: Any) -> None:
        time.sleep(SHORT_TTL * 1.2)
        flush(self)

    monkeypatch.setattr(PublishBatch, "flush", slow_flush)
    a = dispatchers(app_a)
    a.run_once()
    assert len(published_ids(r)) == 3
    assert "fence: 3 message(s) reached the broker after their lease may have expired" in caplog.text
    count, _, most = a.fence_window()
    assert count == 1 and most >= SHORT_TTL * 1200


# -- a beat paused inside its publish (issue 24, item 2): the workers' start check ------------

#: Messages beat A hands to the broker before it stops itself (one by one on RabbitMQ; on the
#: Redis broker its one batch of the pass is flushed first, so all of them).
STOP_AFTER_PUBLISHED = 300


def paused_inside_publish(
    broker: str,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
    label: str,
    conf: dict[str, Any],
    queue: str = "celery",
) -> None:
    """``JOBS`` jobs due at once; beat A stops itself (SIGSTOP) once it has published
    ``STOP_AFTER_PUBLISHED`` of them (its messages are in the broker, the rest of its pass and
    its ack are not done); beat B re-claims everything after A's leases and publishes it again;
    A is resumed past ``PAUSE``. The workers run each job once: the copies of the claim that
    started second are dropped (``delayq_start_check``)."""
    conf = {"delayq_reclaim_ttl": RECLAIM_TTL, **conf}
    env = env_for(broker, redis_url, conf)
    producer = producers(broker, redis_url, **conf)
    start_stack(procs, {**env, "DELAYQ_TEST_STOP_IN_PUBLISH": str(STOP_AFTER_PUBLISHED)}, beats=1)
    warm_up(producer, r, procs)
    r.delete("e2e:stopped")
    results = producer.record.apply_at_many([(time.time() + 2.0, (i,), None) for i in range(JOBS)])
    ids = {res.id for res in results}
    sent = wait_for(lambda: r.get("e2e:stopped"), TIMEOUT, 0.05)
    assert sent, f"beat A never published {STOP_AFTER_PUBLISHED} jobs in a pass\n{procs.logs()}"
    counts, paused, done, alive = resume_after_b(procs, env, r, broker, queue, "fence:")
    duplicates = {job_id: n for job_id, n in counts.items() if n > 1}
    lost = ids - set(counts)
    said = [line for line in log_of(procs, 1).splitlines() if "fence" in line or "no longer" in line]
    print(
        f"\nFENCING beat paused inside its publish, {label}: jobs={JOBS}, A published {int(sent)} "
        f"then stopped {paused:.1f} s (TTL {RECLAIM_TTL:g} s): duplicates={len(duplicates)} "
        f"lost={len(lost)}; A said: {said[-3:]}"
    )
    procs.stop_all()
    assert done, f"beat A did nothing visible after SIGCONT\n{procs.logs()}"
    assert not lost, f"{len(lost)} lost"
    assert duplicates == {}, f"{len(duplicates)} job(s) ran twice"
    dropped = sum(int(r.get(get_store(producer.app).keys.shard(i).dropped) or 0) for i in range(16))
    print(f"  stale copies dropped by the workers: {dropped}")
    assert dropped >= int(sent) - 1  # (the warm-up job may be among those A counted)
    assert "dropped a stale copy of job" in log_of(procs, 0)
    assert alive, procs.logs()
    not_published = [line for line in said if "claimed job(s) were not published" in line]
    for line in not_published:  # what A says it did not publish excludes what it had sent
        count = int(line.split("fence: ")[1].split(" ")[0])
        assert count <= JOBS - int(sent) + 1, line


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_beat_paused_inside_its_publish_runs_nothing_twice_kombu_batch(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    paused_inside_publish(
        redis_url, redis_url, r, procs, producers, "kombu batch (Redis broker)", {"delayq_push": False}
    )


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.rabbitmq
@pytest.mark.timeout(240)
def test_a_beat_paused_inside_its_publish_runs_nothing_twice_rabbitmq(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    broker = rabbitmq_or_skip()
    queue = f"delayq-fence-{uuid.uuid4().hex[:12]}"
    conf = {"task_default_queue": queue, "broker_heartbeat": 0, "worker_enable_remote_control": False}
    try:
        paused_inside_publish(broker, redis_url, r, procs, producers, "rabbitmq", conf, queue=queue)
    finally:
        procs.stop_all()
        _delete_queue(broker, queue)
