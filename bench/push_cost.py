"""Issue 26's figure: Redis server CPU per job of the push path, beside the bare script's.

``python -m bench.push_cost [N] [RUNS]`` starts its own Redis server, stores ``N`` (20,000) real
due jobs (:data:`bench.jobs.REAL`) with ``apply_at_many`` (broker and store: that server, so a
beat pushes on claim), resets the server's command statistics, drains them with a beat's
:class:`~celery_delayq.beat.dispatch.Dispatcher` ``run_once`` loop, and reads the server's CPU
(``INFO commandstats``: the usec of ``evalsha``, and of every command) per job. Then the same
for :data:`bench.dispatch.LIMIT_MESSAGES_SCRIPT` moving ``N`` members with kombu's message for
the job, on the same server. ``RUNS`` (3) times each; prints each run and the spread.

Server CPU per job is what the row's 0.4x target comes down to (Redis runs at most of a core
while one beat drains), and unlike throughput it hardly moves when other processes share the
machine. One job of the shape is delivered first (the beat's way), which stores its template.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import EmbeddedRedis

from .dispatch import LIMIT_CHUNK, LIMIT_MESSAGES_SCRIPT, QUEUE, kombu_message
from .harness import Producer, fill, producer
from .jobs import REAL

#: The commands the scripts call (counted in INFO commandstats beside, and inside, evalsha's usec).
INNER = ("zrange", "hmget", "hlen", "lpush", "zrem", "hdel", "hget", "time", "set")


def _usec(client: redis.Redis) -> tuple[int, int, int]:
    """(evalsha usec, evalsha calls, usec of the commands the scripts called) since the last
    CONFIG RESETSTAT: what is left of evalsha's is the Lua work."""
    stats: dict[str, Any] = client.info("commandstats")
    script = stats.get("cmdstat_evalsha", {})
    inner = sum(int(stats.get(f"cmdstat_{name}", {}).get("usec", 0)) for name in INNER)
    return int(script.get("usec", 0)), int(script.get("calls", 0)), inner


def store_due(p: Producer, n: int) -> None:
    """Store ``n`` real jobs due now, after one of their shape that a beat has delivered the
    beat's way (which stores the shape's template), its message taken out of the queue."""
    now = time.time() - 1
    fill(p, 1, lambda i: now, float("inf"), REAL)
    warm = Dispatcher(p.app)
    for _ in range(10):
        warm.run_once()
    warm.close()
    p.client.delete(QUEUE)
    fill(p, n, lambda i: now, float("inf"), REAL)


def push_cost(p: Producer, n: int) -> tuple[float, float, int]:
    """Drain ``n`` due real jobs through a beat's push path; (evalsha usec per job, usec per job
    of the commands the script called, evalsha calls)."""
    client = p.client
    client.flushall()
    store_due(p, n)
    dispatcher = Dispatcher(p.app)  # a new beat claims every shard at its first pass
    try:
        client.config_resetstat()
        while int(client.llen(QUEUE)) < n and dispatcher.stats.passes < n:
            dispatcher.run_once()
        script, calls, inner = _usec(client)
    finally:
        dispatcher.close()
    pushed = int(client.llen(QUEUE))
    if pushed != n or dispatcher.stats.pushed_on_claim != n:
        on_claim = dispatcher.stats.pushed_on_claim
        raise RuntimeError(f"{pushed:,} in the queue, {on_claim:,} pushed on claim, not {n:,}")
    return script / n, inner / n, calls


def limit_cost(client: redis.Redis, n: int, message: str) -> tuple[float, int]:
    """Move ``n`` members with their message by LIMIT_MESSAGES_SCRIPT, LIMIT_CHUNK a call;
    (evalsha usec per job, calls). The members are ids the length of a job's."""
    client.flushall()
    zset, lst, msgs = "bench:limit:due", "bench:limit:list", "bench:limit:msgs"
    ids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(n)]
    with client.pipeline(transaction=False) as pipe:
        pipe.zadd(zset, {job: i for i, job in enumerate(ids)})
        pipe.hset(msgs, mapping=dict.fromkeys(ids, message))
        pipe.execute()
    script = client.register_script(LIMIT_MESSAGES_SCRIPT)
    script(keys=[zset, lst, msgs], args=[-1, 1])  # loaded (moves nothing)
    client.config_resetstat()
    while int(script(keys=[zset, lst, msgs], args=[n, LIMIT_CHUNK])):
        pass
    usec, calls, _ = _usec(client)
    if int(client.llen(lst)) != n:
        raise RuntimeError(f"the limit script moved {client.llen(lst):,} members, not {n:,}")
    return usec / n, calls


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 20_000
    runs = int(argv[1]) if len(argv) > 1 else 3
    ours: list[float] = []
    limits: list[float] = []
    with EmbeddedRedis() as server:
        url = server.url + "/0"
        with producer(url, url) as p:
            message = kombu_message(p)
            for run in range(1, runs + 1):
                per_job, inner, calls = push_cost(p, n)
                limit, limit_calls = limit_cost(p.client, n, message)
                ours.append(per_job)
                limits.append(limit)
                print(
                    f"run {run}: push.lua {per_job:.2f} us/job ({calls} calls, "
                    f"{per_job * n / calls:,.0f} us/call; of which Redis commands {inner:.2f} us/job); "
                    f"limit {limit:.2f} us/job ({limit_calls} calls); "
                    f"limit/ours {limit / per_job:.3f}",
                    flush=True,
                )
    ratios = [limit / per_job for limit, per_job in zip(limits, ours, strict=True)]
    print(
        f"{n:,} real jobs, {runs} runs: push.lua {min(ours):.2f}-{max(ours):.2f} us/job, "
        f"limit {min(limits):.2f}-{max(limits):.2f} us/job, "
        f"limit/ours, each run's own {min(ratios):.3f}-{max(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
