"""The end-to-end stack: a celery worker and beats running ``tests/apps/e2e_app.py`` in
subprocesses, and the producer in the test process (:class:`Producer`, the ``producers``
fixture); what the app's tasks record (``e2e:runs``, ``e2e:starts``), the checks every bulk
test makes (:func:`check_exactly_once`), the processes' environment (:func:`env_for`), the
brokers (:func:`rabbitmq_or_skip`, :func:`broker_backlog`) and the beats' leases
(:func:`leases_of`).
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_delayq import DelayedTask, DelayQ, ScheduledResult
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env

RABBITMQ_HOST, RABBITMQ_PORT = "127.0.0.1", 5672

#: Worker and store share this machine's clock: a job may start this much "before" its due.
CLOCK_TOL = 0.010
#: Time for a worker or beat to start on a loaded 2-core machine.
STARTUP = 60.0
#: Bulk tests print their lateness rather than gate it; this only catches jobs that were
#: delivered by the safety poll (delayq_max_sleep, 20 s) instead of on time.
MAX_LATE = 15.0


class Producer:
    """A producer app in the test process, with the e2e app's task names and signatures."""

    def __init__(self, broker: str, store: str, **conf: Any) -> None:
        self.app = app = make_app(broker, store, task_ignore_result=True, **conf)

        @app.task(base=DelayedTask, bind=True, name="e2e.record", shared=False)
        def record(self: Any, *args: Any, **kwargs: Any) -> None:
            return None

        @app.task(base=DelayedTask, bind=True, name="e2e.flaky", max_retries=3, shared=False)
        def flaky(self: Any, fail_times: int = 1, countdown: float = 1.0) -> None:
            return None

        @app.task(bind=True, name="e2e.plain", shared=False)
        def plain(self: Any) -> None:
            return None

        self.record = record
        self.flaky = flaky
        self.plain = plain
        self.dq = DelayQ(app)

    def close(self) -> None:
        get_store(self.app).close()
        self.app.close()


@pytest.fixture
def producers() -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(broker: str, store: str, **conf: Any) -> Producer:
        producer = Producer(broker, store, **conf)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close()


def runs(r: redis.Redis) -> dict[str, int]:
    return {k: int(v) for k, v in r.hgetall("e2e:runs").items()}


def starts(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(s) for s in r.lrange("e2e:starts", 0, -1)]


def starts_by_id(r: redis.Redis) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in starts(r)}


def log_of(procs: Procs, index: int) -> str:
    return procs.procs[index][1].read_text(errors="replace")


def assert_alive(procs: Procs) -> None:
    for proc, log in procs.procs:
        assert proc.poll() is None, f"{log.name} exited with {proc.returncode}\n{procs.logs()}"


def start_stack(procs: Procs, env: dict[str, str], beats: int = 1) -> None:
    """A worker and ``beats`` beats; returns once every beat has set up its dispatcher."""
    procs.start("worker", env)
    for _ in range(beats):
        procs.start("beat", env)
    beat_indexes = range(1, 1 + beats)
    ready = wait_for(lambda: all("delayq: beat" in log_of(procs, i) for i in beat_indexes), STARTUP, 0.1)
    assert ready, f"beat(s) did not start\n{procs.logs()}"


def warm_up(producer: Producer, r: redis.Redis, procs: Procs) -> None:
    """Run one delayq job through beat and worker, then forget it: both are up and idle."""
    job = producer.record.apply_in(0, task_id=f"warmup-{uuid.uuid4().hex}")
    ran = wait_for(lambda: r.hexists("e2e:runs", job.id), STARTUP, 0.05)
    assert ran, f"warm-up job did not run; in the store: {producer.dq.get(job.id)}\n{procs.logs()}"
    r.delete("e2e:runs", "e2e:starts")


def lateness_line(label: str, late_s: list[float]) -> str:
    ms = sorted(x * 1000.0 for x in late_s)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, max(0, round(p / 100.0 * len(ms)) - 1))]

    return (
        f"E2E lateness {label}: p50={pct(50):.1f} ms p99={pct(99):.1f} ms "
        f"max={ms[-1]:.1f} ms min={ms[0]:.1f} ms"
    )


def check_exactly_once(
    r: redis.Redis,
    producer: Producer,
    procs: Procs,
    results: list[ScheduledResult],
    timeout: float,
    label: str,
) -> list[float]:
    """Every job ran exactly once, none before its due; print and return the lateness (s)."""
    ids = {res.id for res in results}
    assert len(ids) == len(results)
    done = wait_for(lambda: r.hlen("e2e:runs") >= len(ids), timeout, 0.1)
    assert done, f"{r.hlen('e2e:runs')}/{len(ids)} ran\n{procs.logs()}"
    # A late duplicate (a job published twice) would show up here.
    time.sleep(1.0)
    counts = runs(r)
    assert set(counts) == ids
    assert sorted(set(counts.values())) == [1], {k: v for k, v in counts.items() if v != 1}
    records = starts(r)
    assert len(records) == len(ids)
    due_of = {res.id: res.due.timestamp() for res in results if res.due is not None}
    late: list[float] = []
    for rec in records:
        assert rec["due"] is not None, rec  # published by a beat: the delayq_due header is set
        assert abs(rec["due"] - due_of[rec["id"]]) < 0.002, (rec, due_of[rec["id"]])
        assert rec["start"] >= rec["due"] - CLOCK_TOL, f"ran before its due: {rec}"
        late.append(rec["start"] - rec["due"])
    # Everything delivered was acked: nothing is left to be delivered again.
    assert producer.dq.count() == 0
    assert list(producer.dq.dead()) == []
    for i in range(1, len(procs.procs)):
        assert "no longer leased" not in log_of(procs, i)
    assert_alive(procs)
    print("\n" + lateness_line(label, late))
    return late


def spread(n: int, start: float, seconds: float) -> list[tuple[float, tuple[int], None]]:
    return [(start + seconds * i / n, (i,), None) for i in range(n)]


def rabbitmq_or_skip(host: str = RABBITMQ_HOST, port: int = RABBITMQ_PORT) -> str:
    """The broker URL, or skip the test when no RabbitMQ answers on ``host:port``."""
    url = f"amqp://guest:guest@{host}:{port}//"
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ broker: {host}:{port} does not answer ({exc})")
    try:
        with Connection(url, connect_timeout=5) as conn:
            conn.connect()
    except Exception as exc:
        pytest.skip(f"no RabbitMQ broker: cannot open an AMQP connection to {url} ({exc!r})")
    return url


def delete_queue(broker: str, name: str) -> None:
    with Connection(broker, connect_timeout=5) as conn:
        channel = conn.channel()
        channel.queue_delete(name)
        channel.exchange_delete(name)


def env_for(broker: str, store: str, conf: dict[str, Any], record: str | None = None) -> dict[str, str]:
    extra = {"DELAYQ_TEST_CONF": json.dumps(conf)}
    if record is not None:
        extra["DELAYQ_TEST_RECORD"] = record
    return subprocess_env(broker, store, **extra)


def broker_backlog(url: str, queue: str = "celery") -> tuple[int, int]:
    """``(messages waiting in the queue, messages unacked)`` on a Redis broker.

    On RabbitMQ (``amqp://``): the ready count of a passive ``queue.declare``, and 0 for
    unacked, which AMQP does not tell; RabbitMQ puts a dead consumer's unacked messages
    back in the queue as soon as its connection closes, and a live worker runs its own.
    """
    if url.startswith(("amqp://", "pyamqp://")):
        with Connection(url, connect_timeout=5) as conn:
            _, ready, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
        return int(ready), 0
    client = redis.Redis.from_url(url)
    try:
        return int(client.llen(queue)), int(client.hlen("unacked"))
    finally:
        client.close()


def leases_of(r: redis.Redis, lease_keys: list[str], pid: int) -> set[str]:
    """Ids of the jobs in ``lease_keys`` leased to the beat of process ``pid``."""
    prefix = f"{socket.gethostname()}:{pid}:".replace("|", "_")
    with r.pipeline(transaction=False) as pipe:
        for key in lease_keys:
            pipe.hgetall(key)
        found = pipe.execute()
    return {
        job_id
        for leases in found
        for job_id, lease in leases.items()
        if lease.split("|", 2)[2].startswith(prefix)
    }
