"""The claim loop in-process: :class:`Dispatcher` with the Redis broker."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish
from kombu import Queue

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.wake import RESUBSCRIBE_EVERY
from celery_delayq.devtools.embedded import free_port
from celery_delayq.store.facade import get_store
from tests.support.apps import add_task, make_app
from tests.support.clocks import Clock
from tests.support.polling import wait_for
from tests.support.store import broker_lists, expire_leases, published_ids, server_ms, store_raw_job

HOUR = 3600.0

AppFactory = Callable[..., Celery]


def test_run_once_publishes_due_jobs_and_acks_them(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    due = [add.apply_at(time.time() - 5 + i, (i, i)) for i in range(3)]
    later = add.apply_in(HOUR, (9, 9))
    dispatcher = dispatchers(app, keep_lateness=10)
    wait = dispatcher.run_once()
    assert 0 < wait <= dispatcher.config.max_sleep

    messages = broker_lists(r)["celery"]
    assert sorted(m["headers"]["id"] for m in messages) == sorted(res.id for res in due)
    by_id = {m["headers"]["id"]: m for m in messages}
    for res in due:
        assert res.due is not None
        assert by_id[res.id]["headers"]["delayq_due"] == round(res.due.timestamp() * 1000)
        assert by_id[res.id]["headers"]["eta"] is None  # the worker runs it at once
    stats = dispatcher.stats
    assert (stats.claimed, stats.published, stats.acked, stats.dead_lettered) == (3, 3, 3, 0)
    assert len(stats.lateness_ms) == 3 and all(x >= 0 for x in stats.lateness_ms)
    dq = DelayQ(app)
    assert [job.id for job in dq.pending()] == [later.id]
    assert all(dq.get(res.id) is None for res in due)

    dispatcher.run_once()  # nothing new is due: nothing is published again
    assert len(broker_lists(r)["celery"]) == 3


def test_run_once_with_nothing_due(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    dispatcher = dispatchers(app)
    assert dispatcher.run_once() > 0
    assert broker_lists(r) == {}
    assert dispatcher.stats.claimed == 0


def test_full_batch_asks_for_another_pass_at_once(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app = app_factory(delayq_batch_size=2, delayq_shards=1)
    results = [app.tasks["t.add"].apply_at(time.time() - 10 + i, (i, i)) for i in range(5)]
    dispatcher = dispatchers(app)
    assert dispatcher.run_once() == 0.0
    assert published_ids(r) == [res.id for res in results[:2]]
    passes = 1
    while DelayQ(app).count() and passes < 10:
        dispatcher.run_once()
        passes += 1
    assert published_ids(r) == [res.id for res in results]  # each once, in due order
    assert passes == 3


def test_corrupt_envelopes_are_dead_lettered(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    good = [add.apply_at(time.time() - 5, (i, i)) for i in range(3)]
    later = add.apply_in(HOUR, (9, 9))
    past = server_ms(r) - 2000
    envelope = json.loads(get_store(app).get(good[0].id).envelope)  # type: ignore[union-attr]
    envelope["v"] = 99
    corrupt = {
        "garbage": "{not json",
        "not-an-object": "[1, 2]",
        "wrong-version": json.dumps(envelope),
        "missing-field": json.dumps({"v": 1, "task": "t.add"}),
    }
    for job_id, raw in corrupt.items():
        store_raw_job(app, job_id, past, raw)
    later_before = DelayQ(app).get(later.id)

    dispatcher = dispatchers(app)
    dispatcher.run_once()

    assert sorted(published_ids(r)) == sorted(res.id for res in good)
    dq = DelayQ(app)
    dead = dict(dq.dead())
    assert set(dead) == set(corrupt)
    for job_id, raw in corrupt.items():
        record = dead[job_id]
        assert record["reason"].startswith("corrupt envelope")
        assert record["envelope"] == raw
        assert (record["due"], record["tries"], record["task"]) == (past, 1, None)
        assert record["beat"] == dispatcher.token
        job = dq.get(job_id)
        assert job is not None and job.state == "dead"
    assert dq.get(later.id) == later_before
    assert dq.count() == 1
    assert dispatcher.stats.dead_lettered == len(corrupt)
    assert dispatcher.stats.acked == len(good)


def test_unknown_task_is_dead_lettered(
    app: Celery, app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    producer = app_factory()

    @producer.task(base=DelayedTask, name="other.task", shared=False)
    def other(x: int) -> int:
        return x

    unknown = other.apply_at(time.time() - 5, (1,))
    known = app.tasks["t.add"].apply_at(time.time() - 5, (1, 2))
    later = other.apply_in(HOUR, (2,))
    assert "other.task" not in app.tasks

    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert published_ids(r) == [known.id]
    dq = DelayQ(app)
    [(dead_id, record)] = list(dq.dead())
    assert dead_id == unknown.id
    assert "not registered" in record["reason"] and "other.task" in record["reason"]
    assert record["task"] == "other.task"
    assert record["envelope"] == json.dumps(json.loads(record["envelope"]), separators=(",", ":"))
    job = dq.get(unknown.id)
    assert job is not None and (job.state, job.task, job.args) == ("dead", "other.task", [1])
    waiting = dq.get(later.id)
    assert waiting is not None and waiting.state == "waiting"


def test_unknown_task_is_published_when_dead_letter_unknown_is_off(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    producer = app_factory()

    @producer.task(base=DelayedTask, name="other.task2", shared=False)
    def other(x: int) -> int:
        return x

    beat_app = app_factory(delayq_dead_letter_unknown=False)
    res = other.apply_at(time.time() - 5, (1,), queue="elsewhere")
    assert "other.task2" not in beat_app.tasks
    dispatcher = dispatchers(beat_app)
    dispatcher.run_once()
    [message] = broker_lists(r)["elsewhere"]
    assert (message["headers"]["id"], message["headers"]["task"]) == (res.id, "other.task2")
    assert list(DelayQ(beat_app).dead()) == []
    assert DelayQ(beat_app).count() == 0


def test_queue_unknown_to_the_beat_is_dead_lettered_and_does_not_block_the_batch(
    app: Celery, app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    beat_app = app_factory(delayq_shards=1, task_create_missing_queues=False, task_queues=[Queue("celery")])
    producer = app_factory(delayq_shards=1)
    add = producer.tasks["t.add"]
    poison = add.apply_at(time.time() - 10, (1, 2), queue="only-the-producer-knows")
    good = add.apply_at(time.time() - 5, (3, 4))

    dispatcher = dispatchers(beat_app)
    dispatcher.run_once()
    assert published_ids(r) == [good.id]
    dq = DelayQ(beat_app)
    [(dead_id, record)] = list(dq.dead())
    assert dead_id == poison.id
    assert "only-the-producer-knows" in record["reason"]
    assert dq.count() == 0
    assert dispatcher.stats.publish_errors == 0


def test_unreachable_broker_keeps_jobs_stored_and_leased(
    app: Celery, app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    results = [add.apply_at(time.time() - 5, (i, i)) for i in range(3)]
    later = add.apply_in(HOUR, (9, 9))
    down = app_factory(
        broker=f"redis://127.0.0.1:{free_port()}/0",
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        broker_transport_options={"max_retries": 0},
        task_publish_retry=False,
    )
    dispatcher = dispatchers(down)
    dispatcher.run_once()  # logs, does not raise

    stats = dispatcher.stats
    assert (stats.claimed, stats.published, stats.acked, stats.dead_lettered) == (3, 0, 0, 0)
    assert stats.publish_errors >= 1
    dq = DelayQ(app)
    assert list(dq.dead()) == []
    assert dq.count() == 4
    for res in results:
        job = dq.get(res.id)
        assert job is not None and (job.state, job.tries, job.due) == ("leased", 1, res.due)
    waiting = dq.get(later.id)
    assert waiting is not None and waiting.state == "waiting"
    assert broker_lists(r) == {}

    # Not lost: once the leases expire, a beat that reaches the broker delivers them.
    assert sorted(expire_leases(get_store(app))) == sorted(res.id for res in results)
    healthy = dispatchers(app)
    healthy.run_once()
    assert sorted(published_ids(r)) == sorted(res.id for res in results)
    assert healthy.stats.acked == 3
    assert [job.id for job in dq.pending()] == [later.id]


def test_an_unreachable_broker_makes_the_beat_back_off(
    app: Celery, app_factory: AppFactory, dispatchers: Callable[..., Dispatcher]
) -> None:
    """While the broker is down a beat does not claim, fail and log at every due job: it waits
    0.5 s, then 1 s, ... (at most 5 s or delayq_max_sleep) between claims."""
    down = app_factory(
        broker=f"redis://127.0.0.1:{free_port()}/0",
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        broker_transport_options={"max_retries": 0},
    )
    job = down.tasks["t.add"].apply_at(time.time() - 5, (1, 1))
    ttl = get_store(down).config.reclaim_ttl
    # The dispatchers' monotonic clock is the test's: it moves only when the test says so. Their
    # wall clock runs, and the test sets it ahead when a lease runs out (ended on the server).
    now = [time.monotonic()]
    wall = Clock()
    dispatcher = dispatchers(down, clock=lambda: now[0], wall=wall)
    wait = dispatcher.run_once()
    assert dispatcher.broker_backoff.delay == 0.5 and wait == 0.5
    passes = dispatcher.stats.passes
    assert expire_leases(get_store(down), [job.id]) == [job.id]  # the job is due again
    wall.advance(ttl)
    now[0] += 0.4
    assert dispatcher.run_once() == pytest.approx(0.1)
    assert dispatcher.stats.passes == passes  # no claim during the back-off
    now[0] += 0.1
    wait = dispatcher.run_once()  # claimed, failed, doubled
    assert dispatcher.stats.passes == passes + 1 and dispatcher.broker_backoff.delay == 1.0
    assert wait == 1.0 and dispatcher.broker_backoff.retry_at == now[0] + 1.0
    # With the broker back, the next claim after the back-off publishes and resets it.
    healthy = dispatchers(app, clock=lambda: now[0], wall=wall)
    healthy.broker_backoff.fail()
    healthy.broker_backoff.fail()  # backing off 1 s, as after two outages
    assert healthy.run_once() == 1.0 and healthy.stats.published == 0
    assert healthy.stats.passes == 0  # no claim during the back-off
    now[0] += 1.0
    assert expire_leases(get_store(app), [job.id]) == [job.id]  # the failing beat's lease ran out
    wall.advance(ttl)
    healthy.run_once()
    assert healthy.stats.published == 1 and healthy.broker_backoff.delay == 0.0


def test_cancel_during_publish_makes_the_ack_stale(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    seen: list[dict[str, Any]] = []

    def on_publish(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        seen.append(dict(headers))
        assert DelayQ(app).cancel(headers["id"]) == "delivering"  # held by the beat right now

    before_task_publish.connect(on_publish, weak=False)
    try:
        dispatcher = dispatchers(app)
        dispatcher.run_once()
    finally:
        before_task_publish.disconnect(on_publish)
    assert [h["id"] for h in seen] == [res.id]
    assert "delayq_due" in seen[0]
    assert published_ids(r) == [res.id]
    assert (dispatcher.stats.acked, dispatcher.stats.stale_acks) == (0, 1)
    assert DelayQ(app).get(res.id) is None


def test_two_dispatchers_deliver_each_job_once(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    n = 300
    app.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(n)])
    beats = [dispatchers(app), dispatchers(app)]
    errors: list[BaseException] = []

    def loop(dispatcher: Dispatcher) -> None:
        try:
            deadline = time.monotonic() + 30
            while DelayQ(app).count() and time.monotonic() < deadline:
                dispatcher.run_once()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(d,)) for d in beats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    ids = published_ids(r)
    assert len(ids) == n and len(set(ids)) == n
    assert sum(d.stats.published for d in beats) == n
    assert sum(d.stats.stale_acks for d in beats) == 0


# -- sleeping ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_wait_returns_early_when_an_earlier_job_arrives(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    dispatcher = dispatchers(app)
    assert dispatcher.run_once() > 5  # empty store: it would sleep long
    scheduled: list[Any] = []

    def enqueue_soon() -> None:
        time.sleep(0.3)
        scheduled.append(app.tasks["t.add"].apply_in(0.2, (1, 2)))

    thread = threading.Thread(target=enqueue_soon)
    started = time.monotonic()
    thread.start()
    dispatcher.wait(20.0)
    elapsed = time.monotonic() - started
    thread.join(10)
    assert scheduled
    assert elapsed < 10.0  # woke on the new job, not at the 20 s timeout
    assert dispatcher.stats.wakeups >= 1
    assert wait_for(lambda: dispatcher.run_once() is not None and published_ids(r), timeout=10)
    assert published_ids(r) == [scheduled[0].id]


@pytest.mark.slow
def test_wait_sleeps_its_timeout_when_the_new_job_is_later(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    dispatcher = dispatchers(app)
    dispatcher.run_once()  # subscribed: the wake message below waits on the socket
    app.tasks["t.add"].apply_in(HOUR, (1, 2))
    started = time.monotonic()
    dispatcher.wait(1.0)
    elapsed = time.monotonic() - started
    assert elapsed >= 1.0  # heard of the job, but it is not due before the timeout
    assert dispatcher.stats.wakeups == 1
    assert dispatcher.seconds_until_due() > 0


def test_seconds_until_due_reflects_the_next_due(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app = app_factory(delayq_max_sleep=120)
    add = app.tasks["t.add"]
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert 60 < dispatcher.seconds_until_due() <= 120  # nothing stored: the safety poll

    def after_wake(check: Callable[[float], bool]) -> float:
        """The next due time once the beat has heard the wake messages (short waits until
        ``check`` holds, 5 s at most)."""
        wait_for(
            lambda: dispatcher.wait(0.01) or check(dispatcher.seconds_until_due()), timeout=5, interval=0
        )
        return dispatcher.seconds_until_due()

    add.apply_in(HOUR, (1, 2))
    dispatcher.wait(0.05)  # hears the wake message
    assert 60 < dispatcher.seconds_until_due() <= 120  # capped by max_sleep

    add.apply_in(30, (1, 2))
    assert 10 < after_wake(lambda s: s <= 30) <= 30

    res = add.apply_in(0, (1, 2))
    assert after_wake(lambda s: s == 0) == 0
    dispatcher.run_once()
    assert published_ids(r) == [res.id]
    assert 10 < dispatcher.seconds_until_due() <= 30

    # A fresh dispatcher that has not looked yet says "now".
    assert dispatchers(app).seconds_until_due() == 0


@pytest.mark.slow
def test_a_broker_refusing_writes_is_an_outage_jobs_are_kept_never_buried(
    app_factory: AppFactory, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A (real) Redis broker answering OOM: kombu reports it as OperationalError, so the job
    stays stored and is retried after every lease, however many times, and goes out on recovery."""
    from celery_delayq.beat.publish import PUBLISH_ATTEMPTS
    from celery_delayq.devtools.embedded import EmbeddedRedis

    with EmbeddedRedis() as broker_server:
        broker = redis.Redis.from_url(broker_server.url)
        broker.config_set("maxmemory", 1)  # every write is refused with OOM
        app = app_factory(
            broker=broker_server.url + "/0",
            delayq_reclaim_ttl=0.05,
            broker_transport_options={"max_retries": 0},
        )
        dq = DelayQ(app)
        job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
        dispatcher = dispatchers(app)
        for attempt in range(1, PUBLISH_ATTEMPTS + 3):
            dispatcher.run_once()
            stored = dq.get(job.id)
            assert stored is not None and stored.state == "leased" and stored.tries == attempt
            assert dispatcher.broker_backoff.delay > 0  # an outage: the beat backs off
            dispatcher.broker_backoff.reset()  # (skip the wait: the back-off has its own test)
            time.sleep(0.1)  # let the lease expire
        assert list(dq.dead()) == []
        broker.config_set("maxmemory", 0)
        dispatcher.run_once()
        assert dq.get(job.id) is None
        assert broker.llen("celery") == 1
        broker.close()


def test_other_publish_errors_are_retried_then_dead_lettered(
    app_factory: AppFactory, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A publish error that is neither a lost connection nor about the message is retried
    through the lease; the claim that makes PUBLISH_ATTEMPTS attempts dead-letters the job."""
    from kombu import compression

    from celery_delayq.beat.publish import PUBLISH_ATTEMPTS

    calls = {"n": 0}

    def failing_encoder(body: bytes) -> bytes:
        calls["n"] += 1
        raise RuntimeError("codec unavailable")

    compression.register(failing_encoder, lambda b: b, "application/x-delayq-failing", aliases=["failing"])
    app = app_factory()
    dq = DelayQ(app)
    job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), compression="failing")
    other = app.tasks["t.add"].apply_at(time.time() - 1, (5, 6))
    wall = Clock()
    dispatcher = dispatchers(app, wall=wall)
    for attempt in range(1, PUBLISH_ATTEMPTS):
        dispatcher.run_once()
        stored = dq.get(job.id)
        assert stored is not None and stored.state == "leased" and stored.tries == attempt
        # The lease runs out: on the server, and on the beat's clock (its next claim is then).
        assert expire_leases(get_store(app), [job.id]) == [job.id]
        wall.advance(get_store(app).config.reclaim_ttl)
    assert dq.get(other.id) is None  # the rest of the batch went out
    dispatcher.run_once()
    dead = dq.get(job.id)
    assert dead is not None and dead.state == "dead"
    reason = dict(dq.dead())[job.id]["reason"]
    assert f"publish failed {PUBLISH_ATTEMPTS} times" in reason and "codec unavailable" in reason
    assert calls["n"] == PUBLISH_ATTEMPTS


def test_a_failure_inside_the_publish_batch_publishes_and_acks_nothing(
    app_factory: AppFactory, dispatchers: Callable[..., Dispatcher], r: redis.Redis
) -> None:
    """On a Redis broker a pass publishes through one kombu batch: if the pass dies before the
    batch is sent, no message reaches the broker, nothing is acked, and every job is delivered
    exactly once after its lease."""

    class Crash(BaseException):
        pass

    app = app_factory()
    jobs = [app.tasks["t.add"].apply_at(time.time() - 1, (i, i)) for i in range(5)]
    calls = {"n": 0}

    def die_on_third(sender: Any = None, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash

    before_task_publish.connect(die_on_third, weak=False)
    try:
        with pytest.raises(Crash):
            dispatchers(app).run_once()
    finally:
        before_task_publish.disconnect(die_on_third)
    assert r.llen("celery") == 0
    assert all(DelayQ(app).get(j.id).state == "leased" for j in jobs)  # type: ignore[union-attr]
    assert sorted(expire_leases(get_store(app))) == sorted(j.id for j in jobs)
    dispatchers(app).run_once()
    bodies = [json.loads(m)["headers"]["id"] for m in r.lrange("celery", 0, -1)]
    assert sorted(bodies) == sorted(j.id for j in jobs)


def test_direct_and_signal_paths_publish_the_same_message(
    app_factory: AppFactory, dispatchers: Callable[..., Dispatcher], r: redis.Redis
) -> None:
    """With no publish-signal receivers the beat hands messages to kombu itself; with one it
    goes through Celery's send_task_message. The broker sees the same message either way."""
    app = app_factory()
    options = {"queue": "q2", "priority": 3, "headers": {"h": 1}, "expires": 600}
    seen: list[Any] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(sender)

    direct = dispatchers(app)
    app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), task_id="direct", **options)
    direct.run_once()
    assert direct.publishing.direct is True
    before_task_publish.connect(receiver, weak=False)
    try:
        app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), task_id="signal", **options)
        via_signal = dispatchers(app)
        via_signal.run_once()
        assert via_signal.publishing.direct is False and seen == ["t.add"]
    finally:
        before_task_publish.disconnect(receiver)
    (key,) = [k for k in r.keys("q2*") if not k.startswith("_kombu")]
    a, b = (json.loads(m) for m in r.lrange(key, 0, -1))
    # Only the message published through kombu carries its claim (the direct one went through
    # push_claimed.lua, which needs none: see celery_delayq/worker/starts.py).
    claims = {m["headers"]["id"]: m["headers"].pop("delayq_claim", None) for m in (a, b)}
    assert claims["direct"] is None and claims["signal"].startswith(f"1|{via_signal.token}|")
    for message in (a, b):
        message["properties"].pop("delivery_tag")
        message["properties"].pop("correlation_id")
        for name in ("id", "root_id", "delayq_due", "expires"):
            message["headers"].pop(name)
        message["properties"].pop("expiration")
    assert a == b


def test_the_fence_renews_a_pass_that_outlived_its_fraction_of_the_lease(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The fence reads the dispatcher's (injected) monotonic clock: a pass whose clock has moved
    past FENCE_FRACTION of the lease since its claim renews the leases before publishing, and
    publishes what it still holds; within the fraction it asks Redis nothing."""
    from celery_delayq.beat.fence import FENCE_FRACTION

    app = app_factory(delayq_push=False, delayq_reclaim_ttl=30.0)
    jobs = [app.tasks["t.add"].apply_at(time.time() - 1, (i, i)) for i in range(3)]
    now = [time.monotonic()]
    dispatcher = dispatchers(app, clock=lambda: now[0])

    def stalled(step: str, detail: Any) -> None:
        if step == "claimed":
            now[0] += (FENCE_FRACTION + 0.1) * 30.0  # past the fence, short of the lease

    dispatcher.pause = stalled
    dispatcher.run_once()
    assert (dispatcher.stats.published, dispatcher.stats.renewals, dispatcher.stats.fenced) == (3, 1, 0)
    assert sorted(published_ids(r)) == sorted(job.id for job in jobs)
    app.tasks["t.add"].apply_at(time.time() - 1, (9, 9))
    dispatcher.pause = None
    dispatcher.close()  # look at every shard at the next pass
    dispatcher.run_once()
    assert (dispatcher.stats.published, dispatcher.stats.renewals) == (4, 1)


def test_a_refused_wake_subscription_never_stops_the_claims(
    redis_url: str, r: redis.Redis, dispatchers: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    """A beat whose wake subscription cannot be made (here its ACL user may not SUBSCRIBE; on
    a cluster, the channel's node failing over) claims and delivers without it: every shard at
    once, then on the safety poll every RESUBSCRIBE_EVERY s, trying to subscribe as often."""
    user, password = "no-subscribe", "pw"
    r.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-subscribe")
    try:
        app = make_app(redis_url, redis_url.replace("redis://", f"redis://{user}:{password}@"))

        add = add_task(app)

        first = add.apply_in(0, (1, 2))
        # Its sleeps move its monotonic clock (no real waiting): how long it slept is on that clock.
        clock = Clock(time.monotonic)
        dispatcher = dispatchers(app, clock=clock, sleep=clock.advance)
        with caplog.at_level(logging.WARNING, logger="celery_delayq.beat.wake"):
            dispatcher.run_once()
        assert dispatcher.subscription is None
        assert published_ids(r) == [first.id]
        assert "the wake subscription failed (NoPermissionError" in caplog.text, caplog.text
        # A job stored now sends a wake message that this beat cannot hear: the safety poll,
        # within about RESUBSCRIBE_EVERY s (not delayq_max_sleep, 20 s), finds it.
        second = add.apply_in(0, (2, 3))
        started = clock()
        dispatcher.wait(dispatcher.config.max_sleep)
        assert clock() - started < RESUBSCRIBE_EVERY + 2.0 < dispatcher.config.max_sleep
        dispatcher.run_once()
        assert published_ids(r) == [first.id, second.id]
        warned = [
            rec
            for rec in caplog.records
            if rec.levelno >= logging.WARNING and "wake subscription failed" in rec.getMessage()
        ]
        assert len(warned) == 1  # logged once until a subscription is made
    finally:
        r.execute_command("ACL", "DELUSER", user)
