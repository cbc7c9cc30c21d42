"""A full Redis drains (issue 13): with ``maxmemory`` reached and ``noeviction``, the scripts that
free memory (claim, push_claimed, ack, cancel, bury, fire) still run, a producer gets ``StoreFull``
naming exactly the jobs stored and not stored, and a real beat delivers every due job while
used memory falls.

Each test starts its own server (``maxmemory`` is set on it) of each kind: Redis 6.2 (no script
flags: the scripts' legacy form, whose first write is never refused), Redis 7 and Valkey 8
(``#!lua flags=allow-oom``; the legacy form is checked there too).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_delayq import DelayedTask, DelayQ, Schedules, StoreFull
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.store.connection import OOM_REPLY, evicts_jobs, is_oom
from celery_delayq.store.delivery import PushClaimedOutcome, PushClaimedReply
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.jobs import CancelOutcome, EnqueueOutcome
from celery_delayq.store.scripts import _NO_FLAGS, SCRIPTS
from tests.support.apps import make_app
from tests.support.cli import invoke
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import delete_queue, rabbitmq_or_skip
from tests.support.store import bury, make_full, make_store, server_ms, snapshot


@pytest.fixture
def server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    """A server of each kind for this test alone, ``noeviction``."""
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


def refused(client: redis.Redis) -> bool:
    """Is a plain write refused for memory right now?"""
    try:
        client.set("delayq-test:probe", "x")
    except redis.ResponseError as exc:
        return is_oom(exc)
    client.delete("delayq-test:probe")
    return False


def uses_flags(store: Store) -> bool:
    """Did this store's server take the scripts' flagged form (Redis 7+, Valkey)?"""
    return SCRIPTS["claim"].sha_for(store.client) == SCRIPTS["claim"].sha


FORMS = ["flags", "legacy"]


def store_in_form(url: str, form: str, label: str) -> Store:
    """A store on ``url`` whose scripts go in ``form``: "flags" (``#!lua flags=allow-oom``,
    Redis 7+ only) or "legacy" (no flags line; what 6.2 runs)."""
    if form == "flags" and label == "redis-6.2":
        pytest.skip("Redis 6.2 has no script flags")
    store = make_store(url, reclaim_ttl=30.0, shards=4)
    if form == "legacy":
        _NO_FLAGS.add(store.client)
    return store


# -- the scripts, one by one ---------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_the_freeing_scripts_run_when_redis_is_full(
    server: EmbeddedRedis, server_binary: tuple[str, str], form: str
) -> None:
    """Over ``maxmemory``: claim leases every due job, renew extends them, ack, cancel and bury
    remove theirs; enqueue is refused (StoreFull) and writes nothing, and so is push_claimed's push
    into a broker list in this Redis (the job keeps its lease). Then memory is under the limit again and
    enqueue works."""
    store = store_in_form(server.url + "/0", form, server_binary[0])
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        now = server_ms(client)
        jobs = [(f"job-{i}", now - 1000, "x" * 400) for i in range(400)]
        store.enqueue(jobs)
        store.enqueue([("later", now + 600_000, "y")])
        make_full(client)
        assert uses_flags(store) == (form == "flags")

        with pytest.raises(StoreFull, match="maxmemory") as full:
            store.enqueue([("new", now, "z")])
        assert (full.value.stored, full.value.not_stored) == ([], ["new"])
        assert store.get("new") is None

        claimed = store.claim(list(range(store.config.shards)), "beat-1", batch=500)
        ids = sorted(j.id for res in claimed for j in res.jobs)
        assert ids == sorted(job_id for job_id, _, _ in jobs)
        assert client.hlen(store.keys.shard(0).leases) + client.hlen(store.keys.shard(1).leases) > 0

        by_shard: dict[int, list[str]] = {res.shard: [j.id for j in res.jobs] for res in claimed}
        assert all(len(v) >= 10 for v in by_shard.values())
        make_full(client)  # each script below starts over the limit
        third = {s: len(v) // 3 for s, v in by_shard.items()}
        delivered = {
            s: [(i, "celery", json.dumps({"id": i})) for i in v[: third[s]]] for s, v in by_shard.items()
        }
        make_full(client)
        pushed = store.push_claimed("beat-1", delivered)  # refused: a full broker gets no messages
        assert all(v.outcome is PushClaimedOutcome.REFUSED and OOM_REPLY in v.error for v in pushed.values())
        assert client.llen("celery") == 0 and store.count() == len(jobs) + 1
        client.config_set("maxmemory", 0)
        assert set(store.push_claimed("beat-1", delivered).values()) == {
            PushClaimedReply(PushClaimedOutcome.PUSHED)
        }
        acked = {s: v[third[s] : 2 * third[s]] for s, v in by_shard.items()}
        make_full(client)
        held, _ = store.renew("beat-1", acked)  # the fence renews the leases of a slow pass
        assert set(held.values()) == {True} and len(held) == sum(len(v) for v in acked.values())
        make_full(client)
        assert set(store.ack("beat-1", acked).values()) == {True}
        make_full(client)
        assert store.bury("beat-1", by_shard[0][-1], {"reason": "test", "envelope": "x"}) is True
        make_full(client)
        assert store.cancel("later") == CancelOutcome.CANCELLED
        assert client.llen("celery") == sum(third.values())
        assert store.count() == len(jobs) - 2 * sum(third.values()) - 1
        assert store.count_dead() == 1

        client.config_set("maxmemory", 0)
        assert store.enqueue([("new", now, "z")])[0][0] is EnqueueOutcome.NEW
    finally:
        client.close()
        store.close()


@pytest.mark.slow
def test_a_claim_adds_at_most_one_lease_per_job_taken(server: EmbeddedRedis) -> None:
    """The bound on what claims add to a full store: one lease entry per job taken (at most
    ``batch`` a shard a call); re-claiming an expired lease rewrites it in place, adding
    nothing. Prints the bytes a lease costs."""
    store = make_store(server.url + "/0", reclaim_ttl=0.3, shards=1)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        now = server_ms(client)
        store.enqueue([(f"job-{i}", now - 1000, "x" * 200) for i in range(300)])
        make_full(client)
        start = int(client.info("memory")["used_memory"])
        for _ in range(3):
            assert len(store.claim([0], "beat-1", batch=100)[0].jobs) == 100
        assert client.hlen(store.keys.shard(0).leases) == 300
        leased = int(client.info("memory")["used_memory"])
        time.sleep(0.4)  # every lease expires: the same jobs are taken again
        for _ in range(3):
            again = store.claim([0], "beat-2", batch=100)[0].jobs
            assert len(again) == 100 and all(j.tries == 2 for j in again)
        assert client.hlen(store.keys.shard(0).leases) == 300
        reclaimed = int(client.info("memory")["used_memory"])
        print(
            f"300 leases: +{leased - start} bytes ({(leased - start) / 300:.0f} a lease); "
            f"re-claiming them: {reclaimed - leased:+d} bytes"
        )
        assert reclaimed - leased < 300 * 16
    finally:
        client.close()
        store.close()


def test_apply_at_many_into_a_full_store_names_the_stored_jobs_exactly(server: EmbeddedRedis) -> None:
    """A bulk call that fills the store on the way: the calls (one per shard and chunk) that ran
    before memory passed ``maxmemory`` stored their jobs whole, those after were refused whole;
    ``StoreFull`` lists both, and the store holds exactly ``stored``. A retry of
    ``not_stored`` once memory is freed stores each of them once."""
    url = server.url + "/0"
    app = make_app(url, url, delayq_shards=64)

    @app.task(base=DelayedTask, name="full.echo", shared=False)
    def echo(i: int, pad: str) -> int:  # pragma: no cover - never runs here
        return i

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        eta = time.time() + 3600
        echo.apply_at(eta, (-1, ""))  # the script is loaded (its cache takes memory too)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 200_000)  # a part of the batch fits, the rest does not
        items = [(eta, (i, "p" * 300), None) for i in range(1000)]
        with pytest.raises(StoreFull, match="maxmemory") as full:
            echo.apply_at_many(items)
        stored, not_stored = full.value.stored, full.value.not_stored
        assert stored and not_stored, (len(stored), len(not_stored))
        print(f"{len(stored)} stored, {len(not_stored)} not stored")
        assert len(stored) + len(not_stored) == len(items)
        assert len(set(stored) | set(not_stored)) == len(items)
        dq = DelayQ(app)
        assert dq.count() == len(stored) + 1
        pending = {job.id for job in dq.pending(task="full.echo")}  # (one scan, not a get each)
        assert set(stored) <= pending and pending.isdisjoint(not_stored)

        positions = full.value.not_stored_positions
        assert len(positions) == len(not_stored) and len(set(positions)) == len(positions)

        client.config_set("maxmemory", 0)
        echo.apply_at_many([items[p] for p in positions])
        assert dq.count() == len(items) + 1
        assert {job.id for job in dq.pending()} >= set(stored)  # nothing stored was lost
    finally:
        client.close()
        get_store(app).close()
        app.close()


#: Every write of a producer or an operator that a full Redis refuses, as ``(name, call)``;
#: each call gets the app, its ``DelayQ`` and ``Schedules``, and the id of a stored job. (Not
#: here: the writes Redis lets through, as they remove first: cancel, delete, pause and update
#: of a schedule, ``delete_dead``.)
OPERATOR_WRITES: list[tuple[str, Callable[[Any, DelayQ, Schedules, str], Any]]] = [
    ("apply_in", lambda app, dq, sch, job: app.tasks["full.add"].apply_in(60, (1, 2))),
    (
        "apply_at_many",
        lambda app, dq, sch, job: app.tasks["full.add"].apply_at_many(
            [(time.time() + 60, (i, 0), None) for i in range(3)]
        ),
    ),
    ("schedules.add", lambda app, dq, sch, job: sch.add("new", "full.add", 60, (1, 2))),
    ("schedules.upsert", lambda app, dq, sch, job: sch.upsert("new", "full.add", 60, (1, 2))),
    ("schedules.resume", lambda app, dq, sch, job: sch.resume("paused")),
    ("schedules.run_now", lambda app, dq, sch, job: sch.run_now("nightly")),
    ("batch", lambda app, dq, sch, job: dq.batch([app.tasks["full.add"].s(1, 2)] * 3)),
    ("set_limit", lambda app, dq, sch, job: dq.set_limit("tenant:9", 3, new=True)),
    ("set_limit(None)", lambda app, dq, sch, job: dq.set_limit("tenant:9", None, new=True)),
    ("clear_limit", lambda app, dq, sch, job: dq.clear_limit("tenant:1")),
    ("pause", lambda app, dq, sch, job: dq.pause("tenant:9", new=True)),
    ("resume", lambda app, dq, sch, job: dq.resume("tenant:1")),
    ("reschedule", lambda app, dq, sch, job: dq.reschedule(job, time.time() + 600)),
    ("requeue_dead", lambda app, dq, sch, job: dq.requeue_dead("dead-1")),
]

#: The same writes from the command line: ``delayq <args>``.
CLI_WRITES = [
    ("schedules", "add", "other", "full.add", "--every", "60"),
    ("schedules", "resume", "paused"),
    ("limit", "tenant:9", "4", "--new"),
    ("pause", "tenant:9", "--new"),
    ("resume", "tenant:1"),
    ("reschedule", "{job}", "+10m"),
    ("dead", "requeue", "dead-1"),
]


@pytest.mark.slow
def test_every_write_refused_by_a_full_redis_raises_store_full(server: EmbeddedRedis) -> None:
    """Over ``maxmemory``, every producer and operator write that Redis refuses raises
    ``StoreFull`` with its advice (not redis-py's ``OOM`` error from inside a script), saying
    what was not written; the command line says the same on one line (exit 3). Nothing
    changes: the schedules, limits, jobs and dead letters read as before. A batch names every
    member as not stored."""
    url = server.url + "/0"
    app = make_app(url, url, delayq_shards=4)

    @app.task(base=DelayedTask, name="full.add", shared=False)
    def add(x: int = 0, y: int = 0) -> int:  # pragma: no cover - never runs here
        return x + y

    client = redis.Redis.from_url(url, decode_responses=True)
    dq, sch = DelayQ(app), Schedules(app)
    try:
        job = add.apply_in(3600, (1, 2)).id
        sch.add("nightly", "full.add", "0 2 * * *", (1, 2))
        sch.add("paused", "full.add", 60, (1, 2), enabled=False)
        dq.set_limit("tenant:1", 2, new=True)
        dq.pause("tenant:1")
        add.apply_at(time.time() - 1, (0, 0), task_id="dead-1")
        bury(app, "dead-1")
        for i in range(200):  # room for the scripts' own replies (a full Redis still answers)
            client.set(f"pad-{i}", "p" * 500)
        before = snapshot(url)
        for name, write in OPERATOR_WRITES:
            make_full(client)
            with pytest.raises(StoreFull, match="maxmemory") as full:
                write(app, dq, sch, job)
                pytest.fail(f"{name} was not refused")
            assert "see docs/errors.md" in str(full.value) and full.value.refused, name
            assert isinstance(full.value.__cause__, redis.ResponseError), name
            if name == "batch":
                assert full.value.stored == [] and len(full.value.not_stored) == 3
            client.config_set("maxmemory", 0)
            assert snapshot(url) == before, f"{name} changed the store"
        for args in CLI_WRITES:
            make_full(client)
            result = invoke(app, *(job if a == "{job}" else a for a in args))
            assert result.exit_code == 3, (args, result.output)
            assert "Redis is full" in result.output and "Traceback" not in result.output, args
            client.config_set("maxmemory", 0)
            assert snapshot(url) == before, f"delayq {' '.join(args)} changed the store"
    finally:
        client.config_set("maxmemory", 0)
        client.close()
        get_store(app).close()
        app.close()


def test_the_start_up_check_names_only_policies_that_evict_jobs(server: EmbeddedRedis) -> None:
    """allkeys-* may evict a shard's keys: warned. volatile-* evict only keys with a TTL, and the
    store's keys have none: not warned (checked: no key the store writes has a TTL)."""
    store = make_store(server.url + "/0")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        for policy, warned in (
            ("noeviction", False),
            ("allkeys-lru", True),
            ("allkeys-random", True),
            ("volatile-lru", False),
            ("volatile-ttl", False),
        ):
            client.config_set("maxmemory-policy", policy)
            text = " ".join(store.check_server())
            assert ("may evict scheduled jobs" in text) == warned, (policy, text)
            assert evicts_jobs(policy) == warned
        now = server_ms(client)
        store.enqueue([("a", now - 1, "x"), ("b", now + 60_000, "y")])
        store.claim(list(range(store.config.shards)), "beat-1")
        store.bury("beat-1", "a", {"reason": "x"})
        assert client.keys("*") and all(client.ttl(key) == -1 for key in client.keys("*"))
    finally:
        client.close()
        store.close()


# -- a real beat and worker in front of a full store -------------------------------------------


def fill_until_full(task: Any, client: redis.Redis, chunk: int = 500) -> list[str]:
    """``apply_at_many`` jobs due now, ``chunk`` a call, until the store refuses them and a plain
    write too (a big call can be refused for the memory of its own pipeline while it is being
    read: then smaller calls go on); returns the ids stored (of a refused call, its
    ``StoreFull.stored``)."""
    stored: list[str] = []
    while True:
        try:
            results = task.apply_at_many([(time.time() - 1, (len(stored) + i,), None) for i in range(chunk)])
        except StoreFull as full:
            stored.extend(full.stored)
            if refused(client):
                return stored
            chunk = max(1, chunk // 4)
        else:
            stored.extend(result.id for result in results)


@pytest.mark.parametrize("broker_kind", ["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
@pytest.mark.e2e
@pytest.mark.slow
def test_a_beat_drains_a_full_store(
    server: EmbeddedRedis, server_binary: tuple[str, str], redis_url: str, procs: Procs, broker_kind: str
) -> None:
    """The store is filled with due jobs until ``apply_at_many`` raises StoreFull; then a real
    ``celery beat`` and worker start, the broker on another Redis (or RabbitMQ). Every job runs
    exactly once and used memory falls under the limit: claim and ack run on the full store.
    Runs are recorded on another server (the full one would refuse the records)."""
    conf: dict[str, Any] = {}
    broker = redis_url
    if broker_kind == "rabbitmq":
        broker = rabbitmq_or_skip()
        conf = {"task_default_queue": f"delayq-full-{uuid.uuid4().hex[:12]}", "broker_heartbeat": 0}
    app, client, record, ids, limit, full_memory = start_full(server, redis_url, broker, **conf)
    try:
        env = subprocess_env(
            broker, server.url + "/0", DELAYQ_TEST_RECORD=redis_url, DELAYQ_TEST_CONF=json.dumps(conf)
        )
        t0 = time.monotonic()
        procs.start("worker", env)
        procs.start("beat", env)
        peak = full_memory
        store = get_store(app)

        def drained() -> bool:
            nonlocal peak
            peak = max(peak, int(client.info("memory")["used_memory"]))
            return record.hlen("e2e:runs") >= len(ids) and store.count() == 0

        done = wait_for(drained, float(os.environ.get("DELAYQ_TEST_DRAIN_S", "180")), 0.2)
        seconds = time.monotonic() - t0
        after = int(client.info("memory")["used_memory"])
        runs = {k: int(v) for k, v in record.hgetall("e2e:runs").items()}
        print(
            f"\n{server_binary[0]} kombu path ({broker_kind} broker): {len(ids)} jobs filled the store "
            f"(maxmemory {limit}); "
            f"used_memory {full_memory} full, peak {peak}, {after} drained; "
            f"{sum(runs.values())} runs in {seconds:.1f} s"
        )
        assert done, f"{len(runs)} of {len(ids)} ran, {store.count()} stored\n{procs.logs()}"
        assert set(runs) == set(ids)
        assert all(n == 1 for n in runs.values()), [k for k, n in runs.items() if n != 1][:5]
        assert after < full_memory and not refused(client)
        for proc, log in procs.procs:
            assert proc.poll() is None, f"{log.name} exited\n{procs.logs()}"
    finally:
        procs.stop_all()
        if conf:
            delete_queue(broker, conf["task_default_queue"])
        client.close()
        record.close()
        get_store(app).close()
        app.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_full_store_that_is_also_the_broker_holds_its_jobs(
    server: EmbeddedRedis, server_binary: tuple[str, str], redis_url: str, procs: Procs
) -> None:
    """Push path, store and broker one Redis, full: the beat claims (its leases are bounded)
    but pushes nothing into the full broker (a message is ~3x the job it replaces, and a worker
    cannot run on a full Redis broker); every job stays stored, the beat stays up. Once
    maxmemory is raised, a worker starts and every job runs exactly once."""
    store_url = server.url + "/0"
    # Leases of 5 s, not 30: the jobs the beat claimed while the broker was full are reclaimed
    # once maxmemory is raised (with the default TTL the test waited 30 s of them out).
    conf = {"delayq_reclaim_ttl": 5}
    app, client, record, ids, limit, full_memory = start_full(server, redis_url, store_url, **conf)
    try:
        store = get_store(app)
        env = subprocess_env(
            store_url, store_url, DELAYQ_TEST_RECORD=redis_url, DELAYQ_TEST_CONF=json.dumps(conf)
        )
        procs.start("beat", env)
        # kombu's declare of the queue (SADD) is refused first: the beat treats it as a broker
        # outage; were it declared, push_claimed.lua's push would be refused ("over its maxmemory").
        said = ("OutOfMemoryError", "over its maxmemory")
        assert wait_for(lambda: any(text in procs.logs() for text in said), 60, 0.2), procs.logs()
        time.sleep(3)
        held = int(client.info("memory")["used_memory"])
        print(
            f"\n{server_binary[0]} push path, full: {len(ids)} jobs held; used_memory "
            f"{full_memory} full, {held} with the beat claiming (maxmemory {limit})"
        )
        assert store.count() == len(ids) and client.llen("celery") == 0
        assert held - full_memory < len(ids) * 200  # leases only: about a hundred bytes a job
        assert procs.procs[0][0].poll() is None, procs.logs()

        client.config_set("maxmemory", 0)
        t0 = time.monotonic()
        procs.start("worker", env)
        done = wait_for(lambda: record.hlen("e2e:runs") >= len(ids) and store.count() == 0, 120, 0.2)
        runs = {k: int(v) for k, v in record.hgetall("e2e:runs").items()}
        print(f"after raising maxmemory: {sum(runs.values())} runs in {time.monotonic() - t0:.1f} s")
        assert done, f"{len(runs)} of {len(ids)} ran, {store.count()} stored\n{procs.logs()}"
        assert set(runs) == set(ids) and all(n == 1 for n in runs.values())
    finally:
        client.close()
        record.close()
        get_store(app).close()
        app.close()


def start_full(
    server: EmbeddedRedis, record_url: str, broker: str, **conf: Any
) -> tuple[Any, redis.Redis, redis.Redis, list[str], int, int]:
    """An app whose store is ``server`` (maxmemory 1.5 MB over what it uses now) filled with due
    ``e2e.record`` jobs until full: ``(app, store client, record client, ids, maxmemory,
    used_memory when full)``."""
    store_url = server.url + "/0"
    app = make_app(broker, store_url, **conf)
    task = app.task(base=DelayedTask, name="e2e.record", shared=False)(_never_runs_here)
    client = redis.Redis.from_url(store_url, decode_responses=True)
    record = redis.Redis.from_url(record_url, decode_responses=True)
    limit = int(client.info("memory")["used_memory"]) + 1_500_000
    client.config_set("maxmemory", limit)
    ids = fill_until_full(task, client)
    # Full: the fill ended on a refused write. Not ``refused`` again here: used_memory counts the
    # refused call's query buffer, which the server trims in its cron, so a moment later the
    # same server can be a few KB under its limit and take a small write (it refuses again at
    # the first writes that follow).
    assert int(client.info("memory")["used_memory"]) > limit - 64 * 1024
    assert get_store(app).count() == len(ids)
    return app, client, record, ids, limit, int(client.info("memory")["used_memory"])


def _never_runs_here(*args: Any) -> None:  # pragma: no cover - the worker runs e2e_app's task
    raise AssertionError("runs in the e2e worker")
