"""End to end on a Redis Cluster store: real ``celery worker`` and ``celery beat`` processes.

The broker (and the record of each task run, ``DELAYQ_TEST_RECORD``) is the plain session
Redis: kombu has no Redis Cluster transport. The store is a local cluster, reached with
``delayq_url`` and ``delayq_cluster=true`` (``DELAYQ_TEST_CONF``).

The failover test runs three primaries with one replica each, SIGKILLs a primary while jobs
are being scheduled and delivered, and reports what the asynchronous replication lost, with
and without ``delayq_wait_replicas``. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import redis

from celery_delayq.store.connection import REDIS_ERRORS
from tests.support.cluster import LocalCluster, cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import (
    MAX_LATE,
    Producer,
    assert_alive,
    check_exactly_once,
    log_of,
    producers,
    runs,
    spread,
    start_stack,
    starts,
    warm_up,
)

__all__ = ["cluster_url", "producers", "redis_cluster"]  # fixtures, used by name

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


def cluster_env(broker: str, cluster: str, **conf: Any) -> dict[str, str]:
    settings = {"delayq_cluster": True, **conf}
    return subprocess_env(broker, cluster, DELAYQ_TEST_RECORD=broker, DELAYQ_TEST_CONF=json.dumps(settings))


@pytest.mark.slow
def test_500_jobs_run_exactly_once_with_the_store_on_a_cluster(
    redis_url: str, cluster_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer]
) -> None:
    producer = producers(redis_url, cluster_url, delayq_cluster=True)
    start_stack(procs, cluster_env(redis_url, cluster_url))
    warm_up(producer, r, procs)
    results = producer.record.apply_at_many(spread(500, time.time() + 2.0, 5.0))
    store = producer.dq.store
    shards_by_node = Counter(
        store.client.get_node_from_key(store.keys.for_job(res.id).due).name for res in results
    )
    print(f"\njobs per cluster node: {dict(shards_by_node)}")
    assert len(shards_by_node) == 3
    late = check_exactly_once(r, producer, procs, results, 60, "500 jobs over 5 s (store on a Redis Cluster)")
    assert max(late) < MAX_LATE, f"some jobs waited for the safety poll\n{procs.logs()}"


# -- failover ---------------------------------------------------------------------------------


class Feeder(threading.Thread):
    """Schedules ``per_tick`` jobs every ``tick`` s, each due ``ahead`` s later, for
    ``seconds``, one ``apply_at`` each; a call that fails is repeated with the same id (keep
    mode: idempotent). ``acked`` maps each id to (the time its call returned, its due time)."""

    def __init__(
        self, producer: Producer, seconds: float, tick: float = 0.1, per_tick: int = 10, ahead: float = 2.0
    ) -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.seconds, self.tick, self.per_tick, self.ahead = seconds, tick, per_tick, ahead
        self.acked: dict[str, tuple[float, float]] = {}
        self.errors: Counter[str] = Counter()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            start = time.time()
            n = 0
            while time.time() - start < self.seconds:
                began = time.time()
                due = began + self.ahead
                for _ in range(self.per_tick):
                    job_id = f"f-{n}"
                    n += 1
                    while True:
                        try:
                            self.producer.record.apply_at(due, task_id=job_id)
                            break
                        except REDIS_ERRORS as exc:
                            self.errors[type(exc).__name__] += 1
                            time.sleep(0.1)
                    self.acked[job_id] = (time.time(), due)
                time.sleep(max(0.0, self.tick - (time.time() - began)))
        except BaseException as exc:  # reported by the test
            self.failure = exc


@pytest.fixture
def six_nodes() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.mark.slow
@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["async", "wait-1"])
def test_a_primary_killed_mid_run_fails_over_and_delivery_resumes(
    six_nodes: LocalCluster,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
    wait_replicas: int,
) -> None:
    cluster = six_nodes
    conf = {"delayq_reclaim_ttl": 5, "delayq_max_sleep": 2}
    producer = producers(
        redis_url, cluster.url, delayq_cluster=True, delayq_wait_replicas=wait_replicas, **conf
    )
    start_stack(procs, cluster_env(redis_url, cluster.url, **conf))
    warm_up(producer, r, procs)
    store = producer.dq.store
    home = {i: store.client.get_node_from_key(s.due).port for i, s in enumerate(store.keys.all_shards())}

    feeder = Feeder(producer, seconds=20.0)
    feeder.start()
    time.sleep(8.0)
    victim = next(n for n in cluster.nodes if n.port == home[0])  # the primary of shard 0
    victim_shards = sorted(i for i, port in home.items() if port == victim.port)
    killed_at = time.time()
    victim.kill()
    state = cluster.wait_ok(60)
    failed_over = time.time() - killed_at
    promoted = [port for port, s in state.items() if s["role"] == "master" and port not in home.values()]
    feeder.join(60)
    assert not feeder.is_alive() and feeder.failure is None, feeder.failure

    acked = feeder.acked
    last_due = max(due for _, due in acked.values())
    # Everything not lost runs: wait for the last due, plus a lease (5 s) and a margin.
    wait_for(lambda: r.hlen("e2e:runs") >= len(acked), max(0.0, last_due - time.time()) + 20, 0.2)
    time.sleep(2.0)
    runs = {k: int(v) for k, v in r.hgetall("e2e:runs").items()}
    records = [rec for rec in starts(r) if rec["id"].startswith("f-")]
    lost = sorted(set(acked) - set(runs), key=lambda i: acked[i][0])
    twice = {k: v for k, v in runs.items() if v > 1}
    on_victim = [rec for rec in records if store.keys.shard_of(rec["id"]) in victim_shards]
    # Due after the kill: claimable only from the promoted replica.
    resumed = [rec["start"] for rec in on_victim if rec["due"] > killed_at]
    resume_s = min(resumed) - killed_at if resumed else float("inf")
    # Start - due, or - stored when the producer's call returned after the due time (with
    # WAIT, a call to a promoted replica that has no replica yet takes WAIT's timeout).
    others_late = [
        rec["start"] - max(rec["due"], acked[rec["id"]][0])
        for rec in records
        if store.keys.shard_of(rec["id"]) not in victim_shards
        and killed_at - 1 <= rec["due"] <= killed_at + failed_over + 1
    ]
    beat_log = log_of(procs, 1)
    outages = beat_log.count("delayq: Redis unavailable")
    partial = beat_log.count("could not be claimed")
    print(
        f"\nFAILOVER ({'delayq_wait_replicas=1' if wait_replicas else 'async replication'}): "
        f"{len(acked)} jobs acknowledged to the producer over 20 s, primary :{victim.port} "
        f"(shards {victim_shards}) SIGKILLed at 8 s; replica :{promoted} promoted and cluster ok "
        f"after {failed_over:.1f} s; first delivery from the failed-over shards {resume_s:.1f} s "
        f"after the kill; lost {len(lost)} (acknowledged "
        f"{[round(acked[i][0] - killed_at, 3) for i in lost[:10]]} s from the kill); "
        f"ran twice {len(twice)}; producer retries {dict(feeder.errors)}; beat: {outages} outage "
        f"back-off(s), {partial} pass(es) with shards not claimed; lateness of the other shards' "
        f"jobs due in the failover window: max {max(others_late, default=0):.2f} s"
    )
    assert promoted, state
    assert_alive(procs)  # the beat rode it out: no crash, no restart
    assert "beat raised exception" not in beat_log
    if outages:
        assert "delayq: Redis reachable again" in beat_log
    assert resume_s < failed_over + 15, f"delivery did not resume\n{procs.logs()}"
    # Jobs due after the failover, on the failed-over shards, ran.
    after = [
        i
        for i, (_, due) in acked.items()
        if due > killed_at + failed_over + 1 and store.keys.shard_of(i) in victim_shards
    ]
    assert after and all(i in runs for i in after)
    if wait_replicas:
        assert lost == [], "a write confirmed by WAIT was lost"
    else:
        # Asynchronous replication: only writes acknowledged just before the kill may be lost.
        assert all(killed_at - 2.0 <= acked[i][0] <= killed_at + 0.5 for i in lost), lost
    assert len(runs) + len(lost) >= len(acked)


# -- the loss of any primary ------------------------------------------------------------------

#: Which primary a run kills, and which primary its ``delayq_url`` names: ``wake`` serves the
#: wake channel's slot, ``a`` and ``b`` are the other two.
LOSSES = {
    "wake-channel": ("wake", "a"),  # the subscription's node; the URL names another
    "url-node": ("a", "a"),  # the node in delayq_url (not the wake channel's)
    "wake-and-url": ("wake", "wake"),  # both (a URL naming the first node of a default layout)
    "other": ("b", "wake"),  # neither
}


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_beat_delivers_after_the_loss_of_any_primary(
    six_nodes: LocalCluster,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
    loss: str,
) -> None:
    """kill -9 of one primary while jobs fall due every few ms on every shard: every job due
    after the kill runs, on the healthy primaries' shards at once and on the failed one's once
    its replica is promoted. Prints the time from the kill to the first delivery."""
    cluster = six_nodes
    probe = cluster.client()
    try:
        wake_port = probe.get_node_from_key("delayq:wake").port
        others = sorted(n.port for n in probe.get_primaries() if n.port != wake_port)
    finally:
        probe.close()
    ports = {"wake": wake_port, "a": others[0], "b": others[1]}
    victim_role, url_role = LOSSES[loss]
    victim = next(n for n in cluster.nodes if n.port == ports[victim_role])
    url = next(n for n in cluster.nodes if n.port == ports[url_role]).url
    conf = {"delayq_reclaim_ttl": 5}  # delayq_max_sleep: the default, 20 s
    producer = producers(redis_url, url, delayq_cluster=True, **conf)
    start_stack(procs, cluster_env(redis_url, url, **conf))
    warm_up(producer, r, procs)
    store = producer.dq.store
    assert store.keys.wake_channel == "delayq:wake"
    home = {i: store.client.get_node_from_key(s.due).port for i, s in enumerate(store.keys.all_shards())}
    victim_shards = {i for i, port in home.items() if port == victim.port}

    # 400 jobs due over 20 s on every shard, all stored (and replicated) before the kill.
    results = producer.record.apply_at_many(spread(400, time.time() + 2.0, 20.0))
    due_of = {res.id: res.due.timestamp() for res in results if res.due is not None}
    time.sleep(6.0)
    killed_at = time.time()
    victim.kill()
    cluster.wait_ok(60)
    failed_over = time.time() - killed_at
    after = {i for i, due in due_of.items() if due > killed_at}
    last_due = max(due_of.values())
    wait_for(lambda: after <= set(runs(r)), max(0.0, last_due - time.time()) + 30, 0.2)
    ran = runs(r)
    records = [rec for rec in starts(r) if rec["start"] > killed_at]
    first = min((rec["start"] for rec in records), default=float("inf")) - killed_at
    first_failed = (
        min(
            (rec["start"] for rec in records if store.keys.shard_of(rec["id"]) in victim_shards),
            default=float("inf"),
        )
        - killed_at
    )
    late = max((rec["start"] - rec["due"] for rec in records if rec["id"] in after), default=0.0)
    missing = sorted(after - set(ran))
    beat_log = log_of(procs, 1)
    # The beat's log line (local time) that says its wake subscription was made again.
    again = re.search(
        r"^\[([-\d]+ [:\d]+,\d+): \w+/MainProcess\] delayq: wake subscription made again", beat_log, re.M
    )
    resubscribed = ""
    if again:
        at = datetime.strptime(again[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        resubscribed = f"; subscribed again {at - killed_at:.1f} s after the kill"
    print(
        f"\nPRIMARY LOST ({loss}): :{victim.port} (shards {sorted(victim_shards)}) killed; the URL "
        f"names :{url.rsplit(':', 1)[1]}; cluster ok after {failed_over:.1f} s; kill -> first "
        f"delivery {first:.2f} s, -> first from the failed node's shards {first_failed:.2f} s; "
        f"{len(after) - len(missing)}/{len(after)} jobs due after the kill ran, latest {late:.2f} s "
        f"late; beat: {beat_log.count('delayq: Redis unavailable')} outage line(s), "
        f"{beat_log.count('wake subscription')} wake subscription line(s){resubscribed}"
    )
    assert not missing, f"{len(missing)} jobs due after the kill never ran\n{procs.logs()}"
    assert_alive(procs)
    assert "beat raised exception" not in beat_log
