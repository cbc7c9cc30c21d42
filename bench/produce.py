"""Rows 1-2: how fast one process schedules jobs, against Celery's ``apply_async(countdown=)``."""

from __future__ import annotations

import time

from celery.utils import uuid

from .harness import Context, envelope_template, producer, timed_loop
from .report import Line, RowResult

BATCH = 1000


def row_apply_at(ctx: Context) -> RowResult:
    """``apply_at`` one job per call vs ``apply_async(countdown=3600)`` to a Redis broker."""
    result = RowResult("apply_at")
    server = ctx.redis()
    url = server.url + "/0"
    seconds = ctx.sizes.produce_seconds
    with producer(url, url) as p:
        due = time.time() + 3600
        for _ in range(100):  # connections, scripts loaded
            p.task.apply_at(due)
            p.task.apply_async(countdown=3600)
        ours: list[float] = []
        base: list[float] = []
        for _ in range(2):  # interleaved halves: drift of the machine hits both
            ours.append(timed_loop(lambda: p.task.apply_at(due), seconds / 2))
            base.append(timed_loop(lambda: p.task.apply_async(countdown=3600), seconds / 2))
        pings = timed_loop(p.client.ping, min(1.0, seconds / 2))  # the floor of one round trip
    ctx.stop_redis(server)
    result.lines.append(Line("apply_at: jobs/s, one call per job", sum(ours) / 2, "jobs/s",
                             baseline=sum(base) / 2, target=">=3"))
    result.notes.append(
        f"one process, {seconds:g} s of each (two interleaved halves), no-argument task; broker and "
        "store on one Redis server; baseline: apply_async(countdown=3600) to that broker; per call: "
        f"apply_at {2e6 / sum(ours):.0f} µs (one EVALSHA round trip), apply_async "
        f"{2e6 / sum(base):.0f} µs; a PING round trip (redis-py) here: {1e6 / pings:.0f} µs"
    )
    return result


def row_apply_at_many(ctx: Context) -> RowResult:
    """``apply_at_many`` in batches of 1,000 vs ``apply_async(countdown=)`` and raw ZADD+HSET."""
    result = RowResult("apply_at_many")
    server = ctx.redis()
    url = server.url + "/0"
    n = ctx.sizes.many_jobs
    with producer(url, url) as p:
        base_due = time.time() + 3600
        p.task.apply_at_many([(base_due, None, None)] * 10)  # warm
        batches = [[(base_due + (b * BATCH + i) / 1000.0, None, None) for i in range(BATCH)]
                   for b in range(n // BATCH)]
        t0 = time.perf_counter()
        for items in batches:
            p.task.apply_at_many(items)
        ours = n / (time.perf_counter() - t0)

        for _ in range(100):
            p.task.apply_async(countdown=3600)
        celery = timed_loop(lambda: p.task.apply_async(countdown=3600), ctx.sizes.produce_seconds)

        template = envelope_template(p)
        size = len(template) if template else 0
        payload = "x" * size
        client = p.client
        client.flushall()
        t0 = time.perf_counter()
        for b in range(n // BATCH):
            pipe = client.pipeline(transaction=False)
            for i in range(BATCH):
                job_id = uuid()
                shard = (b * BATCH + i) % 16
                pipe.zadd(f"raw:{{raw:{shard}}}:due", {job_id: int(base_due * 1000) + i})
                pipe.hset(f"raw:{{raw:{shard}}}:jobs", job_id, payload)
            pipe.execute()
        raw = n / (time.perf_counter() - t0)
    ctx.stop_redis(server)
    result.lines.append(Line("apply_at_many: jobs/s, batches of 1,000", ours, "jobs/s", baseline=celery,
                             target=">=30"))
    result.lines.append(Line("apply_at_many: share of raw pipelined ZADD+HSET", ours, "jobs/s",
                             baseline=raw))
    result.notes.append(
        f"{n:,} jobs in batches of {BATCH:,} from one process; baseline 1: apply_async(countdown=3600) "
        f"for {ctx.sizes.produce_seconds:g} s; baseline 2: redis-py pipeline of ZADD+HSET per job "
        f"(uuid ids, a {size}-byte payload = the stored envelope's size, 16 keys of each, "
        f"batches of {BATCH:,}); the ratio of the second line is the fraction of raw speed"
    )
    return result
