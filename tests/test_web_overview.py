"""The overview page and ``/api/status`` over real HTTP: the lateness histograms of the last hour
(the per-minute record of :mod:`celery_delayq.store.lateness`) beside the all-time ones, the beats
with their last heartbeat, the oldest overdue job, pending jobs by shard, the dead letters and
the charts."""

from __future__ import annotations

import re
from collections.abc import Callable

import redis
from celery import Celery

from celery_delayq.admin.status import lateness_view, lateness_window_view
from celery_delayq.due import ms_to_datetime
from celery_delayq.store import lateness
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.lateness import Histogram, PublishLateness, key_for, minute_key, tally
from celery_delayq.worker.lateness import LatenessRecorder
from tests.support.store import bury
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

MINUTE = lateness.MINUTE_MS


def now_minute(store: Store) -> int:
    return store.server_now_ms() // MINUTE


def test_a_flushed_observation_shows_in_the_last_hour_and_in_all_time(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    store = get_store(app)
    histogram = Histogram()
    for ms in (3, 3, 700):
        histogram.observe(ms)
    assert histogram.flush(store, key_for("delayq", "publish")) == 3

    window = lateness_window_view(store, "publish")
    assert (window["count"], window["p50_ms"], window["p99_ms"]) == (3, 5.0, 1000.0)
    assert [b["count"] for b in window["buckets"] if b["count"]] == [2, 1]
    assert lateness_window_view(store, "start")["count"] == 0

    served = dashboard().get("/api/status").json()
    assert served["lateness_last_hour"]["publish"] == window
    assert served["lateness"]["publish"]["count"] == 3  # the all-time histogram, as the CLI prints it
    assert served["lateness_last_hour"]["start"]["count"] == 0


def test_the_beats_and_the_workers_flush_into_the_minute_too(app: Celery) -> None:
    """Both recorders (the beat's :class:`PublishLateness`, the worker's
    :class:`LatenessRecorder`) flush through ``Store.add_lateness``: the last hour sees them."""
    store = get_store(app)
    beat = PublishLateness(store, "delayq")
    beat.record([2, 2, 900])
    beat.flush(force=True)
    worker = LatenessRecorder(app)
    worker.histogram.observe(12)
    assert worker.flush() == 1
    assert lateness_window_view(store, "publish")["count"] == 3
    assert lateness_window_view(store, "start")["count"] == 1
    assert lateness_window_view(store, "start") == lateness_view(lateness.read(store, "delayq", "start"))


def test_a_minute_older_than_the_hour_is_not_in_it_and_its_hash_expires(app: Celery, redis_url: str) -> None:
    store = get_store(app)
    key = key_for("delayq", "start")
    minute = now_minute(store)
    store.add_lateness(key, tally([70]), minute=minute - 59)  # the window's first minute
    store.add_lateness(key, tally([4, 4]), minute=minute - 60)  # one minute before it

    window = lateness_window_view(store, "start")
    assert (window["count"], window["p99_ms"]) == (1, 100.0)
    assert store.lateness_fields(key)["count"] == "3"  # all time keeps both

    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # kept until an hour after its minute ends, so at most this minute's and 60 before it exist
        ttl = raw.pttl(minute_key(key, minute - 60))
        assert 0 < ttl <= MINUTE
        assert MINUTE < raw.pttl(minute_key(key, minute - 59)) <= 2 * MINUTE
        store.add_lateness(key, tally([4]), minute=minute - 62)  # past its hour: no hash written
        assert not raw.exists(minute_key(key, minute - 62))
        assert store.lateness_fields(key)["count"] == "4"
    finally:
        raw.close()


def test_the_minute_hashes_stay_bounded(app: Celery, redis_url: str) -> None:
    store = get_store(app)
    key = key_for("delayq", "publish")
    minute = now_minute(store)
    for back in range(80):
        store.add_lateness(key, tally([1]), minute=minute - back)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        kept = list(raw.scan_iter(match=f"{key}:m:*", count=1000))
    finally:
        raw.close()
    assert len(kept) == lateness.WINDOW_MINUTES + 1
    assert lateness_window_view(store, "publish")["count"] == lateness.WINDOW_MINUTES
    assert lateness_window_view(store, "publish", minutes=5)["count"] == 5


def text_of(page: str, element_id: str, lines: int = 1) -> str:
    """The markup from the tag with ``id="element_id"`` to the end of its ``lines``-th line."""
    found = re.search(rf'id="{re.escape(element_id)}"(.*\n){{{lines - 1}}}.*', page)
    assert found, f"no #{element_id} in the page"
    return found.group(0)


def flat(markup: str) -> str:
    """``markup`` with every run of whitespace one space."""
    return " ".join(markup.split())


def test_the_overview_shows_beats_overdue_shards_dead_and_charts(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    store = get_store(app)
    add = app.tasks["t.add"]
    now_s = store.server_now_ms() / 1000
    # Buried first: bury claims every due job of the dead one's shard (as a beat does), and
    # would lease an overdue job stored before it in the same shard.
    dead = add.apply_at(now_s - 1, args=(3, 3)).id
    bury(app, dead)
    overdue = add.apply_at(now_s - 330, args=(1, 1)).id
    second = add.apply_at(now_s - 120, args=(2, 2)).id
    later = [add.apply_in(600 + i, args=(i, i)).id for i in range(5)]
    seen_ms = store.server_now_ms() - 4_000
    store.write_heartbeat(
        "beat-1",
        {"token": "beat-1", "host": "box-7", "pid": 4242, "started_ms": seen_ms - 60_000,
         "seen_ms": seen_ms, "passes": 12, "published": 34, "dead_lettered": 1, "errors": 0},
        read_all=False,
    )  # fmt: skip
    store.write_heartbeat("beat-old", {"token": "beat-old", "seen_ms": seen_ms - 600_000}, read_all=False)
    store.add_lateness(key_for("delayq", "publish"), tally([3, 30]))

    page = dashboard().get("/").text

    assert ">1<" in text_of(page, "beats-alive")
    row = re.search(r'<tr data-beat="beat-1">.*?</tr>', page, re.S)
    assert row, page
    seen_text = ms_to_datetime(seen_ms).astimezone(app.timezone).strftime("%Y-%m-%d %H:%M:%S")
    assert "alive" in row.group(0) and "box-7" in row.group(0) and seen_text in row.group(0)
    old = re.search(r'<tr data-beat="beat-old">.*?</tr>', page, re.S)
    assert old and "stale" in old.group(0)

    oldest = text_of(page, "oldest-overdue", lines=2)
    assert overdue in oldest and "5m" in oldest and "ago" in oldest
    assert ">2<" in text_of(page, "total-overdue")
    assert ">7<" in text_of(page, "total-waiting")
    assert f">{1}</a>" in text_of(page, "total-dead")

    shards = re.search(r'<table id="shards">.*?</table>', page, re.S)
    assert shards
    cell = r'<td class="num">([\d,]+)</td>'
    rows = re.findall(r"<tr>" + cell * 6, shards.group(0))
    by_shard = {int(s): (int(waiting), int(dead)) for s, waiting, _leased, _running, _gated, dead in rows}
    expected: dict[int, tuple[int, int]] = {}
    for job_id, is_dead in ((overdue, 0), (second, 0), *((j, 0) for j in later), (dead, 1)):
        waiting, buried = expected.get(store.keys.shard_of(job_id), (0, 0))
        expected[store.keys.shard_of(job_id)] = (waiting + 1 - is_dead, buried + is_dead)
    assert by_shard == expected

    for chart in ("chart-hour", "chart-day", "lateness-publish", "lateness-start"):
        figure = re.search(rf'<figure id="{chart}">.*?</figure>', page, re.S)
        assert figure and "<svg" in figure.group(0), chart
        bars = {"chart-hour": 60, "chart-day": 24}.get(chart, len(lateness.BOUNDS) + 1)
        assert figure.group(0).count('<rect class="bar"') == bars, chart
    publish = re.search(r'<figure id="lateness-publish">.*?</figure>', page, re.S)
    assert publish
    caption = flat(publish.group(0))
    assert "last hour: p50 ≤ 5ms, p99 ≤ 50ms, 2 jobs" in caption
    assert "All time: p50 ≤ 5ms, p99 ≤ 50ms, 2 jobs" in caption
    assert "≤5ms: 1</title>" in publish.group(0) and "≤50ms: 1</title>" in publish.group(0)
    start = re.search(r'<figure id="lateness-start">.*?</figure>', page, re.S)
    assert start and "none recorded" in start.group(0)


def test_the_overview_says_when_the_hour_saw_nothing_but_all_time_did(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    store = get_store(app)
    store.add_lateness(key_for("delayq", "publish"), tally([7]), minute=now_minute(store) - 60)
    page = dashboard().get("/").text
    publish = re.search(r'<figure id="lateness-publish">.*?</figure>', page, re.S)
    assert publish
    assert "last hour: none recorded" in flat(publish.group(0))
    assert "All time: p50 ≤ 10ms, p99 ≤ 10ms, 1 job" in flat(publish.group(0))
