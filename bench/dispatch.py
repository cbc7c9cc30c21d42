"""Rows 3, 4 and 11: how fast real beats publish due jobs into the broker."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from kombu.connection import Connection

from .harness import (
    BenchError,
    Context,
    CpuWatch,
    Fill,
    Producer,
    fill,
    producer,
    rate_between,
    wake_channel,
    watch,
)
from .jobs import BARE, PAYLOAD, PAYLOAD_BYTES, REAL, job_call
from .report import Line, RowResult

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: Seconds a fill may take through apply_at_many before it switches to the fast path.
FILL_BUDGET = 8.0
QUEUE = "celery"


@dataclass
class Drained:
    """One drain: the steady rate, the time to the last, the fill, and the CPU each process
    used over the drain (% of one core), with the whole machine's busy share."""

    rate: float
    took: float
    filled: Fill
    cpu: dict[str, float] = field(default_factory=dict)
    machine: float = float("nan")  # % of one core, all processes (others' included)
    after: Any = None  # what ``before_stop`` returned


def drain(
    ctx: Context,
    p: Producer,
    broker: str,
    store: str,
    beats: int,
    n: int,
    published: Callable[[], int],
    store_due: Callable[[], Fill],
    conf: dict[str, Any] | None = None,
) -> tuple[float, float, Fill]:
    """``beats`` beats publish ``n`` jobs due at once; return (steady jobs/s, seconds from the
    start until all are published, how they were stored). See :func:`drain_measured`."""
    got = drain_measured(ctx, p, broker, store, beats, n, published, store_due, conf)
    return got.rate, got.took, got.filled


def drain_measured(
    ctx: Context,
    p: Producer,
    broker: str,
    store: str,
    beats: int,
    n: int,
    published: Callable[[], int],
    store_due: Callable[[], Fill],
    conf: dict[str, Any] | None = None,
    servers: dict[str, int] | None = None,
    subscribers: Any = None,
    before_stop: Callable[[], Any] | None = None,
) -> Drained:
    """``beats`` beats publish ``n`` jobs due at once.

    The beats start on a store with nothing due, and once they are in their claim loop (asleep)
    they are frozen (SIGSTOP) while ``store_due`` stores the jobs, then thawed together: the
    measure holds no start-up, no fill, and no beat starting before another. The CPU time of
    each beat and of each of ``servers`` (name: pid) is read from the thaw until the last job
    is published. ``subscribers`` answers ``pubsub_numsub`` (default: the producer's client).
    ``before_stop`` runs after the drain, while the beats still run; its result is ``after``.
    """
    children = [ctx.start_beat(broker, store, conf) for _ in range(beats)]
    try:
        ctx.wait_beats(subscribers or p.client, wake_channel(p), children)
        time.sleep(0.5)  # past their first pass: asleep on the wake channel
        ctx.freeze(children)
        filled = store_due()
        pids = {f"beat {i + 1}": c.pid for i, c in enumerate(children)}
        cpu = CpuWatch({**pids, **(servers or {})})
        machine0 = _busy_seconds()
        start = time.time()
        cpu.start()
        ctx.thaw(children)
        samples = watch(
            published,
            n,
            timeout=max(120.0, n / 500.0),
            interval=0.02,
            children=children,
            what=f"{beats} beat(s) publishing {n:,} jobs",
        )
        used = cpu.used()
        machine = 100.0 * (_busy_seconds() - machine0) / (time.time() - start)
        after = before_stop() if before_stop else None
    finally:
        ctx.stop_all(children)
    return Drained(rate_between(samples, n), samples[-1][0] - start, filled, used, machine, after)


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores, every process)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def cpu_text(d: Drained) -> str:
    """Each process's CPU share over a drain, and what limits it."""
    cores = os.cpu_count() or 1
    shares = ", ".join(f"{name} {pct:.0f}%" for name, pct in d.cpu.items())
    redis_cpu = max((pct for name, pct in d.cpu.items() if name.startswith("redis")), default=0.0)
    ours = sum(d.cpu.values())
    if redis_cpu >= 90.0:
        limit = f"Redis's CPU: the server ran at {redis_cpu:.0f}% of its one core"
    elif d.machine >= 90.0 * cores:
        limit = (
            f"the {cores} cores: the machine was {d.machine:.0f}% busy of {100 * cores}% "
            f"(these processes {ours:.0f}%)"
        )
    else:
        limit = (
            f"neither Redis's core nor the machine's {cores} cores were full (machine {d.machine:.0f}% "
            f"of {100 * cores}%): waits, round trips"
        )
    return f"CPU over the drain, % of one core: {shares}; limit: {limit}"


#: The Redis limit: the least work a Lua script does to move due zset members into a list.
#: One call takes up to ARGV[2] members with a score up to ARGV[1] (ZRANGE BYSCORE LIMIT),
#: pushes them with one LPUSH, removes them with one ZREM, and returns how many it moved.
LIMIT_SCRIPT = """
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return 0 end
redis.call('LPUSH', KEYS[2], unpack(ids))
redis.call('ZREM', KEYS[1], unpack(ids))
return #ids
"""
#: The same with a stored message per member: it reads the members' messages from a hash
#: (one HMGET), pushes the messages, and removes the members from the zset and the hash.
LIMIT_MESSAGES_SCRIPT = """
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return 0 end
redis.call('LPUSH', KEYS[2], unpack(redis.call('HMGET', KEYS[3], unpack(ids))))
redis.call('ZREM', KEYS[1], unpack(ids))
redis.call('HDEL', KEYS[3], unpack(ids))
return #ids
"""
LIMIT_CHUNK = 1_000
#: Script calls per round trip: the server never waits for the client between chunks.
LIMIT_DEPTH = 4


def redis_limit(
    client: Any, n: int, pid: int | None = None, message: str | None = None
) -> tuple[float, float]:
    """Move ``n`` due members of a sorted set into a list with :data:`LIMIT_SCRIPT` (with a
    ``message``: each member's copy of it, stored in a hash, with :data:`LIMIT_MESSAGES_SCRIPT`),
    one call per :data:`LIMIT_CHUNK`; return (jobs/s, the server's CPU over the move in % of one
    core).

    The members are uuid4 strings (the length of a job id), all due; the keys are deleted after.
    """
    zset, lst, msgs = "bench:limit:due", "bench:limit:list", "bench:limit:msgs"
    client.delete(zset, lst, msgs)
    due = int(time.time() * 1000) - 1000
    for start in range(0, n, 10_000):
        ids = [str(uuid.uuid4()) for _ in range(start, min(n, start + 10_000))]
        with client.pipeline(transaction=False) as pipe:
            pipe.zadd(zset, {job: due + start + i for i, job in enumerate(ids)})
            if message is not None:
                pipe.hset(msgs, mapping=dict.fromkeys(ids, message))
            pipe.execute()
    script = client.register_script(LIMIT_SCRIPT if message is None else LIMIT_MESSAGES_SCRIPT)
    keys = [zset, lst] if message is None else [zset, lst, msgs]
    script(keys=keys, args=[due + n, 1])  # loaded before the clock starts
    cpu = CpuWatch({"redis": pid}) if pid else None
    moved = 1
    t0 = time.perf_counter()
    if cpu:
        cpu.start()
    while moved < n:
        with client.pipeline(transaction=False) as pipe:
            for _ in range(LIMIT_DEPTH):
                script(keys=keys, args=[due + n, LIMIT_CHUNK], client=pipe)
            got = sum(int(x) for x in pipe.execute())
        if got == 0:
            raise BenchError(f"the limit script moved {moved:,} of {n:,} members")
        moved += got
    took = time.perf_counter() - t0
    share = cpu.used()["redis"] if cpu else float("nan")
    if int(client.llen(lst)) != n:
        raise BenchError(f"the limit script left {client.llen(lst):,} members in the list, not {n:,}")
    client.delete(zset, lst, msgs)
    return (n - 1) / took, share


def _starved(share: float) -> str:
    """A warning when the server had under 90% of a core for a move that should fill one."""
    if share >= 90.0:
        return ""
    return " (under 90%: other processes took the server's CPU, so this limit is understated)"


def kombu_message(p: Producer, shape: str = REAL) -> str:
    """The JSON kombu's Redis transport LPUSHes for ``bench.job`` with job 0's arguments of
    ``shape`` (sent through Celery into the broker list, then taken back out)."""
    args, kwargs = job_call(0, shape)
    p.app.send_task(p.task.name, args, kwargs)
    raw = p.client.rpop(QUEUE)
    if not raw:
        raise BenchError(f"no message in the broker list {QUEUE!r} after send_task")
    return str(raw)


def _fill_due(p: Producer, n: int, shape: str = REAL) -> Fill:
    now = time.time()
    return fill(p, n, lambda i: now, FILL_BUDGET, shape)


#: The runs of the dispatch row: (beats, job shape).
DISPATCH_RUNS = ((1, REAL), (2, REAL), (1, BARE), (1, PAYLOAD))


def row_dispatch(ctx: Context) -> RowResult:
    """One beat and two beats, a Redis broker, ``dispatch_jobs`` real jobs due at once; the Redis
    limit; one beat again with no-argument jobs and with 2 KB payload jobs."""
    result = RowResult("dispatch")
    n = ctx.sizes.dispatch_jobs
    server = ctx.redis()
    url = server.url + "/0"
    runs: dict[tuple[int, str], Drained] = {}
    row_t0 = time.monotonic()
    pid = server.process.pid if server.process else None
    with producer(url, url) as p:
        ctx.say(f"dispatch: the Redis limit, a bare Lua script moving {n:,} zset members into a list")
        p.client.flushall()
        limit, limit_cpu = redis_limit(p.client, n, pid)
        message = kombu_message(p)
        limit_msg, limit_msg_cpu = redis_limit(p.client, n, pid, message)
        for beats, shape in DISPATCH_RUNS:
            p.client.flushall()
            ctx.say(f"dispatch: {_beats(beats)}, storing {n:,} due jobs ({shape}), then publishing them")
            run = drain_measured(
                ctx,
                p,
                url,
                url,
                beats,
                n,
                lambda: int(p.client.llen(QUEUE)),
                functools.partial(_fill_due, p, n, shape),
                servers={"redis": pid} if pid else None,
            )
            runs[(beats, shape)] = run
            result.notes.append(
                f"{_beats(beats)}, {shape}: all {n:,} published {run.took:.1f} s after the "
                f"start ({n / run.took:,.0f} jobs/s overall); {cpu_text(run)}"
            )
            if (beats, shape) == (1, REAL):
                result.notes.append(f"fill: {run.filled.method}; fill time is not measured")
    ctx.stop_redis(server)
    row_s = time.monotonic() - row_t0
    size = f"{n:,} due"
    real, bare, payload = runs[(1, REAL)].rate, runs[(1, BARE)].rate, runs[(1, PAYLOAD)].rate
    lines = result.lines
    lines.append(
        Line(
            f"dispatch: 1 beat, Redis broker, {size}, {REAL} (vs the Redis limit)",
            real,
            "jobs/s",
            baseline=limit,
            target=">=0.5",
        )
    )
    lines.append(
        Line(
            f"dispatch: 1 beat, {size}, {REAL} (vs the limit with messages)",
            real,
            "jobs/s",
            baseline=limit_msg,
            target=">=0.4",
        )
    )
    lines.append(
        Line(
            f"dispatch: 2 beats, {size}, {REAL} (vs 1 beat)",
            runs[(2, REAL)].rate,
            "jobs/s",
            baseline=real,
            target=">=1.7",
        )
    )
    lines.append(
        Line(f"dispatch: 1 beat, {size}, {REAL} (vs {BARE})", real, "jobs/s", baseline=bare, target=">=0.7")
    )
    lines.append(Line(f"dispatch: 1 beat, {size}, {PAYLOAD} (vs {REAL})", payload, "jobs/s", baseline=real))
    result.notes.append(
        f"the jobs: {REAL} = bench.job(user_id, text, locale=...), an int, a text of 32-39 characters and "
        f"a 5-character locale, all differing per job (bench/jobs.py job_call); {BARE} = bench.job(); "
        f"{PAYLOAD} = the real job with payload= a {PAYLOAD_BYTES:,}-character string differing per job. "
        f"Side by side, 1 beat: {REAL} {real:,.0f} jobs/s, {BARE} {bare:,.0f} jobs/s, {PAYLOAD} "
        f"{payload:,.0f} jobs/s"
    )
    result.notes.append(
        f"the Redis limit: {n:,} uuid members of one sorted set, all due, moved into a list on the same "
        f"server by a bare Lua script (ZRANGE BYSCORE LIMIT {LIMIT_CHUNK:,}, one LPUSH, one ZREM per call; "
        f"{LIMIT_DEPTH} calls per pipelined round trip) until none is left: {limit:,.0f} jobs/s, "
        f"the server at {limit_cpu:.0f}% of one core{_starved(limit_cpu)}; it pushes ids, not messages "
        "(bench/dispatch.py LIMIT_SCRIPT)"
    )
    result.notes.append(
        f"the limit with messages: the same, but each member has its own copy of a real bench.job's kombu "
        f"message ({len(message):,} B, taken from a real broker list) in a hash, and each call reads them "
        f"(one HMGET), pushes the messages and removes the members from the zset and the hash "
        f"(LIMIT_MESSAGES_SCRIPT): {limit_msg:,.0f} jobs/s, the server at {limit_msg_cpu:.0f}% of one core"
        f"{_starved(limit_msg_cpu)}; "
        "no target, a figure for pushing on claim with the whole message stored"
    )
    if n < 1_000_000:
        result.notes.append(
            f"{n:,} jobs due at once, not the issue's 1,000,000: this row took {row_s:.0f} s, so 1M would "
            f"take about {row_s * 1_000_000 / n:.0f} s here (stores filled {len(DISPATCH_RUNS)} times, "
            "drained by 1 or 2 beats), too much of the 10-minute budget of the whole suite on 2 cores; "
            "python -m bench --full --only dispatch runs 1M"
        )
    result.notes.append(
        "the beats are started and frozen (SIGSTOP) while the jobs are stored, then thawed together; "
        "rate = jobs/s between 5% and 95% published (LLEN of the broker list, sampled every 20 ms); "
        "no worker, the list grows and is flushed after; "
        "broker and store on one Redis server, default settings (16 shards, batch 500); "
        "CPU = user+system time from /proc/<pid>/stat (psutil) from the thaw to the last published"
    )
    return result


def _spread(first: float, step: float) -> Callable[[int], float]:
    """Due times ``first``, ``first + step``, ... by index."""

    def due_at(i: int) -> float:
        return first + i * step

    return due_at


def _beats(k: int) -> str:
    return f"{k} beat" if k == 1 else f"{k} beats"


def rabbitmq_or_reason(url: str = RABBITMQ_URL) -> tuple[bool, str]:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError as exc:
        return False, f"RabbitMQ does not answer on 127.0.0.1:5672 ({exc})"
    try:
        with Connection(url, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
            conn.connect()
    except Exception as exc:
        return False, f"cannot open an AMQP connection to 127.0.0.1:5672 ({exc!r})"
    return True, ""


@contextlib.contextmanager
def rabbit_queue(p: Producer, name: str) -> Iterator[Callable[[], int]]:
    """Declare the queue as Celery would; yield its message count; delete it (and its exchange)."""
    with Connection(RABBITMQ_URL, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
        channel = conn.channel()
        try:
            p.app.amqp.queues[name].bind(channel).declare()

            def count() -> int:
                return int(channel.queue_declare(queue=name, passive=True).message_count)

            yield count
        finally:
            with contextlib.suppress(Exception):
                channel.queue_purge(name)
            with contextlib.suppress(Exception):
                channel.queue_delete(name)
            with contextlib.suppress(Exception):
                channel.exchange_delete(name)


def row_dispatch_rabbitmq(ctx: Context) -> RowResult:
    """One beat publishing into RabbitMQ."""
    result = RowResult("dispatch_rabbitmq")
    what = "dispatch_rabbitmq: 1 beat, RabbitMQ broker"
    ok, reason = rabbitmq_or_reason()
    if not ok:
        result.lines.append(Line(what, None, "jobs/s", target=">=5000", on="ours", skipped=reason))
        return result
    n = ctx.sizes.rabbit_jobs
    queue = f"delayq-bench-{uuid.uuid4().hex[:12]}"
    conf = {"task_default_queue": queue, "broker_heartbeat": 0}
    server = ctx.redis()
    store = server.url + "/0"
    with producer(RABBITMQ_URL, store, **conf) as p, rabbit_queue(p, queue) as count:
        ctx.say(f"dispatch_rabbitmq: 1 beat publishing {n:,} jobs into RabbitMQ")
        rate, took, filled = drain(ctx, p, RABBITMQ_URL, store, 1, n, count, lambda: _fill_due(p, n), conf)
    ctx.stop_redis(server)
    result.lines.append(Line(f"{what}, {n:,} due", rate, "jobs/s", target=">=5000", on="ours"))
    result.notes.append(
        f"{n:,} real jobs due at once in a Redis store, published by one beat into RabbitMQ "
        f"(queue {queue}, purged and deleted after); rate between 5% and 95% of the queue's "
        f"message count; all published {took:.1f} s after the start; fill: {filled.method}"
    )
    return result


def row_scale(ctx: Context) -> RowResult:
    """Dispatch rate of ``scale_due`` due jobs with many vs few not-due jobs pending."""
    result = RowResult("scale")
    sz = ctx.sizes
    server = ctx.redis()
    url = server.url + "/0"
    rates: dict[int, float] = {}
    with producer(url, url) as p:
        later = time.time() + 3600
        stored = 0
        for pending in (sz.scale_small, sz.scale_large):
            ctx.say(
                f"scale: storing {pending - stored:,} not-due jobs (total {pending:,}), {sz.scale_due:,} due"
            )
            fill(p, pending - stored, _spread(later + stored * 0.05, 0.05), FILL_BUDGET)
            stored = pending
            p.client.delete(QUEUE)
            ctx.say(f"scale: 1 beat publishing {sz.scale_due:,} due among {pending:,} pending")
            rates[pending], _, _ = drain(
                ctx,
                p,
                url,
                url,
                1,
                sz.scale_due,
                lambda: int(p.client.llen(QUEUE)),
                lambda: _fill_due(p, sz.scale_due),
            )
    ctx.stop_redis(server)
    small, large = sz.scale_small, sz.scale_large
    result.lines.append(
        Line(
            f"scale: dispatch, {large:,} pending vs {small:,}",
            rates[large],
            "jobs/s",
            baseline=rates[small],
            target=">=0.8",
        )
    )
    result.notes.append(
        f"{sz.scale_due:,} real jobs (bench.job(user_id, text, locale=...), bench/jobs.py) due at once, "
        "published by one beat into a Redis broker, with "
        f"{small:,} then {large:,} jobs pending (due over the next hours) in the same store; "
        "beats frozen while the due jobs are stored (see dispatch); rate between 5% and 95% published"
    )
    if large < 10_000_000:
        result.notes.append(
            f"{large:,} pending, not the issue's 10,000,000 (filling 10M takes minutes and about 4 GB): "
            "python -m bench --full --only scale runs 10M with 100,000 due"
        )
    return result
