"""The fence where the work happens (issue 24, item 2): the claim a beat puts in each message it
publishes through kombu, the start check of ``lua/start.lua`` on a real Redis, and what the
worker's consumer step does with it.

The paused-beat experiments with real processes are in ``tests/test_fencing.py``
(``test_a_beat_paused_inside_its_publish_runs_nothing_twice_*``); here, end to end, a worker
SIGKILLed mid-task (``acks_late``) and a task that retries (``self.retry``) still run again
under the check.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_delayq import DelayedTask
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.devtools.embedded import EmbeddedRedis, free_port
from celery_delayq.store.envelope import CLAIM_HEADER
from celery_delayq.store.facade import get_store
from celery_delayq.store.keys import start_record
from celery_delayq.store.scripts import SCRIPTS
from celery_delayq.worker.starts import CHECK_TIMEOUT, RETRY_AFTER, StartCheck, read_claim
from tests.support.apps import make_app
from tests.support.metrics import scrape, value
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import Producer, env_for, log_of, producers, runs, start_stack, starts, warm_up
from tests.support.store import broker_lists, make_store, server_ms

__all__ = ["producers"]  # a fixture, used by name

TTL_MS = 60_000


def _records(r: redis.Redis) -> dict[str, int]:
    """The bucketed start-record hashes of ``r`` and how many records each holds (their
    fields are bytes: ``r`` decodes replies)."""
    return {key: r.hlen(key) for key in r.scan_iter("*:starts:*:*:*")}


def test_the_first_claim_to_start_wins_and_may_start_again(redis_url: str, r: redis.Redis) -> None:
    store = make_store(redis_url)
    assert store.start("job-1", 1000, 7, "1|beat-a", TTL_MS)
    assert store.start("job-1", 1000, 7, "1|beat-a", TTL_MS)  # a retry, a redelivery
    assert not store.start("job-1", 1000, 7, "1|beat-b", TTL_MS)  # another beat's copy
    assert not store.start("job-1", 1000, 7, "2|beat-a", TTL_MS)  # a later claim of the same beat
    assert r.get(store.keys.for_job("job-1").dropped) == "2"
    # The same id stored again later (another envelope, or requeued at another due): new instances.
    assert store.start("job-1", 1000, 8, "1|beat-b", TTL_MS)
    assert store.start("job-1", 2000, 7, "1|beat-b", TTL_MS)
    assert store.overview(0).dropped == 2


def test_a_start_record_is_a_field_of_its_shards_bucket_hash(redis_url: str) -> None:
    """No key a job (the form before issue 52): a field (8 bytes) holding a mark of the claim (4
    bytes) in the hash of the job's shard, time bucket and part, which expires as a whole at
    least delayq_start_ttl after its bucket ends; its name has the shard's hash tag (one slot)."""
    raw = redis.Redis.from_url(redis_url)
    store = make_store(redis_url)
    assert store.start("job-1", 1000, 7, "1|beat-a", TTL_MS)
    part, field, mark = start_record("job-1", 1000, 7, "1|beat-a")
    shard = store.keys.for_job("job-1")
    [key] = [k.decode() for k in raw.scan_iter("*:starts:*:*:*")]
    bucket = server_ms(raw) // 8000  # buckets of 8 s: the least 2^k s with TTL_MS <= 8 of them
    assert key in {shard.start_records(8, b, part) for b in (bucket - 1, bucket)}, key
    assert raw.hgetall(key) == {field: mark}
    assert TTL_MS < raw.pttl(key) <= TTL_MS + 8000
    assert sorted(k.decode() for k in raw.keys("*")) == [key]  # nothing else, no per-job key
    assert key.startswith(shard.base)
    # Every job is found again in its bucket; the jobs of a shard share its hashes.
    ids = [f"j{i}" for i in range(300)]
    assert all(store.start(i, 1, 2, "1|a", TTL_MS) for i in ids)
    assert not any(store.start(i, 1, 2, "1|b", TTL_MS) for i in ids)
    fields = sum(_records(raw).values())
    assert fields == 301 and len(_records(raw)) <= 256 * 16


def test_a_record_of_the_one_key_form_is_still_recognised(redis_url: str, r: redis.Redis) -> None:
    """A rolling upgrade: a job a worker of an earlier version started has its record in a key of
    its own (ShardKeys.started); its other claims are dropped, its own starts again, and
    nothing new is written for it."""
    store = make_store(redis_url)
    old = store.keys.for_job("job-1").started("job-1", 1000, 7)
    r.set(old, "1|beat-a", px=TTL_MS)
    assert not store.start("job-1", 1000, 7, "1|beat-b", TTL_MS)
    assert store.start("job-1", 1000, 7, "1|beat-a", TTL_MS)
    assert _records(r) == {}
    assert r.get(store.keys.for_job("job-1").dropped) == "1"


@pytest.mark.slow
def test_a_record_is_kept_its_ttl_across_buckets_and_then_goes_with_its_bucket(redis_url: str) -> None:
    """TTL 1.5 s: buckets of 1 s. A record written in one bucket is found from the next ones
    until its TTL has passed; then its bucket's hash has expired and another claim starts."""
    store = make_store(redis_url)
    raw = redis.Redis.from_url(redis_url)
    assert store.start("job-1", 1000, 7, "1|beat-a", 1500)
    written = server_ms(raw)
    wait_for(lambda: server_ms(raw) // 1000 > written // 1000, 3, 0.01)  # the next bucket
    assert server_ms(raw) < written + 1500
    assert not store.start("job-1", 1000, 7, "1|beat-b", 1500)
    assert store.start("job-1", 1000, 7, "1|beat-a", 1500)
    assert wait_for(lambda: not list(raw.scan_iter("*:starts:*:*:*")), 5, 0.05)
    assert server_ms(raw) >= written + 1500
    assert store.start("job-1", 1000, 7, "1|beat-b", 1500)


@pytest.mark.slow
def test_a_start_record_costs_at_most_64_bytes(redis_url: str, r: redis.Redis) -> None:
    """30,000 starts at the default TTL (what 60 s at 500 starts a second leaves, the bench's
    start_records row): Redis's used_memory grows by at most 64 B a started job (one key a job:
    about 210 B)."""
    store = make_store(redis_url)
    store.start("warm-up", 1, 2, "1|host:1:0123456789abcdef", 3_600_000)
    before = int(r.info("memory")["used_memory"])
    pipe = store.client.pipeline(transaction=False)
    n = 30_000
    for i in range(n):
        job_id = f"{uuid.UUID(int=i)}"
        claim = "1|host:1:0123456789abcdef"
        shard = store.keys.for_job(job_id)
        part, field, mark = start_record(job_id, 1_765_000_000_000, 1_764_000_000_000, claim)
        keys = [shard.started(job_id, 1_765_000_000_000, 1_764_000_000_000), shard.dropped]
        SCRIPTS["start"](pipe, keys, [claim, 3_600_000, part, field, mark])
        if i % 2000 == 1999:
            assert all(pipe.execute())
    per_job = (int(r.info("memory")["used_memory"]) - before) / n
    print(f"\nSTART RECORDS: {per_job:.1f} B of used_memory a started job ({n:,} starts, default TTL)")
    assert per_job <= 64


def test_bad_input_is_refused_before_anything_is_written(redis_url: str, r: redis.Redis) -> None:
    store = make_store(redis_url)
    for claim, ttl in (("", TTL_MS), ("1|a", 0), ("1|a", -5)):
        with pytest.raises(redis.ResponseError, match="delayq start"):
            store.start("job-1", 1000, 7, claim, ttl)
    shard = store.keys.for_job("job-1")
    keys = [shard.started("job-1", 1000, 7), shard.dropped]
    for part, field, mark in ((-1, "f", "m"), ("x", "f", "m"), (0, "", "m"), (0, "f", "")):
        with pytest.raises(redis.ResponseError, match="delayq start"):
            SCRIPTS["start"](store.client, keys, ["1|a", TTL_MS, part, field, mark])
    assert r.dbsize() == 0


def test_a_full_redis_refuses_the_record(redis_url: str, r: redis.Redis) -> None:
    """Over maxmemory (noeviction) the record cannot be written: an error, which the worker's
    check takes as "run it" (see test_an_unreachable_store_runs_the_task_unchecked)."""
    store = make_store(redis_url)
    r.set("ballast", "x" * 200_000)
    r.config_set("maxmemory", max(1, int(r.info("memory")["used_memory"]) - 100_000))
    try:
        with pytest.raises(redis.RedisError, match=r"OOM|maxmemory"):
            store.start("job-1", 1000, 7, "1|a", TTL_MS)
    finally:
        r.config_set("maxmemory", 0)


def _claims(messages: list[dict[str, Any]]) -> list[Any]:
    return [m["headers"].get(CLAIM_HEADER) for m in messages]


@pytest.mark.parametrize(
    ("push", "conf"),
    [(False, {}), (True, {}), (True, {"task_compression": "gzip"})],
    ids=["kombu", "push", "compressed"],
)
def test_messages_published_through_kombu_carry_their_claim_and_the_push_path_none(
    push: bool,
    conf: dict[str, Any],
    app_factory: Callable[..., Any],
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
) -> None:
    """The push path (push_claimed.lua) puts no claim on its messages; kombu's publish does, also
    for compressed messages, which leave the push path."""
    app = app_factory(delayq_push=push, delayq_push_on_claim=False, **conf)
    results = app.tasks["t.add"].apply_at_many([(time.time() - 1, (i, i), None) for i in range(3)])
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    messages = broker_lists(r)["celery"]
    assert sorted(m["headers"]["id"] for m in messages) == sorted(res.id for res in results)
    if push and not conf:
        assert _claims(messages) == [None, None, None]
        return
    for message in messages:
        claim = read_claim(message["headers"][CLAIM_HEADER])
        assert claim is not None
        assert claim.job_id == message["headers"]["id"]
        assert claim.claim == f"1|{dispatcher.token}"
        assert claim.due_ms == message["headers"]["delayq_due"]
        assert claim.created_ms > 0


def test_a_released_capped_job_carries_no_claim(
    app_factory: Callable[..., Any], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """Flow control delivers a released job again by design once its worker died (its slot
    expired) after it started: a claim would have the worker drop that second delivery. The
    gate keeps such a job to its one slot instead (docs/flow-control.md)."""
    app = app_factory(delayq_push=False)
    app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), concurrency_key="k", concurrency_limit=1)
    dispatchers(app).run_once()
    [message] = broker_lists(r)["celery"]
    assert "delayq_gate" in message["headers"]
    assert CLAIM_HEADER not in message["headers"]


class _Consumer:
    """What :class:`StartCheck` reads of Celery's consumer: the app and its task strategies."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.strategies: dict[str, Any] = {"t.add": self.strategy}
        self.requested: list[str] = []

    def strategy(self, message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
        self.requested.append(message.headers["id"])


class _Message:
    def __init__(self, headers: dict[str, Any]) -> None:
        self.headers = headers
        self.acked = False

    def ack(self) -> None:
        self.acked = True


def _deliver(consumer: _Consumer, claim: str | None, task_id: str) -> _Message:
    headers: dict[str, Any] = {"id": task_id, "task": "t.add"}
    if claim is not None:
        headers[CLAIM_HEADER] = claim
    message = _Message(headers)
    consumer.strategies["t.add"](message, None, None, None, None)
    return message


def test_the_consumer_step_drops_a_stale_copy_and_passes_everything_else(
    app_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    consumer = _Consumer(app_factory())
    step = StartCheck(consumer)
    step.start(consumer)
    step.start(consumer)  # (a connection restart starts the step again: wrapped once)
    first = _deliver(consumer, "1|beat-a|1000|7|j1", "j1")
    stale = _deliver(consumer, "1|beat-b|1000|7|j1", "j1")
    again = _deliver(consumer, "1|beat-a|1000|7|j1", "j1")
    plain = _deliver(consumer, None, "p1")
    unreadable = _deliver(consumer, "nonsense", "u1")
    assert consumer.requested == ["j1", "j1", "p1", "u1"]
    assert (first.acked, stale.acked, again.acked, plain.acked, unreadable.acked) == (
        False,
        True,
        False,
        False,
        False,
    )
    assert "dropped a stale copy of job j1" in caplog.text
    assert f"carries a {CLAIM_HEADER} header that does not read" in caplog.text


def test_an_unreachable_store_runs_the_task_unchecked(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(redis_url, f"redis://127.0.0.1:{free_port()}/0")
    consumer = _Consumer(app)
    StartCheck(consumer).start(consumer)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            _deliver(consumer, f"1|beat-b|1000|7|j{i}", f"j{i}")
    assert consumer.requested == ["j0", "j1", "j2"]
    assert caplog.text.count("such tasks run unchecked") == 1  # once per failing streak


@pytest.mark.slow
def test_a_hung_store_costs_the_consumer_one_wait_per_retry_not_one_per_message(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that stops answering (SIGSTOP) holds the consumer for CHECK_TIMEOUT once; the
    next claimed messages and plain ones run at once, unchecked, until RETRY_AFTER has passed;
    then the store is asked again, and once it answers, stale copies are dropped again."""
    now = [0.0]
    with EmbeddedRedis() as store_server:
        app = make_app(redis_url, store_server.url)
        consumer = _Consumer(app)
        step = StartCheck(consumer)
        step.clock = lambda: now[0]
        step.start(consumer)
        _deliver(consumer, "1|beat-a|1000|7|j0", "j0")  # a first start, while the store answers
        assert store_server.process is not None
        os.kill(store_server.process.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING):
                waited = time.monotonic()
                _deliver(consumer, "1|beat-a|1000|7|j1", "j1")
                first_wait = time.monotonic() - waited
                waited = time.monotonic()
                for i in range(2, 6):
                    _deliver(consumer, f"1|beat-a|1000|7|j{i}", f"j{i}")
                _deliver(consumer, None, "plain")
                later = time.monotonic() - waited
        finally:
            os.kill(store_server.process.pid, signal.SIGCONT)
        assert CHECK_TIMEOUT * 0.9 <= first_wait < CHECK_TIMEOUT * 5
        assert later < CHECK_TIMEOUT * 0.9  # not asked again within RETRY_AFTER
        assert caplog.text.count("such tasks run unchecked") == 1
        now[0] += RETRY_AFTER
        stale = _deliver(consumer, "1|beat-b|1000|7|j0", "j0")  # asked again: the store answers
        assert stale.acked and "checking task starts in Redis works again" in caplog.text
        assert consumer.requested == ["j0", *(f"j{i}" for i in range(1, 6)), "plain"]


@pytest.mark.slow
def test_the_beat_metrics_count_the_copies_dropped(
    app_factory: Callable[..., Any], redis_url: str, dispatchers: Callable[..., Dispatcher]
) -> None:
    app = app_factory()
    store = get_store(app)
    store.start("j", 1, 2, "1|a", TTL_MS)
    for beat in ("b", "c"):
        store.start("j", 1, 2, f"1|{beat}", TTL_MS)
    server = serve_metrics(dispatchers(app), free_port())
    try:
        page = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert value(page, "delayq_stale_starts_dropped", "delayq_stale_starts_dropped_total") == 2


def test_the_check_is_added_to_the_worker_of_the_app_that_has_it_on(app_factory: Callable[..., Any]) -> None:
    from celery_delayq.worker.lateness import DelayQWorker

    class Worker:
        def __init__(self, app: Any) -> None:
            self.app = app

    on, off = app_factory(), app_factory(delayq_start_check=False)
    DelayQWorker(Worker(on))
    DelayQWorker(Worker(off))
    assert StartCheck in on.steps["consumer"]
    assert StartCheck not in off.steps["consumer"]


# -- end to end: a killed worker and a retrying task still run again ---------------------------


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_and_a_retried_task_run_again_under_the_check(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    """Kombu path (every message carries its claim): three ``acks_late`` tasks are running when
    the worker is SIGKILLed; a new worker gets their messages again (``visibility_timeout`` 3 s)
    and runs them: the redelivery carries the same claim. Two tasks fail once and
    ``self.retry(countdown=1)``: the retry carries the same claim and runs."""
    conf: dict[str, Any] = {
        "delayq_push": False,
        # kombu looks for a dead worker's unacked messages every interval x throttle seconds
        "broker_transport_options": {
            "visibility_timeout": 3,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        },
    }
    env = env_for(redis_url, redis_url, conf)
    producer = producers(redis_url, redis_url, **conf)

    @producer.app.task(base=DelayedTask, name="e2e.record_late", acks_late=True, shared=False)
    def record_late(*args: Any, **kwargs: Any) -> None:
        return None

    start_stack(procs, env, beats=1)  # worker 0, beat 1
    warm_up(producer, r, procs)
    late = [
        record_late.apply_in(0, kwargs={"hold": 6}, task_id=f"late-{uuid.uuid4().hex[:8]}-{i}")
        for i in range(3)
    ]
    flaky = [producer.flaky.apply_in(0, kwargs={"fail_times": 1, "countdown": 1}) for _ in range(2)]
    ran = wait_for(
        lambda: (
            all(runs(r).get(res.id) == 1 for res in late) and all(runs(r).get(res.id) == 2 for res in flaky)
        ),
        60,
        0.05,
    )
    assert ran, f"{runs(r)}\n{procs.logs()}"
    # The flaky tasks ack early, but under prefork the ack is sent by the worker's main process
    # once the child says it took the task, which may be after the body ran: killed before
    # that, kombu restores the message and the retry runs again, as with plain Celery. Kill
    # only once kombu holds none of them unacked (its "unacked" hash on the broker, db 0).
    acked = wait_for(lambda: not any(res.id in v for v in r.hvals("unacked") for res in flaky), 30, 0.05)
    assert acked, f"{r.hvals('unacked')}\n{procs.logs()}"
    assert all(any(res.id in v for v in r.hvals("unacked")) for res in late)  # (running: unacked)
    worker = procs.procs[0][0]
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    procs.start("worker", env)
    again = wait_for(lambda: all(runs(r).get(res.id) == 2 for res in late), 60, 0.1)
    assert again, f"{runs(r)}\n{procs.logs()}"
    retries = sorted((s["id"], s["retries"]) for s in starts(r) if s["id"] in {res.id for res in flaky})
    assert retries == sorted((res.id, n) for res in flaky for n in (0, 1))
    records = sum(_records(r).values())
    assert records >= len(late) + len(flaky)  # each was checked (and the warm-up job)
    for i in (0, 2):
        assert "dropped a stale copy" not in log_of(procs, i)
    print(
        f"\nSTART CHECK: 3 acks_late tasks ran again after a worker SIGKILL, 2 retries ran; "
        f"{records} start record(s)"
    )
