"""Rows 7, 9 and 10: what an idle beat costs, worker RSS, Redis bytes per pending job.

Row 7 counts an idle beat's commands two ways on its own Redis server: sent (``MONITOR``: what
its connections send) and run (``INFO commandstats``: every command the server ran, those run
inside Lua scripts included, less the ``INFO`` call of the measure). The target is on the second.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import psutil
import redis

from celery_delayq.devtools.embedded import EmbeddedRedis

from .celery_eta import celery_eta
from .dispatch import kombu_message
from .harness import (
    BenchError,
    Child,
    Context,
    Fill,
    fill,
    producer,
    rss_mib,
    used_memory,
    wait_until,
    wake_channel,
)
from .jobs import BARE, PAYLOAD, PAYLOAD_BYTES, REAL, SHAPES, job_call
from .report import Line, RowResult

_MONITOR_LINE = re.compile(r'^\+\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')


class Monitor:
    """Counts the commands clients send to one server (``MONITOR``), by command name.

    Commands that Lua scripts run (``[0 lua]``) are not counted: they are not sent.
    """

    def __init__(self, port: int) -> None:
        self.counts: Counter[str] = Counter()
        self.clients: set[str] = set()
        self._stop = threading.Event()
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        self._sock.sendall(b"MONITOR\r\n")
        self._thread = threading.Thread(target=self._read, name="bench-monitor", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data
            *lines, buf = buf.split(b"\r\n")
            for raw in lines:
                match = _MONITOR_LINE.match(raw.decode(errors="replace"))
                if match and match.group(1) != "lua":
                    self.clients.add(match.group(1))
                    self.counts[match.group(2).upper()] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(OSError):
            self._sock.close()


def commandstats(client: Any) -> Counter[str]:
    """Calls of every command so far on ``client``'s server, by name, from ``INFO commandstats``
    (the calls scripts make included)."""
    stats = client.info("commandstats").items()
    return Counter({name.removeprefix("cmdstat_").upper(): int(v.get("calls", 0)) for name, v in stats})


def server_delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """The commands run between two :func:`commandstats` snapshots, less the measure's own:
    the first snapshot's ``INFO`` (counted by the second, which does not count itself) and the
    ``MONITOR`` started after it.

    >>> server_delta(Counter(INFO=3, GET=1), Counter(INFO=4, GET=5, SET=2, MONITOR=1))
    Counter({'GET': 4, 'SET': 2})
    """
    delta = after - before
    delta["INFO"] -= 1
    delta["MONITOR"] -= 1
    return +delta


class IdleBeat:
    """Row 7, in two halves so it can run alongside the other rows: :meth:`start` brings up a
    dedicated Redis and one beat and opens the window, which a timer closes after
    ``idle_seconds``; :meth:`finish` waits for that and reports. The beat's commands are counted
    on its own server (nothing else is connected to it), its CPU from its own process times, so
    the rows that run meanwhile do not count."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.server: EmbeddedRedis | None = None
        self.beat: Child | None = None
        self.monitor: Monitor | None = None
        self.client: Any = None  # the bench's connection to the beat's server (INFO commandstats)
        self.stats0: Counter[str] = Counter()
        self.ran: Counter[str] = Counter()
        self.t0 = 0.0
        self.cpu0 = 0.0
        self.elapsed = 0.0
        self.cpu = 0.0
        self.closed = threading.Event()
        self.timer: threading.Timer | None = None

    def start(self) -> None:
        ctx = self.ctx
        self.server = ctx.redis()
        url = self.server.url + "/0"
        self.beat = ctx.start_beat(url, url)
        with producer(url, url) as p:
            ctx.wait_beats(p.client, wake_channel(p), [self.beat])
        time.sleep(2.0)  # settle: the start-up passes are over
        self.client = redis.Redis.from_url(url)
        self.stats0 = commandstats(self.client)  # before MONITOR, which so does not see it
        self.monitor = Monitor(self.server.port)
        self.t0 = time.time()
        self.cpu0 = _cpu_seconds(self.beat.pid)
        self.timer = threading.Timer(ctx.sizes.idle_seconds, self._close)
        self.timer.daemon = True
        self.timer.start()

    def _close(self) -> None:
        assert self.beat is not None and self.monitor is not None
        try:
            self.cpu = _cpu_seconds(self.beat.pid) - self.cpu0
        except psutil.Error:
            self.cpu = float("nan")
        self.elapsed = time.time() - self.t0
        self.monitor.stop()
        try:
            self.ran = server_delta(self.stats0, commandstats(self.client))
        finally:
            self.client.close()
        self.closed.set()

    def finish(self) -> RowResult:
        assert self.beat is not None and self.monitor is not None and self.server is not None
        ctx = self.ctx
        left = self.t0 + ctx.sizes.idle_seconds - time.time()
        if left > 0:
            ctx.say(f"idle_beat: {left:.0f} s left of the idle window")
        self.closed.wait(timeout=max(0.0, left) + 30)
        alive = self.beat.alive()
        counts = self.monitor.counts
        total = sum(counts.values())
        clients = len(self.monitor.clients)
        ctx.stop(self.beat)
        ctx.stop_redis(self.server)
        if not alive:
            raise BenchError(f"the idle beat exited\n{self.beat.log_tail()}")
        elapsed, cpu = self.elapsed, self.cpu
        result = RowResult("idle_beat")
        ran = self.ran
        ran_total = sum(ran.values())
        result.lines.append(
            Line(
                f"idle_beat: Redis commands/s run for an idle beat ({elapsed:.0f} s)",
                ran_total / elapsed,
                "cmd/s",
                target="<=1",
                on="ours",
            )
        )
        result.lines.append(
            Line(
                f"idle_beat: Redis commands/s sent by an idle beat ({elapsed:.0f} s)",
                total / elapsed,
                "cmd/s",
            )
        )
        result.lines.append(
            Line(
                "idle_beat: CPU of an idle beat, % of a core",
                100.0 * cpu / elapsed,
                "%",
                target="<=1",
                on="ours",
            )
        )
        breakdown = ", ".join(f"{name} {k}" for name, k in counts.most_common()) or "none"
        ran_breakdown = ", ".join(f"{name} {k}" for name, k in ran.most_common()) or "none"
        result.notes.append(
            f"one beat, nothing stored, on a Redis server of its own (broker and store), {elapsed:.1f} s; "
            f"run: {ran_total} commands per the server's INFO commandstats (commands run inside Lua "
            f"scripts included, the measure's INFO and MONITOR left out): {ran_breakdown}; sent: {total} "
            f"commands from {clients} connection(s) counted with MONITOR (what scripts run not counted): "
            f"{breakdown}; CPU = user+system time of the beat process ({cpu * 1000:.0f} ms); the "
            "window runs while the other rows run"
        )
        if ctx.sizes.idle_seconds < 20:
            result.notes.append(
                f"the {ctx.sizes.idle_seconds:g} s window is shorter than delayq_max_sleep "
                "(20 s): it may hold no safety poll"
            )
        return result


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def row_idle_beat(ctx: Context) -> RowResult:
    idle = IdleBeat(ctx)
    idle.start()
    return idle.finish()


def row_worker_rss(ctx: Context) -> RowResult:
    """Worker RSS with ``rss_jobs`` pending in delayq vs none; Celery ETA worker holding tasks."""
    result = RowResult("worker_rss")
    n = ctx.sizes.rss_jobs
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        worker = ctx.start_worker(url, url)
        ctx.wait_worker(worker)
        p.task.apply_async(*job_call(0))
        wait_until(lambda: p.client.llen("bench:starts") >= 1, 60, 0.05, [worker], "warm-up task")
        time.sleep(2.0)
        none = rss_mib(worker.pid)
        later = time.time() + 3600
        ctx.say(f"worker_rss: storing {n:,} jobs in delayq")
        fill(p, n, lambda i: later + i * 0.01, 5.0)
        time.sleep(3.0)
        pending = rss_mib(worker.pid)
        ctx.stop(worker)
    ctx.stop_redis(server)
    eta = celery_eta(ctx, result.notes)
    result.lines.append(
        Line(
            f"worker_rss: worker RSS, {n:,} pending in delayq vs none",
            pending,
            "MiB",
            baseline=none,
            target="<=1.05",
        )
    )
    result.lines.append(
        Line(f"worker_rss: vs a Celery ETA worker holding {eta.n:,}", pending, "MiB", baseline=eta.rss_mib)
    )
    result.notes.append(
        "one worker (-P threads -c 8: one process), median RSS over 1 s, after a warm-up task, then "
        f"again 3 s after {n:,} real jobs (bench/jobs.py) due in an hour were stored in delayq on the "
        "same Redis"
    )
    if eta.n < n:
        result.notes.append(
            f"Celery ETA worker: {eta.n:,} ETA tasks, not {n:,}: the worker fetched them at "
            f"{eta.n / eta.fetch_s:,.0f}/s here, so {n:,} would not fit the time budget "
            "(--full runs 100,000)"
        )
    return result


def row_redis_memory(ctx: Context) -> RowResult:
    """``used_memory`` growth per pending job, real jobs and no-argument and 2 KB payload jobs,
    each vs Celery's bytes per ETA message of the same job."""
    result = RowResult("redis_memory")
    n = ctx.sizes.memory_jobs
    server = ctx.redis()
    url = server.url + "/0"
    per_job: dict[str, float] = {}
    fills: dict[str, Fill] = {}
    with producer(url, url) as p:
        later = time.time() + 3600
        for shape in SHAPES:
            p.client.flushall()
            p.task.apply_at(later, *job_call(0, shape))  # scripts loaded, shard keys exist
            before = used_memory(p.client)
            fills[shape] = fill(p, n, lambda i: later + i * 0.01, 5.0, shape)
            per_job[shape] = (used_memory(p.client) - before) / n
        message = kombu_message(p)
        p.client.flushall()
        whole = _whole_messages(p.client, n, message, later)
    ctx.stop_redis(server)
    eta = celery_eta(ctx, result.notes)
    k = min(n, eta.n)
    theirs = {REAL: eta.bytes_per_message}
    for shape in (BARE, PAYLOAD):
        theirs[shape] = celery_eta_bytes(ctx, k, shape)
    result.lines.append(
        Line(
            f"redis_memory: bytes per pending job, {REAL}",
            per_job[REAL],
            "B",
            baseline=theirs[REAL],
            target="<=500",
            on="ours",
        )
    )
    result.lines.append(
        Line(
            f"redis_memory: {REAL}, as a share of Celery's ETA message of the same job",
            per_job[REAL],
            "B",
            baseline=theirs[REAL],
            target="<=0.45",
        )
    )
    for shape in (BARE, PAYLOAD):
        result.lines.append(
            Line(f"redis_memory: bytes per pending job, {shape}", per_job[shape], "B", baseline=theirs[shape])
        )
    result.lines.append(
        Line(
            f"redis_memory: a whole kombu message per job (the other design) vs ours, {REAL}",
            whole,
            "B",
            baseline=per_job[REAL],
        )
    )
    result.notes.append(
        f"the jobs: {REAL} = bench.job(user_id, text, locale=...), an int, a text of 32-39 characters and "
        f"a 5-character locale, all differing per job (bench/jobs.py job_call); {BARE} = bench.job(); "
        f"{PAYLOAD} = the real job with payload= a {PAYLOAD_BYTES:,}-character string differing per job. "
        "Side by side, bytes per pending job, delayq vs Celery ETA: "
        + "; ".join(f"{shape} {per_job[shape]:,.0f} B vs {theirs[shape]:,.0f} B" for shape in SHAPES)
    )
    result.notes.append(
        f"the other design: each job's own kombu message ({len(message):,} B: the JSON kombu's Redis "
        f"transport LPUSHed for a real bench.job, taken from a real broker list, task id and delivery tag "
        f"replaced by new uuids per job) in a hash by job id, and the job id in a sorted set by due time, "
        f"over {WHOLE_SHARDS} shards as delayq spreads its jobs; {n:,} jobs, "
        "(used_memory after - before) / N on the same server, emptied first"
    )
    result.notes.append(
        f"(used_memory after - before) / N on a dedicated server, emptied before each shape: {n:,} delayq "
        f"jobs of each ({'; '.join(fills[shape].method for shape in SHAPES)}), vs Celery "
        f"apply_async(eta=) messages of the same job in a Redis broker list ({eta.n:,} real jobs, "
        f"{k:,} of each other shape)"
    )
    return result


def celery_eta_bytes(ctx: Context, n: int, shape: str) -> float:
    """Bytes per Celery ETA message of ``n`` jobs of ``shape`` (``apply_async(args, kwargs,
    eta=)`` into a Redis broker list on a server of its own, no worker): ``used_memory`` after -
    before, / n."""
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        p.task.apply_async(countdown=3600)  # connection up, queue key exists
        eta = datetime.fromtimestamp(time.time() + 3600, UTC)
        before = used_memory(p.client)
        for i in range(n):
            p.task.apply_async(*job_call(i, shape), eta=eta)
        grown = (used_memory(p.client) - before) / n
    ctx.stop_redis(server)
    return grown


#: Shards of the other design's hashes and sorted sets (delayq's default count).
WHOLE_SHARDS = 16


def _whole_messages(client: Any, n: int, message: str, due: float) -> float:
    """Bytes per job when each job stores its whole kombu message (see :func:`row_redis_memory`)."""
    parsed = json.loads(message)
    task_id = parsed["headers"]["id"]
    tag = parsed["properties"]["delivery_tag"]
    before = used_memory(client)
    for start in range(0, n, 10_000):
        with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 10_000)):
                job_id = str(uuid.uuid4())
                shard = i % WHOLE_SHARDS
                pipe.hset(
                    f"other:{{{shard}}}:msgs",
                    job_id,
                    message.replace(task_id, job_id).replace(tag, str(uuid.uuid4())),
                )
                pipe.zadd(f"other:{{{shard}}}:due", {job_id: round(due * 1000) + i})
            pipe.execute()
    return (used_memory(client) - before) / n
