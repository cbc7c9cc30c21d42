"""Celery canvas through delayq, in process: what is stored, and what is refused at the call.

The intercepted ``apply_async(countdown=)`` of groups, chords and chains, and
``celery_delayq.apply_at(signature, eta)``/``apply_in`` for any signature or
canvas. tests/test_canvas_e2e.py runs the same shapes with a real worker and beat.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group, signature
from celery.result import AsyncResult, GroupResult

import celery_delayq
from celery_delayq import DelayedTask, DelayQ, ScheduledResult, StoreFull
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import InvalidDueTime, InvalidOptions, UnknownTask
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from tests.support.apps import forget_subscriptions, make_app


@pytest.fixture
def capp(redis_url: str) -> Iterator[Celery]:
    """An app with a DelayedTask ``c.add`` and a plain task ``c.plain``, results in db 1."""
    application = make_app(redis_url, redis_url, result_backend=redis_url[:-2] + "/1")

    @application.task(base=DelayedTask, name="c.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @application.task(name="c.plain", shared=False)
    def plain(*args: Any) -> None:
        return None

    yield application
    forget_subscriptions(application)
    get_store(application).close()
    application.close()


def stored(app: Celery) -> dict[str, Any]:
    """Every waiting job: id -> decoded envelope."""
    store = get_store(app)
    out = {}
    for job in DelayQ(app).pending(limit=1000):
        record = store.get(job.id)
        assert record is not None
        out[job.id] = decode_envelope(record.envelope)
    return out


def broker_queue_length(app: Celery, queue: str = "celery") -> int:
    with app.connection_for_write() as conn:
        client = conn.channel().client
        return int(client.llen(queue))


# -- intercept: Celery's canvas passes its producer to each member ---------------------------


@pytest.mark.parametrize(
    "shape",
    ["group", "chord", "group_of_set_members", "chain"],
)
def test_intercepted_canvas_with_countdown_stores_each_member(capp: Celery, shape: str) -> None:
    capp.conf.delayq_intercept_eta = True
    add = capp.tasks["c.add"]
    before = time.time()
    if shape == "group":
        result = group(add.s(i, i) for i in range(3)).apply_async(countdown=8)
        expected = {r.id for r in result.results}
    elif shape == "chord":
        result = chord([add.s(i, i) for i in range(3)], add.s(1)).apply_async(countdown=8)
        expected = {r.id for r in result.parent.results}
    elif shape == "group_of_set_members":
        result = group(add.s(1, 1).set(countdown=8), add.s(2, 2).set(countdown=8)).apply_async()
        expected = {r.id for r in result.results}
    else:
        result = chain(add.s(1, 1), add.s(2), add.s(3)).apply_async(countdown=8)
        expected = {result.parent.parent.id}  # the first task; the rest ride in its message
    jobs = stored(capp)
    assert set(jobs) == expected
    assert broker_queue_length(capp) == 0  # nothing published at once
    for job in DelayQ(capp).pending():
        assert before + 8 - 0.01 <= job.due.timestamp() <= time.time() + 8 + 0.01
    if shape in ("group", "chord"):
        group_ids = {env.headers["group"] for env in jobs.values()}
        assert len(group_ids) == 1 and None not in group_ids
    if shape == "chord":
        assert all(env.headers["group_index"] is not None for env in jobs.values())
        assert all(b'"chord": {' in env.body for env in jobs.values())  # the callback rides along
    if shape == "chain":
        (env,) = jobs.values()
        assert b'"chain": [' in env.body


def test_intercepted_group_member_without_countdown_is_published_at_once(capp: Celery) -> None:
    capp.conf.delayq_intercept_eta = True
    add = capp.tasks["c.add"]
    result = group(add.s(1, 1).set(countdown=8), add.s(2, 2)).apply_async()
    assert set(stored(capp)) == {result.results[0].id}
    assert broker_queue_length(capp) == 1


def test_explicit_apply_at_still_refuses_a_producer(capp: Celery) -> None:
    add = capp.tasks["c.add"]
    with capp.producer_or_acquire() as producer:
        with pytest.raises(InvalidOptions, match="option 'producer' is not supported by apply_at"):
            add.apply_in(5, (1, 1), producer=producer)
        with pytest.raises(InvalidOptions, match="option 'producer' is not supported by apply_at"):
            celery_delayq.apply_in(add.s(1, 1), 5, producer=producer)
    assert DelayQ(capp).count() == 0


# -- celery_delayq.apply_at / apply_in ------------------------------------------------------


def test_apply_at_a_signature_of_a_plain_task_keeps_its_options(capp: Celery) -> None:
    plain = capp.tasks["c.plain"]
    due = datetime.fromtimestamp(round(time.time()) + 60, tz=UTC)
    sig = plain.s(1, 2).set(queue="canvas", priority=3, task_id="sig-1")
    result = celery_delayq.apply_at(sig, due)
    assert isinstance(result, ScheduledResult)
    assert (result.id, result.due, result.created) == ("sig-1", due, True)
    env = stored(capp)["sig-1"]
    assert env.task == "c.plain"
    assert env.route["queue"] == "canvas"
    assert env.route["priority"] == 3
    assert broker_queue_length(capp) == 0
    # A normal job: found, rescheduled and cancelled by id.
    dq = DelayQ(capp)
    assert dq.reschedule("sig-1", time.time() + 120)
    assert dq.cancel("sig-1")
    assert dq.count() == 0


def test_apply_in_options_override_the_signatures(capp: Celery) -> None:
    sig = capp.tasks["c.add"].s(1, 2).set(queue="a")
    result = celery_delayq.apply_in(sig, 30, queue="b")
    assert stored(capp)[result.id].route["queue"] == "b"
    assert sig.options == {"queue": "a"}  # the caller's signature is not changed


def test_apply_at_a_group_stores_every_member_under_one_group_id(capp: Celery) -> None:
    plain = capp.tasks["c.plain"]
    due = round(time.time()) + 60
    result = celery_delayq.apply_at(group(plain.s(i) for i in range(4)), due)
    assert isinstance(result, GroupResult)
    jobs = stored(capp)
    assert set(jobs) == {r.id for r in result.results}
    assert {env.headers["group"] for env in jobs.values()} == {result.id}
    assert sorted(env.headers["group_index"] for env in jobs.values()) == [0, 1, 2, 3]
    assert {job.due.timestamp() for job in DelayQ(capp).pending()} == {due}


def test_apply_at_a_chord_returns_the_callbacks_result(capp: Celery) -> None:
    plain = capp.tasks["c.plain"]
    result = celery_delayq.apply_in(chord([plain.s(i) for i in range(3)], plain.s()), 60)
    assert isinstance(result, AsyncResult) and not isinstance(result, ScheduledResult)
    jobs = stored(capp)
    assert set(jobs) == {r.id for r in result.parent.results}
    assert all(result.id.encode() in env.body for env in jobs.values())  # the callback's id


def test_apply_at_a_chain_stores_its_first_task_with_the_rest_in_its_message(capp: Celery) -> None:
    add = capp.tasks["c.add"]
    result = celery_delayq.apply_in(chain(add.s(1, 1), add.s(2), add.s(3)), 60)
    first = result.parent.parent
    jobs = stored(capp)
    assert set(jobs) == {first.id}
    assert result.id.encode() in jobs[first.id].body


def test_apply_at_replace(capp: Celery) -> None:
    sig = capp.tasks["c.add"].s(1, 2).set(task_id="same")
    first = celery_delayq.apply_in(sig, 60)
    kept = celery_delayq.apply_in(sig, 120)
    assert (first.created, kept.created, kept.due) == (True, False, first.due)
    moved = celery_delayq.apply_in(sig, 120, replace=True)
    assert moved.created and moved.due > first.due


def test_bad_input_raises_at_the_call_and_stores_nothing(capp: Celery) -> None:
    add = capp.tasks["c.add"]
    with pytest.raises(TypeError, match="take a Celery signature"):
        celery_delayq.apply_at(add, time.time() + 5)
    with pytest.raises(TypeError, match="take a Celery signature"):
        celery_delayq.apply_in(("c.add", (1, 2)), 5)
    with pytest.raises(UnknownTask, match=r"'c\.nope' is not registered"):
        celery_delayq.apply_in(group(add.s(1, 1), signature("c.nope", app=capp)), 5)
    with pytest.raises(TypeError):  # the third member does not fit add's signature
        celery_delayq.apply_in(group(add.s(1, 1), add.s(2, 2), add.s(1, 2, 3)), 5)
    with pytest.raises(InvalidOptions, match="option 'countdown' conflicts"):
        celery_delayq.apply_in(add.s(1, 1), 5, countdown=3)
    with pytest.raises(InvalidOptions, match="option 'countdown' conflicts"):
        celery_delayq.apply_in(group(add.s(1, 1), add.s(1, 2).set(countdown=3)), 5)
    with pytest.raises(InvalidDueTime):
        celery_delayq.apply_in(add.s(1, 1), -1)
    capp.conf.enable_utc = False
    with pytest.raises(InvalidDueTime, match="naive datetime"):
        celery_delayq.apply_at(add.s(1, 1), datetime(2030, 1, 1))
    assert DelayQ(capp).count() == 0
    assert broker_queue_length(capp) == 0


def test_eager_mode_runs_at_once(capp: Celery) -> None:
    capp.conf.task_always_eager = True
    add = capp.tasks["c.add"]
    result = celery_delayq.apply_in(group(add.s(1, 1), add.s(2, 2)), 60)
    assert result.get() == [2, 4]
    assert DelayQ(capp).count() == 0


@pytest.mark.parametrize("shape", ["group_of_chains", "chain_from_a_group", "chunks", "map"])
def test_apply_at_nested_and_builtin_canvases_publish_nothing_now(capp: Celery, shape: str) -> None:
    add = capp.tasks["c.add"]
    plain = capp.tasks["c.plain"]
    if shape == "group_of_chains":
        sig: Any = group(chain(add.s(1, 1), add.s(2)), chain(add.s(3, 3), add.s(4)))
        expected = 2  # the first task of each chain
    elif shape == "chain_from_a_group":
        sig = chain(group(add.s(1, 1), add.s(2, 2)), plain.s())  # Celery makes it a chord
        expected = 2
    elif shape == "chunks":
        sig = add.chunks(zip(range(4), range(4), strict=True), 2)
        expected = 1  # one celery.chunks message: the worker splits it
    else:
        sig = plain.map([1, 2, 3])
        expected = 1  # one celery.map message
    celery_delayq.apply_in(sig, 60)
    assert broker_queue_length(capp) == 0
    assert DelayQ(capp).count() == expected


def test_apply_at_refuses_a_chord_due_after_the_result_backends_chord_expiry(capp: Celery) -> None:
    capp.conf.result_chord_expires = 600
    plain = capp.tasks["c.plain"]
    with pytest.raises(InvalidOptions, match=r"chord due in \d+ s, after result_chord_expires \(600 s\)"):
        celery_delayq.apply_in(chord([plain.s(1), plain.s(2)], plain.s()), 601)
    assert DelayQ(capp).count() == 0
    celery_delayq.apply_in(chord([plain.s(1), plain.s(2)], plain.s()), 590)
    assert DelayQ(capp).count() == 2


def test_a_full_redis_refuses_a_canvas_whole(server_binary: tuple[str, str]) -> None:
    """Faults: a store at ``maxmemory`` (``noeviction``) refuses the enqueue script of every shard
    before it writes, so ``apply_at`` of a group raises ``StoreFull`` at the call, naming every
    member as not stored, and no member is stored: a caller can retry the whole canvas. On each
    server: Redis 7 refuses at the script's first write, and so must 6.2, which has no script
    flags."""
    with EmbeddedRedis(binary=server_binary[1]) as srv:
        url = srv.url + "/0"
        application = make_app(url, url)

        @application.task(base=DelayedTask, name="c.add", shared=False)
        def add(x: int, y: int) -> int:
            return x + y

        client = redis.Redis.from_url(url)
        try:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
            members = group(add.s(i, i) for i in range(40))
            with pytest.raises(StoreFull, match="maxmemory") as refused:
                celery_delayq.apply_in(members, 60)
            assert refused.value.stored == [] and len(refused.value.not_stored) == 40
            client.config_set("maxmemory", 0)
            assert DelayQ(application).count() == 0
            result = celery_delayq.apply_in(members, 60)
            assert DelayQ(application).count() == len(result.results) == 40
        finally:
            client.close()
            get_store(application).close()
            application.close()
