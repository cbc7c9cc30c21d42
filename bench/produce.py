"""Rows 1-2: how fast one process schedules jobs, against Celery's ``apply_async(countdown=)``."""

from __future__ import annotations

import statistics
import time
from typing import Any

from celery.utils import uuid

from .harness import Context, envelope_template, producer, timed_loop
from .report import Line, RowResult

BATCH = 1000


#: PINGs timed one by one after each half of the ``apply_at`` row: their median is the round trip.
PINGS = 2000


def ping_times(client: Any, n: int) -> list[float]:
    """``n`` PING round trips on ``client`` (one connection: the calls come one after the
    other from one thread), each timed on its own, in seconds."""
    out: list[float] = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        client.ping()
        out.append(clock() - t0)
    return out


def row_apply_at(ctx: Context) -> RowResult:
    """``apply_at`` one job per call vs ``apply_async(countdown=3600)`` to a Redis broker, and
    the call's time in PING round trips of the same server, measured in the same run."""
    result = RowResult("apply_at")
    server = ctx.redis()
    url = server.url + "/0"
    seconds = ctx.sizes.produce_seconds
    with producer(url, url) as p:
        due = time.time() + 3600
        for _ in range(100):  # connections, scripts loaded
            p.task.apply_at(due)
            p.task.apply_async(countdown=3600)
            p.client.ping()
        ours: list[float] = []
        base: list[float] = []
        pings: list[float] = []
        for _ in range(2):  # interleaved halves: drift of the machine hits every side
            ours.append(timed_loop(lambda: p.task.apply_at(due), seconds / 2))
            pings.extend(ping_times(p.client, PINGS // 2))
            base.append(timed_loop(lambda: p.task.apply_async(countdown=3600), seconds / 2))
    ctx.stop_redis(server)
    call_us = 2e6 / sum(ours)
    celery_us = 2e6 / sum(base)
    rtt_us = statistics.median(pings) * 1e6
    result.lines.append(Line("apply_at: jobs/s, one call per job", sum(ours) / 2, "jobs/s",
                             baseline=sum(base) / 2, target=">=3"))
    result.lines.append(Line("apply_at: µs a call, in PING round trips of the server", call_us, "µs",
                             baseline=rtt_us, target="<=1.5"))
    result.notes.append(
        f"one process, {seconds:g} s of each (two interleaved halves), no-argument task; broker and "
        "store on one Redis server; baseline: apply_async(countdown=3600) to that broker; per call "
        f"(the timed loops' mean): apply_at {call_us:.0f} µs = {call_us / rtt_us:.2f} PING RTT (one EVALSHA "
        f"round trip), apply_async {celery_us:.0f} µs = {celery_us / rtt_us:.2f} PING RTT; a PING round trip "
        f"here: {rtt_us:.0f} µs, the median of {len(pings):,} PINGs timed one by one through "
        "redis-py on one connection, after each half of apply_at"
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
