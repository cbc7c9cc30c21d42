"""Row ``start_records``: Redis bytes per started job of the workers' start check (kombu path).

``RATE`` jobs/s for ``steady_seconds`` (60 s by default) through one beat and two workers
whose broker is a Redis server other than the store: the beat publishes through kombu, so
every message carries its claim and every start is checked (``lua/start.lua``, default
``delayq_start_ttl`` of an hour: nothing expires during the row). Then, side by side:

* **ours**: the start records the run's workers wrote (the bucketed hashes,
  ``<prefix>:{<prefix>:<i>}:starts:<W>:<bucket>:<part>``): the sum of their ``MEMORY USAGE``
  over the jobs that started;
* **the one-key-a-job design** (before issue 52): the same starts (the run's job ids and due
  times, the beat's token as the claim) written by that design's script (:data:`OLD_START`,
  a string a record, ``SET PX``) on a fresh server: ``MEMORY USAGE`` summed the same way;
* the same two written on fresh servers, as ``used_memory`` grows with them (what also counts
  the expiry of each old key).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from celery_delayq.store.keys import KeySpace, start_record
from celery_delayq.store.scripts import SCRIPTS

from .harness import STARTS_KEY, Context, fill, producer, used_memory, wait_until, wake_channel, watch
from .report import Line, RowResult

RATE = 500  # jobs/s
TTL_MS = 3_600_000  # delayq_start_ttl's default
TARGET = "<=64"
STORE_CONF: dict[str, Any] = {}

#: lua/start.lua as it was before issue 52: one string key a started job instance.
OLD_START = """
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if held == ARGV[1] then
  return 1
end
redis.call('INCR', KEYS[2])
return 0
"""


def _records_usage(client: redis.Redis) -> tuple[int, int]:
    """``(keys, bytes)``: the bucketed start-record hashes of ``client`` and their MEMORY USAGE."""
    keys, total = 0, 0
    for key in client.scan_iter(match="*:starts:*:*:*", count=1000):
        keys += 1
        total += int(client.memory_usage(key, samples=0) or 0)
    return keys, total


def _old_usage(client: redis.Redis) -> int:
    return sum(int(client.memory_usage(key, samples=0) or 0) for key in client.scan_iter(match="*:start:*"))


def _replay(ctx: Context, starts: list[tuple[str, int, int, str]], old: bool) -> tuple[int, int]:
    """Write ``starts`` (job id, due ms, created ms, claim) with the old or the new script on a
    fresh server: ``(used_memory delta, MEMORY USAGE of the records)``."""
    server = ctx.redis()
    try:
        client = redis.Redis.from_url(server.url + "/0")
        keys = KeySpace("delayq", 16)
        old_script = client.register_script(OLD_START)
        old_script(["warm-up", "warm-up:dropped"], ["1|a", 1000])  # (both loaded before the pipelines)
        SCRIPTS["start"](client, ["warm-up", "{warm-up}:starts:dropped"], ["1|a", 1000, 0, "f", "m"])
        before = used_memory(client)
        pipe = client.pipeline(transaction=False)
        for i, (job_id, due_ms, created_ms, claim) in enumerate(starts, 1):
            shard = keys.for_job(job_id)
            names = [shard.started(job_id, due_ms, created_ms), shard.dropped]
            if old:
                old_script(names, [claim, TTL_MS], client=pipe)
            else:
                part, field, mark = start_record(job_id, due_ms, created_ms, claim)
                SCRIPTS["start"](pipe, names, [claim, TTL_MS, part, field, mark])
            if i % 2000 == 0:
                pipe.execute()
        pipe.execute()
        grown = used_memory(client) - before
        usage = _old_usage(client) if old else _records_usage(client)[1]
        client.close()
    finally:
        ctx.stop_redis(server)
    return grown, usage


def row_start_records(ctx: Context) -> RowResult:
    result = RowResult("start_records")
    seconds = ctx.sizes.steady_seconds
    n = int(seconds * RATE)
    store_server, broker_server = ctx.redis(), ctx.redis()
    store, broker = store_server.url + "/0", broker_server.url + "/0"
    with producer(broker, store) as p:
        workers = [ctx.start_worker(broker, store, pool=("-P", "solo")) for _ in range(2)]
        beat = ctx.start_beat(broker, store)
        for worker in workers:
            ctx.wait_worker(worker)
        ctx.wait_beats(p.client, wake_channel(p), [beat])
        p.task.apply_in(0)
        wait_until(
            lambda: p.client.llen(STARTS_KEY) >= 1, 60, 0.05, [*workers, beat], "the warm-up job did not run"
        )
        p.client.delete(STARTS_KEY)
        warm_keys, warm_usage = _records_usage(p.client)
        t0 = time.time() + 10.0 + n / 20_000  # (after the fill: every job is still stored)
        created_ms = int(time.time() * 1000)
        fill(p, n, lambda i: t0 + i / RATE, 5.0)
        shards = KeySpace("delayq", 16)
        jobs = [
            (job_id, int(due))
            for i in range(16)
            for job_id, due in p.client.zrange(shards.shard(i).due, 0, -1, withscores=True)
        ]
        ctx.say(f"start_records: {RATE:,} jobs/s for {seconds:g} s on the kombu path")
        watch(
            lambda: int(p.client.llen(STARTS_KEY)),
            n,
            timeout=t0 - time.time() + seconds + 60,
            interval=0.5,
            children=[*workers, beat],
            what="start_records runs",
        )
        started = int(p.client.llen(STARTS_KEY))
        record_keys, usage = _records_usage(p.client)
        token = next(iter(p.client.hkeys("delayq:beats")), "host:1:" + "0" * 16)
        ctx.stop_all([beat, *workers])
    ctx.stop_redis(store_server)
    ctx.stop_redis(broker_server)
    ours = (usage - warm_usage) / started
    runs = [(job_id, due, created_ms, f"1|{token}") for job_id, due in jobs]
    old_grown, old_usage = _replay(ctx, runs, old=True)
    new_grown, new_usage = _replay(ctx, runs, old=False)
    what = f"start_records: {RATE:,} jobs/s for {seconds:g} s (kombu path), Redis bytes per started job"
    result.lines.append(
        Line(
            f"{what} (MEMORY USAGE) vs one key a job",
            ours,
            "B",
            baseline=old_usage / len(runs),
            target=TARGET,
            on="ours",
        )
    )
    result.lines.append(
        Line(
            f"{what} (used_memory, written again) vs one key a job",
            new_grown / len(runs),
            "B",
            baseline=old_grown / len(runs),
            target=TARGET,
            on="ours",
        )
    )
    result.notes.append(
        f"{started:,} of {n:,} jobs started, their records in {record_keys - warm_keys:,} "
        f"hashes (16 shards, 256 parts, buckets of 512 s at delayq_start_ttl 3600 s); ours is what the "
        f"run's workers wrote, the one-key-a-job figure the same {len(runs):,} starts written by that "
        f"design's script on a fresh server (new design written the same way: {new_usage / len(runs):.1f} B "
        "of MEMORY USAGE). A run fills its buckets to 60 s of an hour's starts: at a steady hour "
        "the hashes hold more each (up to 128 fields a hash stays a listpack) and a record costs less"
    )
    return result
