"""A Cluster process starts while a node is down (issue 52), with real ``celery worker`` and
``celery beat`` processes on a 6-node Redis Cluster (3 primaries, 3 replicas; the broker and the
record of runs on the plain session Redis, as in ``tests/test_cluster_e2e.py``).

Before: a beat whose ``delayq_url`` named a node that was down exited 1 with a traceback
(``RedisCluster.from_url`` knew only that node) and a worker died at start with
``Unrecoverable error: RedisClusterUnreachableError`` from the start check's consumer step.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_delayq.exceptions import StoreError
from tests.support.cluster import LocalCluster
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import (
    Producer,
    assert_alive,
    check_exactly_once,
    log_of,
    producers,
    spread,
    start_stack,
)

__all__ = ["producers"]  # a fixture, used by name

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def six_nodes() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


def cluster_env(broker: str, url: str, **conf: Any) -> dict[str, str]:
    """The e2e app's environment with the store on the cluster that ``url`` names."""
    settings = json.dumps({"delayq_cluster": True, **conf})
    return subprocess_env(broker, url, DELAYQ_TEST_RECORD=broker, DELAYQ_TEST_CONF=settings)


def address(node: Any) -> str:
    return f"127.0.0.1:{node.port}"


def primaries(cluster: LocalCluster) -> list[Any]:
    ports = {port for port, state in cluster.state().items() if state.get("role") == "master"}
    return [n for n in cluster.nodes if n.port in ports]


def test_a_worker_and_a_beat_start_while_their_url_node_is_down_and_deliver_once_it_is_back(
    six_nodes: LocalCluster,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
) -> None:
    """The URL's node (a primary) is killed and its replica promoted; jobs are stored through
    another node; then a worker and a beat start on a URL naming only the dead node. Both stay
    up (the beat warns and keeps trying, the worker's start check lets it run); once the node is
    back (a replica now), every job stored earlier runs once."""
    cluster = six_nodes
    victim, other = primaries(cluster)[:2]
    conf = {"delayq_reclaim_ttl": 5}
    producer = producers(redis_url, f"redis://{address(other)}", delayq_cluster=True, **conf)
    victim.kill()
    cluster.wait_ok(60)
    results = producer.record.apply_at_many(spread(60, time.time() + 3.0, 6.0))
    start_stack(procs, cluster_env(redis_url, f"redis://{address(victim)}", **conf))
    time.sleep(10.0)  # every job is due by now; nothing can claim them
    assert_alive(procs)
    beat_log = log_of(procs, 1)
    assert "delayq: cannot store beat_schedule in Redis yet" in beat_log, beat_log
    assert "delayq: Redis unavailable (StoreUnreachable: cannot reach Redis at redis://127.0.0.1:" in beat_log
    assert "Traceback" not in beat_log and "Unrecoverable error" not in log_of(procs, 0)
    assert r.hlen("e2e:runs") == 0
    victim.start()  # back, as a replica of the promoted one
    cluster.wait_ok(60, replicas=3)
    check_exactly_once(r, producer, procs, results, 60.0, "cluster, URL node down at start")
    assert "Unrecoverable error" not in log_of(procs, 0)


def test_a_worker_whose_url_node_is_down_runs_what_a_beat_on_a_live_node_publishes(
    six_nodes: LocalCluster,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
) -> None:
    """The worker's start check cannot ask the store (its URL's only node is down): it never
    stops the worker, which runs the tasks unchecked, with one warning."""
    cluster = six_nodes
    victim, other = primaries(cluster)[:2]
    conf = {"delayq_reclaim_ttl": 5}
    live = f"redis://{address(other)}"
    producer = producers(redis_url, live, delayq_cluster=True, **conf)
    victim.kill()
    cluster.wait_ok(60)
    procs.start("worker", cluster_env(redis_url, f"redis://{address(victim)}", **conf))
    start_stack_beat = cluster_env(redis_url, live, **conf)
    procs.start("beat", start_stack_beat)
    assert wait_for(lambda: "delayq: beat" in log_of(procs, 1), 60, 0.1), procs.logs()
    results = producer.record.apply_at_many(spread(50, time.time() + 2.0, 4.0))
    check_exactly_once(r, producer, procs, results, 60.0, "cluster, the worker's URL node down")
    worker_log = log_of(procs, 0)
    assert "Unrecoverable error" not in worker_log
    assert worker_log.count("delayq: cannot check in Redis whether another delivery of a job started") == 1


def test_with_two_startup_nodes_named_and_one_down_delivery_never_stops(
    six_nodes: LocalCluster,
    redis_url: str,
    r: redis.Redis,
    procs: Procs,
    producers: Callable[..., Producer],
) -> None:
    cluster = six_nodes
    victim, other = primaries(cluster)[:2]
    url = f"redis://{address(victim)},{address(other)}"
    conf = {"delayq_reclaim_ttl": 5}
    producer = producers(redis_url, url, delayq_cluster=True, **conf)
    victim.kill()
    cluster.wait_ok(60)
    results = producer.record.apply_at_many(spread(100, time.time() + 2.0, 8.0))
    start_stack(procs, cluster_env(redis_url, url, **conf))
    late = check_exactly_once(r, producer, procs, results, 60.0, "cluster, one of two startup nodes down")
    assert max(late) < 5.0, max(late)
    beat_log = log_of(procs, 1)
    assert "Redis unavailable" not in beat_log and "cannot reach Redis at start" not in beat_log, beat_log


def test_a_producer_retrying_on_store_error_survives_a_full_cluster_restart(
    six_nodes: LocalCluster, redis_url: str, producers: Callable[..., Producer]
) -> None:
    """A loop that stores jobs one at a time and retries each on StoreError until it is stored:
    every node is killed and started again under it; the loop never meets another error, and
    every job is stored in the end."""
    cluster = six_nodes
    producer = producers(redis_url, cluster.url, delayq_cluster=True)
    stored: list[str] = []
    caught: list[BaseException] = []
    crashed: list[BaseException] = []
    done = threading.Event()

    def produce() -> None:
        try:
            for i in range(300):
                while True:
                    try:
                        producer.record.apply_in(3600, (i,), task_id=f"job-{i}")
                        break
                    except StoreError as exc:
                        caught.append(exc)
                        time.sleep(0.2)
                stored.append(f"job-{i}")
                time.sleep(0.02)
        except BaseException as exc:  # what a retry loop on StoreError would not survive
            crashed.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    assert wait_for(lambda: len(stored) >= 20, 30, 0.05), crashed
    for node in cluster.nodes:
        node.kill()
    time.sleep(2.0)
    for node in cluster.nodes:
        node.start()
    cluster.wait_ok(90, replicas=3)
    assert done.wait(120), f"{len(stored)} stored; {len(caught)} retries"
    assert not crashed, repr(crashed[0])
    assert len(stored) == 300 and caught, (len(stored), len(caught))
    assert all(isinstance(exc.__cause__, Exception) for exc in caught)
    print(
        f"\nFULL RESTART: {len(caught)} StoreError(s) retried: {sorted({type(e).__name__ for e in caught})}"
    )
    last = stored[-50:]
    assert all(producer.dq.get(job) is not None for job in last)  # stored after the restart
