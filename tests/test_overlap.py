"""Overlap policies of recurring schedules (issue 28, part 4): the spec's checks and stored form,
and ``lua/overlap.lua`` through :meth:`Store.overlap` on a real server (each decision, a beat
that died after it, a worker that died mid-run, a corrupt definition, bad input, a full Redis,
a Redis Cluster). The policies end to end, with real workers and a beat: ``test_overlap_e2e.py``.

A point goes as a beat takes it: stored due now, claimed with a beat's token, then asked about
(:meth:`Store.overlap`); a run in flight is a slot in the schedule's ``gate:run:<name>``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.firing import OVERLAP_POLL_MS
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.devtools.embedded import EmbeddedRedis, free_port
from celery_delayq.exceptions import InvalidSchedule
from celery_delayq.flow.gate import GATE_HEADER
from celery_delayq.schedules.spec import OVERLAP_POLICIES, ScheduleSpec, can_plan, overlap_key
from celery_delayq.store.connection import is_oom
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.jobs import EnqueueOutcome
from celery_delayq.store.schedules import OverlapAnswer
from tests.support.apps import app, dispatchers
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.gate import message
from tests.support.metrics import scrape, value
from tests.support.polling import wait_for
from tests.support.server_kinds import redis_server
from tests.support.store import (
    broker_lists,
    expire_leases,
    expire_slots,
    make_store,
    published_ids,
    rule_due_soon,
    server_ms,
    snapshot,
)

__all__ = ["app", "cluster_url", "dispatchers", "redis_cluster", "redis_server"]  # fixtures, used by name

START_MS = 3_600_000
NAME = "nightly"


def point(n: int, name: str = NAME) -> str:
    """A point id of schedule ``name`` (on its shard: the name is the hash tag)."""
    return "{" + name + "}" + f"@p{n}"


def claimed(store: Store, r: redis.Redis, job_id: str, token: str = "beat-a") -> int:
    """Store ``job_id`` due a second ago and claim its shard with ``token``; its shard."""
    if store.get(job_id) is None:
        outcome = store.enqueue([(job_id, server_ms(r) - 1000, "env-" + job_id)])
        assert [status for status, _ in outcome] == [EnqueueOutcome.NEW]
    shard = store.keys.shard_of(job_id)
    [result] = store.claim([shard], token)
    assert job_id in {job.id for job in result.jobs}
    return shard


def ask(store: Store, job_id: str, policy: str, token: str = "beat-a", name: str = NAME) -> OverlapAnswer:
    return store.overlap(
        token, store.keys.shard_of(job_id), job_id, overlap_key(name), policy, START_MS, OVERLAP_POLL_MS
    )


def slots(store: Store, r: redis.Redis, name: str = NAME) -> dict[str, float]:
    key = overlap_key(name)
    return dict(r.zrange(store.keys.for_key(key).running(key), 0, -1, withscores=True))


def lease(store: Store, r: redis.Redis, job_id: str) -> str | None:
    value: str | None = r.hget(store.keys.for_job(job_id).leases, job_id)
    return value


def forget(store: Store, r: redis.Redis, job_id: str) -> None:
    """What ``lua/fire.lua`` does to a published point: the point removed (its slot kept)."""
    keys = store.keys.for_job(job_id)
    r.zrem(keys.due, job_id)
    r.hdel(keys.jobs, job_id)
    r.hdel(keys.leases, job_id)


def running(store: Store, r: redis.Redis, n: int) -> str:
    """Point ``n`` asked about with a free key: it runs (its slot taken) and is fired."""
    job_id = point(n)
    claimed(store, r, job_id, "beat-run")
    assert ask(store, job_id, "skip", "beat-run") == OverlapAnswer("run")
    forget(store, r, job_id)
    return job_id


# -- the spec ----------------------------------------------------------------------------------


def test_the_spec_checks_and_stores_the_policy() -> None:
    assert OVERLAP_POLICIES == ("allow", "skip", "buffer_one", "cancel_previous")
    allow = ScheduleSpec(name="a", task="t", rule=60)
    assert allow.overlap == "allow" and "overlap" not in allow.to_stored("UTC", 1000)
    for policy in OVERLAP_POLICIES[1:]:
        spec = ScheduleSpec(name="a", task="t", rule=60, overlap=policy)
        assert spec.to_stored("UTC", 1000)["overlap"] == policy
    with pytest.raises(
        InvalidSchedule, match="overlap must be one of allow, skip, buffer_one, cancel_previous, got 'later'"
    ):
        ScheduleSpec(name="a", task="t", rule=60, overlap="later")
    with pytest.raises(InvalidSchedule, match=r"needs a name without '\|'"):
        ScheduleSpec(name="a|b", task="t", rule=60, overlap="skip")
    assert ScheduleSpec(name="a|b", task="t", rule=60).overlap == "allow"  # no key needed
    assert overlap_key("nightly") == "nightly"
    base = {
        "rule": {"type": "interval", "every_ms": 1000, "anchor_ms": 0},
        "missed": "once",
        "max_missed": 1,
        "grace": 1,
    }
    assert can_plan(base) and can_plan({**base, "overlap": "skip"})
    assert not can_plan({**base, "overlap": "sometimes"})


def test_schedules_store_read_and_update_the_policy(redis_url: str) -> None:
    """``add``/``update`` store the policy; ``get`` reads it back (``allow`` when stored without
    it); its points carry the gate header naming the schedule's key, so the worker renews and
    gives back the run's slot."""
    app = Celery(broker=redis_url, set_as_current=False)
    app.conf.delayq_url = redis_url

    @app.task(name="proj.task")
    def task() -> None:
        return None

    schedules = Schedules(app)
    try:
        schedules.add("ov-a", "proj.task", 3600, overlap="buffer_one")
        got = schedules.get("ov-a")
        assert got is not None and got.overlap == "buffer_one" and got.to_json()["overlap"] == "buffer_one"
        schedules.update("ov-a", overlap="allow")
        got = schedules.get("ov-a")
        assert got is not None and got.overlap == "allow"
        schedules.update("ov-a", overlap="cancel_previous")
        definition = json.loads(
            schedules.store.client.hget(schedules.keys.for_job("{ov-a}").schedules, "ov-a")
        )
        assert definition["overlap"] == "cancel_previous"
        _, envelope = schedules.envelope_for(definition, 1_767_225_600_000)
        assert f'"{GATE_HEADER}":{{"key":"ov-a"}}' in envelope.replace(" ", "")
        with pytest.raises(InvalidSchedule, match="overlap must be one of"):
            schedules.update("ov-a", overlap="nope")
        got = schedules.get("ov-a")
        assert got is not None and got.overlap == "cancel_previous"  # nothing lost
    finally:
        schedules.delete("ov-a")


# -- lua/overlap.lua -----------------------------------------------------------------------------


def test_a_free_key_runs_the_point_and_hands_it_to_its_slot(store: Store, r: redis.Redis) -> None:
    """No run in flight: a slot until now + start TTL; the lease entry gets token "gate" (due and
    tries kept), so the worker's renewal and release leave the stored point to the fire."""
    job_id = point(1)
    claimed(store, r, job_id)
    before = lease(store, r, job_id)
    assert before is not None and before.endswith("|1|beat-a")
    now = server_ms(r)
    assert ask(store, job_id, "buffer_one") == OverlapAnswer("run")
    [(slot_id, expiry)] = slots(store, r).items()
    assert slot_id == job_id and now + START_MS - 1000 <= expiry <= server_ms(r) + START_MS
    assert lease(store, r, job_id) == before.replace("|beat-a", "|gate")
    due_score = r.zscore(store.keys.for_job(job_id).due, job_id)
    assert store.renew_slots([(job_id, overlap_key(NAME))], 5000) == {job_id: True}
    assert r.zscore(store.keys.for_job(job_id).due, job_id) == due_score  # the point is left
    assert store.release(job_id, overlap_key(NAME), "succeeded").released
    assert store.get(job_id) is not None and slots(store, r) == {}


@pytest.mark.parametrize("policy", ["skip", "buffer_one", "cancel_previous"])
def test_a_run_in_flight_decides_by_policy(store: Store, r: redis.Redis, policy: str) -> None:
    """Point 1 runs (its slot held, the point fired); point 2 comes due: ``skip`` writes nothing
    and names the run; ``cancel_previous`` takes a slot too and names the run to revoke;
    ``buffer_one`` makes the point wait (due again within the poll, lease "gate", tries back)
    and marks it as having waited."""
    first = running(store, r, 1)
    second = point(2)
    claimed(store, r, second)
    state = snapshot(store.config.url)
    now = server_ms(r)
    answer = ask(store, second, policy)
    assert answer.running == (first,)
    if policy == "skip":
        assert answer == OverlapAnswer("skip", (first,))
        assert snapshot(store.config.url) == state
    elif policy == "cancel_previous":
        assert answer == OverlapAnswer("cancel", (first,))
        assert set(slots(store, r)) == {first, second}
        assert (lease(store, r, second) or "").endswith("|1|gate")
    else:
        assert answer.decision == "wait" and answer.until_ms is not None
        assert now < answer.until_ms <= server_ms(r) + OVERLAP_POLL_MS
        assert r.zscore(store.keys.for_job(second).due, second) == answer.until_ms
        assert (lease(store, r, second) or "").endswith("|0|gate")
        assert set(slots(store, r)) == {first}
        record = store.get(second)
        assert record is not None and record.state == "gated"


@pytest.mark.slow
def test_a_buffered_point_runs_once_the_run_ends_and_says_it_waited(store: Store, r: redis.Redis) -> None:
    first = running(store, r, 1)
    second = point(2)
    claimed(store, r, second)
    assert ask(store, second, "buffer_one").decision == "wait"
    # looked at again while the run is in flight: waits again
    time.sleep(OVERLAP_POLL_MS / 1000 + 0.05)
    claimed(store, r, second, "beat-b")
    assert ask(store, second, "buffer_one", "beat-b").decision == "wait"
    # the run ends (its worker gives the slot back): the next look runs it, once
    assert store.release(first, overlap_key(NAME), "succeeded").released
    time.sleep(OVERLAP_POLL_MS / 1000 + 0.05)
    claimed(store, r, second, "beat-c")
    assert ask(store, second, "buffer_one", "beat-c") == OverlapAnswer("run", waited=True)
    assert set(slots(store, r)) == {second}
    assert not r.exists(store.keys.for_job(second).gate_overlap)


def test_not_held_writes_nothing(store: Store, r: redis.Redis) -> None:
    running(store, r, 1)
    second = point(2)
    claimed(store, r, second)
    state = snapshot(store.config.url)
    for policy in ("skip", "buffer_one", "cancel_previous"):
        assert ask(store, second, policy, "beat-other") == OverlapAnswer("not-held")
    assert snapshot(store.config.url) == state


def test_a_beat_that_died_after_the_answer_leaves_the_point_to_the_next(store: Store, r: redis.Redis) -> None:
    """Beat A took the slot and died before publishing or firing: the point's lease runs out,
    beat B claims it, and it runs on the slot it holds (one slot, not a skip of itself)."""
    job_id = point(1)
    claimed(store, r, job_id)
    assert ask(store, job_id, "skip").decision == "run"
    assert expire_leases(store, [job_id]) == [job_id]
    claimed(store, r, job_id, "beat-b")
    assert ask(store, job_id, "skip", "beat-b") == OverlapAnswer("run")
    assert set(slots(store, r)) == {job_id}


def test_a_worker_that_died_mid_run_frees_the_key_when_its_slot_expires(store: Store, r: redis.Redis) -> None:
    """The run's worker died: nothing renews its slot. Until the slot expires the run counts as
    in flight; then the next look removes it and the point runs."""
    first = running(store, r, 1)
    second = point(2)
    claimed(store, r, second)
    assert ask(store, second, "skip").decision == "skip"
    assert expire_slots(store, overlap_key(NAME)) == [first]
    assert ask(store, second, "skip") == OverlapAnswer("run")
    assert set(slots(store, r)) == {second}


def test_bad_input_is_refused_before_anything_is_written(store: Store, r: redis.Redis) -> None:
    job_id = point(1)
    shard = claimed(store, r, job_id)
    state = snapshot(store.config.url)
    for args in (
        ("beat-a", shard, job_id, NAME, "sometimes", START_MS, 1000),
        ("beat-a", shard, job_id, "a|b", "skip", START_MS, 1000),
        ("beat-a", shard, job_id, NAME, "skip", 0, 1000),
        ("beat-a", shard, job_id, NAME, "skip", START_MS, 0),
        ("be|at", shard, job_id, NAME, "skip", START_MS, 1000),
        ("beat-a", shard, "", NAME, "skip", START_MS, 1000),
    ):
        with pytest.raises(redis.ResponseError, match="delayq overlap"):
            store.overlap(*args)  # type: ignore[arg-type]
    assert snapshot(store.config.url) == state


@pytest.fixture
def full_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


def test_a_full_redis_refuses_the_answer_and_the_point_keeps_its_lease(full_server: EmbeddedRedis) -> None:
    """Over maxmemory the script is refused at its first write that may grow memory (the slot,
    or the waiting point's score): no slot taken, the point still the beat's (claimed again after
    its lease). A skip, which writes nothing, is answered."""
    store = make_store(full_server.url + "/0", reclaim_ttl=30.0)
    r = redis.Redis.from_url(full_server.url, decode_responses=True)
    try:
        first = running(store, r, 1)
        free, busy = point(2, "other"), point(3)
        claimed(store, r, free)
        claimed(store, r, busy)
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 20_000)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            r.set("probe", "x")
        for job_id, name, policy in (
            (free, "other", "skip"),
            (busy, NAME, "buffer_one"),
            (busy, NAME, "cancel_previous"),
        ):
            with pytest.raises(redis.ResponseError) as refused:
                ask(store, job_id, policy, name=name)
            assert is_oom(refused.value)
            assert (lease(store, r, job_id) or "").endswith("|1|beat-a")
        assert slots(store, r, "other") == {} and set(slots(store, r)) == {first}
        assert ask(store, busy, "skip") == OverlapAnswer("skip", (first,))
    finally:
        r.config_set("maxmemory", 0)
        r.close()
        store.close()


@pytest.mark.cluster
def test_overlap_runs_on_a_redis_cluster(cluster_url: str) -> None:
    """The point, its lease and its schedule's slot share the name's hash tag: on a cluster the
    script runs on the node serving it, for schedules spread over the nodes."""
    from redis.cluster import RedisCluster

    store = make_store(cluster_url, cluster=True, reclaim_ttl=30.0)
    r = RedisCluster.from_url(cluster_url, decode_responses=True)
    try:
        names = [f"sched-{i}" for i in range(6)]
        assert len({r.get_node_from_key(store.keys.for_key(n).due).name for n in names}) > 1
        for name in names:
            first, second = point(1, name), point(2, name)
            claimed(store, r, first)  # type: ignore[arg-type]
            assert ask(store, first, "buffer_one", name=name) == OverlapAnswer("run")
            claimed(store, r, second)  # type: ignore[arg-type]
            assert ask(store, second, "buffer_one", name=name).decision == "wait"
            assert ask(store, second, "skip", name=name).decision == "not-held"  # it is the gate's now
            assert store.release(first, overlap_key(name), "succeeded").released
    finally:
        r.close()
        store.close()


def test_a_waiting_point_removed_leaves_no_mark_on_the_next(store: Store, r: redis.Redis) -> None:
    """A point that waited is removed (the schedule paused or deleted meanwhile): the schedule's
    one mark names it; the schedule's next point is not taken for one that waited, and its run
    removes the mark."""
    first = running(store, r, 1)
    second = point(2)
    claimed(store, r, second)
    assert ask(store, second, "buffer_one").decision == "wait"
    mark = store.keys.for_job(second).gate_overlap
    assert r.hgetall(mark) == {NAME: second}
    forget(store, r, second)  # as a pause removes the schedule's point
    assert store.release(first, overlap_key(NAME), "succeeded").released
    third = point(3)
    claimed(store, r, third)
    assert ask(store, third, "buffer_one") == OverlapAnswer("run", waited=False)
    assert not r.exists(mark)


def test_deleting_a_schedule_removes_its_waiting_mark(app: Celery, r: redis.Redis) -> None:
    """A schedule deleted while a point of it waits (``buffer_one``): its one field in the
    shard's ``gate:overlap`` goes with it (the point will not run); another schedule's stays."""
    store = get_store(app)
    schedules = Schedules(app)
    schedules.add("ov-del", "t.noop", 3600.0, overlap="buffer_one")
    mark = store.keys.for_job("{ov-del}@p").gate_overlap
    r.hset(mark, mapping={"ov-del": "{ov-del}@p", "other": "{other}@q"})
    assert schedules.delete("ov-del")
    assert r.hgetall(mark) == {"other": "{other}@q"}


def test_a_retry_of_a_run_is_stored_outside_the_schedules_slot(app: Celery, r: redis.Redis) -> None:
    """What ``self.retry(countdown=30)`` of a ``DelayedTask`` run of a schedule with an overlap
    policy sends: the point's id, ``retries=1``, the request's headers (the gate's among them).
    It is stored under ``<point id>:retry-1``, which its message does not carry, so it goes
    without the gate header: its worker could not give back a slot taken under that id (the
    schedule would wait for it until the slot's start TTL). Seen with a real worker and beat
    before this: the retries' slots stayed taken and every later point was skipped."""
    add = app.tasks["t.add"]
    point_id = "{ov-retry}@2026-01-01T00:00:00.000Z"
    headers = {GATE_HEADER: {"key": "ov-retry"}, "delayq_due": 1.0}
    again = add.apply_async((1, 2), task_id=point_id, countdown=30, retries=1, headers=headers)
    assert again.id == point_id
    stored, _, _, _ = message(app, point_id + ":retry-1")
    assert GATE_HEADER not in stored and stored["retries"] == 1 and stored["id"] == point_id
    assert headers == {GATE_HEADER: {"key": "ov-retry"}, "delayq_due": 1.0}  # the caller's, untouched
    # a retry of any other gated job keeps its gate (tests/test_flow_api.py)
    assert r.llen("celery") == 0


# -- the beat: firing a point by its policy ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "cancel_previous"])
def test_a_beat_fires_a_point_by_its_policy_and_counts_it(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher], policy: str
) -> None:
    """A real dispatcher (a beat's loop, one pass at a time) over a schedule whose run is in
    flight (a slot held, its job fired): ``skip`` publishes nothing and moves the schedule to its
    next point; ``cancel_previous`` revokes the run (a broadcast on the broker) and publishes the
    point with the gate header. Once nothing is in flight, the next point runs. The decisions
    are counted in ``delayq_schedule_overlap_total``."""
    store = get_store(app)
    schedules = Schedules(app)
    schedules.add("ov-d", "t.noop", rule_due_soon(store), overlap=policy)
    key = store.keys.for_key("ov-d").running("ov-d")
    r.zadd(key, {"{ov-d}@old-run": server_ms(r) + 600_000})  # a run in flight
    dispatcher = dispatchers(app)
    first = Schedules(app).get("ov-d")
    assert first is not None and first.next_run is not None

    def passes_until(done: Callable[[], Any]) -> Any:
        """The beat's loop: wait (reading wake messages), claim, publish, until ``done()``."""
        return wait_for(
            lambda: dispatcher.wait(0.05) or (dispatcher.run_once() is not None and done()), 10, 0.01
        )

    fired = passes_until(lambda: dispatcher.stats.overlap)
    assert fired, dispatcher.stats
    sent = published_ids(r)
    if policy == "skip":
        assert dispatcher.stats.overlap == {"skip": 1} and sent == []
        assert set(r.zrange(key, 0, -1)) == {"{ov-d}@old-run"}
    else:
        assert dispatcher.stats.overlap == {"cancel": 1} and len(sent) == 1
        assert set(r.zrange(key, 0, -1)) == {"{ov-d}@old-run", sent[0]}
        assert GATE_HEADER in broker_lists(r)["celery"][0]["headers"]
    after = schedules.get("ov-d")
    assert after is not None and after.next_run is not None and after.next_run > first.next_run
    r.delete(key)  # the runs ended
    schedules.update("ov-d", rule=rule_due_soon(store))  # a point due soon again
    ran = passes_until(lambda: dispatcher.stats.overlap.get("run"))
    assert ran, dispatcher.stats
    server = serve_metrics(dispatcher, free_port())
    try:
        page = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert value(page, "delayq_schedule_overlap", "delayq_schedule_overlap_total", decision="run") == 1
    decided = "skip" if policy == "skip" else "cancel"
    assert value(page, "delayq_schedule_overlap", "delayq_schedule_overlap_total", decision=decided) == 1
    schedules.delete("ov-d")


@pytest.mark.slow
@pytest.mark.parametrize("stall", ["past the fence", "past the lease"])
def test_a_beat_stalled_before_publishing_a_handed_point_runs_it_once(
    app_factory: Callable[..., Celery], r: redis.Redis, dispatchers: Callable[..., Dispatcher], stall: str
) -> None:
    """Beat A stalls (a GC pause, a stopped process) after its claim, before it publishes a point
    whose overlap check hands it to the schedule's slot (lease token "gate"):

    - past the fence's fraction of the lease, the lease still held: A's fence cannot renew a
      lease it handed on, so A counts the point fenced and leaves it unpublished (its slot given
      back); any beat runs it after its lease (``delayq_reclaim_ttl``): late by up to that, once;
    - past the lease: beat B takes the point meanwhile and runs it; A's check says not held.
    """
    ttl = 0.6
    conf = {"delayq_reclaim_ttl": ttl, "delayq_shards": 4}
    app_a, app_b = app_factory(**conf), app_factory(**conf)
    store = get_store(app_a)
    Schedules(app_a).add("ov-f", "t.noop", rule_due_soon(store), overlap="skip")
    a, b = dispatchers(app_a), dispatchers(app_b)

    def stalled(step: str, detail: Any) -> None:
        if step != "claimed" or not detail:
            return
        a.pause = None
        time.sleep(ttl * 0.8 if stall == "past the fence" else ttl * 1.5)
        if stall == "past the lease":
            assert wait_for(lambda: b.run_once() is not None and published_ids(r), 5, 0.05)

    a.pause = stalled
    assert wait_for(lambda: a.wait(0.05) or (a.run_once() is not None and a.pause is None), 10, 0.01)
    if stall == "past the fence":
        assert (a.stats.overlap["run"], a.stats.fenced, published_ids(r)) == (1, 1, [])
        held = set(slots(store, r, "ov-f"))  # the point keeps its own slot
        assert len(held) == 1
    else:
        assert (a.stats.overlap["not-held"], b.stats.overlap["run"]) == (1, 1)
    deadline = time.monotonic() + ttl * 4  # every lease of the stall expired: any beat may retry
    while time.monotonic() < deadline:
        a.run_once()
        b.run_once()
        time.sleep(0.05)
    sent = published_ids(r)
    assert len(sent) == 1 and sent[0].startswith("{ov-f}@"), sent
    if stall == "past the fence":
        assert held == set(sent)
    assert Schedules(app_a).get("ov-f").run_count == 1  # type: ignore[union-attr]
