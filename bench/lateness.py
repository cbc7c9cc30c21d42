"""Rows 5, 6 and 8: how late jobs are published and started."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime

from celery_delayq.devtools.embedded import EmbeddedRedis

from .app import due_seconds
from .celery_eta import celery_eta
from .harness import (
    STARTS_KEY,
    BenchError,
    Child,
    Context,
    CpuWatch,
    Producer,
    fill,
    percentile,
    producer,
    read_floats,
    starts,
    wait_until,
    wake_channel,
    watch,
)
from .jobs import job_call
from .report import Line, RowResult

QUEUE = "celery"
RATE = 1000  # jobs/s of the steady row
#: Workers of the steady row (delayq and Celery alike): one worker of any pool runs at most
#: ~950 of these tasks a second on this 2-core machine, below the 1,000/s the row needs.
STEADY_WORKERS = 2
STEADY_POOL = ("-P", "solo")
#: A conservative rate at which the steady row's workers fetch ETA tasks (~2,600/s measured).
ETA_FETCH_RATE = 1500.0
#: Seconds of the schedule the Celery side holds ahead (sent before its workers start, then
#: kept that far ahead while they run).
ETA_PRESEND = 20.0
FILL_BUDGET = 5.0


def _warm_up(ctx: Context, p: Producer, beat: Child | None, workers: list[Child]) -> None:
    """A few jobs through the stack (each worker gets some), then forget them (and their
    publish records)."""
    k = 4 * len(workers)
    for i in range(k):
        if beat is not None:
            p.task.apply_in(0, *job_call(i))
        else:
            p.task.apply_async(*job_call(i))
    children = [*workers, *([beat] if beat else [])]
    wait_until(lambda: p.client.llen(STARTS_KEY) >= k, 60, 0.02, children, "warm-up jobs did not run")
    time.sleep(0.5)  # the beat's publish log is flushed every 0.2 s
    p.client.delete(STARTS_KEY)
    if beat is not None and beat.publish_log is not None:
        beat.publish_log.write_text("")


def _published(beat: Child, n: int, timeout: float = 10.0) -> list[float]:
    wait_until(
        lambda: len(read_floats(beat.publish_log)) >= n,
        timeout,
        0.1,
        [beat],
        f"the beat's publish log did not reach {n:,} lines",
    )
    return read_floats(beat.publish_log)


def row_lateness_steady(ctx: Context) -> RowResult:
    """1,000 jobs/s for ``steady_seconds``: due -> publish p50/p99, due -> start p99 vs Celery ETA."""
    result = RowResult("lateness_steady")
    seconds = ctx.sizes.steady_seconds
    n = int(seconds * RATE)

    # delayq: the jobs are stored before the run; one beat, STEADY_WORKERS workers.
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        workers = [ctx.start_worker(url, url, pool=STEADY_POOL) for _ in range(STEADY_WORKERS)]
        beat = ctx.start_beat(url, url, publish_log=True)
        for worker in workers:
            ctx.wait_worker(worker)
        ctx.wait_beats(p.client, wake_channel(p), [beat])
        _warm_up(ctx, p, beat, workers)
        t0 = time.time() + 3.0 + n / 20_000
        filled = fill(p, n, lambda i: t0 + i / RATE, FILL_BUDGET)
        if time.time() > t0:
            result.notes.append("the fill ended after the first due time: the first jobs ran late")
        ctx.say(f"lateness_steady: delayq, {RATE:,} jobs/s for {seconds:g} s")
        time.sleep(max(0.0, t0 - time.time()))
        cpu = _cpu_watch(server, beat=beat, workers=workers)
        watch(
            lambda: int(p.client.llen(STARTS_KEY)),
            n,
            timeout=t0 - time.time() + seconds + 60,
            interval=0.2,
            children=[*workers, beat],
            what="delayq steady runs",
        )
        ours_cpu = cpu.stop()
        published = _published(beat, n)
        ours = starts(p.client)
        ctx.stop_all([beat, *workers])
    ctx.stop_redis(server)

    # Celery ETA: the same schedule. The first ETA_PRESEND seconds of it are sent before the
    # workers start and fetched before the first is due; the rest is sent while they run,
    # ETA_PRESEND seconds ahead of due.
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        pre = min(n, int(ETA_PRESEND * RATE))
        t0 = time.time() + pre / (0.8 * _send_rate(p)) + 6.0 + pre / ETA_FETCH_RATE
        ctx.say(f"lateness_steady: Celery ETA, sending {pre:,} apply_async(eta=) before the workers start")
        schedule = [t0 + i / RATE for i in range(n)]
        warm = 4 * STEADY_WORKERS
        for _ in range(warm):
            p.task.apply_async()
        t_send = time.time()
        for i, due in enumerate(schedule[:pre]):
            p.task.apply_async(*job_call(i), eta=datetime.fromtimestamp(due, UTC))
        t_sent = time.time()
        workers = [ctx.start_worker(url, url, pool=STEADY_POOL) for _ in range(STEADY_WORKERS)]
        for worker in workers:
            ctx.wait_worker(worker)
        t_ready = time.time()
        wait_until(
            lambda: p.client.llen(QUEUE) == 0 and p.client.llen(STARTS_KEY) >= warm,
            max(60.0, t0 - time.time() + 60),
            0.1,
            workers,
            "workers fetching the ETA tasks",
        )
        t_fetched = time.time()
        p.client.delete(STARTS_KEY)
        ctx.say(f"lateness_steady: Celery ETA, {RATE:,} tasks/s for {seconds:g} s")
        time.sleep(max(0.0, t0 - time.time()))
        cpu = _cpu_watch(server, producer=True, workers=workers)
        leads = [ETA_PRESEND]
        for i, due in enumerate(schedule[pre:], pre):
            wait = due - ETA_PRESEND - time.time()
            if wait > 0:
                time.sleep(wait)
            leads.append(due - time.time())
            p.task.apply_async(*job_call(i), eta=datetime.fromtimestamp(due, UTC))
        deadline = t0 + seconds + ctx.sizes.steady_grace
        with contextlib.suppress(BenchError):  # what has not run by then is counted below
            watch(
                lambda: int(p.client.llen(STARTS_KEY)),
                n,
                timeout=deadline - time.time(),
                interval=0.2,
                children=workers,
                what="Celery ETA steady runs",
            )
        theirs_cpu = cpu.stop()
        t_end = time.time()
        theirs = starts(p.client)
        in_broker = int(p.client.llen(QUEUE))  # not fetched by any worker yet
        held = int(p.client.hlen("unacked"))  # kombu's Redis transport: delivered, not acked
        ctx.stop_all(workers, grace=3.0)
    ctx.stop_redis(server)
    fetch_note = (
        f"{t0 - t_fetched:.1f} s before the first was due"
        if t_fetched <= t0
        else f"{t_fetched - t0:.1f} s AFTER the first was due: the first ones ran late because of it"
    )
    missing = _not_started(schedule, theirs)
    theirs_ms = [(s - d) * 1000.0 for s, d in theirs] + [(t_end - d) * 1000.0 for d in missing]

    ours_ms = [(s - d) * 1000.0 for s, d in ours]
    what = f"lateness_steady: {RATE:,} jobs/s for {seconds:g} s"
    result.lines.append(
        Line(f"{what}, due→publish p50", percentile(published, 50), "ms", target="<=2", on="ours")
    )
    result.lines.append(
        Line(f"{what}, due→publish p99", percentile(published, 99), "ms", target="<=10", on="ours")
    )
    result.lines.append(
        Line(
            f"{what}, due→start p99 vs Celery ETA",
            percentile(ours_ms, 99),
            "ms",
            baseline=percentile(theirs_ms, 99),
            target="<=2",
            baseline_at_least=bool(missing),
        )
    )
    result.notes.append(
        f"delayq: {n:,} real jobs (bench.job(user_id, text, locale=...), bench/jobs.py) due 1 ms apart, "
        f"stored before the first is due ({filled.method}); one beat, "
        f"{STEADY_WORKERS} workers ({' '.join(STEADY_POOL)}), broker and store on one Redis server; "
        "due→publish is the beat's own record (Dispatcher(keep_lateness=...): the server clock once "
        "the publish was sent, minus the due time; beat run with -S bench.app.RecordingScheduler, a "
        "celery_delayq.Scheduler that only turns that on); "
        "due→start by the task (time.time() at start - due). "
        f"due→publish p50/p99/max: {_pcts(published)}; due→start: {_pcts(ours_ms)}; {_drift(ours)}; "
        f"CPU during the run: {ours_cpu}"
    )
    behind = "; below 0: this process fell behind" if min(leads) < 0 else ""
    result.notes.append(
        f"Celery ETA: the same {n:,} jobs and due times, apply_async(args, kwargs, eta=) from this "
        "process: the first "
        f"{pre:,} ({ETA_PRESEND:g} s of the schedule) before the workers started "
        f"({pre / max(1e-9, t_sent - t_send):,.0f}/s), fetched in {t_fetched - t_ready:.1f} s, {fetch_note}; "
        f"the rest while they ran, {ETA_PRESEND:g} s ahead of due (lead p1/min "
        f"{percentile(leads, 1):.2f}/{min(leads):.2f} s{behind}); "
        f"the same {STEADY_WORKERS} workers on a Redis of their own; due→start p50/p99/max: "
        f"{_pcts(theirs_ms)}; {_drift(theirs)}; CPU during the run: {theirs_cpu}"
    )
    if missing:
        result.notes.append(
            f"Celery ETA: {len(missing):,} of {n:,} tasks had not started {t_end - t0 - seconds:.0f} s after "
            f"the last was due ({in_broker:,} still in the broker list, {held:,} delivered to a worker and "
            "not acked); each is counted as late by that wait, so its figures are lower bounds (≥)"
        )
    result.notes.append(
        f"why {ETA_PRESEND:g} s ahead: sent 3 s ahead while the workers ran, this process fell up to 28 s "
        "behind the schedule on this 2-core machine; with the whole 60 s sent first, each worker held "
        "30,000 ETA tasks and ran only ~110 a second"
    )
    result.notes.append(
        f"one worker of any pool runs at most ~950 of these tasks/s here, hence {STEADY_WORKERS}; when "
        "the first-tenth and last-tenth due→start p50 differ a lot, the workers fell behind (the 2-core "
        "machine is saturated) and due→start measures that backlog for both"
    )
    return result


def _not_started(schedule: list[float], runs: list[tuple[float, float]]) -> list[float]:
    """Due times of the schedule that no recorded run has (matched to the millisecond)."""
    seen = Counter(round(d * 1000) for _, d in runs)
    missing = []
    for due in schedule:
        key = round(due * 1000)
        if seen[key] > 0:
            seen[key] -= 1
        else:
            missing.append(due)
    return missing


def _send_rate(p: Producer, k: int = 1000) -> float:
    """apply_async(eta=) per second from this process, into a scratch queue (deleted after)."""
    eta = datetime.fromtimestamp(time.time() + 3600, UTC)
    t0 = time.perf_counter()
    for i in range(k):
        p.task.apply_async(*job_call(i), eta=eta, queue="bench-calibrate")
    rate = k / (time.perf_counter() - t0)
    p.client.delete("bench-calibrate")
    return rate


def _cpu_watch(
    server: EmbeddedRedis, beat: Child | None = None, producer: bool = False, workers: Sequence[Child] = ()
) -> CpuWatch:
    pids: dict[str, int] = {}
    if beat is not None:
        pids["beat"] = beat.pid
    if producer:
        pids["producer (this process)"] = os.getpid()
    for i, worker in enumerate(workers):
        pids[f"worker {i + 1}"] = worker.pid
    assert server.process is not None
    pids["redis"] = server.process.pid
    return CpuWatch(pids).start()


def _drift(runs: list[tuple[float, float]]) -> str:
    """due→start p50 of the first and the last tenth of the schedule."""
    ordered = sorted(runs, key=lambda sd: sd[1])
    tenth = max(1, len(ordered) // 10)
    first = percentile([(s - d) * 1000.0 for s, d in ordered[:tenth]], 50)
    last = percentile([(s - d) * 1000.0 for s, d in ordered[-tenth:]], 50)
    return f"due→start p50 first/last tenth: {first:.1f}/{last:.1f} ms"


def _pcts(values: list[float]) -> str:
    return (
        f"{percentile(values, 50):.2f}/{percentile(values, 99):.2f}/{max(values):.1f} ms "
        f"({len(values):,} jobs)"
    )


def _burst(ctx: Context, p: Producer, url: str, beats: int, n: int) -> float:
    """Seconds from the start of the due second until the last of ``n`` jobs is in the broker."""
    p.client.flushall()
    children = [ctx.start_beat(url, url) for _ in range(beats)]
    try:
        ctx.wait_beats(p.client, wake_channel(p), children)
        # Room for a fill at 8,000 jobs/s (a loaded 2-core machine fills 1M at about 12,000/s).
        due = time.time() + 2.0 + n / 8_000
        fill(p, n, lambda i: due + i / n, FILL_BUDGET)
        if time.time() > due:
            raise BenchError(f"storing {n:,} jobs took longer than planned (past their due time)")
        samples = watch(
            lambda: int(p.client.llen(QUEUE)),
            n,
            timeout=due - time.time() + 60 + n / 1000,
            interval=0.01,
            children=children,
            what=f"{n:,} due jobs published",
        )
    finally:
        ctx.stop_all(children)
    return samples[-1][0] - due


def row_lateness_burst(ctx: Context) -> RowResult:
    """``burst_jobs`` due within one second: when is the last published (1 and 2 beats)?"""
    result = RowResult("lateness_burst")
    n = ctx.sizes.burst_jobs
    eta = celery_eta(ctx, result.notes)
    server = ctx.redis()
    url = server.url + "/0"
    took: dict[tuple[int, int], float] = {}
    with producer(url, url) as p:
        for beats in (1, 2):
            ctx.say(f"lateness_burst: {n:,} due in one second, {beats} beat{'s' if beats > 1 else ''}")
            took[(n, beats)] = _burst(ctx, p, url, beats, n)
        if eta.n != n:
            ctx.say(f"lateness_burst: {eta.n:,} due in one second, 1 beat (Celery's size)")
            took[(eta.n, 1)] = _burst(ctx, p, url, 1, eta.n)
    ctx.stop_redis(server)
    nan = float("nan")
    same = eta.n == n
    for beats in (1, 2):
        result.lines.append(
            Line(
                f"lateness_burst: {n:,} due in 1 s, last published, {beats} beat{'s' if beats > 1 else ''}",
                took[(n, beats)],
                "s",
                baseline=eta.last_started_s,
                ratio=None if same else nan,
                baseline_at_least=eta.not_started > 0,
                target="<=10" if beats == 1 else "",
                on="ours",
            )
        )
    if not same:
        result.lines.append(
            Line(
                f"lateness_burst: {eta.n:,} due in 1 s, last published, 1 beat (Celery's size)",
                took[(eta.n, 1)],
                "s",
                baseline=eta.last_started_s,
                baseline_at_least=eta.not_started > 0,
            )
        )
    if n < 1_000_000:
        result.notes.append(
            f"{n:,} jobs due in the second, not the issue's 1,000,000 (the target, <= 10 s for the last, is "
            "set for 1M; filling 1M takes most of a minute here): python -m bench --full --only "
            "lateness_burst runs 1M"
        )
    result.notes.append(
        "real jobs (bench.job(user_id, text, locale=...), bench/jobs.py); "
        "time from the start of the due second until the last job is in the broker list (LLEN "
        "sampled every 10 ms); beats running and idle before the jobs are stored; no worker"
    )
    result.notes.append(
        f"baseline: Celery ETA, time from the start of the due second until the last of "
        f"{eta.n:,} ETA tasks started on one worker"
        + ("" if same else f" ({eta.n:,}, not {n:,}: see celery ETA notes)")
    )
    return result


def row_wakeup(ctx: Context) -> RowResult:
    """A job due soon, stored while the beat sleeps for a later one: published how late?"""
    result = RowResult("wakeup")
    tries = ctx.sizes.wake_tries
    server = ctx.redis()
    url = server.url + "/0"
    rng = random.Random(7)
    with producer(url, url) as p:
        beat = ctx.start_beat(url, url, publish_log=True)
        ctx.wait_beats(p.client, wake_channel(p), [beat])
        p.task.apply_at(time.time() + 3600, *job_call(0))  # what the beat sleeps for
        time.sleep(0.5)
        ctx.say(f"wakeup: {tries} tries")
        received: list[float] = []
        for i in range(tries):
            p.task.apply_at(time.time() + rng.uniform(0.02, 0.1), *job_call(i + 1))
            got = p.client.brpop([QUEUE], timeout=10)
            now = time.time()
            if got is None:
                raise BenchError(f"a job due within 100 ms was not published within 10 s\n{beat.log_tail()}")
            due = due_seconds(json.loads(got[1])["headers"]["delayq_due"])
            received.append((now - due) * 1000.0)
            time.sleep(rng.uniform(0.0, 0.02))
        published = _published(beat, tries)
        ctx.stop(beat)
    ctx.stop_redis(server)
    result.lines.append(
        Line(
            f"wakeup: earlier job while the beat sleeps, due→publish p99 ({tries} tries)",
            percentile(published, 99),
            "ms",
            target="<=10",
            on="ours",
        )
    )
    result.notes.append(
        "one beat sleeping for a job due in an hour; each try stores a real job due 20-100 ms later "
        "(apply_at), waits for it in the broker list (BRPOP), then the next; due→publish measured in "
        f"the beat: p50/p99/max {_pcts(published)}; seen by the BRPOP consumer: {_pcts(received)}"
    )
    return result
