"""Debounce and throttle by key (issue 28, part 3): ``apply_async(..., debounce=(key, wait))``
keeps one pending job a key, due ``wait`` after the last call (no later than ``max_wait`` after
the first), its arguments the last call's; ``throttle=(key, period)`` stores at most one job a
key a period. Both on the Redis server's clock (``lua/keyed.lua``).

Against a real Redis, with a real :class:`Dispatcher` delivering; the worker and beat
processes are in tests/test_e2e.py.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ, StoreFull, apply_at
from celery_delayq.admin.views import job_detail
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import InvalidOptions
from celery_delayq.spark import READ_COLUMNS, read_shard
from celery_delayq.store.facade import get_store
from celery_delayq.store.scripts import SCRIPTS
from tests.support.apps import make_app, race_producers
from tests.support.cli import invoke
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.store import broker_lists, make_full, make_store, server_ms, snapshot
from tests.support.web import Client, dashboard

__all__ = ["cluster_url", "dashboard", "redis_cluster"]  # fixtures, used by name

LATER = datetime(2031, 1, 1, tzinfo=UTC)


def _digest(user: int, text: str) -> str:  # pragma: no cover - never runs here
    return f"{user}: {text}"


@pytest.fixture
def digest(app: Celery) -> Any:
    return app.task(base=DelayedTask, name="t.digest", shared=False)(_digest)


def records(app: Celery, key: str) -> tuple[str, str, str]:
    """The key's shard's debounce hash, debounce due set and throttle set."""
    keys = get_store(app).keys.for_key(key)
    return keys.debounce, keys.debounce_due, keys.throttle


# -- debounce -----------------------------------------------------------------------------------


def test_each_call_replaces_the_key_s_pending_job_and_moves_its_due_time(
    app: Celery, digest: Any, r: redis.Redis
) -> None:
    first = digest.apply_async((1, "a"), debounce=("user:1", 60))
    assert (first.outcome, first.replaced, first.created) == ("new", None, True)
    assert first.id.startswith("{user:1}")
    time.sleep(0.05)
    second = digest.apply_async((1, "b"), debounce=("user:1", 60))
    assert (second.outcome, second.replaced) == ("debounced", first.id)
    assert second.due is not None and first.due is not None and second.due > first.due
    dq = DelayQ(app)
    assert dq.count() == 1 and dq.get(first.id) is None
    job = dq.get(second.id)
    assert job is not None and job.args == [1, "b"]  # the last call's arguments
    assert abs(job.due.timestamp() * 1000 - (server_ms(r) + 60_000)) < 2_000
    # another key is a job of its own
    assert digest.apply_async((2, "c"), debounce=("user:2", 60)).outcome == "new"
    assert dq.count() == 2


@pytest.mark.slow
def test_max_wait_caps_the_due_time_from_the_first_call(app: Celery, digest: Any, r: redis.Redis) -> None:
    first = digest.apply_async((1, "a"), debounce=("user:1", 10, timedelta(seconds=10.5)))
    debounce, _, _ = records(app, "user:1")
    opened = int(r.hget(debounce, "user:1").rsplit("|", 1)[1])
    assert first.due is not None and round(first.due.timestamp() * 1000) - opened == 10_000
    time.sleep(1.0)  # now + wait is past the first call + max_wait
    later = digest.apply_async((1, "b"), debounce=("user:1", 10, 10.5))
    assert later.outcome == "debounced" and later.due is not None
    assert round(later.due.timestamp() * 1000) == opened + 10_500
    assert r.hget(debounce, "user:1") == f"{later.id}|{opened}"  # the window keeps its opening


def test_a_job_a_beat_holds_is_left_alone_and_the_call_opens_a_new_window(
    app: Celery, digest: Any, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    first = digest.apply_async((1, "a"), debounce=("user:1", 0))
    store = get_store(app)
    [claimed] = store.claim([store.keys.shard_of(first.id)], "beat-test", batch=10)
    assert [job.id for job in claimed.jobs] == [first.id]
    second = digest.apply_async((1, "b"), debounce=("user:1", 60))
    assert (second.outcome, second.replaced) == ("new", None)
    held = store.get(first.id)
    assert held is not None and held.state == "leased"
    assert DelayQ(app).count() == 2


@pytest.mark.slow
def test_a_debounced_job_is_delivered_once_with_the_last_arguments(
    app: Celery, digest: Any, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    for text in ("a", "b", "c"):
        last = digest.apply_async((1, text), debounce=("user:1", 0.3))
    time.sleep(0.5)
    dispatchers(app).run_once()
    messages = broker_lists(r)["celery"]
    assert [m["headers"]["id"] for m in messages] == [last.id]
    assert json.loads(messages[0]["body"])[0] == [1, "c"]
    assert messages[0]["headers"]["delayq_keyed"] == "debounce"  # the key: the id's tag
    # the key's next call after the delivery opens a new window
    again = digest.apply_async((1, "d"), debounce=("user:1", 60))
    assert (again.outcome, again.replaced) == ("new", None)


# -- throttle -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_throttle_stores_one_job_a_key_a_period_and_says_so(app: Celery, digest: Any, r: redis.Redis) -> None:
    first = digest.apply_at(LATER, (1, "a"), throttle=("user:1", 1.0))
    assert (first.outcome, first.created, first.due) == ("new", True, LATER)
    dropped = [digest.apply_async((1, x), throttle=("user:1", 1.0)) for x in "bcd"]
    assert [(d.outcome, d.created, d.due) for d in dropped] == [("throttled", False, None)] * 3
    assert digest.apply_in(5, (2, "e"), throttle=("user:2", 1.0)).outcome == "new"  # another key
    assert DelayQ(app).count() == 2
    time.sleep(1.1)
    after = digest.apply_async((1, "f"), countdown=30, throttle=("user:1", 1.0))
    assert after.outcome == "new" and DelayQ(app).count() == 3
    _, _, throttle = records(app, "user:1")
    assert r.zcard(throttle) >= 1  # windows that ended are removed by later calls


# -- two producers, a full Redis, corrupt records -------------------------------------------------


@pytest.mark.parametrize("mode", ["debounce", "throttle"])
def test_two_producers_racing_on_one_key_leave_one_job(redis_url: str, mode: str) -> None:
    """Two producers (an app and connection each) call 200 times each on one key at once:
    debounce leaves one pending job; throttle stores one, and tells every other call."""
    outcomes = race_producers(
        redis_url, _digest, lambda t: t.apply_async((1, "x"), **{mode: ("race", 60)}), 200
    )
    app = make_app(redis_url)
    try:
        assert DelayQ(app).count() == 1
    finally:
        app.close()
    if mode == "debounce":
        assert outcomes == {"new": 1, "debounced": 399}
    else:
        assert outcomes == {"new": 1, "throttled": 399}


@pytest.fixture
def full_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


def test_a_full_store_refuses_with_store_full_and_changes_nothing(full_server: EmbeddedRedis) -> None:
    url = full_server.url + "/0"
    app = make_app(url, url)
    task = app.task(base=DelayedTask, name="t.digest", shared=False)(_digest)
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        pending = task.apply_async((1, "a"), debounce=("user:1", 60))
        assert task.apply_at(LATER, (2, "a"), throttle=("user:2", 60)).outcome == "new"
        make_full(client)
        before = snapshot(url)
        with pytest.raises(StoreFull, match="maxmemory"):
            task.apply_async((1, "b"), debounce=("user:1", 60))  # would replace the pending job
        with pytest.raises(StoreFull, match="maxmemory"):
            task.apply_async((3, "a"), throttle=("user:3", 60))  # would open a window
        assert snapshot(url) == before  # the pending job, its record, no window
        # a throttled call writes nothing: answered even now
        assert task.apply_async((2, "b"), throttle=("user:2", 60)).outcome == "throttled"
        client.config_set("maxmemory", 0)
        again = task.apply_async((1, "c"), debounce=("user:1", 60))
        assert (again.outcome, again.replaced) == ("debounced", pending.id)
        assert DelayQ(app).count() == 2
    finally:
        client.close()
        get_store(app).close()
        app.close()


@pytest.mark.parametrize("which", ["debounce", "debounce_due", "throttle"])
def test_a_corrupt_record_is_reported_replaced_and_does_not_block_the_key(
    app: Celery, digest: Any, r: redis.Redis, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    debounce, debounce_due, throttle = records(app, "user:1")
    key = {"debounce": debounce, "debounce_due": debounce_due, "throttle": throttle}[which]
    r.set(key, "not a record")
    mode = "throttle" if which == "throttle" else "debounce"
    with caplog.at_level(logging.WARNING, logger="celery_delayq"):
        first = digest.apply_async((1, "a"), **{mode: ("user:1", 60)})
    assert first.outcome == "new"
    assert f"a {mode} record of shard" in caplog.text and "corrupt" in caplog.text
    assert r.type(key) in ("hash", "zset")
    second = digest.apply_async((1, "b"), **{mode: ("user:1", 60)})
    assert second.outcome == ("throttled" if mode == "throttle" else "debounced")


def test_a_record_naming_an_unreadable_job_is_taken_as_none(app: Celery, digest: Any, r: redis.Redis) -> None:
    debounce, _, _ = records(app, "user:1")
    r.hset(debounce, "user:1", "no bar here")
    assert digest.apply_async((1, "a"), debounce=("user:1", 60)).outcome == "new"
    assert DelayQ(app).count() == 1


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda t: t.apply_async((1, "a"), debounce="user:1"), r"must be \(key, wait\)"),
        (lambda t: t.apply_async((1, "a"), debounce=("user:1",)), r"must be \(key, wait\)"),
        (lambda t: t.apply_async((1, "a"), debounce=("", 5)), "a key is a non-empty string"),
        (lambda t: t.apply_async((1, "a"), debounce=("a{b}", 5)), "without '{', '}'"),
        (lambda t: t.apply_async((1, "a"), debounce=("k", -1)), "0 or more"),
        (lambda t: t.apply_async((1, "a"), debounce=("k", "5s")), "number of seconds or a timedelta"),
        (lambda t: t.apply_async((1, "a"), debounce=("k", 10, 5)), "shorter than its wait"),
        (lambda t: t.apply_async((1, "a"), debounce=("k", 5), countdown=3), "give no eta or countdown"),
        (lambda t: t.apply_async((1, "a"), debounce=("k", 5), task_id="x"), "takes no task_id"),
        (lambda t: t.apply_async((1, "a"), throttle=("k", 0)), "more than 0"),
        (lambda t: t.apply_async((1, "a"), throttle=("k", 5, 6)), r"must be \(key, period\)"),
        (lambda t: t.apply_async((1, "a"), throttle=("k", 5), debounce=("k", 5)), "exclude each other"),
        (lambda t: t.apply_at(LATER, (1, "a"), debounce=("k", 5)), "option of apply_async, not apply_at"),
        (lambda t: t.apply_in(5, (1, "a"), debounce=("k", 5)), "option of apply_async, not apply_in"),
        (lambda t: t.apply_at(LATER, (1, "a"), throttle=("k", 5), unique_for=60), "takes no unique_for"),
        (
            lambda t: t.apply_at(
                LATER, (1, "a"), throttle=("k", 5), concurrency_key="c", concurrency_limit=1
            ),
            "takes no concurrency_key",
        ),
        (
            lambda t: t.apply_at_many([(LATER, (1, "a"))], throttle=("k", 5)),
            "apply_at_many takes no throttle",
        ),
        (lambda t: apply_at(t.s(1, "a"), LATER, debounce=("k", 5)), "take no debounce"),
    ],
)
def test_bad_debounce_or_throttle_is_refused_at_the_call_and_stores_nothing(
    digest: Any, redis_url: str, call: Callable[[Any], Any], says: str
) -> None:
    before = snapshot(redis_url)
    with pytest.raises(InvalidOptions, match=says):
        call(digest)
    assert snapshot(redis_url) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["nothing", "wake", 0, "k", "{k}1", "{}", 0, 0, "in"],
        ["debounce", "wake", 0, "k", "{k}1", "{}", -1, 0, "in"],
        ["debounce", "wake", 0, "k", "{k}1", "{}", 5, 0, "at"],
        ["throttle", "wake", 0, "k", "{k}1", "{}", 5, 0, "at"],
        ["throttle", "wake", 0, "", "{k}1", "{}", 5, 10, "at"],
        ["throttle", "wake", 0, "k", "{k}1", "{}", 5, 10, "then"],
    ],
)
def test_the_script_refuses_bad_arguments_before_writing(
    app: Celery, r: redis.Redis, argv: list[Any]
) -> None:
    keys = get_store(app).keys.for_key("k")
    before = snapshot(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0")
    with pytest.raises(redis.ResponseError, match="delayq keyed"):
        SCRIPTS["keyed"](r, keys.with_keyed, argv)
    assert snapshot(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0") == before


def test_eager_mode_runs_at_once(app: Celery, digest: Any) -> None:
    app.conf.task_always_eager = True
    try:
        result = digest.apply_async((1, "a"), debounce=("user:1", 60))
        assert result.get() == "1: a"
    finally:
        app.conf.task_always_eager = False
    assert DelayQ(app).count() == 0


# -- where it shows -------------------------------------------------------------------------------


def test_show_the_dashboard_s_view_and_the_spark_reader_name_the_key(app: Celery, digest: Any) -> None:
    debounced = digest.apply_async((1, "a"), debounce=("user:1", 60))
    throttled = digest.apply_at(LATER, (2, "b"), throttle=("user:2", 60))
    plain = digest.apply_at(LATER, (3, "c"))
    store = get_store(app)
    for result, keyed in ((debounced, "debounce:user:1"), (throttled, "throttle:user:2"), (plain, None)):
        view = job_detail(store, "celery", result.id)
        assert view is not None and view["keyed"] == keyed
        rows = [
            dict(zip(READ_COLUMNS, row, strict=True))
            for row in read_shard(store, store.keys.shard_of(result.id))
        ]
        assert [row["keyed"] for row in rows if row["id"] == result.id] == [keyed]


def test_show_and_the_dashboard_page_print_the_key(
    app: Celery, digest: Any, dashboard: Callable[..., Client]
) -> None:
    debounced = digest.apply_async((1, "a"), debounce=("user:1", 60))
    out = invoke(app, "show", debounced.id).stdout
    assert re.search(r"^debounce\s+user:1$", out, flags=re.M), out
    page = dashboard().get(f"/jobs/{debounced.id}")
    assert page.status == 200
    assert re.search(r'<dt>Debounce key</dt><dd id="job-keyed">user:1</dd>', page.text), page.text[:3000]


@pytest.mark.cluster
def test_debounce_and_throttle_on_a_redis_cluster(cluster_url: str) -> None:
    """Each key's job and records sit on the key's node (its hash tag)."""
    app = make_app(cluster_url, cluster_url, delayq_cluster=True)
    task = app.task(base=DelayedTask, name="t.digest", shared=False)(_digest)
    try:
        for user in range(20):
            for text in "ab":
                task.apply_async((user, text), debounce=(f"user:{user}", 60))
            assert task.apply_at(LATER, (user, "t"), throttle=(f"t:{user}", 60)).outcome == "new"
            assert task.apply_at(LATER, (user, "u"), throttle=(f"t:{user}", 60)).outcome == "throttled"
        assert DelayQ(app).count() == 40
        store = make_store(cluster_url, cluster=True)
        try:
            debounced = [job for job in DelayQ(app).pending() if job.id.startswith("{user:")]
            assert sorted(job.args[1] for job in debounced) == ["b"] * 20
        finally:
            store.close()
    finally:
        get_store(app).close()
        app.close()
