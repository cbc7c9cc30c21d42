"""Uniqueness windows (issue 28, part 2): ``apply_at(..., task_id=..., unique_for=...)`` keeps
an id taken for that long after its job was stored, even after it was delivered, on the Redis
server's clock (``lua/enqueue.lua`` in mode ``unique:<ms>``, the shard's ``unique`` record).

Against a real Redis, with a real :class:`Dispatcher` delivering; the worker and beat processes
are in tests/test_unique_e2e.py.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ, StoreFull
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import InvalidOptions, InvalidTaskId
from celery_delayq.store.facade import get_store
from celery_delayq.store.jobs import EnqueueOutcome
from celery_delayq.store.scripts import SCRIPTS
from tests.support.apps import make_app, race_producers
from tests.support.store import make_full, published_ids, server_ms, snapshot

LATER = datetime(2031, 1, 1, tzinfo=UTC)


def _add(x: int, y: int) -> int:  # pragma: no cover - never runs here
    return x + y


def unique_record(app: Celery, job_id: str) -> str:
    store = get_store(app)
    return store.keys.shard(store.keys.shard_of(job_id)).unique


def deliver(app: Celery, dispatchers: Callable[..., Dispatcher]) -> None:
    """Publish every due job, as a beat does."""
    dispatchers(app).run_once()


def test_an_id_stays_taken_after_its_job_was_delivered(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    first = add.apply_at(time.time() - 1, (1, 2), task_id="invoice-42", unique_for=3600)
    assert (first.outcome, first.created) == ("new", True)
    # stored: a second call keeps it (its due time, not the new one's)
    again = add.apply_at(LATER, (3, 4), task_id="invoice-42", unique_for=3600)
    assert (again.outcome, again.created, again.due) == ("kept", False, first.due)
    deliver(app, dispatchers)
    assert published_ids(r) == ["invoice-42"]
    assert get_store(app).get("invoice-42") is None
    # delivered: the id is still taken; nothing is stored, nothing published again
    late = add.apply_at(time.time() - 1, (5, 6), task_id="invoice-42", unique_for=3600)
    assert (late.outcome, late.created, late.due) == ("taken", False, None)
    assert get_store(app).get("invoice-42") is None
    deliver(app, dispatchers)
    assert published_ids(r) == ["invoice-42"]
    # the window's end is on the server's clock: an hour from the first store
    end = r.zscore(unique_record(app, "invoice-42"), "invoice-42")
    assert end is not None and abs(end - (server_ms(r) + 3_600_000)) < 60_000


def test_apply_in_and_a_timedelta_take_the_window_too(app: Celery) -> None:
    add = app.tasks["t.add"]
    first = add.apply_in(600, (1, 2), task_id="remind-7", unique_for=timedelta(days=2))
    second = add.apply_in(5, (1, 2), task_id="remind-7", unique_for=timedelta(days=2))
    assert (first.outcome, second.outcome) == ("new", "kept")
    assert second.due == first.due  # kept: not moved to 5 s from now


@pytest.mark.slow
def test_a_window_that_ended_frees_the_id(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    assert add.apply_at(time.time() - 1, (1, 2), task_id="w1", unique_for=0.4).outcome == "new"
    deliver(app, dispatchers)
    assert add.apply_at(time.time() - 1, (1, 2), task_id="w1", unique_for=0.4).outcome == "taken"
    time.sleep(0.5)
    again = add.apply_at(time.time() - 1, (1, 2), task_id="w1", unique_for=0.4)
    assert again.outcome == "new"
    # the ended window was removed by that call, and the new one written
    assert r.zcard(unique_record(app, "w1")) == 1


def test_a_cancelled_job_s_id_stays_taken(app: Celery) -> None:
    add = app.tasks["t.add"]
    res = add.apply_at(LATER, (1, 2), task_id="c1", unique_for=60)
    assert res.cancel()
    assert add.apply_at(LATER, (1, 2), task_id="c1", unique_for=60).outcome == "taken"
    # without unique_for the id is free as before
    assert add.apply_at(LATER, (1, 2), task_id="c1").created


def test_a_job_a_beat_holds_is_kept_with_its_due_time(app: Celery) -> None:
    add = app.tasks["t.add"]
    due = time.time() - 1
    first = add.apply_at(due, (1, 2), task_id="held-1", unique_for=60)
    store = get_store(app)
    [claimed] = store.claim([store.keys.shard_of("held-1")], "beat-test", batch=10)
    assert [job.id for job in claimed.jobs] == ["held-1"]
    again = add.apply_at(LATER, (1, 2), task_id="held-1", unique_for=60)
    assert (again.outcome, again.due) == ("kept", first.due)  # its due, not its lease's expiry
    record = store.get("held-1")
    assert record is not None and record.state == "leased"


def test_an_id_stored_without_a_window_is_kept_and_gets_none(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    add.apply_at(LATER, (1, 2), task_id="plain-1")
    assert add.apply_at(LATER, (1, 2), task_id="plain-1", unique_for=60).outcome == "kept"
    assert r.zscore(unique_record(app, "plain-1"), "plain-1") is None


def test_apply_at_many_takes_each_item_s_id_and_a_window_for_all(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    now = time.time() - 1
    items = [(now, (i, i), None, f"m-{i}") for i in range(5)]
    first = add.apply_at_many(items, unique_for=600)
    assert [res.id for res in first] == [f"m-{i}" for i in range(5)]
    assert {res.outcome for res in first} == {"new"}
    deliver(app, dispatchers)
    assert sorted(published_ids(r)) == [f"m-{i}" for i in range(5)]
    more = [*items, (LATER, (9, 9), None, "m-9")]
    second = add.apply_at_many(more, unique_for=600)
    assert [res.outcome for res in second] == ["taken"] * 5 + ["new"]
    assert [res.due for res in second[:5]] == [None] * 5
    # without a window: ids of the items where given, generated where None, kept while waiting
    mixed = add.apply_at_many(
        [(LATER, (1, 1), None, "m-9"), (LATER, (1, 1), None, None), (LATER, (1, 1), None)]
    )
    assert mixed[0].id == "m-9" and not mixed[0].created
    assert mixed[1].created and mixed[2].created and len({mixed[1].id, mixed[2].id, "m-9"}) == 3


def test_apply_at_many_checks_item_ids_before_storing(app: Celery, redis_url: str) -> None:
    add = app.tasks["t.add"]
    before = snapshot(redis_url)
    with pytest.raises(InvalidTaskId, match="must be a string, got int"):
        add.apply_at_many([(LATER, (1, 1), None, "ok"), (LATER, (1, 1), None, 42)])
    with pytest.raises(InvalidOptions, match=r"must begin with '\{tenant\}'"):  # a gated job's id
        add.apply_at_many([(LATER, (1, 1), None, "x")], concurrency_key="tenant", concurrency_limit=2)
    assert snapshot(redis_url) == before
    [res] = add.apply_at_many(
        [(LATER, (1, 1), None, "{tenant}x")], concurrency_key="tenant", concurrency_limit=2
    )
    assert res.id == "{tenant}x"


def test_two_producers_racing_on_the_same_ids_store_each_once(redis_url: str) -> None:
    """Two processes' worth of producers (an app and connection each) schedule the same 100
    ids at once: each id is stored by exactly one call; every other call is told kept."""
    ids = itertools.cycle([f"race-{i}" for i in range(100)])  # 600 calls: each id 6 times
    outcomes = race_producers(
        redis_url, _add, lambda t: t.apply_at(LATER, (1, 2), task_id=next(ids), unique_for=60), 300
    )
    assert outcomes == {"new": 100, "kept": 500}


def test_a_corrupt_record_is_reported_and_does_not_stop_the_shard(
    app: Celery, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    add = app.tasks["t.add"]
    record = unique_record(app, "corrupt-1")
    r.set(record, "not a sorted set")
    with caplog.at_level(logging.WARNING, logger="celery_delayq"):
        res = add.apply_at(LATER, (1, 2), task_id="corrupt-1", unique_for=60)
    assert res.outcome == "new"
    assert "uniqueness record of shard" in caplog.text and "corrupt" in caplog.text
    assert r.type(record) == "zset" and r.zscore(record, "corrupt-1") is not None
    assert add.apply_at(LATER, (1, 2), task_id="corrupt-1", unique_for=60).outcome == "kept"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"unique_for": 60}, "needs the job's own task_id"),
        ({"unique_for": 0, "task_id": "x"}, "more than 0"),
        ({"unique_for": -5, "task_id": "x"}, "more than 0"),
        ({"unique_for": math.nan, "task_id": "x"}, "more than 0"),
        ({"unique_for": 11 * 366 * 86_400, "task_id": "x"}, "at most"),
        ({"unique_for": "1h", "task_id": "x"}, "number of seconds or a timedelta"),
        ({"unique_for": True, "task_id": "x"}, "number of seconds or a timedelta"),
        ({"unique_for": 60, "task_id": "x", "replace": True}, "contradict"),
    ],
)
def test_bad_unique_for_is_refused_at_the_call_and_stores_nothing(
    app: Celery, redis_url: str, options: dict[str, object], says: str
) -> None:
    before = snapshot(redis_url)
    with pytest.raises(InvalidOptions, match=says):
        app.tasks["t.add"].apply_at(LATER, (1, 2), **options)
    assert snapshot(redis_url) == before


def test_apply_at_many_without_ids_and_apply_async_name_what_unique_for_needs(
    app: Celery, redis_url: str
) -> None:
    add = app.tasks["t.add"]
    before = snapshot(redis_url)
    with pytest.raises(InvalidOptions, match="unique_for needs every job's own id: item 1 of apply_at_many"):
        add.apply_at_many([(LATER, (1, 2), None, "m0"), (LATER, (1, 2), None)], unique_for=60)
    with pytest.raises(InvalidOptions, match="unique_for is an option of apply_at and apply_in"):
        add.apply_async(
            (1, 2), countdown=60, task_id="x", unique_for=60, concurrency_key="k", concurrency_limit=1
        )
    assert snapshot(redis_url) == before


@pytest.mark.parametrize("mode", ["unique:0", "unique:", "unique:-1", "unique:1.5", "unique:1234567890123"])
def test_the_script_refuses_a_bad_window_before_writing(app: Celery, r: redis.Redis, mode: str) -> None:
    keys = get_store(app).keys.shard(0)
    with pytest.raises(redis.ResponseError, match="unique:<ms>"):
        SCRIPTS["enqueue"](r, keys.with_unique, [mode, "wake", 0, "at", 0, "j1", 1, "{}"])
    assert r.hlen(keys.jobs) == 0 and not r.exists(keys.unique)
    with pytest.raises(redis.ResponseError, match="KEYS"):  # the record's key is required
        SCRIPTS["enqueue"](r, keys.with_shapes, ["unique:1000", "wake", 0, "at", 0, "j1", 1, "{}"])


@pytest.fixture
def full_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


def test_a_full_store_refuses_with_store_full_and_writes_nothing(full_server: EmbeddedRedis) -> None:
    url = full_server.url + "/0"
    app = make_app(url, url)
    task = app.task(base=DelayedTask, name="t.add", shared=False)(_add)
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert task.apply_at(LATER, (1, 2), task_id="before", unique_for=60).outcome == "new"
        make_full(client)
        before = snapshot(url)
        with pytest.raises(StoreFull, match="maxmemory"):
            task.apply_at(LATER, (1, 2), task_id="after", unique_for=60)
        assert snapshot(url) == before  # neither the job nor its window
        # a kept id writes nothing but the sweep of ended windows, which frees memory
        assert task.apply_at(LATER, (1, 2), task_id="before", unique_for=60).outcome == "kept"
        client.config_set("maxmemory", 0)
        assert task.apply_at(LATER, (1, 2), task_id="after", unique_for=60).outcome == "new"
        assert DelayQ(app).count() == 2
    finally:
        client.close()
        get_store(app).close()
        app.close()


def test_store_enqueue_answers_taken_with_the_window_s_end(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    job = app.tasks["t.add"].apply_at(LATER, (1, 2), task_id="s1", unique_for=10)
    assert job.cancel()
    [(outcome, end)] = store.enqueue([("s1", 0, "{}")], unique_ms=10_000)
    assert outcome is EnqueueOutcome.TAKEN
    assert abs(end - (server_ms(r) + 10_000)) < 5_000
