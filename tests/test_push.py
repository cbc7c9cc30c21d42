"""The push path on claim: ``lua/push.lua`` claims due jobs and pushes their messages itself.

When the broker is the store's Redis server and database, a due job whose message has a
stored template (one per job shape, written by the beat the first time it meets that shape)
is pushed into its queue and removed inside one script, with no round trip through the beat.
These tests check that what reaches the queue is what kombu pushes for the same job, that
every job goes out exactly once, and what each fault does: a lease another beat holds, a
queue key that is not a list, a full Redis, a corrupt envelope or template, a full
templates hash.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import example, settings
from kombu import Queue

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.wire import WireTemplates
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.flow.gate import BATCH_DONE_HEADER, GATE_HEADER
from celery_delayq.schedules.api import Schedules
from celery_delayq.store.delivery import MAX_STORED_TEMPLATES, TEMPLATES_TTL_MS
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app
from tests.support.clocks import Clock
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.store import expire_leases, make_full
from tests.support.wire import (
    JOB_VALUES,
    OPTION_SETS,
    AppFactory,
    OptionSet,
    comparable,
    take_lists,
)

#: Every option set of test_wire's differential test, and a compressed body.
ALL_SETS: list[OptionSet] = [*OPTION_SETS, ("compressed", (1,), {}, {"compression": "zlib"})]
#: The option sets whose jobs go the beat's way: an expiry (checked at publish), a body that is
#: not UTF-8 text (pickle), a compressed body (kombu compresses it).
BEATS_WAY = {"expires", "pickle", "compressed"}


def drain(application: Celery, passes: int = 50) -> Dispatcher:
    """A new dispatcher (it claims every shard at its first pass) run until nothing is stored."""
    dispatcher = Dispatcher(application)
    for _ in range(passes):
        dispatcher.run_once()
        if DelayQ(application).count() == 0:
            break
    dispatcher.close()
    return dispatcher


def warm_up(application: Celery, args: tuple[Any, ...] = (0,), **options: Any) -> None:
    """Deliver one job of this shape the beat's way, which stores its template."""
    application.tasks["t.add"].apply_at(time.time() - 1, args, **options)
    dispatcher = drain(application)
    assert dispatcher.stats.pushed_on_claim == 0 and dispatcher.stats.published == 1


@pytest.mark.parametrize(("name", "args", "kwargs", "options"), ALL_SETS, ids=[o[0] for o in ALL_SETS])
def test_pushing_on_claim_pushes_what_kombu_pushes(
    app_factory: AppFactory,
    r: redis.Redis,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> None:
    """The same job published by kombu and pushed on claim (its template stored by an
    earlier job of the same shape) lands in the same list as the same message."""
    conf = {"accept_content": ["json", "pickle"], "delayq_shards": 1}
    via_kombu = app_factory(delayq_prefix="k", delayq_push=False, **conf)
    on_claim = app_factory(delayq_prefix="a", **conf)
    warm_up(on_claim, args, **options)
    take_lists(r)
    due = time.time() - 1
    messages = []
    for application in (via_kombu, on_claim):
        application.tasks["t.add"].apply_at(due, args, kwargs, task_id="same-job", **options)
        dispatcher = drain(application)
        expected = 1 if application is on_claim and name not in BEATS_WAY else 0
        assert dispatcher.stats.pushed_on_claim == expected, name
        assert dispatcher.stats.published == dispatcher.stats.acked == 1
        messages.append(take_lists(r))
    kombu_lists, ours = messages
    assert list(kombu_lists) == list(ours)  # the same list key (queue, priority)
    (key,) = kombu_lists
    assert comparable(kombu_lists[key][0]) == comparable(ours[key][0])


@pytest.fixture(scope="module")
def lua_env() -> Iterator[Callable[[bool], tuple[Celery, Dispatcher, WireTemplates, list[Any]]]]:
    """``(app, dispatcher, templates, push arguments)`` with ``delayq_publish_eta`` off or on,
    a template stored for ``t.add`` with one positional and one keyword argument; the beat's
    own templates on a producer kept open (as a beat's pass holds one)."""
    with EmbeddedRedis() as server, contextlib.ExitStack() as stack:
        made: dict[bool, tuple[Celery, Dispatcher, WireTemplates, list[Any]]] = {}

        def env(publish_eta: bool) -> tuple[Celery, Dispatcher, WireTemplates, list[Any]]:
            if publish_eta not in made:
                url = f"{server.url}/{int(publish_eta)}"
                application = make_app(url, delayq_url=url, delayq_shards=1, delayq_publish_eta=publish_eta)

                @application.task(base=DelayedTask, name="t.add", shared=False)
                def add(x: Any, y: Any = None) -> Any:
                    return x

                warm_up(application, ("a",), kwargs={"y": "b"})
                get_store(application).client.delete("celery")
                dispatcher = Dispatcher(application)
                producer = stack.enter_context(application.producer_or_acquire())
                dispatcher.push_path.begin(producer)
                space = dispatcher.push_path.space
                assert space is not None
                templates = WireTemplates(producer.channel, producer, dispatcher.publishing.direct_args)
                args = [space, 1_048_576, GATE_HEADER, BATCH_DONE_HEADER]
                made[publish_eta] = (application, dispatcher, templates, args)
            return made[publish_eta]

        yield env
        for application, dispatcher, _, _ in made.values():
            dispatcher.close()
            application.close()


def tricky_texts(test: Callable[..., None]) -> Callable[..., None]:
    """Texts that hold what the script looks for where a text ends (``'","'``, ``'","k":"'``,
    ``'","t":'``) and what JSON escapes before a quote (a backslash, a quote): each text still
    ends where it ends. Due times at both ends of the range."""
    test = example(args='","k":"', kwargs='\\","t":', due_ms=1)(test)
    test = example(args="\\", kwargs='"\\"', due_ms=253_402_300_799_999)(test)
    return example(args='x","j":"y', kwargs='","b":"', due_ms=0)(test)


def push_one(
    env: tuple[Celery, Dispatcher, WireTemplates, list[Any]], args: str, kwargs: str, due_ms: int
) -> tuple[str, str, Any]:
    """A ``t.add`` job of these argument texts whose expired lease holds ``due_ms``, pushed by
    lua/push.lua: ``(job id, its envelope, the push's result)``."""
    application, _, _, push_args = env
    store = get_store(application)
    keys = store.keys.shard(0)
    job = application.tasks["t.add"].apply_at(time.time() - 1, (args,), {"y": kwargs})
    # an expired lease holding the due time: the script publishes the job as due then
    store.client.zadd(keys.due, {job.id: 1})
    store.client.hset(keys.leases, job.id, f"{due_ms}|0|gone")
    record = store.get(job.id)
    assert record is not None
    (result,) = store.push([0], "tok", push_args)
    return job.id, record.envelope, result


@pytest.mark.slow
@JOB_VALUES
@settings(max_examples=150, deadline=None)
@tricky_texts
def test_the_script_fills_templates_in_as_the_beat_does(
    lua_env: Callable[[bool], tuple[Celery, Dispatcher, WireTemplates, list[Any]]],
    args: str,
    kwargs: str,
    due_ms: int,
) -> None:
    """Any argument text (escapes, non-ASCII, surrogate pairs) and any due time from 1970 to
    9999: the message lua/push.lua makes is the one the beat's own template makes (which
    test_wire compares with kombu's), its delivery tag aside."""
    application, _, templates, _ = env = lua_env(False)
    job_id, envelope, result = push_one(env, args, kwargs, due_ms)
    store = get_store(application)
    keys = store.keys.shard(0)
    client = store.client
    assert (result.pushed, result.jobs) == (1, [])
    assert client.hget(keys.leases, job_id) is None and store.count() == 0
    built = templates.build(envelope, due_ms)
    assert built is not None, envelope
    key, text, _, _ = built
    pushed = client.rpop(key)
    assert pushed is not None and client.llen(key) == 0
    ours, theirs = json.loads(pushed), json.loads(text)
    tag = ours["properties"].pop("delivery_tag")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-" + re.escape(job_id), tag), tag
    theirs["properties"].pop("delivery_tag")
    assert ours == theirs
    their_tag = json.loads(text)["properties"]["delivery_tag"]
    assert pushed.replace(tag, "T") == text.replace(their_tag, "T")  # byte for byte


@JOB_VALUES
@settings(max_examples=30, deadline=None)  # one outcome whatever the text: fewer than above
@tricky_texts
def test_with_publish_eta_the_script_leaves_every_job_to_the_beat(
    lua_env: Callable[[bool], tuple[Celery, Dispatcher, WireTemplates, list[Any]]],
    args: str,
    kwargs: str,
    due_ms: int,
) -> None:
    """With ``delayq_publish_eta`` the script leaves the job to the beat, leased with its due
    time (an ``eta`` is a date to write: the beat writes it), whatever its argument texts."""
    env = lua_env(True)
    job_id, _, result = push_one(env, args, kwargs, due_ms)
    assert result.pushed == 0 and [(j.id, j.due_ms) for j in result.jobs] == [(job_id, due_ms)]
    get_store(env[0]).ack("tok", {0: [job_id]})


@pytest.mark.slow
def test_every_job_goes_out_once_with_two_beats_racing(app_factory: AppFactory, r: redis.Redis) -> None:
    """Two beats drain the same shards at once: each job is in the queue exactly once."""
    application = app_factory(delayq_shards=4)
    add = application.tasks["t.add"]
    add.apply_at_many([(time.time() - 1, (i,), None) for i in range(40)])
    drain(application)  # a template on every shard that had a job
    take_lists(r)
    ids = [j.id for j in add.apply_at_many([(time.time() - 1, (i,), None) for i in range(5000)])]
    beats = [Dispatcher(application) for _ in range(2)]

    def run(beat: Dispatcher) -> None:
        for _ in range(200):
            beat.run_once()
            if DelayQ(application).count() == 0:
                return

    threads = [threading.Thread(target=run, args=(beat,)) for beat in beats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    messages = [json.loads(m) for m in r.lrange("celery", 0, -1)]
    pushed = [m["headers"]["id"] for m in messages]
    assert sorted(pushed) == sorted(ids)
    assert sum(b.stats.pushed_on_claim for b in beats) > 0
    # every delivery tag is its own (kombu keys a worker's unacked messages by it: two alike,
    # and one is lost when a dead worker's messages are restored; a CI soak found it)
    tags = [m["properties"]["delivery_tag"] for m in messages]
    assert len(set(tags)) == len(tags)
    assert sum(b.stats.published for b in beats) == len(ids)
    for beat in beats:
        beat.close()


def test_a_lease_another_beat_holds_is_left_alone_and_an_expired_one_goes_out_once(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """A job leased to a live beat is not due (its score is the lease's end): the script does
    not touch it. Once the lease has expired, the script pushes it once, at its original due
    time, and removes its lease; the slow beat then pushes nothing."""
    application = app_factory(delayq_shards=1)
    warm_up(application)
    take_lists(r)
    jobs = [application.tasks["t.add"].apply_at(time.time() - 5, (i,)) for i in range(20)]
    slow = Dispatcher(application)
    store = get_store(application)
    claimed = [(res.shard, job) for res in store.claim([0], slow.token) for job in res.jobs]
    assert len(claimed) == 20
    wall = Clock()
    fast = Dispatcher(application, wall=wall)
    fast.run_once()
    assert fast.stats.published == 0 and r.llen("celery") == 0
    # The slow beat's leases expire: on the server, and on the fast beat's clock.
    assert len(expire_leases(store)) == 20
    wall.advance(store.config.reclaim_ttl)
    fast.run_once()
    assert fast.stats.pushed_on_claim == fast.stats.published == 20
    assert r.hlen(store.keys.shard(0).leases) == 0
    slow.publish_claimed(claimed)
    assert slow.stats.published == 0 and slow.stats.stale_acks == 20
    messages = [json.loads(m) for m in r.lrange("celery", 0, -1)]
    assert sorted(m["headers"]["id"] for m in messages) == sorted(j.id for j in jobs)
    due = {j.id: round(j.due.timestamp() * 1000) for j in jobs}
    assert all(m["headers"]["delayq_due"] == due[m["headers"]["id"]] for m in messages)
    for d in (slow, fast):
        d.close()


def test_a_queue_key_that_is_not_a_list_dead_letters_only_its_jobs(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """The script's LPUSH is refused (WRONGTYPE): those jobs go to the beat, which buries them;
    the other queue's jobs are pushed by the script."""
    application = app_factory(delayq_shards=1)
    warm_up(application, queue="q2")
    warm_up(application)
    take_lists(r)
    r.set("q2", "not a list")
    bad = application.tasks["t.add"].apply_at(time.time() - 1, (1,), queue="q2")
    good = application.tasks["t.add"].apply_at(time.time() - 1, (2,))
    beat = drain(application)
    assert beat.stats.pushed_on_claim == beat.stats.published == 1 and beat.stats.dead_lettered == 1
    dead = dict(DelayQ(application).dead())
    assert list(dead) == [bad.id] and "is not a list" in dead[bad.id]["reason"]
    assert [m["headers"]["id"] for m in take_lists(r)["celery"]] == [good.id]
    r.delete("q2")


def test_a_corrupt_envelope_is_buried_and_a_corrupt_template_is_written_again(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    application = app_factory(delayq_shards=1)
    warm_up(application)
    take_lists(r)
    store = get_store(application)
    keys = store.keys.shard(0)
    (field,) = r.hkeys(keys.wire)
    r.hset(keys.wire, field, '{"l": "not a list"')
    r.zadd(keys.due, {"broken": 1})
    r.hset(keys.jobs, "broken", "{not json")
    good = application.tasks["t.add"].apply_at(time.time() - 1, (1,))
    beat = drain(application)
    # the template did not read: the job went the beat's way, and the beat wrote it again
    assert beat.stats.pushed_on_claim == 0 and beat.stats.published == 1 and beat.stats.dead_lettered == 1
    assert "corrupt envelope" in dict(DelayQ(application).dead())["broken"]["reason"]
    assert json.loads(r.hget(keys.wire, field))["t"] == "t.add"
    again = application.tasks["t.add"].apply_at(time.time() - 1, (2,))
    assert drain(application).stats.pushed_on_claim == 1
    assert [m["headers"]["id"] for m in take_lists(r)["celery"]] == [good.id, again.id]


def test_a_due_time_past_year_9999_and_a_bad_hole_go_the_beats_way(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """An expired lease whose due time reads but is past year 9999 (corrupt): the script leaves
    the job to the beat, which dead-letters it, and pushes the job beside it. A template whose
    hole is no value's index (7, 1.5) is a miss: the beat writes it again."""
    application = app_factory(delayq_shards=1)
    warm_up(application)
    take_lists(r)
    keys = get_store(application).keys.shard(0)
    add = application.tasks["t.add"]
    late, good = add.apply_at(time.time() - 1, (1,)), add.apply_at(time.time() - 1, (2,))
    r.hset(keys.leases, late.id, "9999999999999999|0|gone")
    beat = drain(application)
    assert beat.stats.pushed_on_claim == beat.stats.published == 1 and beat.stats.dead_lettered == 1
    assert "corrupt due time" in dict(DelayQ(application).dead())[late.id]["reason"]
    assert [m["headers"]["id"] for m in take_lists(r)["celery"]] == [good.id]
    (field,) = r.hkeys(keys.wire)
    template = json.loads(r.hget(keys.wire, field))
    for hole in (7, 1.5):
        r.hset(keys.wire, field, json.dumps({**template, "h": [hole, *template["h"][1:]]}))
        job = add.apply_at(time.time() - 1, (3,))
        beat = drain(application)
        assert beat.stats.pushed_on_claim == 0 and beat.stats.published == 1, hole
        assert json.loads(r.hget(keys.wire, field)) == template
        assert [m["headers"]["id"] for m in take_lists(r)["celery"]] == [job.id]


def test_an_id_the_script_cannot_write_and_a_bad_shape_id_go_the_beats_way(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """push.lua writes a job's id into its message as is: an id with a character outside letters,
    digits and -_.: goes the beat's way (kombu escapes it), as does an envelope whose shape id
    "S" is not hex (corrupt: the beat dead-letters it); the job beside them is pushed."""
    application = app_factory(delayq_shards=1)
    warm_up(application)
    take_lists(r)
    keys = get_store(application).keys.shard(0)
    add = application.tasks["t.add"]
    for odd in ('a "quoted" id', "an id with spaces", "ünïcode"):
        add.apply_at(time.time() - 1, (1,), task_id=odd)
    good, bad = add.apply_at(time.time() - 1, (2,)), add.apply_at(time.time() - 1, (3,))
    envelope = r.hget(keys.jobs, bad.id)
    assert re.search(r'"S":"[0-9a-f]+"', envelope)
    r.hset(keys.jobs, bad.id, re.sub(r'"S":"[0-9a-f]+"', '"S":"not-hex"', envelope))
    beat = drain(application)
    assert beat.stats.pushed_on_claim == 1 and beat.stats.published == 4 and beat.stats.dead_lettered == 1
    assert bad.id in dict(DelayQ(application).dead())
    ids = {m["headers"]["id"] for m in take_lists(r)["celery"]}
    assert ids == {good.id, 'a "quoted" id', "an id with spaces", "ünïcode"}


@pytest.mark.slow
def test_gated_jobs_and_schedule_points_go_the_beats_way(app_factory: AppFactory, r: redis.Redis) -> None:
    """A job under flow control and a schedule's point are never pushed by the script: the gate
    and the schedule's next point are the beat's (each delivered, and the schedule re-armed)."""
    application = app_factory(delayq_shards=1)
    add = application.tasks["t.add"]
    warm_up(application, concurrency_key="k", concurrency_limit=5)
    take_lists(r)
    gated = add.apply_at(time.time() - 1, (1,), concurrency_key="k", concurrency_limit=5)
    schedules = Schedules(application)
    schedules.add("every-second", add, 1, (2,))
    time.sleep(1.2)
    beat = drain(application, passes=5)
    assert beat.stats.pushed_on_claim == 0 and beat.stats.published >= 2
    ids = [m["headers"]["id"] for m in take_lists(r)["celery"]]
    assert gated.id in ids
    assert schedules.get("every-second") is not None and DelayQ(application).count() >= 1


def test_the_templates_hash_is_bounded(app_factory: AppFactory, r: redis.Redis) -> None:
    """Past MAX_STORED_TEMPLATES fields (a header unique to each job would make a shape per job),
    no template is added: new shapes are delivered the beat's way."""
    application = app_factory(delayq_shards=1)
    wire = get_store(application).keys.shard(0).wire
    r.hset(wire, mapping={f"junk-{i}": "-" for i in range(MAX_STORED_TEMPLATES)})
    warm_up(application)
    add = application.tasks["t.add"]
    add.apply_at(time.time() - 1, (1,))
    beat = drain(application)
    assert beat.stats.pushed_on_claim == 0 and beat.stats.published == 1
    assert r.hlen(wire) == MAX_STORED_TEMPLATES and r.pttl(wire) == -1  # nothing added, no TTL set


def test_the_templates_hash_lives_a_day_after_its_last_template(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    """A shard's templates name their producers (origin, reply-to): the hash of a shard that takes
    no new shape for a day expires and is refilled on demand; a template-less shard still delivers."""
    application = app_factory(delayq_shards=1)
    wire = get_store(application).keys.shard(0).wire
    warm_up(application)
    assert 0 < r.pttl(wire) <= TEMPLATES_TTL_MS
    r.delete(wire)  # as when it expires
    application.tasks["t.add"].apply_at(time.time() - 1, (1,))
    assert drain(application).stats.pushed_on_claim == 0 and r.hlen(wire) == 1
    application.tasks["t.add"].apply_at(time.time() - 1, (2,))
    assert drain(application).stats.pushed_on_claim == 1


@pytest.fixture
def full_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


@pytest.mark.slow
def test_a_full_redis_pushes_nothing_and_loses_nothing(full_server: EmbeddedRedis) -> None:
    """Over maxmemory the script is refused with nothing written; the beat claims the shard with
    claim.lua (which a full Redis runs) and push_claimed.lua's pushes are refused too, so the full
    broker does not grow. Once memory is freed and the leases expire, every job goes out once."""
    url = full_server.url + "/0"
    application = make_app(
        url, delayq_url=url, delayq_shards=1, delayq_reclaim_ttl=0.5, task_queues=[Queue("celery")]
    )

    @application.task(base=DelayedTask, name="t.add", shared=False)
    def add(x: Any, y: Any = None) -> Any:
        return x

    client = redis.Redis.from_url(url)
    try:
        warm_up(application)
        client.delete("celery")
        ids = [j.id for j in add.apply_at_many([(time.time() - 1, (i,), None) for i in range(50)])]
        make_full(client)
        beat = Dispatcher(application)
        beat.run_once()
        assert beat.stats.pushed_on_claim == 0 and beat.stats.published == 0
        assert client.llen("celery") == 0 and DelayQ(application).count() == 50
        beat.close()
        client.config_set("maxmemory", 0)
        time.sleep(0.6)
        done = drain(application)
        assert done.stats.published == 50
        pushed = [json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1)]
        assert sorted(pushed) == sorted(ids)
    finally:
        client.close()
        application.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_beats_paused_and_killed_mid_drain_deliver_each_job_once(
    redis_url: str, r: redis.Redis, procs: Procs
) -> None:
    """Real beats, no worker: beat A is frozen (SIGSTOP) as soon as messages appear, past its
    lease; beat B takes over and is SIGKILLed in the middle of the drain; beat C finishes; then A
    is thawed and goes on with what it held. Every job is in the queue exactly once."""
    conf = {"delayq_reclaim_ttl": 1.0, "delayq_batch_size": 100}
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    producer = make_app(redis_url, delayq_url=redis_url, **conf)

    @producer.task(base=DelayedTask, name="e2e.record", shared=False)
    def record(*args: Any) -> None:  # pragma: no cover - never runs here
        return None

    n = 60_000
    ids: list[str] = []
    due = time.time() + 4
    for start in range(0, n, 10_000):
        ids += [j.id for j in record.apply_at_many([(due, (i,), None) for i in range(start, start + 10_000)])]
    a = procs.start("beat", env)
    assert wait_for(lambda: r.llen("celery") > 0, 30, 0.005), procs.logs()
    os.kill(a.pid, signal.SIGSTOP)
    try:
        paused_at = r.llen("celery")
        b = procs.start("beat", env)
        assert wait_for(lambda: r.llen("celery") > paused_at + 2_000, 60, 0.005), procs.logs()
        b.kill()
        b.wait(10)
        killed_at = r.llen("celery")
        procs.start("beat", env)
        drained = wait_for(lambda: DelayQ(producer).count() == 0 and r.llen("celery") >= n, 90, 0.1)
        assert drained, procs.logs()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    time.sleep(3)  # A goes on with what it held before it was frozen
    pushed = [json.loads(m)["headers"]["id"] for m in r.lrange("celery", 0, -1)]
    print(f"\nA frozen at {paused_at}, B killed at {killed_at}, total {len(pushed)} of {n}")
    assert len(pushed) == n and sorted(pushed) == sorted(ids)
    producer.close()
