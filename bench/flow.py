"""Row ``flow``: capped jobs (issue 15) against the same jobs uncapped, in one run.

10,000 jobs (1,000 in quick mode) of a 10 ms task, 100 per key over 100 keys, due at once, each
with a real job's arguments too (:func:`bench.jobs.job_call`: a user id, a text, ``locale=``):
once with ``concurrency_key=k<i>, concurrency_limit=2``, once without. Each side: one beat
(frozen while the jobs are stored, then thawed), two workers ``-P threads -c 8``; the store and
the broker on two Redis servers, so that the store's ``INFO commandstats`` counts delayq's
commands only (beat, workers' slot releases and renewals), not the broker's.

This module is also imported by the row's workers (``imports=["bench.flow"]``): it adds the
task ``bench.flow_job(seconds, key, user_id, text, locale=...)`` to :mod:`bench.app`, which
notes ``"<start> <end> <key>"`` (``time.time()``; the end is taken before the task returns, so
before the worker gives the slot back) and appends the notes to a list in the *broker's* Redis
every 0.1 s.

Figures: throughput (jobs/s between 5% and 95% of the recorded ends), capped vs uncapped;
slot release → next start of the same key, p50 and p99: with limit L, the key's i-th end frees
the slot that its (i+L)-th start takes (both sorted), so the gap is ``start[i+L] - end[i]``
(never negative while the cap holds); Redis commands per job (the store's ``INFO commandstats``
delta over the drain / jobs, and of those the script calls).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from celery_delayq import DelayedTask

from .app import _Starts
from .app import app as _bench_app
from .harness import Context, Producer, percentile, producer, wait_until, wake_channel
from .jobs import job_call
from .report import Line, RowResult

FLOW_TASK = "bench.flow_job"
#: The list the row's task appends ``"<start> <end> <key>"`` to, in the broker's Redis.
FLOW_KEY = "bench:flow"
KEYS = 100
#: Keys of the third side, whose slots (FEW_KEYS x LIMIT) are fewer than the worker threads.
FEW_KEYS = 5
LIMIT = 2
TASK_SECONDS = 0.010
WORKERS = 2
POOL = ("-P", "threads", "-c", "8")
#: The row's worker and beat settings: the workers import this module (the task).
CONF: dict[str, Any] = {"imports": ["bench.flow"]}
#: Commands the row itself sends to the store, left out of the count.
OWN_COMMANDS = ("cmdstat_info", "cmdstat_config")
SCRIPT_COMMANDS = (
    "cmdstat_evalsha",
    "cmdstat_eval",
    "cmdstat_evalsha_ro",
    "cmdstat_eval_ro",
    "cmdstat_fcall",
)


class _Notes(_Starts):
    """:class:`bench.app._Starts`, appending to :data:`FLOW_KEY` in the broker's Redis."""

    def flush(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
        if lines:
            if self.client is None:
                self.client = redis.Redis.from_url(os.environ.get("BENCH_BROKER", "redis://127.0.0.1:1/0"))
            self.client.rpush(FLOW_KEY, *lines)


_notes = _Notes()


@_bench_app.task(base=DelayedTask, bind=True, name=FLOW_TASK)  # type: ignore[untyped-decorator]
def flow_job(
    self: Any,
    seconds: float,
    key: str,
    user_id: int | None = None,
    text: str = "",
    locale: str = "en-US",
    payload: str = "",
) -> None:
    start = time.time()
    time.sleep(seconds)
    _notes.add(f"{start:.6f} {time.time():.6f} {key}")


# -- the row (bench process) -----------------------------------------------------------------


@dataclass
class Side:
    """What one side (capped or uncapped) measured."""

    jobs: int
    rate: float
    gaps_ms: list[float]
    negative: int
    calls: dict[str, int]
    seconds: float

    @property
    def commands(self) -> int:
        return sum(self.calls.values())

    @property
    def scripts(self) -> int:
        return sum(n for name, n in self.calls.items() if name in SCRIPT_COMMANDS)

    def per_job(self, count: int) -> float:
        return count / self.jobs if self.jobs else float("nan")

    def top(self, k: int = 6) -> str:
        """The ``k`` commands called most, per job."""
        most = sorted(self.calls.items(), key=lambda item: -item[1])[:k]
        return ", ".join(f"{name.removeprefix('cmdstat_').upper()} {self.per_job(n):.2f}" for name, n in most)


def _runs(client: redis.Redis) -> list[tuple[float, float, str]]:
    out = []
    for raw in client.lrange(FLOW_KEY, 0, -1):
        start, end, key = str(raw).split()
        out.append((float(start), float(end), key))
    return out


def _throughput(ends: Sequence[float]) -> float:
    ordered = sorted(ends)
    n = len(ordered)
    lo, hi = ordered[int(0.05 * (n - 1))], ordered[int(0.95 * (n - 1))]
    return (int(0.95 * (n - 1)) - int(0.05 * (n - 1))) / (hi - lo) if hi > lo else float("nan")


def release_gaps(runs: Sequence[tuple[float, float, str]], limit: int) -> list[float]:
    """Per key, ms from the i-th end to the (i+limit)-th start (see the module's docstring).

    >>> release_gaps([(0.0, 1.0, "a"), (0.0, 2.0, "a"), (1.5, 3.0, "a")], 2)
    [500.0]
    """
    by_key: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for start, end, key in runs:
        by_key[key][0].append(start)
        by_key[key][1].append(end)
    gaps: list[float] = []
    for starts, ends in by_key.values():
        starts.sort()
        ends.sort()
        gaps.extend((starts[i + limit] - ends[i]) * 1000.0 for i in range(len(starts) - limit))
    return gaps


def _command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls of each command since the last CONFIG RESETSTAT, the row's own left out."""
    stats = client.info("commandstats")
    return {name: int(v["calls"]) for name, v in stats.items() if name not in OWN_COMMANDS}


def _fill(task: Any, n: int, keys: int, capped: bool) -> None:
    per_key = n // keys
    now = time.time()
    for k in range(keys):
        key = f"k{k}"
        items = [
            (now, (TASK_SECONDS, key, *args), kwargs)
            for args, kwargs in map(job_call, range(k * per_key, (k + 1) * per_key))
        ]
        options = {"concurrency_key": key, "concurrency_limit": LIMIT} if capped else {}
        task.apply_at_many(items, **options)


def _side(
    ctx: Context,
    p: Producer,
    task: Any,
    broker: redis.Redis,
    beat: Any,
    workers: Sequence[Any],
    n: int,
    keys: int,
    capped: bool,
) -> Side:
    label = "capped" if capped else "uncapped"
    broker.delete(FLOW_KEY)
    ctx.freeze([beat])
    ctx.say(f"flow: storing {n:,} {label} jobs over {keys} keys")
    _fill(task, n, keys, capped)
    p.client.config_resetstat()
    t0 = time.time()
    ctx.thaw([beat])
    ctx.say(f"flow: draining the {label} jobs")
    wait_until(
        lambda: broker.llen(FLOW_KEY) >= n,
        max(120.0, n / 50.0),
        0.05,
        [beat, *workers],
        f"flow: {n:,} {label} jobs run",
    )
    took = time.time() - t0
    calls = _command_calls(p.client)
    runs = _runs(broker)
    gaps = release_gaps(runs, LIMIT) if capped else []
    return Side(
        len(runs), _throughput([end for _, end, _ in runs]), gaps, sum(1 for g in gaps if g < 0), calls, took
    )


def row_flow(ctx: Context) -> RowResult:
    result = RowResult("flow")
    n = {"smoke": 500, "quick": 1_000}.get(ctx.mode, 10_000)
    store_server, broker_server = ctx.redis(), ctx.redis()
    store, broker_url = store_server.url + "/0", broker_server.url + "/0"
    broker = redis.Redis.from_url(broker_url, decode_responses=True)
    sides: dict[str, Side] = {}
    try:
        with producer(broker_url, store) as p:
            task = p.app.task(base=DelayedTask, name=FLOW_TASK, shared=False)(_producer_side)
            workers = [ctx.start_worker(broker_url, store, CONF, pool=POOL) for _ in range(WORKERS)]
            beat = ctx.start_beat(broker_url, store, CONF)
            for worker in workers:
                ctx.wait_worker(worker)
            ctx.wait_beats(p.client, wake_channel(p), [beat])
            time.sleep(0.5)  # past its first pass
            sides["uncapped"] = _side(ctx, p, task, broker, beat, workers, n, KEYS, False)
            sides["capped"] = _side(ctx, p, task, broker, beat, workers, n, KEYS, True)
            sides["binding"] = _side(ctx, p, task, broker, beat, workers, n // 10, FEW_KEYS, True)
            ctx.stop_all([beat, *workers])
    finally:
        broker.close()
        ctx.stop_redis(store_server)
        ctx.stop_redis(broker_server)
    _report(result, n, sides["capped"], sides["uncapped"], sides["binding"])
    return result


def _report(result: RowResult, n: int, capped: Side, plain: Side, binding: Side) -> None:
    threads = WORKERS * int(POOL[-1])
    size = f"{n:,} jobs of 10 ms, {KEYS} keys, limit {LIMIT}"
    few = f"{binding.jobs:,} jobs, {FEW_KEYS} keys x {LIMIT} slots < {threads} threads"
    lines = result.lines
    lines.append(
        Line(
            f"flow: capped throughput, {size} (vs uncapped)",
            capped.rate,
            "jobs/s",
            baseline=plain.rate,
            target=">=0.8",
        )
    )
    for q in (50, 99):
        lines.append(
            Line(
                f"flow: release → next start, {KEYS} keys (broker queue wait included), p{q}",
                percentile(capped.gaps_ms, q),
                "ms",
            )
        )
    lines.append(Line(f"flow: release → next start, {few}, p50", percentile(binding.gaps_ms, 50), "ms"))
    lines.append(
        Line(
            f"flow: release → next start, {few}, p99",
            percentile(binding.gaps_ms, 99),
            "ms",
            target="<=20",
            on="ours",
        )
    )
    lines.append(
        Line(
            "flow: Redis commands per job, capped (vs uncapped)",
            capped.per_job(capped.commands),
            "cmd/job",
            baseline=plain.per_job(plain.commands),
        )
    )
    result.notes.append(
        f"side by side: capped {capped.rate:,.0f} jobs/s, all run {capped.seconds:.1f} s after the thaw; "
        f"uncapped {plain.rate:,.0f} jobs/s, {plain.seconds:.1f} s; store commands per job "
        f"{capped.per_job(capped.commands):.1f} capped ({capped.per_job(capped.scripts):.2f} script calls) "
        f"vs {plain.per_job(plain.commands):.1f} uncapped ({plain.per_job(plain.scripts):.2f} script calls)"
    )
    result.notes.append(f"commands per job by command, capped: {capped.top()}; uncapped: {plain.top()}")
    for name, side in (("capped", capped), ("few keys", binding)):
        gaps = side.gaps_ms
        result.notes.append(
            f"release → next start, {name}: {len(gaps):,} gaps, p50 {percentile(gaps, 50):.1f} ms, "
            f"p99 {percentile(gaps, 99):.1f} ms, max {max(gaps, default=float('nan')):.1f} ms; negative "
            f"gaps (a start before a slot of its key was free: the cap broken) {side.negative}; "
            f"{side.rate:,.0f} jobs/s"
        )
    result.notes.append(
        f"one beat (frozen while the jobs are stored), {WORKERS} workers {' '.join(POOL)}; store and "
        f"broker on two Redis servers; {KEYS} x {LIMIT} = {KEYS * LIMIT} slots against {threads} worker "
        "threads, so the cap does not bind on throughput: a released job can wait in the broker queue "
        "behind others, and release → next start includes that wait. The few-keys side has fewer slots "
        "than threads: nothing waits in the broker, so it times the gate's own path (the worker's release "
        "and promotion, the beat's wake, claim, gate and publish, the worker's receipt); its target is the "
        "issue's. The release is the task's recorded end (the worker gives the slot back just after). "
        "Commands: the store's INFO commandstats delta over the drain (commands run by scripts included, "
        "the row's own INFO/CONFIG left out)"
    )


def _producer_side(
    seconds: float,
    key: str,
    user_id: int | None = None,
    text: str = "",
    locale: str = "en-US",
    payload: str = "",
) -> None:
    """The producer's stand-in for ``bench.flow_job`` (never run here)."""
