"""Operating a beat, in-process: lateness histograms in Redis, heartbeats, the metrics endpoint,
and the worker-side lateness recorder (``celery_delayq.worker.lateness``) driven by Celery's signal."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
import pytest
import redis
from celery import Celery
from celery.signals import task_prerun

from celery_delayq import DelayedTask
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.heartbeat import BEAT_FORGET_MS
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.config import DelayQConfig
from celery_delayq.devtools.embedded import free_port
from celery_delayq.exceptions import ConfigurationError
from celery_delayq.store import lateness
from celery_delayq.store.facade import get_store
from celery_delayq.store.lateness import BOUNDS, LATENESS_FLUSH_EVERY, Histogram
from celery_delayq.worker import lateness as worker
from tests.support.metrics import scrape, value
from tests.support.store import broker_lists, server_ms

HOUR = 3600.0
PUBLISH_KEY = "delayq:lateness:publish"
START_KEY = "delayq:lateness:start"
BEATS_KEY = "delayq:beats"
HEARTBEAT_FIELDS = {
    "token",
    "host",
    "pid",
    "started_ms",
    "seen_ms",
    "passes",
    "published",
    "dead_lettered",
    "errors",
}


def enqueue_due(app: Celery, n: int, late_s: float = 5.0) -> list[str]:
    add = app.tasks["t.add"]
    return [add.apply_at(time.time() - late_s, (i, i), task_id=f"job-{i}").id for i in range(n)]


def claim_now(dispatcher: Dispatcher) -> float:
    """One pass over every shard (what a lost subscription, a wake message or the safety poll
    leads to)."""
    dispatcher.close()
    return dispatcher.run_once()


def published_count(r: redis.Redis) -> int:
    return sum(len(messages) for messages in broker_lists(r).values())


# -- due -> publish lateness ------------------------------------------------------------------


@pytest.mark.parametrize("push", [True, False], ids=["push-path", "kombu-batch"])
def test_every_published_job_is_counted_in_the_publish_histogram(
    app_factory: Callable[..., Celery], r: redis.Redis, dispatchers: Callable[..., Dispatcher], push: bool
) -> None:
    app = app_factory(delayq_push=push, delayq_batch_size=7)
    enqueue_due(app, 40, late_s=5.0)
    app.tasks["t.add"].apply_in(HOUR, (0, 0))  # not due: never counted
    dispatcher = dispatchers(app)
    while dispatcher.run_once() == 0.0:  # full batches: pass again at once
        pass
    assert dispatcher.pushing is push
    assert dispatcher.stats.published == 40 == published_count(r)
    dispatcher.chores(force=True)
    snap = lateness.read(get_store(app), "delayq", "publish")
    assert snap.count == 40 == sum(snap.buckets)
    # due 5 s before the pass: every one lies in the (2.5 s, 5 s] bucket or later ones
    assert snap.quantile(0.0) is not None and snap.quantile(0.0) >= 5_000
    assert snap.sum_ms >= 40 * 4_900
    assert len(r.hgetall(PUBLISH_KEY)) <= len(BOUNDS) + 3
    # the in-process total (the metrics endpoint's) holds the same observations
    seen = dispatcher.lateness_seen.snapshot()
    assert (seen.buckets, seen.count) == (snap.buckets, snap.count)
    assert seen.sum_ms == pytest.approx(snap.sum_ms, abs=0.01)
    assert not dispatcher.lateness.pending


@pytest.mark.slow
def test_the_histogram_is_flushed_at_most_every_two_seconds_even_while_asleep(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    enqueue_due(app, 3)
    dispatcher = dispatchers(app)
    dispatcher.publish_lateness.flushed_at = time.monotonic()  # just flushed: the next flush is 2 s away
    started = time.monotonic()
    dispatcher.run_once()
    assert dispatcher.stats.published == 3
    if time.monotonic() - started < LATENESS_FLUSH_EVERY:
        assert not r.exists(PUBLISH_KEY), "flushed before its interval"
    # the beat sleeps (nothing is due for 20 s): the flush happens within the sleep
    dispatcher.wait(LATENESS_FLUSH_EVERY + 1.5)
    assert lateness.read(get_store(app), "delayq", "publish").count == 3
    # a second batch in the same pass interval is added to the same hash
    enqueue_due(app, 2)
    dispatcher.publish_lateness.flushed_at = time.monotonic() - 10
    claim_now(dispatcher)
    assert lateness.read(get_store(app), "delayq", "publish").count == 5


def test_a_redis_error_while_flushing_keeps_the_counts_and_delivery_goes_on(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    r.set(PUBLISH_KEY, "not a hash")  # every HINCRBY fails with WRONGTYPE
    enqueue_due(app, 4)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    dispatcher.chores(force=True)  # fails: no exception, one warning
    assert dispatcher.lateness.pending["count"] == 4
    add = app.tasks["t.add"]
    for i in range(3):
        add.apply_at(time.time() - 1, (i, 0), task_id=f"more-{i}")
    dispatcher.publish_lateness.flushed_at = time.monotonic() - 10
    claim_now(dispatcher)  # delivery goes on; the flush after the pass fails again
    assert dispatcher.stats.published == 7 == published_count(r)
    assert dispatcher.lateness.pending["count"] == 7
    warnings = [rec for rec in caplog.records if "lateness histogram" in rec.getMessage()]
    assert len(warnings) == 1, "one warning per failing streak"
    r.delete(PUBLISH_KEY)
    dispatcher.chores(force=True)
    assert lateness.read(get_store(app), "delayq", "publish").count == 7
    assert not dispatcher.lateness.pending


def test_stop_flushes_what_is_left(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    enqueue_due(app, 2)
    dispatcher = dispatchers(app)
    dispatcher.publish_lateness.flushed_at = time.monotonic() + 100  # no flush on the pass
    dispatcher.run_once()
    assert not r.exists(PUBLISH_KEY)
    dispatcher.stop()
    assert lateness.read(get_store(app), "delayq", "publish").count == 2


# -- heartbeats ---------------------------------------------------------------------------------


def test_each_pass_keeps_a_heartbeat_with_sane_fields(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    enqueue_due(app, 3)
    dispatcher = dispatchers(app)
    before = server_ms(r)
    dispatcher.run_once()
    raw = r.hget(BEATS_KEY, dispatcher.token)
    assert raw is not None
    entry = json.loads(raw)
    assert set(entry) == HEARTBEAT_FIELDS
    assert entry["token"] == dispatcher.token
    assert entry["host"] == socket.gethostname() and entry["pid"] == os.getpid()
    assert entry["started_ms"] <= entry["seen_ms"]
    assert before - 60_000 <= entry["seen_ms"] <= server_ms(r) + 60_000
    assert (entry["passes"], entry["published"], entry["dead_lettered"], entry["errors"]) == (1, 3, 0, 0)

    # the next heartbeat is 5 s away: passes in between do not write one
    claim_now(dispatcher)
    if time.monotonic() < dispatcher.beat.due_at:
        assert json.loads(r.hget(BEATS_KEY, dispatcher.token) or "{}")["passes"] == 1
    # once it is due, the next pass (or the sleep) writes it
    dispatcher.beat.due_at = 0.0
    dispatcher.stats.errors = 2
    claim_now(dispatcher)
    later = json.loads(r.hget(BEATS_KEY, dispatcher.token) or "{}")
    assert later["passes"] == dispatcher.stats.passes >= 3
    assert later["seen_ms"] >= entry["seen_ms"] and later["errors"] == 2
    assert later["started_ms"] == entry["started_ms"]


@pytest.mark.slow
def test_a_sleeping_beat_still_writes_its_heartbeat(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    first = json.loads(r.hget(BEATS_KEY, dispatcher.token) or "{}")
    dispatcher.beat.due_at = time.monotonic() + 0.5
    dispatcher.wait(2.0)  # nothing due: a 2 s sleep with a heartbeat in it
    assert json.loads(r.hget(BEATS_KEY, dispatcher.token) or "{}")["seen_ms"] > first["seen_ms"]


def test_entries_of_beats_gone_for_ten_minutes_are_pruned(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    now = server_ms(r)

    def entry(token: str, seen: int) -> str:
        return json.dumps(
            {
                "token": token,
                "host": "h",
                "pid": 1,
                "started_ms": seen - 1000,
                "seen_ms": seen,
                "passes": 1,
                "published": 0,
                "dead_lettered": 0,
                "errors": 0,
            }
        )

    r.hset(
        BEATS_KEY,
        mapping={
            "old": entry("old", now - BEAT_FORGET_MS - 60_000),
            "recent": entry("recent", now - BEAT_FORGET_MS + 60_000),
            "garbage": "{not json",
        },
    )
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert sorted(r.hkeys(BEATS_KEY)) == sorted(["recent", dispatcher.token])
    # the next look is a minute away; a beat that went quiet meanwhile stays until then
    r.hset(BEATS_KEY, "old2", entry("old2", now - BEAT_FORGET_MS - 1))
    dispatcher.beat.due_at = 0.0
    dispatcher.run_once()
    assert r.hexists(BEATS_KEY, "old2")
    dispatcher.beat.due_at = dispatcher.beat.prune_at = 0.0
    dispatcher.run_once()
    assert not r.hexists(BEATS_KEY, "old2")


def test_stop_removes_the_beats_own_entry_only(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    one, two = dispatchers(app), dispatchers(app)
    one.run_once()
    two.run_once()
    assert sorted(r.hkeys(BEATS_KEY)) == sorted([one.token, two.token])
    one.stop()
    assert r.hkeys(BEATS_KEY) == [two.token]
    one.close()  # a Redis error in a tick closes the subscription: the entry stays
    two.close()
    assert r.hkeys(BEATS_KEY) == [two.token]


def test_a_heartbeat_error_does_not_break_the_pass(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    r.set(BEATS_KEY, "not a hash")
    enqueue_due(app, 2)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.stats.published == 2
    r.delete(BEATS_KEY)
    dispatcher.beat.due_at = 0.0
    dispatcher.run_once()
    assert r.hexists(BEATS_KEY, dispatcher.token)


# -- the metrics endpoint -----------------------------------------------------------------------


@pytest.mark.slow
def test_metrics_endpoint_serves_counters_gauges_and_histograms(
    app_factory: Callable[..., Celery], r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    port = free_port()
    app = app_factory(delayq_metrics_port=port)
    assert "other.task" not in app.tasks
    enqueue_due(app, 12, late_s=3.0)
    add = app.tasks["t.add"]
    for i in range(5):
        add.apply_in(HOUR, (i, i), task_id=f"later-{i}")
    producer = app_factory()

    @producer.task(base=DelayedTask, name="other.task", shared=False)
    def other() -> None:
        return None

    other.apply_at(time.time() - 1)  # a task the beat does not know: dead-lettered
    # the workers' histogram, as they would have written it
    workers = Histogram()
    for ms in (3, 40, 40, 900):
        workers.observe(ms)
    workers.flush(get_store(app), START_KEY)

    dispatcher = dispatchers(app)
    server = serve_metrics(dispatcher)
    assert server.port == port
    url = f"http://127.0.0.1:{port}/metrics"
    dispatcher.run_once()
    page = scrape(url)

    assert value(page, "delayq_dispatched", "delayq_dispatched_total") == 12 == dispatcher.stats.published
    assert value(page, "delayq_claimed", "delayq_claimed_total") == 13
    assert value(page, "delayq_dead_lettered", "delayq_dead_lettered_total") == 1
    assert value(page, "delayq_publish_errors", "delayq_publish_errors_total") == 0
    assert value(page, "delayq_stale_acks", "delayq_stale_acks_total") == 0
    assert value(page, "delayq_passes", "delayq_passes_total") == 1
    assert value(page, "delayq_schedules_repaired", "delayq_schedules_repaired_total") == 0
    zcard = sum(int(r.zcard(shard.due)) for shard in get_store(app).keys.all_shards())
    assert value(page, "delayq_pending_jobs") == zcard == 5
    assert value(page, "delayq_leased_jobs") == 0
    assert value(page, "delayq_overdue_jobs") == 0
    assert value(page, "delayq_dead_jobs") == 1
    assert value(page, "delayq_store_up") == 1

    publish = "delayq_publish_lateness_seconds"
    assert value(page, publish, publish + "_count") == 12
    assert value(page, publish, publish + "_bucket", le="2.5") == 0  # all 3 s late or more
    assert value(page, publish, publish + "_bucket", le="+Inf") == 12
    assert value(page, publish, publish + "_sum") >= 12 * 2.9
    start = "delayq_start_lateness_seconds"
    assert value(page, start, start + "_count") == 4
    assert value(page, start, start + "_bucket", le="0.005") == 1
    assert value(page, start, start + "_bucket", le="0.05") == 3
    assert value(page, start, start + "_bucket", le="1") == 4
    assert abs(value(page, start, start + "_sum") - 0.983) < 1e-6
    claims = "delayq_claim_batch_size"
    assert value(page, claims, claims + "_sum") == 13
    assert value(page, claims, claims + "_bucket", le="+Inf") == value(page, claims, claims + "_count") >= 1
    info = page["delayq_beat_info"]
    ((_, labels),) = info
    assert dict(labels)["token"] == dispatcher.token

    # the store's sizes are read at most every 5 s: a later scrape within that reuses them
    enqueue_due(app, 1, late_s=-HOUR)  # one more waiting job (job-0 again, due in an hour)
    server.collector.read_every = 0.0
    assert value(scrape(url), "delayq_pending_jobs") == 6

    # nothing of this in the process-wide default registry
    assert prometheus_client.REGISTRY.get_sample_value("delayq_dispatched_total") is None
    server.stop()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.slow
def test_metrics_keep_answering_when_the_store_cannot_be_read(
    app_factory: Callable[..., Celery],
    dispatchers: Callable[..., Dispatcher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = app_factory()
    dispatcher = dispatchers(app)
    server = serve_metrics(dispatcher, free_port())
    dispatcher.run_once()

    def broken(*args: Any) -> Any:
        raise redis.ConnectionError("gone")

    monkeypatch.setattr(dispatcher.store, "overview", broken)  # what a scrape reads the store with
    try:
        page = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert value(page, "delayq_store_up") == 0
    assert "delayq_pending_jobs" not in page
    assert value(page, "delayq_passes", "delayq_passes_total") == 1


@pytest.mark.slow
def test_two_dispatchers_serve_their_own_registries(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    one, two = dispatchers(app), dispatchers(app)
    server_one, server_two = serve_metrics(one, free_port()), serve_metrics(two, free_port())
    try:
        one.stats.published = 7
        assert (
            value(
                scrape(f"http://127.0.0.1:{server_one.port}/metrics"),
                "delayq_dispatched",
                "delayq_dispatched_total",
            )
            == 7
        )
        assert (
            value(
                scrape(f"http://127.0.0.1:{server_two.port}/metrics"),
                "delayq_dispatched",
                "delayq_dispatched_total",
            )
            == 0
        )
    finally:
        server_one.stop()
        server_two.stop()


def test_metrics_settings_are_validated() -> None:
    def config(**conf: Any) -> DelayQConfig:
        return DelayQConfig.from_mapping({"delayq_url": "redis://127.0.0.1:6390/0", **conf})

    assert config().metrics_port is None and config().metrics_addr == "127.0.0.1"
    assert config(delayq_metrics_port="9808").metrics_port == 9808
    assert config(delayq_metrics_port=65535, delayq_metrics_addr="0.0.0.0").metrics_addr == "0.0.0.0"
    for bad in (0, -1, 65536, "http", 9808.5, True):
        with pytest.raises(ConfigurationError, match="delayq_metrics_port"):
            config(delayq_metrics_port=bad)
    for bad_addr in ("", "a b", None, 127):
        with pytest.raises(ConfigurationError, match="delayq_metrics_addr"):
            config(delayq_metrics_addr=bad_addr)
    assert config(delayq_record_lateness="yes").record_lateness is True
    with pytest.raises(ConfigurationError, match="delayq_record_lateness"):
        config(delayq_record_lateness="sometimes")


# -- the worker-side recorder -------------------------------------------------------------------


@pytest.fixture
def recorder(app: Celery) -> Iterator[worker.LatenessRecorder]:
    rec = worker.install(app)
    yield rec
    worker.uninstall(app)


def run_prerun(task: Any, **request: Any) -> None:
    """What the worker does before a task runs: push its request, send ``task_prerun``."""
    task.push_request(id="x", **request)
    try:
        task_prerun.send(sender=task, task_id="x", task=task, args=(), kwargs={})
    finally:
        task.pop_request()


def test_the_prerun_receiver_records_delayq_messages_only(
    app: Celery, r: redis.Redis, recorder: worker.LatenessRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker, "FLUSH_EVERY", 3600.0)  # only the flush() below writes
    task = app.tasks["t.add"]
    assert worker.install(app) is recorder
    run_prerun(task, delayq_due=(time.time() - 0.15) * 1000)  # 150 ms late: the (100, 250] bucket
    run_prerun(task, delayq_due=(time.time() + 5) * 1000)  # "early" (clock skew): counts as 0
    run_prerun(task, delayq_due=str((time.time() - 3) * 1000))  # a header that came back as text
    run_prerun(task)  # a plain Celery message: no header
    # a broker ETA retry
    run_prerun(task, delayq_due=(time.time() - 0.2) * 1000, eta="2026-01-01T00:00:00+00:00")
    run_prerun(task, delayq_due="not a time")
    assert recorder.flush() == 3
    snap = lateness.read(get_store(app), "delayq", "start")
    assert snap.count == 3
    assert snap.buckets[0] == 1  # the early one
    assert snap.quantile(0.5) == 250.0 and snap.quantile(1.0) == 5_000.0


@pytest.mark.slow
def test_the_flusher_thread_writes_within_seconds(
    app: Celery, r: redis.Redis, recorder: worker.LatenessRecorder
) -> None:
    task = app.tasks["t.add"]
    for _ in range(5):
        run_prerun(task, delayq_due=(time.time() - 0.01) * 1000)
    deadline = time.monotonic() + 15
    while lateness.read(get_store(app), "delayq", "start").count < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lateness.read(get_store(app), "delayq", "start").count == 5


def test_the_setting_installs_the_recorder_when_the_worker_is_built(
    app_factory: Callable[..., Celery],
) -> None:
    class FakeWorker:
        def __init__(self, app: Celery) -> None:
            self.app = app

    off, on = app_factory(), app_factory(delayq_record_lateness="true")
    try:
        worker.DelayQWorker(FakeWorker(off))
        assert worker.recorder_for(off) is None
        worker.DelayQWorker(FakeWorker(on))
        assert worker.recorder_for(on) is not None
        assert task_prerun.has_listeners()
    finally:
        worker.uninstall(on)
    assert worker.recorder_for(on) is None


# -- the beat (Scheduler) -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_beat_serves_metrics_and_removes_its_heartbeat_at_close(
    app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    from celery_delayq import Scheduler

    port = free_port()
    app = app_factory(delayq_metrics_port=str(port), delayq_max_sleep=0.5)  # a short tick
    enqueue_due(app, 3)
    beat = Scheduler(app)
    try:
        assert beat.dispatcher is not None and beat.metrics is not None
        beat.tick()
        page = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(page, "delayq_dispatched", "delayq_dispatched_total") == 3
        assert r.hexists(BEATS_KEY, beat.dispatcher.token)
    finally:
        beat.close()
    assert not r.exists(BEATS_KEY)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


@pytest.mark.slow
def test_a_beat_whose_metrics_port_is_taken_delivers_anyway(
    app_factory: Callable[..., Celery], r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_delayq import Scheduler

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = app_factory(delayq_metrics_port=port, delayq_max_sleep=0.5)
        enqueue_due(app, 2)
        beat = Scheduler(app)
        try:
            assert beat.dispatcher is not None and beat.metrics is None
            assert any("cannot serve metrics" in rec.getMessage() for rec in caplog.records)
            beat.tick()
            assert beat.dispatcher.stats.published == 2 == published_count(r)
        finally:
            beat.close()


def test_a_heartbeat_never_goes_back_when_the_clock_estimate_steps_back(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The beat's estimate of the server's clock is re-measured at each claim and may step back
    by a millisecond or more; the seen_ms it writes does not (CI saw later < earlier by 1 ms)."""
    wall = [time.time()]
    dispatcher = dispatchers(app, wall=lambda: wall[0])
    first = dispatcher.heartbeat()["seen_ms"]
    wall[0] -= 5.0  # the next estimate says the server is 5 s behind the last one
    assert dispatcher.heartbeat()["seen_ms"] >= first
