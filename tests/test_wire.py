"""The push publish path: messages built in the beat and pushed by ``lua/push_claimed.lua``.

When the broker is the store's Redis server and database, the beat builds kombu's
message itself and one script pushes it and removes the job. These tests check that
what reaches the queue is what kombu itself pushes for the same job, and what the
one-step push changes: no duplicate when a lease was lost.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import settings

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.wire import WireTemplates, wire_message
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.due import due_iso
from celery_delayq.producer.build import build_envelope
from celery_delayq.schedules.api import Schedules, point_id
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app
from tests.support.store import expire_leases
from tests.support.wire import (
    JOB_VALUES,
    OPTION_SETS,
    WITH_AND_WITHOUT_ETA,
    AppFactory,
    OptionSet,
    comparable,
    take_lists,
)


@pytest.mark.parametrize(
    ("args", "kwargs", "options"), [o[1:] for o in OPTION_SETS], ids=[o[0] for o in OPTION_SETS]
)
def test_the_push_path_pushes_what_kombu_pushes(
    app_factory: AppFactory,
    r: redis.Redis,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> None:
    """The same job (same id, arguments, options, due time), published by kombu and by the
    push path, lands in the same list as the same message (JSON compared as data)."""
    conf = {"accept_content": ["json", "pickle"]}
    via_kombu = app_factory(delayq_prefix="k", delayq_push=False, **conf)
    push = app_factory(delayq_prefix="a", **conf)
    due = time.time() - 1
    messages = []
    for application in (via_kombu, push):
        application.tasks["t.add"].apply_at(due, args, kwargs, task_id="same-job", **options)
        dispatcher = Dispatcher(application)
        dispatcher.run_once()
        dispatcher.close()
        assert dispatcher.pushing is (application is push)
        assert dispatcher.stats.published == dispatcher.stats.acked == 1
        assert DelayQ(application).count() == 0
        lists = take_lists(r)
        assert len(lists) == 1 and len(next(iter(lists.values()))) == 1
        messages.append(lists)
    kombu_lists, push_lists = messages
    assert list(kombu_lists) == list(push_lists)  # the same list key (queue, priority)
    (key,) = kombu_lists
    assert comparable(kombu_lists[key][0]) == comparable(push_lists[key][0])
    if "priority" in options and options["priority"] >= 3:
        assert key.endswith("\x06\x16" + str(options["priority"] // 3 * 3))


@JOB_VALUES
@settings(max_examples=150, deadline=None)
@WITH_AND_WITHOUT_ETA
def test_templates_equal_the_reference_message(
    template_env: Callable[[bool], tuple[Celery, Any, Dispatcher, WireTemplates]],
    publish_eta: bool,
    args: str,
    kwargs: str,
    due_ms: int,
) -> None:
    """A message filled in from a shape's template is the reference message of that job
    (with ``delayq_publish_eta``: with the job's due time as its ``eta``)."""
    application, producer, dispatcher, templates = template_env(publish_eta)
    job_id = str(uuid.uuid4())
    envelope = build_envelope(application, application.tasks["t.add"], job_id, due_ms, (args,), {"y": kwargs})
    built = templates.build(envelope, due_ms)
    assert built is not None
    key, text, queue, task = built
    reference = wire_message(
        templates.channel,
        producer,
        dispatcher.publishing.direct_args(producer, decode_envelope(envelope), due_ms),
        body_encoding=None,
    )
    assert reference is not None
    assert (key, queue, task) == (reference[0], "celery", "t.add")
    ours, theirs = json.loads(text), json.loads(reference[1])
    # byte for byte, but for the delivery tag
    tags = (ours["properties"]["delivery_tag"], theirs["properties"]["delivery_tag"])
    assert text.replace(tags[0], "<tag>") == reference[1].replace(tags[1], "<tag>")
    assert ours["headers"]["id"] == job_id
    assert ours["headers"]["delayq_due"] == due_ms
    assert ours["headers"]["eta"] == (due_iso(due_ms) if publish_eta else None)
    for message in (ours, theirs):
        message["properties"].pop("delivery_tag")
    assert ours == theirs


@pytest.fixture(scope="module")
def template_env() -> Iterator[Callable[[bool], tuple[Celery, Any, Dispatcher, WireTemplates]]]:
    """``(app, producer, dispatcher, templates)`` with ``delayq_publish_eta`` off or on; the
    templates are kept across the examples, as a beat keeps them across passes."""
    with EmbeddedRedis() as server:
        application = make_app(server.url + "/0", delayq_url=server.url + "/0")

        @application.task(base=DelayedTask, name="t.add", shared=False)
        def add(x: Any, y: Any = None) -> Any:
            return x

        made: dict[bool, tuple[Celery, Any, Dispatcher, WireTemplates]] = {}
        with application.producer_or_acquire() as producer:

            def env(publish_eta: bool) -> tuple[Celery, Any, Dispatcher, WireTemplates]:
                if publish_eta not in made:
                    dispatcher = Dispatcher(application)
                    publishing = dispatcher.publishing
                    publishing.config = replace(publishing.config, publish_eta=publish_eta)
                    publishing.begin(producer)  # a pass's settings, as a beat's pass reads them
                    templates = WireTemplates(producer.channel, producer, publishing.direct_args)
                    made[publish_eta] = (application, producer, dispatcher, templates)
                return made[publish_eta]

            yield env
            for _, _, dispatcher, _ in made.values():
                dispatcher.close()
        application.close()


#: Option sets compared with Celery's own ``apply_async(eta=...)`` (an expiry is left out:
#: Celery counts ``expires=600`` from the moment it sends, delayq from the due time).
ETA_OPTION_SETS = [o for o in OPTION_SETS if o[0] != "expires"] + [
    ("compressed", (1,), {}, {"compression": "zlib"}),
]


@pytest.mark.parametrize("option_set", ETA_OPTION_SETS, ids=[o[0] for o in ETA_OPTION_SETS])
def test_with_publish_eta_every_path_pushes_what_celery_pushes_for_that_eta(
    app_factory: AppFactory, r: redis.Redis, option_set: OptionSet
) -> None:
    """With ``delayq_publish_eta``, a job published by the push path, by kombu's
    ``Producer.publish`` and by Celery's ``send_task_message`` (the path taken when
    task-sent events are on) is the message Celery's own ``apply_async(eta=due)`` sends for
    the same job and id, plus the ``delayq_due`` header: its ``eta`` is the due time, to the
    millisecond, written as Celery writes an aware ``eta``."""
    _, args, kwargs, options = option_set
    conf = {"accept_content": ["json", "pickle"], "delayq_publish_eta": True}
    paths = {
        "kombu": app_factory(delayq_prefix="k", delayq_push=False, **conf),
        "push": app_factory(delayq_prefix="a", **conf),
        "send_task_message": app_factory(delayq_prefix="s", task_send_sent_event=True, **conf),
    }
    due_ms = int(time.time() * 1000) - 1234
    messages: dict[str, tuple[str, dict[str, Any]]] = {}
    for path, application in paths.items():
        application.tasks["t.add"].apply_at(due_ms / 1000, args, kwargs, task_id="same-job", **options)
        dispatcher = Dispatcher(application)
        dispatcher.run_once()
        dispatcher.close()
        assert dispatcher.pushing is (path == "push"), path  # (a compressed job goes through kombu)
        assert dispatcher.stats.published == dispatcher.stats.acked == 1
        ((key, [message]),) = take_lists(r).items()
        assert message["headers"]["eta"] == due_iso(due_ms), path
        assert message["headers"].pop("delayq_due") == due_ms
        messages[path] = (key, comparable(message))
    celery_app = paths["kombu"]
    eta = datetime.fromtimestamp(due_ms / 1000, UTC)
    celery_app.tasks["t.add"].apply_async(args, kwargs, task_id="same-job", eta=eta, **options)
    ((key, [message]),) = take_lists(r).items()
    assert message["headers"]["eta"] == eta.isoformat() == due_iso(due_ms)
    celery = (key, comparable(message))
    for path, ours in messages.items():
        assert ours == celery, path


def test_a_job_whose_lease_was_taken_over_is_not_pushed_again(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """kombu's path publishes, then acks: a beat whose lease expired meanwhile has already
    published, and the beat that re-claimed the job publishes it again. On the push path
    the push happens only while the lease is held, so the slow beat pushes nothing."""
    application = app_factory()
    jobs = [application.tasks["t.add"].apply_at(time.time() - 1, (i,)) for i in range(20)]
    slow, fast = Dispatcher(application), Dispatcher(application)
    store = get_store(application)
    claimed = [
        (res.shard, job) for res in store.claim(range(store.config.shards), slow.token) for job in res.jobs
    ]
    assert len(claimed) == 20
    assert len(expire_leases(store)) == 20  # the slow beat's leases expire
    fast.run_once()
    assert fast.stats.published == 20 and fast.pushing
    slow.publish_claimed(claimed)  # the slow beat goes on with what it claimed
    assert slow.stats.published == 0 and slow.stats.stale_acks == 20
    ids = [m["headers"]["id"] for m in take_lists(r)["celery"]]
    assert sorted(ids) == sorted(j.id for j in jobs)
    for d in (slow, fast):
        d.close()


def test_a_cancel_while_the_beat_holds_the_job_wins(app_factory: AppFactory, r: redis.Redis) -> None:
    application = app_factory()
    job = application.tasks["t.add"].apply_at(time.time() - 1, (1,))
    beat = Dispatcher(application)
    store = get_store(application)
    claimed = [
        (res.shard, j) for res in store.claim(range(store.config.shards), beat.token) for j in res.jobs
    ]
    # cancel() cannot know which path the beat takes, so it says "may already be in the
    # broker" ("delivering", false); on the push path the job is then never pushed.
    assert DelayQ(application).cancel(job.id) == "delivering"
    assert DelayQ(application).get(job.id) is None
    beat.publish_claimed(claimed)
    assert beat.stats.published == 0 and take_lists(r) == {}
    beat.close()


def test_a_queue_key_that_is_not_a_list_dead_letters_only_its_jobs(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    application = app_factory()
    r.set("q2", "not a list")
    bad = application.tasks["t.add"].apply_at(time.time() - 1, (1,), queue="q2")
    good = application.tasks["t.add"].apply_at(time.time() - 1, (2,))
    beat = Dispatcher(application)
    beat.run_once()
    assert beat.pushing and beat.stats.published == 1 and beat.stats.dead_lettered == 1
    dead = dict(DelayQ(application).dead())
    assert list(dead) == [bad.id] and "is not a list" in dead[bad.id]["reason"]
    assert [m["headers"]["id"] for m in take_lists(r)["celery"]] == [good.id]
    r.delete("q2")
    beat.close()


@pytest.mark.slow
def test_the_push_path_needs_the_same_server_and_database(app_factory: AppFactory, redis_url: str) -> None:
    other_db = redis_url.rsplit("/", 1)[0] + "/5"
    with EmbeddedRedis() as other:
        for broker, expected in ((redis_url, True), (other_db, False), (other.url + "/0", False)):
            application = app_factory(broker=broker)
            application.tasks["t.add"].apply_at(time.time() - 1, (1,))
            beat = Dispatcher(application)
            beat.run_once()
            assert (beat.pushing, beat.stats.published) == (expected, 1), broker
            beat.close()
    redis.Redis.from_url(other_db).flushdb()


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
@pytest.mark.slow
def test_with_publish_eta_a_schedule_point_carries_its_time_as_eta(
    app_factory: AppFactory, r: redis.Redis, push: bool
) -> None:
    """A recurring schedule's point is published by the same code (kombu's
    ``Producer.publish``, whatever the path of plain jobs): its ``eta`` is the point's time."""
    application = app_factory(delayq_publish_eta=True, delayq_push=push)
    created = Schedules(application).add("every-second", application.tasks["t.add"], 1, (1,))
    assert created.next_run is not None
    due_ms = round(created.next_run.timestamp() * 1000)
    time.sleep(max(0.0, due_ms / 1000 - time.time()) + 0.05)
    dispatcher = Dispatcher(application)
    dispatcher.run_once()
    dispatcher.close()
    assert dispatcher.stats.published == 1
    ((_, [message]),) = take_lists(r).items()
    assert message["headers"]["id"] == point_id("every-second", due_ms)
    assert message["headers"]["eta"] == due_iso(due_ms)
    assert message["headers"]["delayq_due"] == due_ms
