"""Envelope version 2 and the producer's plans.

A planned envelope (many jobs, one task and options) must be the very string
the one-job path builds, and what a beat publishes from it must be what
``apply_async`` publishes. Version 1 envelopes are still read.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import EagerResult
from celery.utils.saferepr import saferepr
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_delayq import DelayedTask, ScheduledResult
from celery_delayq import config as extension_module
from celery_delayq.exceptions import CorruptData
from celery_delayq.producer.build import (
    _build_one,
    _quick_saferepr,
    build_envelope,
    build_envelopes,
    new_task_ids,
)
from celery_delayq.producer.message import current_worker_task
from celery_delayq.producer.options import clean_options
from celery_delayq.producer.plans import plan_for
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from celery_delayq.store.jobs import MAX_STORED_SHAPES, EnqueueOutcome
from celery_delayq.store.stored_forms import id_opening, loaded_form, shape_id_of, stored_form
from tests.support.apps import AppFactory
from tests.support.messages import OPTION_SETS, dispatch, normalized, pop_broker_messages
from tests.support.store import server_ms

DUE = 1_900_000_000_000


@pytest.fixture
def app(app_factory: AppFactory) -> Celery:
    """The tests' app (``t.add``, ``t.noop``), Celery's default queues, and ``t.any`` taking
    any arguments."""
    application = app_factory(task_queues=None)

    @application.task(base=DelayedTask, name="t.any", shared=False)
    def any_(*args: Any, **kwargs: Any) -> None:
        return None

    return application


ARGS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    ((1, 2), {}),
    ((), {"x": 1, "y": None}),
    (("it's", None, 1.5, True, -0.0, 10**30), {}),
    ((["nested", {"k": [1, (2, 3)]}],), {"when": datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)}),
    (("x" * 3000,), {}),
    ((Decimal("1.5"), uuid.UUID(int=5)), {}),
    (('ünïcødé \u2028 "quoted" \\',), {"é": "\n"}),
    ((float("nan"), float("inf")), {}),
    ((1,), {}),
]


def link() -> Any:
    from celery import signature

    return signature("t.noop")


EXTRA_OPTIONS: list[dict[str, Any]] = [
    {"expires": 60},
    {"expires": 1.5},
    {"expires": timedelta(seconds=5)},
    {"expires": datetime(2031, 1, 1, tzinfo=UTC)},
    {"expires": "2031-01-01T00:00:00+02:00"},
    {"argsrepr": "custom", "kwargsrepr": "()"},
    {"stamped_headers": ["s1"], "s1": "v"},
    {"queue": "q1", "exchange": "ex", "routing_key": "rk"},
    {"origin": "elsewhere"},
    {"time_limit": 0},
    {"retries": 0.0},
    {"retries": False},
    {"ignore_result": 0},
    {"group_index": 0},
    {"reply_to": ""},
    {"priority": -0.0},
    {"priority": 1.0},
    {"priority": True},
    {"link": None},
    {"chain": None, "chord": None},
]


def without_created(envelope: str) -> str:
    return re.sub(r',"c":\d+', "", envelope)


@pytest.mark.parametrize("options", OPTION_SETS + EXTRA_OPTIONS, ids=lambda o: ",".join(o) or "none")
def test_planned_envelope_is_the_one_job_envelope(app: Celery, options: dict[str, Any]) -> None:
    task = app.tasks["t.any"]
    jobs = [(f"job-{i}", DUE + i, args, kwargs) for i, (args, kwargs) in enumerate(ARGS)]
    assert plan_for(app, task, clean_options(options), (), {}) is not None  # the planned path
    planned = build_envelopes(app, task, jobs, options, max_payload=None)
    for (task_id, due, args, kwargs), envelope in zip(jobs, planned, strict=True):
        one = _build_one(app, task, task_id, due, args, kwargs, clean_options(options), None, None)
        assert without_created(envelope) == without_created(one)
        assert decode_envelope(envelope).headers["id"] == task_id


def test_planned_envelope_with_link_and_link_error(app: Celery) -> None:
    task = app.tasks["t.any"]
    options = {"link": link(), "link_error": [link()]}
    jobs = [(f"job-{i}", DUE, args, kwargs) for i, (args, kwargs) in enumerate(ARGS)]
    planned = build_envelopes(app, task, jobs, options)
    for (task_id, due, args, kwargs), envelope in zip(jobs, planned, strict=True):
        one = _build_one(app, task, task_id, due, args, kwargs, clean_options(options), None, None)
        assert without_created(envelope) == without_created(one)
        assert '"b":' in envelope  # the body's tail is not the plain one


def test_planned_envelope_inside_a_worker_task_and_with_a_schedule(app: Celery) -> None:
    from celery._state import _task_stack

    task = app.tasks["t.any"]
    parent = app.tasks["t.noop"]
    parent.push_request(id="parent-id", root_id="root-id", called_directly=False)
    _task_stack.push(parent)
    try:
        planned = build_envelope(app, task, "job", DUE, (1,), {}, {}, schedule=("nightly", DUE))
        one = _build_one(app, task, "job", DUE, (1,), {}, {}, None, ("nightly", DUE))
        same_as_root = build_envelope(app, task, "root-id", DUE, (1,), {}, {})
    finally:
        _task_stack.pop()
        parent.pop_request()
    assert without_created(planned) == without_created(one)
    decoded = decode_envelope(planned)
    assert (decoded.headers["root_id"], decoded.headers["parent_id"]) == ("root-id", "parent-id")
    assert decoded.schedule == ("nightly", DUE)
    assert decode_envelope(same_as_root).headers["root_id"] == "root-id"


def test_current_worker_task_agrees_with_celery(app: Celery) -> None:
    """The short read of Celery's task stack (no AttributeError when this thread has none)
    finds what ``app.current_worker_task`` finds: none, a worker's task, none in another
    thread, none for a task called directly, none once popped."""
    from celery._state import _task_stack

    parent = app.tasks["t.noop"]
    assert current_worker_task(app) is None and app.current_worker_task is None
    parent.push_request(id="parent-id", called_directly=False)
    _task_stack.push(parent)
    try:
        assert current_worker_task(app) is parent and app.current_worker_task is parent
        seen: list[Any] = []
        thread = threading.Thread(target=lambda: seen.append(current_worker_task(app)))
        thread.start()
        thread.join()
        assert seen == [None]
    finally:
        _task_stack.pop()
        parent.pop_request()
    parent.push_request(id="direct")  # called directly (task(), apply): not a worker's task
    _task_stack.push(parent)
    try:
        assert current_worker_task(app) is None and app.current_worker_task is None
    finally:
        _task_stack.pop()
        parent.pop_request()
    assert current_worker_task(app) is None


def test_compact_envelope_of_a_plain_job(app: Celery) -> None:
    envelope = build_envelope(app, app.tasks["t.noop"], "3f1e5c9a-0000-4000-8000-000000000000", DUE)
    data = json.loads(envelope)
    assert list(data) == ["v", "i", "a", "k", "j", "t", "o", "r", "q", "c"]
    assert envelope.count("3f1e5c9a-0000-4000-8000-000000000000") == 1
    assert (data["v"], data["t"], data["j"], data["q"]) == (3, "t.noop", "[[], {}", "celery")
    assert (data["a"], data["k"]) == ("()", "{}")
    decoded = decode_envelope(envelope)
    assert decoded.body == b'[[], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
    assert list(decoded.headers) == [
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps",
    ]  # fmt: skip
    assert list(decoded.props) == ["correlation_id", "reply_to"]
    assert (decoded.content_type, decoded.content_encoding, decoded.route) == (
        "application/json",
        "utf-8",
        {"queue": "celery"},
    )


# -- what the beat publishes is what apply_async publishes --------------------------------------

DISPATCH_OPTIONS: list[dict[str, Any]] = [
    {},
    {"queue": "q1", "priority": 3},
    {"serializer": "pickle"},
    {"headers": {"h": 1}},
    {"root_id": "root-1", "parent_id": "parent-1"},
    {"shadow": "nice-name", "retries": 2, "time_limit": 30},
    {"stamped_headers": ["s1"], "s1": "v"},
]


@pytest.mark.parametrize("options", DISPATCH_OPTIONS, ids=lambda o: ",".join(o) or "none")
def test_apply_at_many_publishes_what_apply_async_publishes(
    app: Celery, r: redis.Redis, options: dict[str, Any]
) -> None:
    task = app.tasks["t.any"]
    direct: list[dict[str, Any]] = []
    for i, (args, kwargs) in enumerate(ARGS):
        sent_id = task.apply_async(args, kwargs, task_id=f"direct-{i}", **options).id
        [[message]] = pop_broker_messages(r).values()
        direct.append(normalized(message, sent_id))
    results = task.apply_at_many([(time.time() - 1, args, kwargs) for args, kwargs in ARGS], **options)
    dispatch(app)
    published = {m["headers"]["id"]: m for messages in pop_broker_messages(r).values() for m in messages}
    assert len(published) == len(ARGS)
    for res, expected in zip(results, direct, strict=True):
        assert normalized(published[res.id], res.id) == expected


def test_arguments_dependent_routing_and_shadow_names_are_built_job_by_job(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    def by_first_argument(name: str, args: Any, kwargs: Any, options: Any, **kw: Any) -> Any:
        return {"queue": f"q-{args[0]}"} if args else None

    app = app_factory(task_routes=[by_first_argument], task_queues=None)

    class Shadowed(DelayedTask):
        abstract = True

        def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str:
            return f"shadow-{args[0]}"

    @app.task(base=Shadowed, name="t.routed", shared=False)
    def routed(x: int) -> int:
        return x

    assert plan_for(app, routed, {}, (1,), {}) is None
    direct = {}
    for x in (1, 2):
        sent_id = routed.apply_async((x,), task_id=f"direct-{x}").id
        [[message]] = pop_broker_messages(r).values()
        direct[x] = normalized(message, sent_id)
    results = routed.apply_at_many([(time.time() - 1, (x,), None) for x in (1, 2)])
    dispatch(app)
    lists = pop_broker_messages(r)
    assert sorted(lists) == ["q-1", "q-2"]
    for x, res in zip((1, 2), results, strict=True):
        [message] = lists[f"q-{x}"]
        assert message["headers"]["shadow"] == f"shadow-{x}"
        assert normalized(message, res.id) == direct[x]


# -- version 2 (the format before the job's own parts came first) ------------------------------


def as_version_2(envelope: str) -> str:
    """The envelope as the version-2 producer stored it: the same fields, without ``n``."""
    data = json.loads(envelope)
    data.pop("n", None)
    data["v"] = 2
    return json.dumps(data, separators=(",", ":"))


def test_version_2_envelopes_decode_to_the_same_message(app: Celery) -> None:
    task = app.tasks["t.any"]
    for options in (
        {},
        {"expires": 60, "queue": "q1", "priority": 3},
        {"retries": 2},
        {"serializer": "pickle"},
    ):
        for args, kwargs in ARGS:
            envelope = build_envelope(app, task, "job", DUE, args, kwargs, options)
            assert decode_envelope(as_version_2(envelope)) == decode_envelope(envelope)
    point = build_envelope(app, task, "{s}@x", DUE, (1,), {}, {}, schedule=("s", DUE))
    assert decode_envelope(as_version_2(point)).schedule == ("s", DUE)


def test_a_stored_version_2_job_is_published_as_before(app: Celery, r: redis.Redis) -> None:
    task = app.tasks["t.add"]
    sent_id = task.apply_async((1, 2), queue="q1").id
    [[message]] = pop_broker_messages(r).values()
    envelope = as_version_2(build_envelope(app, task, "v2-job", DUE, (1, 2), {}, {"queue": "q1"}))
    keys = get_store(app).keys.for_job("v2-job")
    r.zadd(keys.due, {"v2-job": server_ms(r) - 1000})
    r.hset(keys.jobs, "v2-job", stored_form("v2-job", envelope))
    dispatch(app)
    [[published]] = pop_broker_messages(r).values()
    assert normalized(published, "v2-job") == normalized(message, sent_id)


@pytest.mark.parametrize(
    "raw",
    [
        '{"v":2,"t":"t.add","j":"[[], {}"}',
        '{"v":2,"i":1,"t":"t.add","j":"[[], {}"}',
        '{"v":2,"i":"a","t":"t.add"}',
        '{"v":2,"i":"a","t":"t.add","j":"[[], {}","h":[1]}',
        '{"v":2,"i":"a","t":"t.add","j":"[[], {}","q":[1]}',
        '{"v":2,"i":"a","t":"t.add","j":"[[], {}","x":"soon"}',
        '{"v":2,"i":"a","t":"t.add","j":"[[], {}","x":1e30}',
        '{"v":2,"i":"a","t":"t.add","z":"!!"}',
        '{"v":1,"i":"a","t":"t.add","j":"[[], {}"}',
        '{"v":4,"i":"a","t":"t.add","j":"[[], {}"}',
        '{"v":3,"i":"a","t":"t.add"}',
    ],
)
def test_malformed_envelopes_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        decode_envelope(raw)


# -- plans follow the settings ------------------------------------------------------------------


def test_a_changed_setting_is_seen_by_the_next_call(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """With RECHECK_EVERY = 0 the fingerprint is read at every call (by default at most every
    0.5 s: test_extension checks that a change is seen once that time passed)."""
    monkeypatch.setattr(extension_module, "RECHECK_EVERY", 0.0)
    task = app.tasks["t.add"]
    first = task.apply_at(DUE / 1000, (1, 2))
    assert decode_envelope(get_store(app).get(first.id).envelope).route == {"queue": "celery"}  # type: ignore[union-attr]
    app.conf.task_default_queue = "elsewhere"
    second = task.apply_at(DUE / 1000, (1, 2))
    assert decode_envelope(get_store(app).get(second.id).envelope).route == {"queue": "elsewhere"}  # type: ignore[union-attr]
    app.conf.task_always_eager = True
    assert isinstance(task.apply_at(DUE / 1000, (1, 2)), EagerResult)
    app.conf.task_always_eager = False
    assert isinstance(task.apply_at(DUE / 1000, (1, 2)), ScheduledResult)


def test_a_forked_producer_plans_with_its_own_origin(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    task = app.tasks["t.add"]
    before = decode_envelope(build_envelope(app, task, "a", DUE, (1, 2)))
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    after = decode_envelope(build_envelope(app, task, "b", DUE, (1, 2)))
    assert after.headers["origin"].startswith("gen424242@")
    assert before.headers["origin"] != after.headers["origin"]


# -- pieces ---------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=40),
)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(st.tuples(), st.lists(scalars, max_size=6).map(tuple)),
    st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), scalars, max_size=5),
    st.sampled_from([None, 0, 1, 5, 20, 60, 1024]),
)
@pytest.mark.slow
def test_quick_saferepr_is_saferepr(
    args: tuple[Any, ...], kwargs: dict[Any, Any], maxlen: int | None
) -> None:
    for value in (args, kwargs):
        quick = _quick_saferepr(value, maxlen)
        if quick is not None:
            assert quick == saferepr(value, maxlen, maxlevels=3)


def test_new_task_ids_are_uuid4_strings() -> None:
    ids = new_task_ids(2000)
    assert len(set(ids)) == 2000
    for task_id in ids:
        parsed = uuid.UUID(task_id)
        assert str(parsed) == task_id
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
    assert new_task_ids(0) == []


def test_scheduled_results_made_many_at_once_are_like_one(app: Celery) -> None:
    due = datetime(2031, 1, 1, tzinfo=UTC)
    many = ScheduledResult.many([("a", due, True), ("b", None, False)], app.backend, "t.add", app)
    one = ScheduledResult("b", backend=app.backend, task_name="t.add", app=app, due=None, created=False)
    assert [(x.id, x.due, x.created) for x in many] == [("a", due, True), ("b", None, False)]
    assert {k: v for k, v in vars(many[1]).items() if k != "_on_ready"} == {
        k: v for k, v in vars(one).items() if k != "_on_ready"
    }
    assert many[1].on_ready is many[1].on_ready  # made once, on first use
    called: list[Any] = []
    many[1].then(called.append)
    many[1].on_ready(many[1])
    assert called == [many[1]]
    assert ScheduledResult.many([], app.backend, "t.add", app) == []


# -- enqueue: several jobs with one id in one call ----------------------------------------------


@pytest.mark.parametrize("replace", [False, True], ids=["keep", "replace"])
def test_enqueue_one_id_three_times_in_one_call(app: Celery, r: redis.Redis, replace: bool) -> None:
    store = get_store(app)
    due = server_ms(r) + 60_000
    result = store.enqueue([("a", due, "1"), ("a", due + 1, "2"), ("a", due + 2, "3")], replace=replace)
    shard = store.keys.for_job("a")
    if replace:
        replaced = EnqueueOutcome.REPLACED
        assert result == [(EnqueueOutcome.NEW, due), (replaced, due + 1), (replaced, due + 2)]
        assert (r.hget(shard.jobs, "a"), r.zscore(shard.due, "a")) == ("3", due + 2)
    else:
        assert result == [(EnqueueOutcome.NEW, due), (EnqueueOutcome.KEPT, due), (EnqueueOutcome.KEPT, due)]
        assert (r.hget(shard.jobs, "a"), r.zscore(shard.due, "a")) == ("1", due)


@pytest.mark.parametrize("replace", [False, True], ids=["keep", "replace"])
def test_enqueue_onto_a_leased_job_twice_in_one_call(app: Celery, r: redis.Redis, replace: bool) -> None:
    store = get_store(app)
    past = server_ms(r) - 1000
    store.enqueue([("a", past, "old")])
    shard = store.keys.for_job("a")
    [held] = store.claim([shard.index], "beat-1")
    assert [j.id for j in held.jobs] == ["a"]
    due = server_ms(r) + 60_000
    result = store.enqueue([("a", due, "new"), ("a", due + 1, "newer")], replace=replace)
    second = (EnqueueOutcome.REPLACED, due + 1) if replace else (EnqueueOutcome.KEPT, due)
    assert result == [(EnqueueOutcome.AFTER_HELD, due), second]
    assert r.hget(shard.leases, "a") is None
    assert r.hget(shard.jobs, "a") == ("newer" if replace else "new")


# -- the jobs hash keeps an envelope without its id --------------------------------------


def test_the_stored_envelope_leaves_its_id_to_the_hash_field(app: Celery, r: redis.Redis) -> None:
    from celery_delayq import DelayQ

    task = app.tasks["t.add"]
    res = task.apply_at(time.time() - 1, (1, 2))
    store = get_store(app)
    shard = store.keys.for_job(res.id)
    raw = r.hget(shard.jobs, res.id)
    assert raw is not None and res.id not in raw and raw.startswith('{"v":3,"a":"(1, 2)","k":"{}","j":')
    record = store.get(res.id)
    assert record is not None and decode_envelope(record.envelope).headers["id"] == res.id
    assert [decode_envelope(j.envelope).headers["root_id"] for j in store.scan()] == [res.id]
    job = DelayQ(app).get(res.id)
    assert job is not None and (job.task, job.args) == ("t.add", [1, 2])
    [claimed] = store.claim([shard.index], "beat-1")
    [held] = claimed.jobs
    assert held.envelope == record.envelope
    assert json.loads(held.envelope)["i"] == res.id


def test_an_envelope_stored_under_another_id_is_kept_whole(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    envelope = build_envelope(app, app.tasks["t.add"], "built-for-a", DUE, (1, 2))
    assert store.enqueue([("b", DUE, envelope), ("c", DUE, "plain text")]) == [
        (EnqueueOutcome.NEW, DUE), (EnqueueOutcome.NEW, DUE),
    ]  # fmt: skip
    assert r.hget(store.keys.for_job("b").jobs, "b") == envelope
    record = store.get("b")
    assert record is not None and record.envelope == envelope
    record = store.get("c")
    assert record is not None and record.envelope == "plain text"


def test_the_one_view_of_a_job(app: Celery) -> None:
    """Envelope.arguments/queue/priority: what DelayQ.get, the CLI and Spark show."""
    task = app.tasks["t.any"]
    options = {"queue": "q1", "priority": 3}
    routed = decode_envelope(build_envelope(app, task, "a", DUE, (1, "x"), {"k": [2]}, options))
    assert (routed.arguments(), routed.queue, routed.priority) == (([1, "x"], {"k": [2]}), "q1", 3)
    plain = decode_envelope(build_envelope(app, task, "b", DUE, (), {}))
    assert (plain.arguments(), plain.queue, plain.priority) == (([], {}), app.conf.task_default_queue, None)
    assert replace(plain, route={}).queue is None  # no route stored: the app's default queue
    pickled = decode_envelope(build_envelope(app, task, "c", DUE, (1,), {}, {"serializer": "pickle"}))
    assert not pickled.json_body and pickled.arguments() == ("(1,)", "{}")
    broken = replace(plain, body=b"[1, 2]")  # a JSON body that is not [args, kwargs, embed]
    with pytest.raises(CorruptData, match="JSON body"):
        broken.arguments()
    assert broken.arguments(reprs_if_unreadable=True) == ("()", "{}")


def test_stored_form_round_trip_and_requeue_opening() -> None:
    envelope = '{"v":3,"i":"j\\u00e9","a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}'
    assert id_opening("j\u00e9") == '{"v":3,"i":"j\\u00e9",'
    assert stored_form("j\u00e9", envelope) == '{"v":3,"a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}'
    assert loaded_form("j\u00e9", stored_form("j\u00e9", envelope)) == envelope
    assert stored_form("other", envelope) == envelope
    old = '{"v":2,"i":"j\\u00e9","t":"t.add","c":1}'  # version 2 was kept the same way
    assert stored_form("j\u00e9", old) == '{"v":2,"t":"t.add","c":1}'
    assert loaded_form("j\u00e9", stored_form("j\u00e9", old)) == old


# -- a shape many jobs share is kept once a shard ---------------------------------------------------


def test_jobs_of_one_shape_keep_it_once_and_read_back_whole(app: Celery, r: redis.Redis) -> None:
    task = app.tasks["t.any"]
    results = task.apply_at_many([(DUE / 1000, args, kwargs) for args, kwargs in ARGS[:6]])
    results.append(task.apply_at(DUE / 1000, (1, "x"), {"k": [2]}))
    store = get_store(app)
    shape_ids = set()
    for res in results:
        keys = store.keys.for_job(res.id)
        raw = r.hget(keys.jobs, res.id)
        assert raw is not None and '"t":' not in raw and shape_id_of(raw) is not None, raw
        shape_ids.add(shape_id_of(raw))
        assert r.hget(keys.shapes, shape_id_of(raw)) is not None  # written with the job
        record = store.get(res.id)
        assert record is not None
        decoded = decode_envelope(record.envelope)
        assert decoded.task == "t.any" and decoded.headers["id"] == res.id
    assert len(shape_ids) == 1  # one task, one producer, the same options
    # what a reader gets is exactly the envelope the producer built
    envelope = build_envelope(app, task, "same", DUE, (1, 2), {"k": 3})
    store.enqueue([("same", DUE, envelope)])
    record = store.get("same")
    assert (
        record is not None
        and record.envelope[: record.envelope.rfind(',"c":')] == envelope[: envelope.rfind(',"c":')]
    )


def test_flow_control_and_expiry_envelopes_are_stored_whole(app: Celery, r: redis.Redis) -> None:
    task = app.tasks["t.any"]
    store = get_store(app)
    gated = task.apply_at(DUE / 1000, (1,), headers={"delayq_gate": "x"})
    expiring = task.apply_at(DUE / 1000, (1,), expires=DUE / 1000 + 60)
    for res in (gated, expiring):
        raw = r.hget(store.keys.for_job(res.id).jobs, res.id)
        assert raw is not None and shape_id_of(raw) is None and '"t":"t.any"' in raw


def test_a_full_shapes_hash_stores_new_shapes_whole(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    keys = store.keys.for_job("whole")
    r.hset(keys.shapes, mapping={f"{n:016x}": '"t":"t.other"' for n in range(MAX_STORED_SHAPES)})
    envelope = build_envelope(app, app.tasks["t.add"], "whole", DUE, (1, 2))
    store.enqueue([("whole", DUE, envelope)])
    raw = r.hget(keys.jobs, "whole")
    assert raw is not None and shape_id_of(raw) is None  # joined back by enqueue.lua
    assert raw == stored_form("whole", envelope) and r.hlen(keys.shapes) == MAX_STORED_SHAPES
    record = store.get("whole")
    assert record is not None and record.envelope == envelope


def test_the_sweep_drops_the_shapes_of_a_shard_with_no_job(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    task = app.tasks["t.add"]
    task.apply_at(time.time() - 1, (1, 2))  # due: delivered below
    kept = task.apply_at(DUE / 1000, (3, 4))  # waits: its shard keeps its shapes
    shapes_before = {shard.index: r.hlen(shard.shapes) for shard in store.keys.all_shards()}
    dispatch(app)
    store.sweep_batches()
    kept_shard = store.keys.for_job(kept.id)
    for shard in store.keys.all_shards():
        if shard.index == kept_shard.index:
            assert r.hlen(shard.shapes) == 1
        else:
            assert r.hlen(shard.shapes) == 0, (shard.index, shapes_before)
    record = store.get(kept.id)
    assert record is not None and decode_envelope(record.envelope).task == "t.add"


def test_a_job_whose_shape_is_missing_is_dead_lettered_and_the_others_go(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    task = app.tasks["t.add"]
    lost = task.apply_at(time.time() - 1, (1, 2), task_id="lost-shape")
    other = task.apply_at(time.time() - 1, (3, 4), task_id="other-shape", queue="q1")
    keys = store.keys.for_job(lost.id)
    raw = r.hget(keys.jobs, lost.id)
    assert raw is not None
    r.hdel(keys.shapes, shape_id_of(raw))  # corrupt store: the shape is gone (no template either)
    with pytest.raises(CorruptData, match=r"shape .* is missing"):
        decode_envelope(store.get(lost.id).envelope)  # type: ignore[union-attr]
    dispatch(app)
    dead = store.dead_record(lost.id)
    assert dead is not None and "missing" in json.dumps(dead), dead
    [[message]] = pop_broker_messages(r).values()
    assert message["headers"]["id"] == other.id
