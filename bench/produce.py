"""Rows 1-2: how fast one process schedules jobs, against Celery's ``apply_async(countdown=)``."""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from celery.utils import uuid

from .harness import Context, envelope_template, producer, timed_loop
from .jobs import BARE, REAL, Call, job_call
from .report import Line, RowResult

BATCH = 1000

#: Keys the debounce line calls in turn.
DEBOUNCE_KEYS = 1000


#: PINGs timed one by one after each half of the ``apply_at`` row: their median is the round trip.
PINGS = 2000


#: EVALSHA calls of lua/enqueue.lua alone timed after each half of the ``apply_at`` row (the floor).
FLOOR_CALLS = 2000


#: ``BENCH_APPLY_AT_WITHOUT=direct,plans``: the apply_at row also times the call with the store's
#: own connections for single writes (direct.DirectCalls) or plans.py's per-app plans turned
#: off, in the same halves, and notes what each buys (the figures their comments give).
WITHOUT = [name for name in os.environ.get("BENCH_APPLY_AT_WITHOUT", "").split(",") if name]


@contextlib.contextmanager
def turned_off(p: Any, what: str) -> Iterator[None]:
    """``what`` (``direct`` or ``plans``) turned off in ``p``'s app while inside."""
    from celery_delayq.producer import build
    from celery_delayq.store.facade import get_store

    if what == "direct":
        store = get_store(p.app)
        kept = store._direct
        store._direct = None  # single writes through redis-py's client and pool
        try:
            yield
        finally:
            store._direct = kept
    elif what == "plans":
        plan_for = build.plan_for
        build.plan_for = lambda *args, **kwargs: None  # every envelope built the long way
        try:
            yield
        finally:
            build.plan_for = plan_for
    else:
        raise ValueError(f"BENCH_APPLY_AT_WITHOUT: {what!r} is not direct or plans")


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


#: A script that does nothing: sent with enqueue.lua's keys and arguments, what any one script
#: call carrying them costs (the floor of the floor).
_EMPTY_SCRIPT = "return 1"


def enqueue_floor_times(p: Any, n: int, due_ms: int, empty: bool = False) -> list[float]:
    """``n`` calls of ``lua/enqueue.lua`` alone, each timed on its own, in seconds: each stores one
    real job under a new id with the keys and arguments ``Store.enqueue`` sends for it (its
    envelope built before the clock starts), one ``EVALSHA`` through redis-py on one connection,
    as :func:`ping_times` sends its PINGs. What an ``apply_at`` call costs at the least: it
    builds the message, then makes this one call. With ``empty``, the same calls of a script
    that only returns 1 (:data:`_EMPTY_SCRIPT`): the cost of sending these keys and arguments
    to a script and reading its reply, whatever the script does."""
    from celery_delayq.producer.build import build_envelope
    from celery_delayq.store.facade import get_store
    from celery_delayq.store.scripts import SCRIPTS

    store = get_store(p.app)
    client = p.client
    sha = client.script_load(_EMPTY_SCRIPT) if empty else SCRIPTS["enqueue"].sha_for(client)
    calls: list[list[Any]] = []
    for i, (args, kwargs) in enumerate(itertools.islice(_calls(REAL), n)):
        job_id = uuid()
        envelope = build_envelope(p.app, p.task, job_id, due_ms + i, args, kwargs)
        _, keys, argv = store.enqueue_call(job_id, due_ms + i, envelope)
        calls.append(["EVALSHA", sha, len(keys), *keys, *argv])
    out: list[float] = []
    clock = time.perf_counter
    for call in calls:
        t0 = clock()
        client.execute_command(*call)
        out.append(clock() - t0)
    return out


def _calls(shape: str) -> Iterator[Call]:
    """The arguments of job 0, 1, 2, ... of ``shape`` (:func:`bench.jobs.job_call`)."""
    return (job_call(i, shape) for i in itertools.count())


def row_apply_at(ctx: Context) -> RowResult:
    """``apply_at`` one real job per call vs ``apply_async(countdown=3600)`` of the same job to a
    Redis broker, and the call's time in PING round trips of the same server, measured in the
    same run; and the same two with no-argument jobs."""
    result = RowResult("apply_at")
    server = ctx.redis()
    url = server.url + "/0"
    seconds = ctx.sizes.produce_seconds
    with producer(url, url) as p:
        due = time.time() + 3600
        for args, kwargs in itertools.islice(_calls(REAL), 100):  # connections, scripts loaded
            p.task.apply_at(due, args, kwargs)
            p.task.apply_async(args, kwargs, countdown=3600)
            p.client.ping()
        pings: list[float] = []
        floor: list[float] = []
        empty: list[float] = []
        ours: dict[str, list[float]] = {REAL: [], BARE: []}
        base: dict[str, list[float]] = {REAL: [], BARE: []}
        calls = {shape: (_calls(shape), _calls(shape)) for shape in (REAL, BARE)}
        without: dict[str, list[float]] = {what: [] for what in WITHOUT}
        debounced: list[float] = []
        debounce_calls = _calls(REAL)
        keys = itertools.cycle([f"user:{i}" for i in range(DEBOUNCE_KEYS)])
        for args, kwargs in itertools.islice(debounce_calls, 100):  # the keyed script loaded
            p.task.apply_async(args, kwargs, debounce=(next(keys), 3600))
        for _ in range(2):  # interleaved halves: drift of the machine hits every side and shape
            for shape in (REAL, BARE):
                ours_calls, base_calls = calls[shape]

                def apply_at(calls: Iterator[Call] = ours_calls) -> None:
                    p.task.apply_at(due, *next(calls))

                def apply_async(calls: Iterator[Call] = base_calls) -> None:
                    p.task.apply_async(*next(calls), countdown=3600)

                ours[shape].append(timed_loop(apply_at, seconds / 2))
                if shape == REAL:
                    pings.extend(ping_times(p.client, PINGS // 2))
                    floor.extend(enqueue_floor_times(p, FLOOR_CALLS // 2, int(due * 1000)))
                    empty.extend(enqueue_floor_times(p, FLOOR_CALLS // 2, int(due * 1000), empty=True))

                    def debounce() -> None:
                        args, kwargs = next(debounce_calls)
                        p.task.apply_async(args, kwargs, debounce=(next(keys), 3600))

                    debounced.append(timed_loop(debounce, seconds / 2))
                base[shape].append(timed_loop(apply_async, seconds / 2))
                if shape == REAL:
                    for what, times in without.items():
                        with turned_off(p, what):
                            times.append(timed_loop(apply_at, seconds / 2))
        rates = {shape: (sum(ours[shape]) / 2, sum(base[shape]) / 2) for shape in (REAL, BARE)}
    ctx.stop_redis(server)
    for what, times in without.items():
        result.notes.append(
            f"apply_at without {what} (BENCH_APPLY_AT_WITHOUT): {2e6 / sum(times):.0f} µs a call, "
            f"with it {2e6 / sum(ours[REAL]):.0f} µs, in the same halves (real job)"
        )
    ours_rate, base_rate = rates[REAL]
    call_us = 1e6 / ours_rate
    celery_us = 1e6 / base_rate
    rtt_us = statistics.median(pings) * 1e6
    bare_ours, bare_base = rates[BARE]
    result.lines.append(
        Line(
            f"apply_at: jobs/s, one call per job, {REAL}",
            ours_rate,
            "jobs/s",
            baseline=base_rate,
            target=">=3",
        )
    )
    result.lines.append(
        Line(
            f"apply_at: µs a call, {REAL}, in PING round trips of the server",
            call_us,
            "µs",
            baseline=rtt_us,
            target="<=1.5",
        )
    )
    floor_us = statistics.median(floor) * 1e6
    result.lines.append(
        Line(
            f"apply_at's floor: µs, lua/enqueue.lua alone (one EVALSHA, {REAL}), in PING round trips",
            floor_us,
            "µs",
            baseline=rtt_us,
        )
    )
    empty_us = statistics.median(empty) * 1e6
    result.lines.append(
        Line(
            f"one EVALSHA of `{_EMPTY_SCRIPT}` with enqueue.lua's keys and arguments, in PING round trips",
            empty_us,
            "µs",
            baseline=rtt_us,
        )
    )
    result.lines.append(
        Line(f"apply_at: jobs/s, one call per job, {BARE}", bare_ours, "jobs/s", baseline=bare_base)
    )
    debounce_rate = sum(debounced) / 2
    result.lines.append(
        Line(
            f"debounce: calls/s, {REAL}, {DEBOUNCE_KEYS:,} keys in turn, vs apply_at",
            debounce_rate,
            "calls/s",
            baseline=ours_rate,
        )
    )
    result.notes.append(
        f"debounce: apply_async(args, kwargs, debounce=(key, 3600)) of the same real jobs, the keys "
        f"user:0..user:{DEBOUNCE_KEYS - 1} in turn (after the first round every call replaces its "
        f"key's pending job: lua/keyed.lua), timed in the same halves as apply_at ({REAL}); "
        f"{1e6 / debounce_rate:.0f} µs a call against apply_at's {call_us:.0f} µs"
    )
    result.notes.append(
        f"one process, {seconds:g} s of each (two halves, sides and job shapes interleaved) for each job "
        f"shape: {REAL} bench.job(user_id, text, locale=...), arguments differing per job (bench/jobs.py "
        f"job_call), and {BARE}; broker and store on one Redis server; baseline: apply_async(args, kwargs, "
        "countdown=3600) of the same job to that broker; per call "
        f"(the timed loops' mean), {REAL}: apply_at {call_us:.0f} µs = {call_us / rtt_us:.2f} PING RTT "
        f"(one EVALSHA round trip), apply_async {celery_us:.0f} µs = {celery_us / rtt_us:.2f} PING RTT; "
        f"{BARE}: apply_at {1e6 / bare_ours:.0f} µs, apply_async {1e6 / bare_base:.0f} µs; a PING round trip "
        f"here: {rtt_us:.0f} µs, the median of {len(pings):,} PINGs timed one by one through "
        f"redis-py on one connection, after each half of apply_at ({REAL})"
    )
    result.notes.append(
        f"apply_at's floor: the median of {len(floor):,} EVALSHA calls of lua/enqueue.lua timed one by "
        f"one after the PINGs, each storing one {REAL} under a new id with the keys and arguments "
        f"Store.enqueue sends (the envelope built before the clock starts; bench/produce.py "
        f"enqueue_floor_times): {floor_us:.0f} µs = {floor_us / rtt_us:.2f} PING RTT. An apply_at call "
        f"is this call and the building of the message ({call_us - floor_us:.0f} µs here, the mean call "
        "less this median)"
    )
    result.notes.append(
        f"{len(empty):,} calls built as the floor's (the same jobs, new ids) sent to a script that only "
        f"returns 1 (`{_EMPTY_SCRIPT}`), timed the same way: {empty_us:.0f} µs = "
        f"{empty_us / rtt_us:.2f} PING RTT, what one script call carrying them costs here whatever the "
        f"script does (enqueue.lua's own work: {floor_us - empty_us:.0f} µs)"
    )
    return result


def row_apply_at_many(ctx: Context) -> RowResult:
    """``apply_at_many`` of real jobs in batches of 1,000 vs ``apply_async(countdown=)`` of the
    same jobs and raw ZADD+HSET."""
    result = RowResult("apply_at_many")
    server = ctx.redis()
    url = server.url + "/0"
    n = ctx.sizes.many_jobs
    with producer(url, url) as p:
        base_due = time.time() + 3600
        p.task.apply_at_many([(base_due, *job_call(i)) for i in range(10)])  # warm
        batches = [
            [(base_due + (b * BATCH + i) / 1000.0, *job_call(b * BATCH + i)) for i in range(BATCH)]
            for b in range(n // BATCH)
        ]
        t0 = time.perf_counter()
        for items in batches:
            p.task.apply_at_many(items)
        ours = n / (time.perf_counter() - t0)

        for args, kwargs in itertools.islice(_calls(REAL), 100):
            p.task.apply_async(args, kwargs, countdown=3600)
        calls = _calls(REAL)
        celery = timed_loop(
            lambda: p.task.apply_async(*next(calls), countdown=3600), ctx.sizes.produce_seconds
        )

        template = envelope_template(p)
        size = len(template.envelope) if template else 0
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
    result.lines.append(
        Line(
            f"apply_at_many: jobs/s, batches of 1,000, {REAL}", ours, "jobs/s", baseline=celery, target=">=30"
        )
    )
    result.lines.append(Line("apply_at_many: share of raw pipelined ZADD+HSET", ours, "jobs/s", baseline=raw))
    result.notes.append(
        f"{n:,} real jobs (bench.job(user_id, text, locale=...), arguments differing per job) in "
        f"batches of {BATCH:,} from one process; the batches' items are made before the clock starts; "
        f"baseline 1: apply_async(args, kwargs, countdown=3600) of the same jobs for "
        f"{ctx.sizes.produce_seconds:g} s; baseline 2: redis-py pipeline of ZADD+HSET per job "
        f"(uuid ids, a {size}-byte payload = a stored real job's envelope size, 16 keys of each, "
        f"batches of {BATCH:,}); the ratio of the second line is the fraction of raw speed"
    )
    return result
