"""Corrupt stored data, piece by piece: the bounded decode (:mod:`celery_delayq.store.bounded`), the
scripts in front of malformed lease entries and run states (on every server kind), the kinds of
Redis error the beat tells apart, and their metrics. The end-to-end table is tests/test_poison.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ, Schedules
from celery_delayq.beat.dispatch import CLUSTER_RETRY_MS, Dispatcher
from celery_delayq.beat.metrics import DispatcherCollector
from celery_delayq.beat.upkeep import StallSweep, sync_config
from celery_delayq.exceptions import CorruptData, InvalidOptions
from celery_delayq.schedules.api import point_id
from celery_delayq.store.bounded import MAX_DEPTH, check_depth, load_json
from celery_delayq.store.connection import redis_error_kind
from celery_delayq.store.delivery import PushClaimedOutcome, PushClaimedReply
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.lateness import Snapshot, key_for
from celery_delayq.store.lua_formats import parse_lease
from celery_delayq.store.schedules import FireOutcome
from celery_delayq.store.stored_forms import stored_form
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.server_kinds import redis_server
from tests.support.store import ids_on_shard, rule_due_soon, server_ms

__all__ = ["redis_server"]  # a fixture, used by name

# -- the bounded decode ----------------------------------------------------------------------


def nested(depth: int, inside: str = "1") -> str:
    return "[" * depth + inside + "]" * depth


@pytest.mark.parametrize(
    ("text", "kind", "reason"),
    [
        (nested(MAX_DEPTH + 1), list, f"nested more than {MAX_DEPTH} levels deep"),
        ('{"a":' * 5000 + "1" + "}" * 5000, dict, "nested more than"),
        (nested(200_000), None, "nested more than"),  # far past Python's recursion limit
        ("not json", dict, "is not JSON"),
        ("", dict, "is not JSON"),
        ("[1, 2]", dict, "is a JSON array, not a JSON object"),
        ('"text"', dict, "is a JSON string, not a JSON object"),
        ("null", dict, "is null, not a JSON object"),
        ("{}", list, "is a JSON object, not a JSON array"),
        (b"\xff\xfe", dict, "is not UTF-8 text"),
        (42, dict, "is not text but int"),
    ],
)
def test_load_json_refuses_with_a_reason(text: Any, kind: type | None, reason: str) -> None:
    with pytest.raises(CorruptData, match=reason) as info:
        load_json(text, "the entry", kind)
    assert str(info.value).startswith("the entry ")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "text",
    [
        nested(MAX_DEPTH),  # exactly the limit
        json.dumps({"a": "[" * 5000, "b": ["{" * 300]}),  # brackets inside strings do not nest
        json.dumps({"a": 'x\\"[[[' * 200}),  # nor after escaped quotes
        json.dumps([[i] for i in range(5000)]),  # many brackets, shallow
    ],
)
def test_load_json_takes_deep_enough_and_bracket_heavy_text(text: str) -> None:
    assert load_json(text, "entry", None) == json.loads(text)


def test_load_json_size_bound() -> None:
    assert load_json('{"a": 1}', "entry", dict, max_bytes=8) == {"a": 1}
    with pytest.raises(CorruptData, match="entry is 9 bytes, over the limit of 8"):
        load_json('{"a": 12}', "entry", dict, max_bytes=8)


def test_check_depth_counts_only_structure() -> None:
    check_depth('"' + "[" * 1000 + '"', "entry")
    with pytest.raises(CorruptData):
        check_depth("{" * (MAX_DEPTH + 1), "entry")


@pytest.mark.parametrize(
    ("lease", "parsed"),
    [
        ("1767225600000|2|beat-1", (1767225600000, 2)),
        ("-5|0|t", (-5, 0)),
        ("1|2|", (1, 2)),
        ("garbage", None),
        ("17|", None),
        ("|1|t", None),
        ("a|1|t", None),
        ("1|b|t", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_lease(lease: Any, parsed: tuple[int, int] | None) -> None:
    assert parse_lease(lease) == parsed


def test_decode_envelope_is_bounded() -> None:
    envelope = json.dumps({"v": 2, "i": "a", "t": "t.add", "c": 1, "j": "[1, 2], {}"})
    assert decode_envelope(envelope).task == "t.add"
    deep = envelope[:-1] + ', "h": ' + '{"x":' * 500 + "1" + "}" * 500 + "}"
    with pytest.raises(CorruptData, match="envelope is nested more than 100 levels deep"):
        decode_envelope(deep)
    with pytest.raises(CorruptData, match=r"envelope is \d+ bytes, over the limit of 20"):
        decode_envelope(envelope, max_bytes=20)


def test_the_producer_refuses_what_the_beat_would_refuse(redis_url: str) -> None:
    app = make_app(redis_url)

    @app.task(base=DelayedTask, name="t.deep", shared=False)
    def deep(*args: Any) -> None:
        return None

    headers: dict[str, Any] = {"leaf": 1}
    for _ in range(MAX_DEPTH + 5):
        headers = {"h": headers}
    try:
        with pytest.raises(InvalidOptions, match=f"more than {MAX_DEPTH} levels deep"):
            deep.apply_in(60, headers=headers)
        assert get_store(app).count() == 0
        deep.apply_in(60, args=(nested(MAX_DEPTH * 3, "0"),))  # deep text in args is fine
        assert get_store(app).count() == 1
    finally:
        get_store(app).close()
        app.close()


# -- the scripts, on every server kind -------------------------------------------------------


# redis_server (each server kind in turn, tests/support/server_kinds.py) and store (30 s leases,
# tests/support/store.py).


BAD_LEASES = ["garbage", "17|", "", "|||", "abc|1|tok", "1.5|2|tok"]


def _seed_bad_leases(store: Store, r: redis.Redis, shard: int, past_ms: int) -> list[str]:
    keys = store.keys.shard(shard)
    ids = [f"bad-{i}" for i in range(len(BAD_LEASES))]
    for n, (job_id, lease) in enumerate(zip(ids, BAD_LEASES, strict=True)):
        r.zadd(keys.due, {job_id: past_ms + n})
        r.hset(keys.jobs, job_id, f"env-{n}")
        r.hset(keys.leases, job_id, lease)
    return ids


def test_claim_repairs_malformed_leases_and_takes_the_jobs(store: Store, r: redis.Redis) -> None:
    shard = 3
    keys = store.keys.shard(shard)
    past = server_ms(r) - 10_000
    ids = _seed_bad_leases(store, r, shard, past)
    r.zadd(keys.due, {"good": past + 100})
    r.hset(keys.jobs, "good", "env-good")
    r.hset(keys.leases, "future", "garbage")  # not due: left alone until it is
    r.zadd(keys.due, {"future": server_ms(r) + 600_000})
    r.hset(keys.jobs, "future", "env-future")

    [result] = store.claim([shard], "beat-1")
    assert result.repaired == len(BAD_LEASES)
    got = {job.id: (job.envelope, job.due_ms, job.tries) for job in result.jobs}
    expected = {job_id: (f"env-{n}", past + n, 1) for n, job_id in enumerate(ids)}
    assert got == {**expected, "good": ("env-good", past + 100, 1)}
    # Every lease is valid now, and the beat's own: ack works as for any job.
    for job_id in ids:
        assert parse_lease(r.hget(keys.leases, job_id)) == (past + ids.index(job_id), 1)
    assert r.hget(keys.leases, "future") == "garbage"
    acked = store.ack("beat-1", {shard: [*ids, "good"]})
    assert all(acked.values())
    assert r.zrange(keys.due, 0, -1) == ["future"]
    [again] = store.claim([shard], "beat-2")
    assert (again.jobs, again.repaired) == ([], 0)


def test_the_other_scripts_tolerate_a_malformed_lease(store: Store, r: redis.Redis) -> None:
    keys = store.keys.for_job("x")
    due = server_ms(r) + 600_000
    r.zadd(keys.due, {"x": due})
    r.hset(keys.jobs, "x", "env")
    r.hset(keys.leases, "x", "garbage")
    # ack, bury, push_claimed: "garbage" is no beat's lease, so nothing is done
    assert store.ack("beat-1", {store.keys.shard_of("x"): ["x"]}) == {"x": False}
    assert store.bury("beat-1", "x", {"reason": "r"}) is False
    assert store.push_claimed("beat-1", {store.keys.shard_of("x"): [("x", "q", "m")]}) == {
        "x": PushClaimedReply(PushClaimedOutcome.STALE)
    }
    # get: a held job of unknown history
    record = store.get("x")
    assert record is not None and (record.state, record.due_ms, record.tries) == ("leased", due, 0)
    assert [(j.id, j.state) for j in store.scan()] == [("x", "leased")]
    stats = store.shard_stats()[store.keys.shard_of("x")]
    assert (stats.stored, stats.leased, stats.overdue) == (1, 1, 0)
    assert store.reschedule("x", due + 1) == "delivering"  # held: refused, as for any lease
    assert store.cancel("x") == "delivering"
    assert not r.exists(keys.leases) and not r.exists(keys.jobs)


@pytest.fixture
def sched_app(redis_url: str) -> Iterator[Celery]:
    app = make_app(redis_url, delayq_reclaim_ttl=30.0, delayq_max_sleep=0.5)

    @app.task(base=DelayedTask, name="t.noop", shared=False)
    def noop() -> None:
        return None

    yield app
    get_store(app).close()
    app.close()


@pytest.mark.parametrize("history", ["garbage", nested(5000), "[1, 2]", '{"cur": 5}', "null"])
def test_fire_resets_a_run_state_that_does_not_read(
    sched_app: Celery, r: redis.Redis, history: str, caplog: pytest.LogCaptureFixture
) -> None:
    schedules = Schedules(sched_app)
    store = get_store(sched_app)
    schedules.add("h", "t.noop", rule_due_soon(schedules.store))
    keys = store.keys.for_job("{h}")
    r.hset(keys.history, "h", history)
    stored = schedules.get("h")  # a run state that does not read reads as no runs yet
    assert stored is not None and stored.run_count == 0 and stored.next_run is None
    assert wait_for(lambda: store.claim([store.keys.shard_of("{h}")], "beat-1")[0].jobs, 5, 0.01)
    [point] = [j for j in store.scan() if j.state == "leased"]
    schedule = decode_envelope(point.envelope).schedule
    assert schedule is not None
    at = schedule[1]
    definition = load_json(r.hget(keys.schedules, "h"), "definition")
    next_id, envelope = schedules.envelope_for(definition, at + 1000)
    args = [point.id, "h", at, point.id, next_id, at + 1000, envelope]
    assert store.fire("beat-1", [(store.keys.shard_of("{h}"), args)]) == [FireOutcome.HISTORY_RESET]
    after = schedules.get("h")
    assert after is not None and after.run_count == 1 and after.last_task_id == point.id
    assert after.next_run is not None and int(after.next_run.timestamp() * 1000) == at + 1000
    assert next_id == point_id("h", at + 1000) and r.hexists(keys.jobs, next_id)
    # sched_put and sched_del over a corrupt run state work too
    r.hset(keys.history, "h", history)
    assert schedules.update("h", enabled=False).enabled is False
    r.hset(keys.history, "h", history)
    assert schedules.delete("h") is True


def test_readers_skip_a_definition_that_does_not_read(
    sched_app: Celery, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    schedules = Schedules(sched_app)
    store = get_store(sched_app)
    for name in ("ok", "bad"):
        schedules.add(name, "t.noop", 3600)
    r.hset(store.keys.for_job("{bad}").schedules, "bad", nested(5000))
    with caplog.at_level(logging.ERROR, "celery_delayq.schedules.api"):
        assert [s.name for s in schedules.list()] == ["ok"]
    assert "schedule 'bad' is not listed: schedule definition is nested more than" in caplog.text
    with pytest.raises(CorruptData):
        schedules.get("bad")
    # upsert is how to mend it
    assert schedules.upsert("bad", "t.noop", 60).name == "bad"
    assert {s.name for s in schedules.list()} == {"ok", "bad"}


# -- kinds of Redis error, their log lines and metrics ----------------------------------------


@pytest.mark.slow
def test_redis_error_kinds_on_a_real_server(r: redis.Redis) -> None:
    def kind_of(call: Callable[[], Any]) -> str:
        with pytest.raises(redis.RedisError) as info:
            call()
        return redis_error_kind(info.value)

    r.set("s", "text")
    assert kind_of(lambda: r.eval("return redis.call('INCR', KEYS[1])", 1, "s")) == "script"
    assert kind_of(lambda: r.eval("return nil + 1", 0)) == "script"
    assert kind_of(lambda: r.evalsha("0" * 40, 0)) == "noscript"
    gone = redis.Redis(port=1, socket_connect_timeout=0.5)
    assert kind_of(gone.ping) == "unreachable"
    r.config_set("maxmemory", 1)
    try:
        assert kind_of(lambda: r.set("x", "y")) == "oom"
        assert kind_of(lambda: r.eval("return redis.call('SET', KEYS[1], 'v')", 1, "x")) == "oom"
    finally:
        r.config_set("maxmemory", 0)


@pytest.mark.slow
def test_a_beat_logs_a_script_error_apart_and_counts_it(
    sched_app: Celery, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_delayq import Scheduler

    app = sched_app
    store = get_store(app)
    shard = store.keys.shard(0)
    r.set(shard.due, "not a sorted set")  # every claim of shard 0 fails with WRONGTYPE
    app.tasks["t.noop"].apply_in(0, task_id=_id_on_other_shard(store))
    beat = Scheduler(app)
    try:
        assert beat.dispatcher is not None
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                beat.tick()
        stats = beat.dispatcher.stats
        assert stats.published == 1  # the other shards were claimed and delivered
        assert stats.redis_errors["script"] >= 1
        assert "could not be claimed" in caplog.text and "WRONGTYPE" in caplog.text
        assert "Redis unavailable" not in caplog.text
        families = {f.name: f for f in DispatcherCollector(beat.dispatcher).collect()}
        samples = {tuple(s.labels.values()): s.value for s in families["delayq_redis_errors"].samples}
        assert samples[("script",)] >= 1
        # A failing single-shard tick is logged as a script error, not as an outage.
        # A dispatcher whose monotonic clock stands still never makes its safety poll (a claim
        # of every shard) after the first pass: once shard 0's retry is due, it is claimed alone.
        beat.dispatcher.stop()
        frozen = time.monotonic()
        beat.dispatcher = Dispatcher(app, store, clock=lambda: frozen)
        beat.dispatcher.run_once()  # every shard: shard 0 fails, retried in CLUSTER_RETRY_MS
        time.sleep(CLUSTER_RETRY_MS / 1000 + 0.1)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            beat.tick()
        assert "a Redis script or command failed" in caplog.text, caplog.text
    finally:
        beat.close()


def _id_on_other_shard(store: Store) -> str:
    return next(f"job-{i}" for i in range(1000) if store.keys.shard_of(f"job-{i}") != 0)


def test_corrupt_entries_are_counted(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    store = get_store(app)
    app.tasks["t.add"].apply_in(0, args=(1, 2), task_id="lease-bad")
    app.tasks["t.add"].apply_in(0, args=(1, 2), task_id="env-bad")
    r.hset(store.keys.for_job("lease-bad").leases, "lease-bad", "garbage")
    r.hset(store.keys.for_job("env-bad").jobs, "env-bad", nested(1000))
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dict(dispatcher.stats.corrupt) == {"lease": 1, "envelope": 1}
    assert dispatcher.stats.published == 1 and dispatcher.stats.dead_lettered == 1
    record = store.dead_record("env-bad")
    assert record is not None and record["reason"].startswith("corrupt envelope: envelope is nested")
    families = {f.name: f for f in DispatcherCollector(dispatcher).collect()}
    samples = {tuple(s.labels.values()): s.value for s in families["delayq_corrupt_entries"].samples}
    assert samples == {("envelope",): 1.0, ("lease",): 1.0}


def test_beat_schedule_sync_replaces_a_definition_that_does_not_read(
    sched_app: Celery, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The beat stores ``beat_schedule`` at start: a corrupt stored entry of the same name must
    not stop the beat from starting; the configuration's entry takes its place."""
    schedules = Schedules(sched_app)
    entries = {"tick": {"task": "t.noop", "schedule": 60.0}}
    assert sync_config(schedules, entries)["added"] == ["tick"]
    key = get_store(sched_app).keys.for_job("{tick}").schedules
    for text in ("not json", nested(5000)):
        r.hset(key, "tick", text)
        with caplog.at_level(logging.ERROR, "celery_delayq.schedules.api"):
            assert sync_config(schedules, entries)["updated"] == ["tick"]
        assert "replaced by its beat_schedule entry" in caplog.text
        stored = schedules.get("tick")
        assert stored is not None and stored.origin == "config" and stored.next_run is not None
    r.hset(key, "tick", "[1]")
    assert sync_config(schedules, {})["removed"] == ["tick"]  # gone from beat_schedule: deleted
    assert not r.hexists(key, "tick")


#: Publish paths of a beat whose broker is the store's Redis: the push path on claim (push.lua),
#: the push path without it (push_claimed.lua) and kombu's.
PATHS = {
    "push-on-claim": {},
    "push": {"delayq_push_on_claim": False},
    "kombu": {"delayq_push": False},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_due_time_out_of_range_is_dead_lettered_and_never_counted(
    app_factory: Callable[..., Celery],
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
    path: str,
) -> None:
    """A lease entry whose due time reads but is no time (``99999999999999999999999|1|x``:
    Redis turns it into -9.2e18 ms; ``9999999999999999|1|x``: past year 9999), or a score
    before 1970: the job is dead-lettered with the reason, on every publish path, and never
    reaches the broker or the lateness histogram (whose sum stayed at 9.2e18 for good)."""
    app = app_factory(**PATHS[path])
    store = get_store(app)
    add = app.tasks["t.add"]
    bad = {
        "overflow": "99999999999999999999999|1|x",
        "past-9999": "9999999999999999|1|x",
    }
    for job_id, lease in bad.items():
        add.apply_in(0, args=(1, 2), task_id=job_id)
        r.hset(store.keys.for_job(job_id).leases, job_id, lease)
    add.apply_in(0, args=(1, 2), task_id="before-1970")
    r.zadd(store.keys.for_job("before-1970").due, {"before-1970": -1e23})
    add.apply_in(0, args=(3, 4), task_id="good")
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.stats.corrupt["due"] == 3, dict(dispatcher.stats.corrupt)
    for job_id in (*bad, "before-1970"):
        record = store.dead_record(job_id)
        assert record is not None, job_id
        assert record["reason"].startswith("corrupt due time: "), record["reason"]
        assert "is not a time from 1970 to year 9999" in record["reason"]
        assert record["due"] == 0  # unknown; the job reads (DelayQ.get, the command line)
        job = DelayQ(app).get(job_id)
        assert job is not None and job.state == "dead", job_id
    assert store.count() == 0 and store.dead_record("good") is None
    queued = [json.loads(m)["headers"]["id"] for m in r.lrange("celery", 0, -1)]
    assert queued == ["good"], queued
    seen = dispatcher.lateness_seen.snapshot()
    assert seen.count == 1 and 0 <= seen.sum_ms < 60_000, (seen.count, seen.sum_ms)
    dispatcher.chores(force=True)
    stored = Snapshot.from_fields(store.lateness_fields(key_for(store.config.prefix, "publish")))
    assert stored.count == 1 and 0 <= stored.sum_ms < 60_000, stored


@pytest.mark.parametrize("route", [{"q": ""}, {"q": {"queue": ""}}], ids=["name", "routed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_an_empty_queue_name_is_dead_lettered(
    app_factory: Callable[..., Celery],
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
    path: str,
    route: dict[str, Any],
) -> None:
    """A stored envelope whose queue name is empty (``"q": ""``) was pushed to a Redis list
    named ``""`` that no worker reads. On every publish path it is dead-lettered with the
    reason, and the job beside it is delivered."""
    app = app_factory(**PATHS[path])
    store = get_store(app)
    add = app.tasks["t.add"]
    for job_id in ("warm", "empty-queue", "good"):  # warm: the shape's template is made first
        add.apply_in(0 if job_id != "empty-queue" else 3600, args=(1, 2), task_id=job_id)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    keys = store.keys.for_job("empty-queue")
    data = json.loads(r.hget(keys.jobs, "empty-queue") or "")
    r.hset(keys.jobs, "empty-queue", json.dumps({**data, **route}, separators=(",", ":")))
    assert store.reschedule("empty-queue", server_ms(r) - 1) == "moved"
    dispatchers(app).run_once()  # a beat that looks at every shard (the other's wake is not read)
    record = store.dead_record("empty-queue")
    assert record is not None, path
    assert "queue name is empty" in record["reason"], record["reason"]
    assert not r.exists(""), r.lrange("", 0, -1)
    queued = sorted(json.loads(m)["headers"]["id"] for m in r.lrange("celery", 0, -1))
    assert queued == ["good", "warm"], queued
    assert store.count() == 0


def test_push_lua_never_pushes_to_an_empty_queue_from_a_stored_template(
    app_factory: Callable[..., Celery],
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
) -> None:
    """A template in Redis for a shape whose queue is empty (stored by a beat before this
    check, or by hand) is a miss for ``lua/push.lua``: the job goes to the beat, which
    dead-letters it, and nothing is pushed to a list named ``""``."""
    app = app_factory()
    store = get_store(app)
    add = app.tasks["t.add"]
    first, second, warm = ids_on_shard(store.keys, 3, 3, stem="q")
    for job_id in (first, second):
        add.apply_in(3600, args=(1, 2), task_id=job_id)
    add.apply_in(0, args=(1, 2), task_id=warm)
    jobs_key = store.keys.shard(3).jobs
    for job_id in (first, second):  # stored whole, with an empty queue name in its shape
        record = store.get(job_id)
        assert record is not None
        data = json.loads(record.envelope)
        r.hset(jobs_key, job_id, stored_form(job_id, json.dumps({**data, "q": ""}, separators=(",", ":"))))
    dispatchers(app).run_once()  # warm's shape gets a template
    assert store.reschedule(first, server_ms(r) - 1) == "moved"
    dispatchers(app).run_once()  # first: dead-lettered; its shape marked "-" (no template)
    assert store.dead_record(first) is not None
    wire = store.keys.shard(3).due[: -len("due")] + "wire"
    fields = r.hgetall(wire)
    [(empty_shape, _)] = [(f, v) for f, v in fields.items() if v == "-"]
    [template] = [json.loads(v) for v in fields.values() if v != "-"]
    r.hset(wire, empty_shape, json.dumps({**template, "q": "", "k": ""}))
    assert store.reschedule(second, server_ms(r) - 1) == "moved"
    dispatchers(app).run_once()
    record = store.dead_record(second)
    assert record is not None and "queue name is empty" in record["reason"], record
    assert not r.exists(""), r.lrange("", 0, -1)


@pytest.mark.parametrize(
    "change",
    [
        {"rule": {"type": "interval", "every_ms": 0, "anchor_ms": 0}},
        {"rule": {"type": "interval", "every_ms": -5, "anchor_ms": 0}},
        {"rule": {"type": "hourly", "at": 5}},
        {"rule": {"type": "interval"}},
        {"rule": "every day"},
        {"overlap": "sometimes"},
    ],
    ids=["every-0", "every-minus-5", "unknown-type", "no-every", "not-an-object", "unknown-overlap"],
)
def test_a_rule_that_cannot_plan_a_point_stops_its_schedule_in_the_dead_letters(
    sched_app: Celery,
    r: redis.Redis,
    dispatchers: Callable[..., Dispatcher],
    change: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A definition that reads (JSON, an object) but whose rule (or overlap policy) cannot plan
    a point: the due point is dead-lettered as ``schedule stopped: <reason>``, not published once and then
    stopped with one log line; later passes and the stall sweep publish nothing either."""
    schedules = Schedules(sched_app)
    store = get_store(sched_app)
    schedules.add("bad", "t.noop", rule_due_soon(schedules.store))
    keys = store.keys.for_job("{bad}")
    definition = json.loads(r.hget(keys.schedules, "bad") or "")
    r.hset(keys.schedules, "bad", json.dumps({**definition, **change}))
    dispatcher = dispatchers(sched_app)
    wait_for(lambda: dispatcher.run_once() is not None and store.count_dead() == 1, 5, 0.01)
    [(point, record)] = list(store.dead())
    assert point.startswith("{bad}@")
    assert record["reason"].startswith("schedule stopped: the rule or policy of schedule 'bad' "), record
    assert dispatcher.stats.corrupt["definition"] == 1
    assert r.llen("celery") == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        # The stall sweep, a minute later: not stalled but stopped, so neither re-armed nor
        # an error line every sweep.
        assert StallSweep(schedules).step(server_ms(r) + 60_000) == []
        dispatcher.run_once()
    assert caplog.text == "", caplog.text
    assert r.llen("celery") == 0 and store.count() == 0
