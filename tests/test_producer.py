"""The producer side: apply_at / apply_in / apply_at_many, results, options, bad input."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery, Task
from celery.result import AsyncResult, EagerResult

from celery_delayq import DelayedTask, DelayQ, DelayQTaskMixin, ScheduledResult, ScheduleError, delayed_task
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.due import ms_to_datetime
from celery_delayq.exceptions import InvalidDueTime, InvalidOptions, PayloadTooLarge, SerializationError
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from celery_delayq.store.scripts import SCRIPTS
from tests.support.apps import add_task, make_app
from tests.support.messages import OPTION_SETS, dispatch, normalized, pop_broker_messages
from tests.support.store import broker_lists, command_calls, snapshot

HOUR = 3600.0

AppFactory = Callable[..., Celery]


@pytest.fixture
def app_factory(redis_url: str) -> Iterator[AppFactory]:
    """Fresh apps (broker and store on the test server) with ``t.add``, configured by keywords."""
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        application = make_app(redis_url, **conf)

        add_task(application)

        apps.append(application)
        return application

    yield factory
    for application in apps:
        application.close()


def ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


def stored_envelope(app: Celery, job_id: str) -> dict[str, Any]:
    """The stored envelope, decoded: headers and properties as the beat will publish them."""
    record = get_store(app).get(job_id)
    assert record is not None, f"job {job_id} is not stored"
    envelope = decode_envelope(record.envelope)
    return {
        "task": envelope.task,
        "headers": envelope.headers,
        "props": envelope.props,
        "route": envelope.route,
        "expires": envelope.expires_ms,
    }


# -- due times --------------------------------------------------------------------------------


def test_apply_at_aware_datetime(app: Celery) -> None:
    add = app.tasks["t.add"]
    eta = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=timezone(timedelta(hours=2)))
    res = add.apply_at(eta, (1, 2))
    assert isinstance(res, ScheduledResult)
    assert isinstance(res, AsyncResult)
    assert res.due == eta
    assert res.due is not None and res.due.tzinfo is not None
    assert res.created is True
    job = DelayQ(app).get(res.id)
    assert job is not None
    assert (job.task, job.args, job.kwargs, job.state, job.queue) == (
        "t.add",
        [1, 2],
        {},
        "waiting",
        "celery",
    )
    assert job.due == eta


@pytest.mark.parametrize(
    ("eta", "expected"),
    [
        (1_900_000_000, 1_900_000_000_000),
        (1_900_000_000.25, 1_900_000_000_250),
        ("2031-01-01T12:00:00+02:00", ms(datetime(2031, 1, 1, 10, tzinfo=UTC))),
        ("2031-01-01T10:00:00Z", ms(datetime(2031, 1, 1, 10, tzinfo=UTC))),
        ("2031-01-01T10:00:00.5", ms(datetime(2031, 1, 1, 10, 0, 0, 500000, tzinfo=UTC))),
        (datetime(2031, 1, 1, 10), ms(datetime(2031, 1, 1, 10, tzinfo=UTC))),  # naive: UTC
    ],
    ids=["int", "float", "iso-offset", "iso-z", "iso-naive", "naive-datetime"],
)
def test_apply_at_due_forms(app: Celery, eta: Any, expected: int) -> None:
    res = app.tasks["t.add"].apply_at(eta, (1, 2))
    assert res.due == ms_to_datetime(expected)
    record = get_store(app).get(res.id)
    assert record is not None and record.due_ms == expected


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(30, 30.0), (0.25, 0.25), (0, 0.0), (timedelta(minutes=2, milliseconds=5), 120.005)],
    ids=["int", "float", "zero", "timedelta"],
)
def test_apply_in(app: Celery, delay: Any, seconds: float) -> None:
    before = time.time()
    res = app.tasks["t.add"].apply_in(delay, kwargs={"x": 1, "y": 2})
    after = time.time()
    record = get_store(app).get(res.id)
    assert record is not None
    assert math.floor((before + seconds) * 1000) <= record.due_ms <= math.ceil((after + seconds) * 1000)
    assert res.due == ms_to_datetime(record.due_ms)
    job = DelayQ(app).get(res.id)
    assert job is not None and job.kwargs == {"x": 1, "y": 2} and job.args == []


@pytest.mark.parametrize(
    "conf", [{"timezone": "Europe/Berlin"}, {"timezone": "America/New_York", "enable_utc": False}]
)
def test_apply_at_refuses_a_naive_time_where_the_app_zone_is_not_utc(
    app_factory: AppFactory, conf: Any
) -> None:
    """Celery reads a naive eta as UTC (tests/test_naive_eta.py); delayq used to read it in the
    app's zone. Where the two differ, apply_at refuses a naive time rather than move it."""
    app = app_factory(**conf)
    add = app.tasks["t.add"]
    before = snapshot_of(app)
    for naive in (datetime(2031, 1, 1, 12), "2031-07-01T12:00:00"):
        with pytest.raises(InvalidDueTime, match="Celery reads a naive eta as UTC, but this app's timezone"):
            add.apply_at(naive, (1, 2))
        with pytest.raises(InvalidDueTime, match="naive"):
            add.apply_at_many([(naive, (1, 2), None)])
        with pytest.raises(InvalidOptions, match="expires: naive"):
            add.apply_at(datetime(2031, 1, 1, tzinfo=UTC), (1, 2), expires=naive)
        with pytest.raises(InvalidDueTime, match="naive"):
            DelayQ(app).reschedule("any", naive)
    assert snapshot_of(app) == before
    res = add.apply_at(datetime(2031, 1, 1, 12, tzinfo=ZoneInfo("Europe/Berlin")), (1, 2))  # aware: fine
    assert res.due == datetime(2031, 1, 1, 11, tzinfo=UTC)
    with pytest.raises(InvalidDueTime, match="naive"):
        res.reschedule(datetime(2031, 1, 1, 12))
    assert res.due == datetime(2031, 1, 1, 11, tzinfo=UTC)


def test_apply_at_reads_a_naive_time_as_utc_in_a_utc_app(app_factory: AppFactory) -> None:
    for conf in ({}, {"timezone": "UTC"}, {"timezone": "UTC", "enable_utc": False}):
        app = app_factory(**conf)
        res = app.tasks["t.add"].apply_at(datetime(2031, 1, 1, 12), (1, 2), expires=datetime(2031, 1, 2))
        assert res.due == datetime(2031, 1, 1, 12, tzinfo=UTC)
        envelope = decode_envelope(get_store(app).get(res.id).envelope)
        assert envelope.expires_ms == ms(datetime(2031, 1, 2, tzinfo=UTC))


@pytest.mark.parametrize(
    "conf",
    [
        {"timezone": "Europe/Paris"},
        {"timezone": "America/New_York", "enable_utc": False},
        {"enable_utc": False},
        {},
    ],
)
def test_intercepted_naive_eta_and_expires_are_utc_as_in_celery(app_factory: AppFactory, conf: Any) -> None:
    """The issue's case: ``apply_async(eta=utcnow() + 600 s)`` with timezone Europe/Paris."""
    app = app_factory(delayq_intercept_eta=True, **conf)
    now = datetime.now(UTC).replace(microsecond=0)
    naive = now.replace(tzinfo=None) + timedelta(seconds=600)
    res = app.tasks["t.add"].apply_async((1, 2), eta=naive, expires=naive + timedelta(seconds=60))
    assert res.due == now + timedelta(seconds=600)
    envelope = decode_envelope(get_store(app).get(res.id).envelope)
    assert envelope.expires_ms == ms(now + timedelta(seconds=660))
    res = app.tasks["t.add"].apply_async((1, 2), eta=naive.isoformat())
    assert res.due == now + timedelta(seconds=600)


@pytest.mark.parametrize(
    "given",
    [
        {"countdown": 600, "eta": datetime(2030, 1, 1, tzinfo=UTC)},
        {"countdown": 600, "expires": 300},
        {"countdown": 3600, "expires": 7200.5},
        {"eta": datetime(2030, 1, 1, tzinfo=UTC), "expires": 60},
        {"countdown": -5, "eta": datetime(2030, 1, 1, tzinfo=UTC), "expires": 60},
    ],
    ids=[
        "countdown-and-eta",
        "expires-before-due",
        "expires-after-due",
        "eta-and-expires",
        "negative-countdown",
    ],
)
def test_intercepted_eta_countdown_expires_match_celerys_own_message(
    app_factory: AppFactory, given: dict[str, Any]
) -> None:
    """The due time and expiry of an intercepted call are the ``eta``/``expires`` Celery itself puts
    in the message (``as_task_v2``): a non-zero countdown wins over eta, and a number of seconds of
    ``expires`` counts from the call, not from the due time."""
    app = app_factory(delayq_intercept_eta=True)
    celery_message = app.amqp.as_task_v2("x" * 36, "t.add", (1, 2), {}, **given)
    celery_eta = datetime.fromisoformat(celery_message.headers["eta"])
    celery_expires = celery_message.headers["expires"]
    res = app.tasks["t.add"].apply_async((1, 2), **given)
    if given.get("countdown", 0) < 0:
        # Celery's eta is already past: the worker runs it at once; delayq stores it due now.
        assert celery_eta <= datetime.now(UTC) and res.due <= datetime.now(UTC)
    else:
        assert abs((res.due - celery_eta).total_seconds()) < 5
    envelope = decode_envelope(get_store(app).get(res.id).envelope)
    if "expires" not in given:
        assert celery_expires is None and envelope.expires_ms is None
        return
    assert celery_expires is not None and envelope.expires_ms is not None
    assert abs(envelope.expires_ms - ms(datetime.fromisoformat(celery_expires))) < 5000


def test_past_eta_is_stored_as_is_and_claimed_at_once(app: Celery, r: redis.Redis) -> None:
    past = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    res = app.tasks["t.add"].apply_at(past, (1, 2))
    assert res.due == past
    store = get_store(app)
    [result] = store.claim([store.keys.shard_of(res.id)], "beat-test")
    assert [(j.id, j.due_ms) for j in result.jobs] == [(res.id, ms(past))]


def test_past_eta_is_dispatched_on_the_next_pass(app: Celery, r: redis.Redis) -> None:
    res = app.tasks["t.add"].apply_at(time.time() - HOUR, (1, 2))
    dispatch(app)
    [message] = broker_lists(r)["celery"]
    assert message["headers"]["id"] == res.id
    assert DelayQ(app).count() == 0


# -- apply_at_many ----------------------------------------------------------------------------


def test_apply_at_many_returns_results_in_order(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    base = 1_900_000_000.0
    items = [(base + i, (i, i), None) for i in range(30)]
    items.append((datetime(2031, 1, 1, tzinfo=UTC), None, {"x": 1, "y": 2}))
    r.script_load(SCRIPTS["enqueue"].source)
    calls_before, _ = command_calls(r, "evalsha")
    results = add.apply_at_many(items, queue="bulk")
    calls_after, _ = command_calls(r, "evalsha")
    assert len(results) == len(items)
    assert len({res.id for res in results}) == len(items)
    assert all(isinstance(res, ScheduledResult) and res.created for res in results)
    store = get_store(app)
    shards = set()
    for res, (eta, args, kwargs) in zip(results, items, strict=True):
        expected_ms = ms(eta) if isinstance(eta, datetime) else round(eta * 1000)
        assert res.due == ms_to_datetime(expected_ms)
        shard = store.keys.for_job(res.id)
        shards.add(shard.index)
        assert r.zscore(shard.due, res.id) == expected_ms  # stored in the job's own shard
        job = DelayQ(app).get(res.id)
        assert job is not None and job.queue == "bulk"
        assert (job.args, job.kwargs) == ((list(args), {}) if args else ([], kwargs))
    assert len(shards) > 1
    assert calls_after - calls_before == len(shards)  # grouped: one script call per shard
    assert store.count() == len(items)


def test_apply_at_many_refuses_task_id(app: Celery) -> None:
    before = snapshot_of(app)
    with pytest.raises(InvalidOptions) as info:
        app.tasks["t.add"].apply_at_many([(time.time() + HOUR, (1, 2), None)], task_id="x")
    assert isinstance(info.value, TypeError)
    assert snapshot_of(app) == before


def test_apply_at_many_with_no_items(app: Celery) -> None:
    assert app.tasks["t.add"].apply_at_many([]) == []
    assert DelayQ(app).count() == 0


# -- ScheduledResult --------------------------------------------------------------------------


def test_scheduled_result_cancel_and_reschedule(app: Celery) -> None:
    add = app.tasks["t.add"]
    res = add.apply_at(time.time() + HOUR, (1, 2))
    assert res == AsyncResult(res.id)
    assert res.id == res.task_id
    assert repr(res) == f"<ScheduledResult: {res.id} due={res.due.isoformat() if res.due else None}>"

    new_due = datetime(2032, 2, 2, tzinfo=UTC)
    assert res.reschedule(new_due) == "moved"
    assert res.due == new_due
    job = DelayQ(app).get(res.id)
    assert job is not None and job.due == new_due

    assert res.cancel() == "cancelled"
    assert DelayQ(app).get(res.id) is None
    assert res.cancel() == "missing"
    assert res.reschedule(datetime(2033, 1, 1, tzinfo=UTC)) == "missing"
    assert res.due == new_due  # unchanged when nothing moved
    assert DelayQ(app).count() == 0


def test_scheduled_result_reschedule_while_leased_is_refused(app: Celery) -> None:
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    store = get_store(app)
    store.claim([store.keys.shard_of(res.id)], "beat-test")
    due = res.due
    assert res.reschedule(time.time() + HOUR) == "delivering"
    assert res.due == due
    assert res.cancel() == "delivering"  # removed, but it was being delivered
    assert DelayQ(app).get(res.id) is None


# -- task_id ----------------------------------------------------------------------------------


def test_task_id_is_idempotent(app: Celery) -> None:
    add = app.tasks["t.add"]
    first_eta = datetime(2031, 1, 1, tzinfo=UTC)
    first = add.apply_at(first_eta, (1, 2), task_id="reminder:42")
    assert (first.id, first.created, first.due) == ("reminder:42", True, first_eta)

    second = add.apply_at(datetime(2031, 6, 1, tzinfo=UTC), (3, 4), task_id="reminder:42")
    assert (second.id, second.created, second.due) == ("reminder:42", False, first_eta)
    job = DelayQ(app).get("reminder:42")
    assert job is not None and job.args == [1, 2] and job.due == first_eta

    third = add.apply_in(10, (5, 6), task_id="reminder:42")
    assert (third.created, third.due) == (False, first_eta)

    replaced_eta = datetime(2031, 6, 1, tzinfo=UTC)
    replaced = add.apply_at(replaced_eta, (7, 8), task_id="reminder:42", replace=True)
    assert (replaced.created, replaced.due) == (True, replaced_eta)
    job = DelayQ(app).get("reminder:42")
    assert job is not None and job.args == [7, 8] and job.due == replaced_eta
    assert stored_envelope(app, "reminder:42")["headers"]["id"] == "reminder:42"
    assert DelayQ(app).count() == 1


def test_task_id_can_be_reused_once_delivered(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    add.apply_at(time.time() - 1, (1, 2), task_id="once")
    dispatch(app)
    assert DelayQ(app).get("once") is None
    again = add.apply_at(time.time() + HOUR, (3, 4), task_id="once")
    assert again.created is True


# -- options, compared with apply_async -------------------------------------------------------


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(o) or "none")
def test_dispatched_message_is_what_apply_async_publishes(
    app: Celery, r: redis.Redis, options: dict[str, Any]
) -> None:
    add = app.tasks["t.add"]
    direct_id = add.apply_async((1, 2), {}, **options).id
    direct = pop_broker_messages(r)

    due = time.time() - 1
    res = add.apply_at(due, (1, 2), {}, **options)
    dispatch(app)
    delayed = pop_broker_messages(r)

    assert set(direct) == set(delayed)
    [key] = direct
    [sent] = direct[key]
    [published] = delayed[key]
    assert res.due is not None
    assert published["headers"]["delayq_due"] == round(res.due.timestamp() * 1000)
    assert normalized(published, res.id) == normalized(sent, direct_id)
    assert DelayQ(app).count() == 0


def test_priority_queue_key(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    add.apply_at(time.time() - 1, (1, 2), queue="q1", priority=3)
    add.apply_at(time.time() - 1, (1, 2), queue="q1")
    dispatch(app)
    lists = broker_lists(r)
    assert sorted(lists) == ["q1", "q1\x06\x163"]
    assert lists["q1\x06\x163"][0]["properties"]["priority"] == 3


def test_task_routes_and_task_options_apply(app_factory: AppFactory, r: redis.Redis) -> None:
    app = app_factory(task_routes={"t.add": {"queue": "routed"}})

    @app.task(base=DelayedTask, name="t.opts", shared=False, queue="task-q", time_limit=7)
    def opts() -> None:
        return None

    routed = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    with_opts = opts.apply_at(time.time() - 1)
    overridden = opts.apply_at(time.time() - 1, queue="override")
    queues = {job.id: job.queue for job in DelayQ(app).pending()}
    assert queues == {routed.id: "routed", with_opts.id: "task-q", overridden.id: "override"}
    dispatch(app)
    lists = broker_lists(r)
    assert [m["headers"]["id"] for m in lists["routed"]] == [routed.id]
    assert [m["headers"]["id"] for m in lists["task-q"]] == [with_opts.id]
    assert lists["task-q"][0]["headers"]["timelimit"] == [7, None]
    assert [m["headers"]["id"] for m in lists["override"]] == [overridden.id]


def test_expires_counts_from_the_due_time(app: Celery) -> None:
    add = app.tasks["t.add"]
    due = datetime(2031, 1, 1, tzinfo=UTC)
    for expires in (60, 60.0, timedelta(seconds=60)):
        res = add.apply_at(due, (1, 2), expires=expires)
        envelope = stored_envelope(app, res.id)
        assert envelope["expires"] == ms(due) + 60_000
        assert datetime.fromisoformat(envelope["headers"]["expires"]) == due + timedelta(seconds=60)
    absolute = datetime(2031, 1, 2, tzinfo=UTC)
    res = add.apply_at(due, (1, 2), expires=absolute)
    assert stored_envelope(app, res.id)["expires"] == ms(absolute)
    res = add.apply_at(due, (1, 2), expires=absolute.isoformat())
    assert stored_envelope(app, res.id)["expires"] == ms(absolute)


def test_expires_is_published_as_the_time_left(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    due = time.time() - 1
    res = add.apply_at(due, (1, 2), expires=600)
    dispatch(app)
    [message] = broker_lists(r)["celery"]
    assert message["headers"]["id"] == res.id
    expires_at = datetime.fromisoformat(message["headers"]["expires"])
    assert res.due is not None and expires_at == res.due + timedelta(seconds=600)
    left_ms = float(message["properties"]["expiration"])
    assert 0 < left_ms <= 600_000


def test_already_expired_job_is_published_with_zero_expiration(app: Celery, r: redis.Redis) -> None:
    app.tasks["t.add"].apply_at(time.time() - HOUR, (1, 2), expires=10)
    dispatch(app)
    [message] = broker_lists(r)["celery"]
    assert float(message["properties"]["expiration"]) == 0


# -- decorators and base classes --------------------------------------------------------------


def test_delayed_task_with_app(app: Celery) -> None:
    @delayed_task(app, name="t.deco1", shared=False)
    def deco1(x: int) -> int:
        return x

    @delayed_task(app, shared=False)
    def deco2() -> None:
        return None

    assert isinstance(deco1, DelayedTask) and isinstance(deco2, DelayedTask)
    assert deco1.name == "t.deco1"
    assert isinstance(app.tasks["t.deco1"], DelayedTask)
    assert deco2.name == f"{__name__}.deco2"
    assert deco1(5) == 5
    res = deco1.apply_at(time.time() + HOUR, (5,))
    job = DelayQ(app).get(res.id)
    assert job is not None and job.task == "t.deco1" and job.args == [5]


def test_delayed_task_refuses_a_base_without_the_mixin(app: Celery) -> None:
    """A base that is not a DelayQTaskMixin would make a task with no apply_at: refused at once."""
    from celery import Task

    from celery_delayq import DelayQTaskMixin
    from celery_delayq.exceptions import InvalidOptions

    with pytest.raises(InvalidOptions, match="must derive from DelayQTaskMixin"):
        delayed_task(app, base=Task, shared=False)
    assert "t.plain" not in app.tasks

    class Mixed(DelayQTaskMixin, Task):  # type: ignore[misc]
        pass

    @delayed_task(app, name="t.mixed", base=Mixed, shared=False)
    def mixed() -> None:
        return None

    assert isinstance(mixed, Mixed) and hasattr(mixed, "apply_at")


def test_delayed_task_shared_forms(app_factory: AppFactory) -> None:
    @delayed_task
    def delayq_test_shared_bare(x: int) -> int:
        return x

    @delayed_task(name="delayq_test.shared_named", max_retries=7)
    def shared_named() -> None:
        return None

    app = app_factory()  # finalized after the shared tasks were declared: it gets both
    bare = app.tasks[f"{__name__}.delayq_test_shared_bare"]
    named = app.tasks["delayq_test.shared_named"]
    assert isinstance(bare, DelayedTask) and isinstance(named, DelayedTask)
    assert named.max_retries == 7
    res = named.apply_at(time.time() + HOUR)
    job = DelayQ(app).get(res.id)
    assert job is not None and job.task == "delayq_test.shared_named"


def test_delayed_task_keeps_an_explicit_base(app: Celery) -> None:
    class Custom(DelayedTask):
        abstract = True
        marker = "custom"

    @delayed_task(app, base=Custom, name="t.custom_base", shared=False)
    def custom() -> None:
        return None

    assert isinstance(custom, Custom)
    assert custom.marker == "custom"


def test_mixin_on_a_custom_base(app: Celery, r: redis.Redis) -> None:
    calls: list[dict[str, Any]] = []

    class Audited(Task):
        abstract = True

        def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            calls.append(dict(options))
            return super().apply_async(args, kwargs, **options)

    class Base(DelayQTaskMixin, Audited):
        abstract = True

    @app.task(base=Base, name="t.audited", shared=False)
    def audited(x: int) -> int:
        return x

    assert isinstance(audited, Audited)
    res = audited.apply_at(time.time() + HOUR, (1,), queue="qa")
    job = DelayQ(app).get(res.id)
    assert job is not None and (job.task, job.args, job.queue) == ("t.audited", [1], "qa")
    assert calls == []  # scheduling does not publish
    audited.delay(2)  # a normal call still reaches the custom base
    assert len(calls) == 1
    assert [m["headers"]["task"] for m in broker_lists(r)["celery"]] == ["t.audited"]


# -- delayq_intercept_eta ---------------------------------------------------------------------


def test_intercept_eta_on(app_factory: AppFactory, r: redis.Redis) -> None:
    app = app_factory(delayq_intercept_eta=True)
    add = app.tasks["t.add"]
    before = time.time()
    by_countdown = add.apply_async((1, 2), countdown=30)
    after = time.time()
    eta = datetime(2031, 1, 1, tzinfo=UTC)
    by_eta = add.apply_async((3, 4), eta=eta, queue="q1")
    assert isinstance(by_countdown, ScheduledResult) and isinstance(by_eta, ScheduledResult)
    assert by_countdown.due is not None
    assert before + 30 - 0.001 <= by_countdown.due.timestamp() <= after + 30 + 0.001
    assert by_eta.due == eta
    job = DelayQ(app).get(by_eta.id)
    assert job is not None and (job.args, job.queue, job.due) == ([3, 4], "q1", eta)
    assert DelayQ(app).count() == 2
    assert broker_lists(r) == {}

    # A retry reuses the id: an intercepted call replaces the waiting job.
    later = datetime(2031, 2, 1, tzinfo=UTC)
    again = add.apply_async((5, 6), eta=later, task_id=by_eta.id)
    assert (again.id, again.created, again.due) == (by_eta.id, True, later)
    job = DelayQ(app).get(by_eta.id)
    assert job is not None and job.args == [5, 6]
    assert DelayQ(app).count() == 2

    # Without eta/countdown the call goes to the broker as usual.
    direct = add.apply_async((7, 8))
    assert not isinstance(direct, ScheduledResult)
    assert [m["headers"]["id"] for m in broker_lists(r)["celery"]] == [direct.id]


def test_intercept_eta_validates_like_apply_at(app_factory: AppFactory) -> None:
    app = app_factory(delayq_intercept_eta=True)
    add = app.tasks["t.add"]
    add.apply_async((5, 6), countdown=60, task_id="keeper")
    before = snapshot_of(app)
    with pytest.raises(InvalidDueTime):
        add.apply_async((1, 2), countdown=float("nan"))
    with pytest.raises(InvalidDueTime):
        add.apply_async((1, 2), countdown=float("inf"))
    with pytest.raises(InvalidDueTime):
        add.apply_async((1, 2), eta="not a date")
    with pytest.raises(TypeError):
        add.apply_async((1,), countdown=5)
    assert snapshot_of(app) == before


def test_intercepted_negative_countdown_runs_at_once(app_factory: AppFactory) -> None:
    app = app_factory(delayq_intercept_eta=True)
    before = time.time()
    res = app.tasks["t.add"].apply_async((1, 2), countdown=-5)
    after = time.time()
    assert isinstance(res, ScheduledResult) and res.due is not None
    assert before - 0.001 <= res.due.timestamp() <= after + 0.001


def test_intercept_eta_off(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    res = add.apply_async((1, 2), countdown=30)
    eta = datetime(2031, 1, 1, tzinfo=UTC)
    res2 = add.apply_async((1, 2), eta=eta)
    assert not isinstance(res, ScheduledResult) and not isinstance(res2, ScheduledResult)
    assert DelayQ(app).count() == 0
    messages = broker_lists(r)["celery"]
    assert [m["headers"]["id"] for m in messages] == [res.id, res2.id]
    assert all(m["headers"]["eta"] is not None for m in messages)
    assert datetime.fromisoformat(messages[1]["headers"]["eta"]) == eta


def test_intercept_setting_is_read_once_per_app(app_factory: AppFactory, r: redis.Redis) -> None:
    app = app_factory()
    app.tasks["t.add"].apply_at(time.time() + HOUR, (1, 2))  # reads and caches the config
    app.conf.delayq_intercept_eta = True
    app.tasks["t.add"].apply_async((1, 2), countdown=30)
    assert len(broker_lists(r)["celery"]) == 1
    assert DelayQ(app).count() == 1
    fresh = app_factory(delayq_intercept_eta=True)  # a new app reads the setting
    fresh.tasks["t.add"].apply_async((1, 2), countdown=30)
    assert len(broker_lists(r)["celery"]) == 1
    assert DelayQ(app).count() == 2


# -- task_always_eager ------------------------------------------------------------------------


def test_always_eager_runs_at_once_and_stores_nothing(app_factory: AppFactory) -> None:
    app = app_factory(task_always_eager=True, delayq_intercept_eta=True)
    add = app.tasks["t.add"]
    res = add.apply_at(time.time() + HOUR, (1, 2), task_id="eager-1")
    assert isinstance(res, EagerResult)
    assert (res.id, res.get()) == ("eager-1", 3)
    assert add.apply_in(HOUR, (2, 3)).get() == 5
    many = add.apply_at_many([(time.time() + 1, (i, i), None) for i in range(3)])
    assert [x.get() for x in many] == [0, 2, 4]
    assert add.apply_async((4, 4), countdown=60).get() == 8
    assert DelayQ(app).count() == 0
    # Bad input is still refused.
    with pytest.raises(InvalidDueTime):
        add.apply_at(float("nan"), (1, 2))
    with pytest.raises(TypeError):
        add.apply_at(time.time(), (1,))


# -- bad input --------------------------------------------------------------------------------


def snapshot_of(app: Celery) -> Any:
    return snapshot(get_store(app).config.url)


@pytest.fixture
def existing(app: Celery) -> ScheduledResult:
    """A job stored before the bad call: it must come out intact."""
    res: ScheduledResult = app.tasks["t.add"].apply_at(time.time() + HOUR, (5, 6), task_id="keeper")
    return res


class Unserializable:
    pass


BAD_CALLS: list[tuple[str, Callable[[Any], Any], type[Exception], type[Exception]]] = [
    ("nan", lambda t: t.apply_at(float("nan"), (1, 2)), InvalidDueTime, ValueError),
    ("inf", lambda t: t.apply_at(float("inf"), (1, 2)), InvalidDueTime, ValueError),
    ("-inf", lambda t: t.apply_at(float("-inf"), (1, 2)), InvalidDueTime, ValueError),
    ("negative", lambda t: t.apply_at(-1, (1, 2)), InvalidDueTime, ValueError),
    ("year-10000", lambda t: t.apply_at(1e12, (1, 2)), InvalidDueTime, ValueError),
    ("bool", lambda t: t.apply_at(True, (1, 2)), InvalidDueTime, ValueError),
    ("not-iso", lambda t: t.apply_at("tomorrow", (1, 2)), InvalidDueTime, ValueError),
    ("wrong-type", lambda t: t.apply_at([2031], (1, 2)), InvalidDueTime, ValueError),
    ("delay-negative", lambda t: t.apply_in(-0.001, (1, 2)), InvalidDueTime, ValueError),
    ("delay-nan", lambda t: t.apply_in(float("nan"), (1, 2)), InvalidDueTime, ValueError),
    ("delay-inf", lambda t: t.apply_in(float("inf"), (1, 2)), InvalidDueTime, ValueError),
    ("delay-huge", lambda t: t.apply_in(1e300, (1, 2)), InvalidDueTime, ValueError),
    ("delay-huge-td", lambda t: t.apply_in(timedelta.max, (1, 2)), InvalidDueTime, ValueError),
    ("delay-neg-td", lambda t: t.apply_in(timedelta(seconds=-1), (1, 2)), InvalidDueTime, ValueError),
    ("delay-bool", lambda t: t.apply_in(True, (1, 2)), InvalidDueTime, ValueError),
    ("delay-str", lambda t: t.apply_in("10", (1, 2)), InvalidDueTime, ValueError),
    ("unserializable", lambda t: t.apply_in(10, (Unserializable(), 2)), SerializationError, TypeError),
    (
        "unserializable-kw",
        lambda t: t.apply_in(10, kwargs={"x": 1, "y": {1, 2}}),
        SerializationError,
        TypeError,
    ),
    ("too-few-args", lambda t: t.apply_in(10, (1,)), TypeError, TypeError),
    ("too-many-args", lambda t: t.apply_in(10, (1, 2, 3)), TypeError, TypeError),
    ("unknown-kwarg", lambda t: t.apply_in(10, (1, 2), {"z": 1}), TypeError, TypeError),
    ("opt-eta", lambda t: t.apply_in(10, (1, 2), eta=datetime.now(UTC)), InvalidOptions, TypeError),
    ("opt-countdown", lambda t: t.apply_in(10, (1, 2), countdown=5), InvalidOptions, TypeError),
    ("opt-producer", lambda t: t.apply_in(10, (1, 2), producer=object()), InvalidOptions, TypeError),
    ("opt-connection", lambda t: t.apply_in(10, (1, 2), connection=object()), InvalidOptions, TypeError),
    ("opt-publisher", lambda t: t.apply_in(10, (1, 2), publisher=object()), InvalidOptions, TypeError),
    ("opt-router", lambda t: t.apply_in(10, (1, 2), router=object()), InvalidOptions, TypeError),
    ("opt-not-json", lambda t: t.apply_in(10, (1, 2), custom=Unserializable()), InvalidOptions, TypeError),
    (
        "header-not-json",
        lambda t: t.apply_in(10, (1, 2), headers={"x": Unserializable()}),
        InvalidOptions,
        TypeError,
    ),
    ("expires-negative", lambda t: t.apply_in(10, (1, 2), expires=-1), InvalidOptions, TypeError),
    ("expires-nan", lambda t: t.apply_in(10, (1, 2), expires=float("nan")), InvalidOptions, TypeError),
    ("expires-garbage", lambda t: t.apply_in(10, (1, 2), expires="soon"), InvalidOptions, TypeError),
    (
        "many-bad-eta",
        lambda t: t.apply_at_many([(time.time() + 10, (1, 2), None), (float("nan"), (1, 2), None)]),
        InvalidDueTime,
        ValueError,
    ),
    (
        "many-bad-args",
        lambda t: t.apply_at_many([(time.time() + 10, (1, 2), None), (time.time() + 10, (1,), None)]),
        TypeError,
        TypeError,
    ),
    (
        "many-unserializable",
        lambda t: t.apply_at_many(
            [(time.time() + 10, (1, 2), None), (time.time() + 10, (Unserializable(), 1), None)]
        ),
        SerializationError,
        TypeError,
    ),
    (
        "many-opt-countdown",
        lambda t: t.apply_at_many([(time.time() + 10, (1, 2), None)], replace=True, countdown=1),
        InvalidOptions,
        TypeError,
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "builtin"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_stores_nothing(
    app: Celery,
    existing: ScheduledResult,
    call: Callable[[Any], Any],
    error: type[Exception],
    builtin: type[Exception],
) -> None:
    before = snapshot_of(app)
    with pytest.raises(error) as info:
        call(app.tasks["t.add"])
    assert isinstance(info.value, builtin)
    assert snapshot_of(app) == before
    job = DelayQ(app).get(existing.id)
    assert job is not None and job.args == [5, 6] and job.due == existing.due


def test_schedule_errors_share_a_base(app: Celery) -> None:
    for error in (InvalidDueTime, InvalidOptions, SerializationError, PayloadTooLarge):
        assert issubclass(error, ScheduleError)


def test_naive_datetime_refused_without_utc_or_timezone(app_factory: AppFactory) -> None:
    app = app_factory(enable_utc=False, timezone=None)
    add = app.tasks["t.add"]
    add.apply_at(datetime(2031, 1, 1, tzinfo=UTC), (5, 6), task_id="keeper")  # aware: fine
    before = snapshot_of(app)
    with pytest.raises(InvalidDueTime, match="naive"):
        add.apply_at(datetime(2031, 1, 1), (1, 2))
    with pytest.raises(InvalidDueTime, match="naive"):
        add.apply_at("2031-01-01T00:00:00", (1, 2))
    assert snapshot_of(app) == before


def test_unknown_queue_refused_when_queues_are_not_created(app_factory: AppFactory) -> None:
    from kombu import Queue

    app = app_factory(task_create_missing_queues=False, task_queues=[Queue("celery"), Queue("known")])
    add = app.tasks["t.add"]
    ok = add.apply_at(time.time() + HOUR, (5, 6), queue="known")
    before = snapshot_of(app)
    with pytest.raises(InvalidOptions, match="nope"):
        add.apply_at(time.time() + HOUR, (1, 2), queue="nope")
    assert snapshot_of(app) == before
    assert DelayQ(app).get(ok.id) is not None


def test_payload_too_large(app_factory: AppFactory) -> None:
    app = app_factory(delayq_max_payload=2000)
    add = app.tasks["t.add"]
    small = add.apply_at(time.time() + HOUR, ("x" * 100, "y"))
    before = snapshot_of(app)
    with pytest.raises(PayloadTooLarge) as info:
        add.apply_at(time.time() + HOUR, ("x" * 2000, "y"))
    assert isinstance(info.value, ValueError)
    with pytest.raises(PayloadTooLarge):
        add.apply_at_many(
            [(time.time() + HOUR, ("x", "y"), None), (time.time() + HOUR, ("x" * 2000, "y"), None)]
        )
    assert snapshot_of(app) == before
    assert DelayQ(app).get(small.id) is not None


def test_a_due_header_passed_on_is_not_stored(app: Celery, r: redis.Redis) -> None:
    """``self.retry`` passes the running request's headers on, ``delayq_due`` included: the
    stored job must not keep it (it would override the retry's own due time at publish)."""
    res = app.tasks["t.add"].apply_in(60, (1, 2), headers={"delayq_due": 1.0, "tenant": "acme"})
    record = get_store(app).get(res.id)
    assert record is not None
    envelope = decode_envelope(record.envelope)
    assert envelope.route.get("headers") == {"tenant": "acme"}
    dispatcher = Dispatcher(app)
    DelayQ(app).reschedule(res.id, time.time() - 1)
    dispatcher.run_once()
    (message,) = broker_lists(r)["celery"]
    assert message["headers"]["delayq_due"] == pytest.approx((time.time() - 1) * 1000, abs=5000)
    assert message["headers"]["delayq_due"] != 1.0 and message["headers"]["tenant"] == "acme"
