"""End to end: a real ``celery worker`` with ``delayq_record_lateness`` and a real beat with
``delayq_metrics_port``: the workers' start histogram in Redis counts every delayq job that
ran, the beat's ``/metrics`` shows them, and the beat's heartbeat comes and goes with it.

Run with ``-s`` to see the scraped ``/metrics`` page.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_delayq.devtools.embedded import free_port
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import Producer, producers
from tests.support.store import stored_lateness

__all__ = ["producers"]  # a fixture, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Time for a worker or beat to start, or for a few jobs to run, on a loaded 2-core machine.
STARTUP = 90.0


@pytest.fixture
def producer(producers: Callable[..., Producer], redis_url: str) -> Celery:
    """The app of a :class:`Producer` (the e2e app's task names and signatures)."""
    return producers(redis_url, redis_url).app


def scrape(port: int) -> tuple[str, dict[str, float]]:
    """The page and ``{sample name{labels}: value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return text, values


def start_stack(procs: Procs, env: dict[str, str], pool: str) -> None:
    procs.start("worker", env, pool=pool)
    procs.start("beat", env)
    beat_log = procs.procs[1][1]

    def beat_ready() -> bool:
        text = beat_log.read_text(errors="replace") if beat_log.exists() else ""
        return "delayq: beat" in text and "metrics on" in text

    assert wait_for(beat_ready, STARTUP, 0.1), f"the beat did not start\n{procs.logs()}"


def runs(r: redis.Redis) -> int:
    return sum(int(v) for v in r.hgetall("e2e:runs").values())


def check_stack(
    procs: Procs, r: redis.Redis, producer: Celery, port: int, jobs: int, pool: str
) -> dict[str, float]:
    """Schedule ``jobs`` record jobs (due in about 2 s) and one flaky job (it runs twice: the
    second run is Celery's own ETA retry, which is not counted); check the histograms and the
    metrics; return the last scrape."""
    record, flaky = producer.tasks["e2e.record"], producer.tasks["e2e.flaky"]
    due = time.time() + 2.0
    for i in range(jobs):
        record.apply_at(due + i * 0.02, task_id=f"op-{pool.split()[0]}-{i}")
    flaky.apply_at(due, kwargs={"fail_times": 1, "countdown": 1.0})
    counted = jobs + 1  # the flaky job's first run, delivered by the beat

    assert wait_for(lambda: runs(r) == jobs + 2, STARTUP, 0.1), (
        f"{runs(r)} of {jobs + 2} runs\n{procs.logs()}"
    )
    assert wait_for(lambda: stored_lateness(r).count >= counted, 30, 0.2), (
        f"start histogram: {stored_lateness(r)}\n{procs.logs()}"
    )
    assert wait_for(lambda: stored_lateness(r, "publish").count >= counted, 30, 0.2)
    time.sleep(2.5)  # any late flush of a wrong count would show by now
    start, publish = stored_lateness(r), stored_lateness(r, "publish")
    assert start.count == counted == sum(start.buckets), start
    assert publish.count == counted, publish
    print(
        f"\nE2E {pool}: start lateness p50 <= {start.quantile(0.5)} ms, p99 <= {start.quantile(0.99)} ms; "
        f"publish p50 <= {publish.quantile(0.5)} ms"
    )

    def metrics_caught_up() -> dict[str, float] | None:
        _, values = scrape(port)
        ok = (
            values.get("delayq_dispatched_total") == counted
            and values.get("delayq_start_lateness_seconds_count") == counted
            and values.get("delayq_publish_lateness_seconds_count") == counted
        )
        return values if ok else None

    values = wait_for(metrics_caught_up, 30, 0.5)  # the store's figures are cached up to 5 s
    text, last = scrape(port)
    print(text)
    assert values, f"metrics never showed {counted} jobs:\n{text}"
    assert last["delayq_pending_jobs"] == 0 and last["delayq_leased_jobs"] == 0
    assert last["delayq_dead_jobs"] == 0 and last["delayq_store_up"] == 1
    assert last["delayq_start_lateness_seconds_bucket{le=+Inf}"] == counted
    assert last["delayq_claimed_total"] >= counted
    return last


@pytest.mark.parametrize("pool", ["threads -c 8", "prefork -c 2"], ids=["threads", "prefork"])
def test_worker_lateness_and_beat_metrics(
    procs: Procs, redis_url: str, r: redis.Redis, producer: Celery, pool: str
) -> None:
    port = free_port()
    conf = {"delayq_record_lateness": True, "delayq_metrics_port": port}
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    start_stack(procs, env, pool)
    worker_log = procs.procs[0][1]
    assert wait_for(
        lambda: "recording due -> start lateness" in worker_log.read_text(errors="replace"), STARTUP, 0.1
    ), procs.logs()

    check_stack(procs, r, producer, port, jobs=20 if pool.startswith("threads") else 8, pool=pool)

    # the beat's heartbeat: one entry, and it counts what the beat published
    def heartbeat() -> dict[str, Any] | None:
        entries = [json.loads(v) for v in r.hvals("delayq:beats")]
        return entries[0] if len(entries) == 1 and entries[0]["published"] >= 1 else None

    entry = wait_for(heartbeat, 30, 0.2)
    assert entry, r.hgetall("delayq:beats")
    beat = procs.procs[1][0]
    assert entry["pid"] == beat.pid and entry["errors"] == 0

    # a clean shutdown removes it
    beat.terminate()
    beat.wait(timeout=30)
    assert wait_for(lambda: not r.exists("delayq:beats"), 10, 0.1), r.hgetall("delayq:beats")
