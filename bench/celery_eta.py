"""The Celery ETA baseline of rows 6, 9 and 10, measured once per run.

``n`` real jobs (:func:`bench.jobs.job_call`) sent with ``apply_async(args, kwargs, eta=...)``
into a Redis broker on a dedicated server, all due within the same second, while no worker
runs: the broker's ``used_memory`` grows by the bytes of ``n`` pending ETA messages (row 10).
Then one worker starts and fetches them all (Celery holds ETA tasks in the worker's memory
until due): its RSS once it holds them is row 9's baseline. Then the second comes, and the time
until the last task started is row 6's baseline.

It is slow (the worker fetches about 1,000 ETA tasks a second on this machine), hence the
smaller ``n`` outside ``--full``. Only the parts the selected rows need are run.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .harness import (
    STARTS_KEY,
    BenchError,
    Context,
    producer,
    rss_mib,
    starts,
    used_memory,
    wait_until,
    watch,
)
from .jobs import job_call

QUEUE = "celery"
#: Conservative rates for choosing the due second: every task must be in the worker before it.
SEND_RATE, FETCH_RATE, START_S = 800.0, 650.0, 5.0


@dataclass
class CeleryEta:
    n: int
    bytes_per_message: float = float("nan")
    send_rate: float = float("nan")
    fetch_s: float = float("nan")
    rss_mib: float = float("nan")
    last_started_s: float = float("nan")
    #: Tasks that had not started when the wait ended (then last_started_s is a lower bound).
    not_started: int = 0
    late_p50_ms: float = float("nan")
    notes: list[str] = field(default_factory=list)


def celery_eta(ctx: Context, notes: list[str] | None = None) -> CeleryEta:
    """Run (once) the parts of the experiment that the selected rows need; the first caller's
    ``notes`` get the experiment's notes."""
    cached = ctx.cache.get("celery_eta")
    if isinstance(cached, CeleryEta):
        return cached
    out = _run(ctx)
    ctx.cache["celery_eta"] = out
    if notes is not None:
        notes.extend(f"Celery ETA baseline: {note}" for note in out.notes)
    return out


def _run(ctx: Context) -> CeleryEta:
    need_run = "lateness_burst" in ctx.selected
    need_rss = need_run or "worker_rss" in ctx.selected
    n = ctx.sizes.eta_jobs
    out = CeleryEta(n)
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        client = p.client
        p.task.apply_async(countdown=3600)  # connection up, queue key exists; never runs here
        before = used_memory(client)
        due = time.time() + (n / SEND_RATE + START_S + n / FETCH_RATE + 2.0 if need_run else 3600.0)
        ctx.say(f"Celery ETA baseline: sending {n:,} apply_async(eta=...) tasks")
        t0 = time.perf_counter()
        for i in range(n):
            p.task.apply_async(*job_call(i), eta=datetime.fromtimestamp(due + i / n, UTC))
        out.send_rate = n / (time.perf_counter() - t0)
        out.bytes_per_message = (used_memory(client) - before) / n
        out.notes.append(
            f"{n:,} ETA tasks (real jobs: bench.job(user_id, text, locale=...)) sent with "
            f"apply_async(args, kwargs, eta=) at "
            f"{out.send_rate:,.0f}/s into a Redis broker with no worker; its used_memory "
            f"grew {out.bytes_per_message:,.0f} B per message"
        )
        if need_rss:
            worker = ctx.start_worker(url, url)
            try:
                ctx.wait_worker(worker)
                ready = time.time()
                ctx.say(f"Celery ETA baseline: worker fetching {n:,} ETA tasks")
                wait_until(
                    lambda: client.llen(QUEUE) == 0,
                    60 + n / 100.0,
                    0.1,
                    [worker],
                    "worker fetching the ETA tasks",
                )
                fetched = time.time()
                out.fetch_s = fetched - ready
                time.sleep(1.0)
                out.rss_mib = rss_mib(worker.pid)
                out.notes.append(
                    f"one worker (-P threads -c 8) fetched them in {out.fetch_s:.1f} s and "
                    f"then had {out.rss_mib:,.0f} MiB RSS"
                )
                if need_run:
                    if fetched > due:
                        out.notes.append(
                            f"the worker finished fetching {fetched - due:.1f} s after the "
                            "tasks were due: that wait is part of the lateness"
                        )
                    ctx.say("Celery ETA baseline: waiting for the due second and the runs")
                    with contextlib.suppress(BenchError):  # what has not run by then is counted
                        watch(
                            lambda: int(client.llen(STARTS_KEY)),
                            n,
                            timeout=max(0.0, due - time.time()) + 60 + n / 200.0,
                            interval=0.05,
                            children=[worker],
                            what="Celery ETA runs",
                        )
                    runs = starts(client)
                    out.not_started = n - len(runs)
                    last = max(s for s, _ in runs) if not out.not_started else time.time()
                    out.last_started_s = last - due
                    if out.not_started:
                        out.notes.append(
                            f"{out.not_started:,} of {n:,} had not started when the wait ended, "
                            f"{out.last_started_s:.0f} s after the due second began: the "
                            "figure is a lower bound (≥)"
                        )
                    late = sorted((s - d) * 1000.0 for s, d in runs)
                    out.late_p50_ms = late[len(late) // 2]
                    out.notes.append(
                        f"all due within [T, T+1 s); the last started at T+"
                        f"{out.last_started_s:.2f} s (p50 lateness {out.late_p50_ms:,.0f} ms)"
                    )
            finally:
                # A worker holding ETA tasks takes long to shut down warm: SIGKILL it soon.
                ctx.stop(worker, grace=2.0)
    ctx.stop_redis(server)
    return out
