"""The store, the API, the schedules and the dispatcher on a Redis Cluster (``delayq_cluster``).

The session cluster (``redis_cluster`` in tests/support/cluster.py) has three primaries. The store tests of
``test_scripts.py`` and ``test_api.py`` run here again, unchanged, with their fixtures
(``store``, ``r``, ``app``) pointed at the cluster; the ones that read a single server's
``INFO commandstats`` or ``DUMP`` have cluster versions below. The broker is always the plain
session Redis: kombu has no Redis Cluster transport.

Run with ``-s`` to see how the shards spread over the nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from redis.crc import key_slot

from celery_delayq import DelayedTask, DelayQ, Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.exceptions import BatchSealed
from celery_delayq.flow.gate import member_id
from celery_delayq.store.connection import REDIS_ERRORS
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.jobs import CancelOutcome, EnqueueOutcome
from celery_delayq.store.scripts import SCRIPTS
from tests import test_api, test_scripts
from tests.support.apps import add_task, make_app
from tests.support.cluster import LocalCluster, cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.store import broker_lists, ids_on_shard, make_store, server_ms
from tests.support.wake import Wake

__all__ = ["cluster_url", "redis_cluster"]  # fixtures, used by name

pytestmark = pytest.mark.cluster

# -- fixtures: the reused tests see the cluster ---------------------------------------------------


@pytest.fixture
def r(cluster_url: str, redis_cluster: LocalCluster) -> RedisCluster:
    """The session cluster's shared client (emptied around each test by ``cluster_url``)."""
    client: RedisCluster = redis_cluster.shared_client()
    return client


@pytest.fixture
def store(cluster_url: str) -> Iterator[Store]:
    s = make_store(cluster_url, cluster=True, reclaim_ttl=30.0)
    yield s
    s.close()


def cluster_app(broker: str, cluster_url: str, **conf: Any) -> Celery:
    application = make_app(broker, delayq_url=cluster_url, delayq_cluster=True, **conf)

    add_task(application)

    @application.task(base=DelayedTask, name="t.noop", shared=False)
    def noop() -> None:
        return None

    return application


@pytest.fixture
def app(redis_url: str, cluster_url: str) -> Iterator[Celery]:
    """The conftest ``app``, with its store on the cluster (its broker, unused here, the plain
    session Redis)."""
    application = cluster_app(redis_url, cluster_url)
    yield application
    get_store(application).close()
    application.close()


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


# -- the store and API tests, again --------------------------------------------------------------

_SINGLE_SERVER_ONLY = {
    # INFO commandstats of one server: see the cluster versions below
    "test_enqueue_groups_by_shard_in_one_pipeline",
    "test_script_flush_before_a_single_call",
    "test_script_flush_before_a_pipeline",
    "test_run_pipelined_repeats_only_the_noscript_calls",
    # DUMP/KEYS of one server (test_shards_spread_over_every_primary checks each node's keys)
    "test_cancel",
    "test_reschedule",
    "test_all_keys_of_a_shard_share_one_hash_tag",
}

for _module in (test_scripts, test_api):
    for _name in dir(_module):
        if _name.startswith("test_") and _name not in _SINGLE_SERVER_ONLY:
            globals()[_name] = getattr(_module, _name)


# -- helpers ----------------------------------------------------------------------------------------


def primaries(r: RedisCluster) -> list[Any]:
    return sorted(r.get_primaries(), key=lambda n: n.port)


def command_calls(r: RedisCluster, command: str) -> tuple[int, int]:
    """``(calls, failed_calls)`` of ``command``, summed over every primary."""
    calls = failed = 0
    for node in primaries(r):
        stats = r.info("commandstats", target_nodes=node).get(f"cmdstat_{command}", {})
        calls += int(stats.get("calls", 0))
        failed += int(stats.get("failed_calls", 0))
    return calls, failed


def slot_ranges(r: RedisCluster) -> dict[str, list[tuple[int, int]]]:
    """Each primary's slots, as ranges, from the client's slot map."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for slot in range(16384):
        name = r.nodes_manager.slots_cache[slot][0].name
        ranges = out[name]
        if ranges and ranges[-1][1] == slot - 1:
            ranges[-1] = (ranges[-1][0], slot)
        else:
            ranges.append((slot, slot))
    return out


def node_of(r: RedisCluster, key: str) -> Any:
    return r.get_node_from_key(key)


def node_client(node: Any) -> redis.Redis:
    """A plain client of one cluster node (it answers for its own keys and slots only)."""
    return redis.Redis(host=node.host, port=node.port, decode_responses=True)


class ClusterWake(Wake):
    """``test_scripts.Wake`` on a cluster: a script's PUBLISH reaches the subscriber's node over
    the cluster bus from the node that ran it, so the sentinel that ends a drain is published
    on every primary, and the drain waits for all of them (each link keeps its order).

    A message an earlier test's script published can still be on its way over the bus when
    this subscription starts (CI once saw one arrive in the next test's first drain), so the
    subscription starts with a drain that throws such messages away."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        super().__init__(client, channel)
        self.drain()

    def drain(self) -> list[str]:
        nodes = self.client.get_primaries()  # type: ignore[attr-defined]
        for node in nodes:
            self.client.execute_command("PUBLISH", self.channel, "sentinel", target_nodes=node)
        got: list[str] = []
        sentinels = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=1.0)
            if message is None or message["type"] != "message":
                continue
            if message["data"] == "sentinel":
                sentinels += 1
                if sentinels == len(nodes):
                    return got
                continue
            got.append(message["data"])
        raise AssertionError(f"the sentinels never arrived; got {got}")


@pytest.fixture
def wake(store: Store, r: RedisCluster) -> Iterator[ClusterWake]:
    w = ClusterWake(r, store.keys.wake_channel)  # type: ignore[arg-type]
    yield w
    w.close()


# -- the client ---------------------------------------------------------------------------------


def test_the_store_uses_a_cluster_client_which_is_not_a_redis(store: Store) -> None:
    assert isinstance(store.client, RedisCluster)
    assert store.is_cluster
    # The push path (publish.Publishing, via Store.is_single_server) is gated on
    # isinstance(.., redis.Redis).
    assert not isinstance(store.client, redis.Redis)
    assert not issubclass(RedisCluster, redis.Redis)


def test_shards_spread_over_every_primary(store: Store, r: RedisCluster) -> None:
    """Each shard's keys live on the node of its hash tag's slot; the 16 shards cover all three
    primaries. Prints the distribution."""
    nodes = primaries(r)
    assert len(nodes) == 3
    past = server_ms(r) - 1
    jobs = [
        (job_id, past, "env")
        for shard in range(store.config.shards)
        for job_id in ids_on_shard(store.keys, shard, 5, stem=f"s{shard}")
    ]
    store.enqueue(jobs)
    by_node: dict[str, list[int]] = defaultdict(list)
    for index, shard in enumerate(store.keys.all_shards()):
        slot = int(r.cluster_keyslot(shard.due))  # the server's own CLUSTER KEYSLOT
        assert slot == key_slot(shard.tag[1:-1].encode())
        assert {int(r.cluster_keyslot(key)) for key in shard.core} == {slot}
        owner = node_of(r, shard.due)
        by_node[owner.name].append(index)
        # The keys really are on that node, and only there (SCAN lists a node's own keys).
        for node in nodes:
            with node_client(node) as client:
                held = sorted(client.scan_iter(match=f"delayq:{shard.tag}:*"))
            assert held == (sorted([shard.due, shard.jobs, shard.wake]) if node.name == owner.name else []), (
                index,
                node.name,
                held,
            )
    assert sorted(by_node) == sorted(n.name for n in nodes), "every primary holds shards"
    print("\nshard distribution over the cluster (16 shards, 5 jobs each):")
    for node in nodes:
        with node_client(node) as client:
            keys = client.dbsize()
        ranges = slot_ranges(r)[node.name]
        shards = by_node[node.name]
        print(f"  {node.name} slots {ranges}: shards {shards} ({len(shards) * 5} jobs, {keys} keys)")
    assert sum(len(v) for v in by_node.values()) == store.config.shards


def test_start_records_live_on_each_job_s_node(store: Store, r: RedisCluster) -> None:
    """lua/start.lua builds its bucket hashes' names from the shard's dropped key: they share its
    slot, so the script runs on the shard's node, for jobs of every shard (every primary); the
    first claim wins there, a record of the one-key form is read there too."""
    ids = [job_id for shard in range(store.config.shards) for job_id in ids_on_shard(store.keys, shard, 2)]
    assert all(store.start(job_id, 1000, 7, "1|beat-a", 60_000) for job_id in ids)
    assert all(store.start(job_id, 1000, 7, "1|beat-a", 60_000) for job_id in ids)
    assert not any(store.start(job_id, 1000, 7, "1|beat-b", 60_000) for job_id in ids)
    for shard in store.keys.all_shards():
        slot = int(r.cluster_keyslot(shard.dropped))
        with node_client(node_of(r, shard.dropped)) as client:
            records = list(client.scan_iter(match=f"delayq:{shard.tag}:starts:*:*:*"))
            assert len(records) >= 1 and sum(client.hlen(key) for key in records) == 2
        assert {int(r.cluster_keyslot(key)) for key in records} == {slot}
    old = store.keys.for_job(ids[0]).started(ids[0], 1000, 8)
    r.set(old, "1|beat-a", px=60_000)
    assert not store.start(ids[0], 1000, 8, "1|beat-b", 60_000)


def test_pipelines_name_each_calls_node_without_asking_the_server(store: Store, r: RedisCluster) -> None:
    """redis-py's cluster pipeline would send COMMAND GETKEYS for every EVALSHA (movable keys):
    run_pipelined routes each call by its first key's slot instead."""
    due = server_ms(r) + 60_000
    store.enqueue([(f"warm{i}", due, "e") for i in range(40)])
    getkeys_before, _ = command_calls(r, "command|getkeys")
    evalsha_before, _ = command_calls(r, "evalsha")
    jobs = [(f"j{i}", due + i, f"env{i}") for i in range(200)]
    shards = {store.keys.shard_of(job_id) for job_id, _, _ in jobs}
    assert store.enqueue(jobs) == [(EnqueueOutcome.NEW, due + i) for i in range(200)]
    claimed = store.claim(range(store.config.shards), "beat-1")
    assert all(result.jobs == [] for result in claimed)
    assert command_calls(r, "command|getkeys")[0] == getkeys_before
    assert command_calls(r, "evalsha")[0] - evalsha_before == len(shards) + store.config.shards


def test_noscript_is_loaded_on_every_primary_and_repeated(store: Store, r: RedisCluster) -> None:
    due = server_ms(r) - 1000
    jobs = [(f"j{i}", due + i, f"env{i}") for i in range(60)]
    shards = {store.keys.shard_of(job_id) for job_id, _, _ in jobs}
    assert len({node_of(r, store.keys.shard(s).due).name for s in shards}) == 3
    r.script_flush()  # every primary
    hset_before, _ = command_calls(r, "hset")
    _, failed_before = command_calls(r, "evalsha")
    assert store.enqueue(jobs, replace=True) == [(EnqueueOutcome.NEW, due + i) for i in range(60)]
    assert command_calls(r, "hset")[0] - hset_before == len(jobs)  # each job written once
    assert command_calls(r, "evalsha")[1] - failed_before == len(shards)  # one NOSCRIPT a call
    for node in primaries(r):  # loaded where it was missing: on every primary
        with node_client(node) as client:
            assert client.script_exists(SCRIPTS["enqueue"].sha) == [True]

    r.script_flush()
    claimed = store.claim(sorted(shards), "beat-1")
    assert sorted(j.id for res in claimed for j in res.jobs) == sorted(j for j, _, _ in jobs)
    r.script_flush()
    acked = store.ack("beat-1", {res.shard: [j.id for j in res.jobs] for res in claimed})
    assert set(acked.values()) == {True}

    # A single call (no pipeline) too.
    store.enqueue([("one", due + 60_000, "env")])
    r.script_flush()
    assert store.cancel("one") == CancelOutcome.CANCELLED
    assert store.count() == 0


def test_wake_messages_of_every_node_reach_a_subscriber_on_one_node(store: Store, r: RedisCluster) -> None:
    """Scripts PUBLISH on the node of their shard; classic pub/sub goes to the whole cluster."""
    by_node: dict[str, int] = {}
    for index, shard in enumerate(store.keys.all_shards()):
        by_node.setdefault(node_of(r, shard.due).name, index)
    assert len(by_node) == 3
    listener_node = primaries(r)[0]
    pubsub = r.pubsub(node=listener_node)
    pubsub.subscribe(store.keys.wake_channel)
    try:
        confirm = pubsub.get_message(timeout=5.0)
        assert confirm is not None and confirm["type"] == "subscribe"
        due = server_ms(r) + 60_000
        for index in by_node.values():
            [job_id] = ids_on_shard(store.keys, index, 1)
            store.enqueue([(job_id, due, "env")])
        expected = {f"{index}:{due}" for index in by_node.values()}
        got: set[str] = set()
        deadline = time.monotonic() + 10
        while not expected <= got and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
            # A message an earlier test published may still arrive over the cluster bus: only
            # this test's due time counts.
            if message and message["type"] == "message" and message["data"].endswith(f":{due}"):
                got.add(message["data"])
        assert got == expected
    finally:
        pubsub.close()


def test_check_server_asks_every_primary(store: Store, r: RedisCluster) -> None:
    assert store.check_server() == []
    node = primaries(r)[1]
    r.config_set("maxmemory-policy", "allkeys-lru", target_nodes=node)
    try:
        [warning] = store.check_server()
        assert warning.startswith(f"{node.name}: Redis maxmemory-policy is 'allkeys-lru'")
    finally:
        r.config_set("maxmemory-policy", "noeviction", target_nodes=node)


@pytest.mark.slow
def test_wait_replicas_without_replicas_warns_and_keeps_the_job(
    cluster_url: str, r: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """``delayq_wait_replicas``: WAIT on each node that took writes; this cluster has no
    replicas, so it times out (1 s) and says so, and the jobs are stored all the same."""
    s = make_store(cluster_url, cluster=True, wait_replicas=1)
    try:
        due = server_ms(r) + 60_000
        caplog.set_level(logging.WARNING, logger="celery_delayq.store.scripts")
        started = time.monotonic()
        stored = s.enqueue([("a", due, "a"), ("b", due, "b"), ("c", due, "c")])
        assert stored == [(EnqueueOutcome.NEW, due)] * 3
        took = time.monotonic() - started
        assert "reached 0 of the 1 replica(s)" in caplog.text
        assert 0.9 < took < 10, took
        assert s.count() == 3
        caplog.clear()
        assert s.cancel("a") == CancelOutcome.CANCELLED
        assert "reached 0 of the 1 replica(s)" in caplog.text
    finally:
        s.close()


# -- the dispatcher -------------------------------------------------------------------------------


def test_dispatcher_delivers_into_a_plain_redis_broker_once(
    app: Celery, broker: redis.Redis, r: RedisCluster, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    due = (server_ms(r) - 1000) / 1000
    results = add.apply_at_many([(due, (i, i), None) for i in range(300)])
    later = add.apply_in(3600, (0, 0))
    store = get_store(app)
    assert store.count() == 301
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.pushing is False  # the broker is another server: kombu's batch, then acks
    assert dispatcher.stats.published == 300 and dispatcher.stats.acked == 300
    messages = broker_lists(broker)["celery"]
    assert sorted(m["headers"]["id"] for m in messages) == sorted(res.id for res in results)
    assert {m["headers"]["task"] for m in messages} == {"t.add"}
    assert store.count() == 1
    assert DelayQ(app).get(later.id) is not None
    dispatcher.run_once()
    assert len(broker_lists(broker)["celery"]) == 300  # nothing twice


def test_unique_for_windows_live_on_each_job_s_node(
    app: Celery, broker: redis.Redis, r: RedisCluster, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The uniqueness record of a shard shares its hash tag: ids spread over every primary are
    kept while stored and taken once delivered."""
    add = app.tasks["t.add"]
    due = (server_ms(r) - 1000) / 1000
    ids = [f"u-{i}" for i in range(40)]
    assert {add.apply_at(due, (1, 1), task_id=i, unique_for=600).outcome for i in ids} == {"new"}
    store = get_store(app)
    records = {store.keys.shard(store.keys.shard_of(i)).unique for i in ids}
    assert len({r.keyslot(k) for k in records}) > 3  # (the shards of 40 ids: on several nodes)
    assert {add.apply_at(due, (1, 1), task_id=i, unique_for=600).outcome for i in ids} == {"kept"}
    dispatchers(app).run_once()
    assert sorted(m["headers"]["id"] for m in broker_lists(broker)["celery"]) == sorted(ids)
    assert {add.apply_at(due, (1, 1), task_id=i, unique_for=600).outcome for i in ids} == {"taken"}
    assert store.count() == 0


@pytest.mark.slow
def test_two_dispatchers_share_the_cluster_store(
    app: Celery, broker: redis.Redis, r: RedisCluster, dispatchers: Callable[..., Dispatcher]
) -> None:
    due = (server_ms(r) - 1000) / 1000
    results = app.tasks["t.add"].apply_at_many([(due, (i, 0), None) for i in range(1000)])
    one, two = dispatchers(app, store=Store(get_store(app).config)), dispatchers(app)
    threads = [threading.Thread(target=d.run_once) for d in (one, two)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    while get_store(app).count():
        one.run_once()
    ids = [m["headers"]["id"] for m in broker_lists(broker)["celery"]]
    assert sorted(ids) == sorted(res.id for res in results)
    one.store.close()


def test_renew_runs_on_every_node_in_one_call(store: Store, r: RedisCluster) -> None:
    """The fence's renew (lua/renew.lua): one call per shard, every key of it in the shard's
    slot, all nodes in one round trip."""
    shards = range(store.config.shards)
    ids = {shard: ids_on_shard(store.keys, shard, 2) for shard in shards}
    now = server_ms(r)
    store.enqueue([(job_id, now - 1, "env") for pair in ids.values() for job_id in pair])
    store.claim(shards, "beat-1")
    mine = {shard: pair[:1] for shard, pair in ids.items()}
    held, server_now = store.renew("beat-1", mine)
    after = max(server_ms(node.redis_connection) for node in r.get_primaries())
    assert held == {pair[0]: True for pair in ids.values()} and server_now is not None
    # Each node reads its own TIME: a renewed lease runs to that node's now + TTL, no earlier
    # than the reported (earliest) now + TTL and no later than any node's clock after the call.
    scores = [r.zscore(store.keys.shard(s).due, ids[s][0]) for s in shards]
    assert all(server_now + 30_000 <= score <= after + 30_000 for score in scores), (
        server_now,
        after,
        scores,
    )
    # The one not renewed keeps its claim lease.
    assert all(r.zscore(store.keys.shard(s).due, ids[s][1]) <= server_now + 30_000 for s in shards)
    assert store.renew("beat-2", ids)[0] == {job_id: False for pair in ids.values() for job_id in pair}


@pytest.mark.slow
def test_wait_wakes_on_a_job_stored_on_any_node(
    app: Celery, r: RedisCluster, broker: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    dispatcher = dispatchers(app)
    dispatcher.run_once()  # subscribes; nothing stored
    assert dispatcher.seconds_until_due() > 5
    store = get_store(app)
    listener = dispatcher.subscription.get_pubsub_node()
    # A shard held by another node than the one the subscription is on.
    index = next(i for i, s in enumerate(store.keys.all_shards()) if node_of(r, s.due).name != listener.name)
    [job_id] = ids_on_shard(store.keys, index, 1)

    def later() -> None:
        time.sleep(0.3)
        app.tasks["t.add"].apply_in(0.2, (1, 1), task_id=job_id)

    thread = threading.Thread(target=later)
    started = time.monotonic()
    thread.start()
    dispatcher.wait(10.0)
    woke = time.monotonic() - started
    thread.join()
    assert woke < 8.0, woke  # woken by the wake message, not by the 10-s timeout
    assert dispatcher.stats.wakeups >= 1
    shard = store.keys.shard(index)

    def state() -> str:  # what the dispatcher and the shard held, for a failure message
        return (
            f"woke after {woke:.2f} s; next {dispatcher.wake.next}; server now {dispatcher.server_now_ms()}; "
            f"{dispatcher.stats}; due {r.zscore(shard.due, job_id)}; lease {r.hget(shard.leases, job_id)}; "
            f"wake marker {r.get(shard.wake)}; broker {broker_lists(broker)}"
        )

    # Generous: on a loaded two-core machine a cluster pass can take seconds.
    assert wait_for(lambda: dispatcher.run_once() is not None and store.count() == 0, 30, 0.05), state()
    assert [m["headers"]["id"] for m in broker_lists(broker)["celery"]] == [job_id], state()


# -- recurring schedules ------------------------------------------------------------------------


@pytest.mark.slow
def test_schedules_fire_their_points_on_every_node(
    app: Celery, r: RedisCluster, broker: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A schedule lives in the shard of its name: one every-second schedule on each node's
    shards (one of them from ``beat_schedule``), and a cron schedule that is not due."""
    keys = get_store(app).keys
    home_of = {}
    for k in range(1000):  # a name whose shard is on each node
        name = f"every-second-{k}"
        home = node_of(r, keys.shard(keys.shard_of("{" + name + "}")).due).name
        home_of.setdefault(home, name)
        if len(home_of) == 3:
            break
    api_names = sorted(home_of.values())
    config_name = api_names.pop()
    schedules = Schedules(app)
    for name in api_names:
        schedules.upsert(name, app.tasks["t.noop"], timedelta(seconds=1))
    schedules.upsert("nightly", app.tasks["t.add"], "0 3 * * *", args=(1, 2), tz="Europe/Paris")
    report = sync_config(schedules, {config_name: {"task": "t.noop", "schedule": 1.0}})
    assert report["added"] == [config_name]
    every = [*api_names, config_name]
    assert {s.name for s in schedules.list()} == {*every, "nightly"}
    assert schedules.count() == 4
    dispatcher = dispatchers(app)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        wait = dispatcher.run_once()
        fired = {s.name: s.run_count for s in schedules.list()}
        if all(fired[name] >= 2 for name in every):
            break
        dispatcher.wait(min(wait, 0.5))
    fired = {s.name: s.run_count for s in schedules.list()}
    assert all(fired[name] >= 2 for name in every) and fired["nightly"] == 0, fired
    ids = [m["headers"]["id"] for m in broker_lists(broker)["celery"]]
    assert len(ids) == len(set(ids)) >= 6
    assert {i[1 : i.index("}")] for i in ids} == set(every)
    assert schedules.delete(api_names[0]) is True
    assert schedules.count() == 3


@pytest.fixture
def six_node_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.mark.slow
def test_wait_replicas_with_replicas_is_confirmed(
    six_node_cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    s = make_store(six_node_cluster.url, cluster=True, wait_replicas=1)
    try:
        caplog.set_level(logging.WARNING, logger="celery_delayq.store.scripts")
        jobs = [(f"j{i}", 2_000_000_000_000 + i, "env") for i in range(100)]
        started = time.monotonic()
        assert s.enqueue(jobs) == [(EnqueueOutcome.NEW, due) for _, due, _ in jobs]
        assert s.cancel("j1") == CancelOutcome.CANCELLED
        took = time.monotonic() - started
        assert "replica" not in caplog.text
        assert took < 5.0, took  # confirmed, not hung; the empty log shows no WAIT timed out
        # Every write is on the replicas already.
        for node in six_node_cluster.nodes:
            client = six_node_cluster.node_client(node)
            try:
                if client.info("replication")["role"] == "slave":
                    keys = client.execute_command("KEYS", "delayq:*")
                    assert keys, f"replica {node.port} has nothing"
            finally:
                client.close()
    finally:
        s.close()


def test_the_safety_poll_reads_the_markers_of_every_node(
    app: Celery, broker: redis.Redis, r: RedisCluster, dispatchers: Callable[..., Dispatcher]
) -> None:
    """On a cluster the markers are read with a GET per shard, pipelined by node: a job on any
    node whose wake message the beat never read is claimed at the next safety poll, and only
    its shard; an unreadable marker on any node means its shard is claimed."""
    clock = [time.monotonic()]
    beat = dispatchers(app, clock=lambda: clock[0])
    beat.run_once()
    store = get_store(app)
    due = (server_ms(r) - 1000) / 1000
    results = app.tasks["t.add"].apply_at_many([(due, (i, i), None) for i in range(5)])
    due_shards = {store.keys.shard_of(res.id) for res in results}
    spoiled = next(s for s in range(store.config.shards) if s not in due_shards)
    r.set(store.keys.shard(spoiled).wake, "spoiled")
    now_ms, markers = store.wake_markers()
    assert abs(now_ms - server_ms(r)) < 1000
    assert markers[spoiled] is None and all(markers[s] is not None for s in due_shards)
    clock[0] += beat.config.max_sleep
    # The shards the next pass claims, as the beat's wake decides them (the safety poll).
    assert sorted(beat.wake.shards_to_claim()) == sorted(due_shards | {spoiled})
    beat.run_once()
    ids = [m["headers"]["id"] for m in broker_lists(broker)["celery"]]
    assert sorted(ids) == sorted(res.id for res in results)


@pytest.mark.slow
def test_the_wake_subscription_follows_its_slot_to_the_promoted_replica(
    six_node_cluster: LocalCluster,
) -> None:
    """redis-py opens a cluster subscription on the node of its cached slot map, and a refused
    connection does not refresh that map: after its node is SIGKILLed, subscribing fails until
    the store reads the map again. Each failed attempt refreshes it, so once a replica is
    promoted the next attempt subscribes there, and hears the scripts' wake messages."""
    cluster = six_node_cluster
    s = make_store(cluster.url, cluster=True)
    try:
        channel = s.keys.wake_channel
        first = s.wake_subscription()
        dead = first.get_pubsub_node().name
        first.close()
        assert dead == s.client.get_node_from_key(channel).name
        next(n for n in cluster.nodes if f"127.0.0.1:{n.port}" == dead).kill()
        errors: list[str] = []

        def subscribe() -> Any:
            try:
                return s.wake_subscription()
            except REDIS_ERRORS as exc:
                errors.append(type(exc).__name__)
                return None

        pubsub = wait_for(subscribe, 30, 0.5)
        assert pubsub, f"never subscribed again: {len(errors)} attempts failed ({errors[-1]})"
        try:
            assert errors  # it failed while the node was down
            node = pubsub.get_pubsub_node().name
            assert node != dead and node == s.client.get_node_from_key(channel).name
            cluster.wait_ok(30)
            s.enqueue([("after-failover", 1, "env")])  # due long ago: the script wakes the beats
            message = wait_for(lambda: pubsub.get_message(timeout=0.5), 10, 0.0)
            assert message and message["channel"] == channel, message
        finally:
            pubsub.close()
    finally:
        s.close()


def test_the_chart_buckets_are_read_from_every_primary(store: Store, r: RedisCluster) -> None:
    """The dashboard's charts (``Store.due_count_series``: ``lua/due_counts.lua``, one call a
    shard on the node of the shard's slot) on a cluster."""
    start = server_ms(r) + 600_000
    store.enqueue([(f"c{i}", start + i * 30_000, "e") for i in range(200)])  # 2 a minute, 100 min
    hour, day = store.due_count_series([(start, 60_000, 60), (start, 3_600_000, 24)])
    assert hour == [2] * 60
    assert day == [120, 80] + [0] * 22


def test_the_dashboards_kept_chart_counts_on_a_cluster(store: Store, r: RedisCluster) -> None:
    """The charts' kept counts are keys of their own slots (no hash tag in common): kept, read
    back and forgotten on a cluster, in a pipeline of single-key commands."""
    names = ["hour", "day"]
    assert key_slot(store.keys.web_counts("hour").encode()) != key_slot(store.keys.web_counts("day").encode())
    store.keep_counts("hour", {"counts": [1]}, 60_000)
    store.keep_counts("day", {"counts": [2]}, 60_000)
    assert store.kept_counts(names) == [{"counts": [1]}, {"counts": [2]}]
    assert 0 < r.pttl(store.keys.web_counts("day")) <= 60_000
    store.forget_counts(names)
    assert store.kept_counts(names) == [None, None]


def test_capped_jobs_are_gated_in_the_claim_on_every_node(
    app: Celery, broker: redis.Redis, r: RedisCluster, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The gate in the claim (lua/includes/gating.lua) touches a key's slots and waiting list on
    the shard of its jobs' hash tag: on a cluster, 2 jobs each of 6 keys, limit 1, spread over the
    nodes; one pass publishes one a key and parks the other, with no gate call; a release
    promotes the parked one, and the next pass publishes it."""
    add = app.tasks["t.add"]
    due = (server_ms(r) - 1000) / 1000
    keys = [f"ck{i}" for i in range(6)]
    by_key = {
        key: [
            add.apply_at(due + n / 1000, (n, 0), concurrency_key=key, concurrency_limit=1).id
            for n in range(2)
        ]
        for key in keys
    }
    store = get_store(app)
    assert len({store.keys.shard_of(key) for key in keys}) > 1
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.stats.gated["released"] == 6 and dispatcher.stats.gated["parked"] == 6
    assert dispatcher.stats.held == 6
    published = {m["headers"]["id"] for m in broker_lists(broker)["celery"]}
    assert published == {ids[0] for ids in by_key.values()}
    for key, ids in by_key.items():
        assert store.key_state(key).running == 1 and store.key_state(key).waiting == 1
        assert store.release(ids[0], key, "succeeded").promoted == 1
    everything = {i for ids in by_key.values() for i in ids}

    def delivered() -> bool:
        dispatcher.wait(0.2)  # the release's wake messages say which shards to claim
        dispatcher.run_once()
        return {m["headers"]["id"] for m in broker_lists(broker)["celery"]} == everything

    assert wait_for(delivered, 10, 0)
    assert len(broker_lists(broker)["celery"]) == 12  # each once


def test_a_streamed_batch_lives_on_its_shard_and_completes_at_the_seal(app: Celery, r: RedisCluster) -> None:
    """``open_batch``, two adds, the members ended, the seal: each script runs on the node of
    the batch's hash tag (batch_open, batch_grow, batch_seal, batch_cancel), the members share
    its slot, the seal completes it and an add after it is refused."""
    add = app.tasks["t.add"]
    batch = DelayQ(app).open_batch(on_complete=add.s(), batch_id="cs")
    ids = batch.add([add.s(1, 1)]) + batch.add([add.s(2, 2), add.s(3, 3)])
    assert ids == [member_id("cs", i) for i in range(3)]
    assert len({key_slot(job_id.encode()) for job_id in ids}) == 1
    assert get_store(app).cancel_batch("cs") == 3
    assert not batch.state().done
    assert batch.seal() is True and batch.state().done
    with pytest.raises(BatchSealed):
        batch.add([add.s(4, 4)])
