"""What the beat's lateness counts (issue 52): a job flow control held back counts in the due ->
publish lateness from when it was let go, and the time it was held back is its own figure
(``<prefix>:lateness:gated``, ``delayq_gated_seconds``); and a beat that falls behind says so
(``delayq_behind_warning``, ``delayq_behind_seconds``). :class:`Dispatcher` passes in-process
against real Redis.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.devtools.embedded import free_port
from celery_delayq.flow.gate import GATE_HEADER, Gate, batch_key, gated_id, member_id, parse_rate
from celery_delayq.store import lateness
from celery_delayq.store.facade import get_store
from tests.support.cli import invoke
from tests.support.flow import parked_completion
from tests.support.metrics import scrape, value
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import STARTUP, Producer, env_for, log_of, producers, runs, start_stack, warm_up
from tests.support.store import broker_lists, published_ids, server_ms

__all__ = ["producers"]  # a fixture, used by name

AppFactory = Callable[..., Celery]
Page = dict[str, Any]
Dispatchers = Callable[..., Dispatcher]


def scraped(dispatcher: Dispatcher) -> Page:
    """The beat's /metrics page (:func:`serve_metrics`), read once."""
    server = serve_metrics(dispatcher, free_port())
    try:
        return scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()


#: How old the batch is made when its last member ends (its completion job's due time).
BATCH_AGE_MS = 45_000


@pytest.mark.slow
@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_a_completion_job_counts_from_when_its_batch_finished(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers, push: bool
) -> None:
    app = app_factory(delayq_push=push)
    bid = "late-1"
    store = get_store(app)
    done_id = parked_completion(app, bid, 2, 7)
    # made BATCH_AGE_MS old: its parked lease entry (<due ms>|<tries>|gate) says it was due then
    created = server_ms(r) - BATCH_AGE_MS
    r.hset(store.keys.for_job(done_id).leases, done_id, f"{created}|0|gate")
    members = [member_id(bid, i) for i in range(2)]
    add = app.tasks["t.add"]
    gate = Gate(batch_key(bid), batch=bid)
    for i, job_id in enumerate(members):
        add.apply_at(time.time() - 1, (i, i), task_id=job_id, headers={GATE_HEADER: gate.header()})
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert sorted(published_ids(r)) == sorted(members)
    for job_id in members:
        store.release(job_id, batch_key(bid), "succeeded", bid)
    finished = store.batch_state(bid)
    assert finished is not None and finished.finished_ms is not None
    assert finished.finished_ms - created >= BATCH_AGE_MS
    dispatcher.wait(5)
    dispatcher.run_once()
    message = broker_lists(r)["celery"][-1]
    assert message["headers"]["id"] == done_id
    # its message is due when its batch finished (the worker's due -> start counts from there)
    assert message["headers"]["delayq_due"] == finished.finished_ms

    publish = dispatcher.lateness_seen.snapshot()
    assert publish.count == 3  # the members (released at once: never held back) and the completion job
    assert publish.quantile(1.0) is not None and publish.quantile(1.0) < BATCH_AGE_MS  # type: ignore[operator]
    gated = dispatcher.gated_seen.snapshot()
    assert gated.count == 1  # the completion job
    assert gated.quantile(1.0) == 60_000  # held back 45 s: the bucket up to 60 s

    dispatcher.chores(force=True)  # flushed to Redis: what status and the dashboard read
    in_redis = lateness.read(store, store.config.prefix, "publish")
    assert in_redis.count == 3 and in_redis.buckets[-3:] == (0, 0, 0)  # none over 30 s
    assert lateness.read(store, store.config.prefix, "gated").quantile(1.0) == 60_000
    printed = invoke(app, "status", "--window", "0")
    assert printed.exit_code == 0, printed.output
    held_line = next(line for line in printed.output.splitlines() if "held back" in line)
    assert "p99 ≤ 60 s" in held_line and "(1 jobs)" in held_line

    page = scraped(dispatcher)
    assert value(page, "delayq_gated_seconds", "delayq_gated_seconds_count") == 1
    assert value(page, "delayq_gated_seconds", "delayq_gated_seconds_bucket", le="30") == 0
    family = "delayq_publish_lateness_seconds"
    assert value(page, family, f"{family}_bucket", le="30") == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("push", "let_go"), [(True, "slot"), (False, "slot"), (True, "resume"), (False, "rate")]
)
def test_a_parked_capped_job_counts_from_its_release(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers, push: bool, let_go: str
) -> None:
    """Parked for its key's one slot, then let go by the slot's release (``slot``), or by the
    key's resume after a pause (``resume``); or deferred by its key's rate, let go at its
    booked time (``rate``)."""
    app = app_factory(delayq_push=push)
    store = get_store(app)
    gate = Gate("tenant:late", limit=1, priority=7)
    if let_go == "rate":
        gate = Gate("tenant:rate", rate=parse_rate("1/s"))
    add = app.tasks["t.add"]
    first, second = (
        add.apply_at(
            time.time() - 1, (i, i), task_id=gated_id(gate.key, None), headers={GATE_HEADER: gate.header()}
        ).id
        for i in range(2)
    )
    dispatcher = dispatchers(app)
    dispatcher.run_once()  # the first takes the key's one slot (or its rate), the second waits
    assert published_ids(r) == [first] and store.get(second).state == "gated"  # type: ignore[union-attr]
    # made BATCH_AGE_MS old while parked: its lease entry (<due ms>|<tries>|gate) says so
    leases = store.keys.for_job(second).leases
    tries = str(r.hget(leases, second)).split("|")[1]
    due = server_ms(r) - BATCH_AGE_MS
    r.hset(leases, second, f"{due}|{tries}|gate")
    if let_go == "resume":
        store.pause(gate.key)
    if let_go != "rate":
        store.release(first, gate.key, "succeeded", "")  # its worker ended: the second is promoted
    if let_go == "resume":  # (not while its key is paused: at the resume)
        dispatcher.run_once()
        assert published_ids(r) == [first]
        store.resume(gate.key)
    dispatcher.wait(5)  # until it is due again (promoted, or its booked time)
    dispatcher.run_once()
    released = server_ms(r)  # (after its release)
    assert published_ids(r) == [first, second]
    message = broker_lists(r)["celery"][-1]
    assert message["headers"]["delayq_due"] == due  # its message keeps its due time

    publish = dispatcher.lateness_seen.snapshot()
    assert publish.count == 2  # the first (never held back) and the second, from its release
    assert publish.quantile(1.0) is not None and publish.quantile(1.0) < BATCH_AGE_MS  # type: ignore[operator]
    gated = dispatcher.gated_seen.snapshot()
    assert gated.count == 1 and gated.quantile(1.0) == 60_000  # held back 45 s
    assert BATCH_AGE_MS <= gated.sum_ms <= released - due  # due -> release, its priority added back


@pytest.mark.slow
def test_a_beat_given_more_due_work_than_it_publishes_in_time_says_it_is_behind(
    app_factory: AppFactory, dispatchers: Dispatchers, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_factory(delayq_behind_warning=0.5, delayq_batch_size=5, delayq_shards=1)
    add = app.tasks["t.add"]
    # due work older than the threshold: a beat that could not publish it in time (paused,
    # or given more than it publishes a second)
    for i in range(12):
        add.apply_at(time.time() - 2, (i, i))
    dispatcher = dispatchers(app)
    with caplog.at_level(logging.INFO, logger="celery_delayq.beat.behind"):
        for _ in range(3):  # three passes of one shard, 5, 5 and 2 jobs: one streak, one warning
            dispatcher.run_once()
        assert dispatcher.behind_seconds > 0.5
        behind = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(behind) == 1
        text = behind[0].getMessage()
        assert "this beat is behind" in text and "delayq_behind_warning = 0.5 s" in text
        assert "another beat on the same store shares the load" in text
        page = scraped(dispatcher)
        assert value(page, "delayq_behind_seconds") > 0.5
        # caught up: nothing due now; then new work published at once ends the streak
        add.apply_at(time.time(), (0, 0))
        dispatcher.wait(2)  # until the wake message of the new job
        dispatcher.run_once()
        assert dispatcher.behind_seconds < 0.25
        assert any("caught up" in rec.getMessage() for rec in caplog.records)
        assert not dispatcher.behind.warned


def test_an_idle_beat_does_not_say_it_is_behind(
    app_factory: AppFactory, dispatchers: Dispatchers, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_factory(delayq_behind_warning=0.5)
    add = app.tasks["t.add"]
    dispatcher = dispatchers(app)
    with caplog.at_level(logging.INFO, logger="celery_delayq.beat.behind"):
        dispatcher.run_once()  # nothing due
        add.apply_at(time.time(), (1, 1))  # due now: published at once
        dispatcher.wait(2)  # until its wake message
        dispatcher.run_once()
    assert dispatcher.stats.published == 1
    assert dispatcher.behind_seconds < 0.5
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    page = scraped(dispatcher)
    assert value(page, "delayq_behind_seconds") < 0.5


@pytest.mark.e2e
@pytest.mark.slow
def test_a_real_beat_paused_past_the_threshold_says_it_is_behind_once(
    procs: Procs, redis_url: str, r: redis.Redis, producers: Callable[..., Producer]
) -> None:
    """A real ``celery beat`` (and worker): idle, it says nothing; stopped (SIGSTOP) while jobs
    fall due, then continued, it publishes them late by more than ``delayq_behind_warning``
    and logs it once."""
    producer = producers(redis_url, redis_url)
    start_stack(procs, env_for(redis_url, redis_url, {"delayq_behind_warning": 1.0}))
    warm_up(producer, r, procs)
    beat = procs.procs[1][0]
    assert "this beat is behind" not in log_of(procs, 1)  # idle, and one job published at once
    os.kill(beat.pid, signal.SIGSTOP)
    try:
        jobs = [producer.record.apply_in(0).id for _ in range(10)]
        time.sleep(2.5)  # the jobs wait more than the threshold: the beat cannot publish them
    finally:
        os.kill(beat.pid, signal.SIGCONT)
    assert wait_for(lambda: all(j in runs(r) for j in jobs), STARTUP, 0.1), procs.logs()
    said = [line for line in log_of(procs, 1).splitlines() if "this beat is behind" in line]
    assert len(said) == 1, procs.logs()
    assert "(delayq_behind_warning = 1 s)" in said[0] and "another beat on the same store" in said[0]
