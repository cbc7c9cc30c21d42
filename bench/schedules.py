"""Row ``schedules_throughput``: how many schedule points a second 1 and 2 beats publish, with
10,000 schedules each due every second (issue 52: one beat fell behind there without a word).

The schedules are ``bench.job`` with a real job's arguments (:func:`bench.jobs.job_call`),
each an interval of 1 s (anchored at the epoch: every schedule is due at each whole second),
added through :class:`celery_delayq.Schedules`. Then 1 beat (or 2) runs, with no worker: every
point published lands in the broker's ``celery`` list, which the row counts and empties every
half second (``LLEN`` and ``DEL`` in one transaction). After a warm-up, points a second =
points counted / the window. A beat *kept up* when it published at least 95 % of the points
due in the window and did not log that it is behind (``delayq_behind_warning``, default 10 s);
each beat's log is searched for that warning.
"""

from __future__ import annotations

import time
from datetime import timedelta

from .harness import Context, producer, wake_channel
from .jobs import job_call
from .report import Line, RowResult

__all__ = ["row_schedules_throughput"]

#: Schedules due every second (the issue's figure; --smoke: fewer).
SCHEDULES = 10_000
QUEUE = "celery"
#: Seconds of warm-up, then of the measured window, by mode.
WINDOWS = {"smoke": (2.0, 3.0), "quick": (4.0, 8.0), "default": (5.0, 20.0), "full": (10.0, 60.0)}
#: The warning a beat logs when it falls behind (celery_delayq/beat/behind.py).
BEHIND = "this beat is behind"
#: Share of the due points a beat must publish to have kept up.
KEPT_UP = 0.95


def row_schedules_throughput(ctx: Context) -> RowResult:
    result = RowResult("schedules_throughput")
    n = 1_000 if ctx.mode == "smoke" else SCHEDULES
    warm, window = WINDOWS.get(ctx.mode, WINDOWS["default"])
    server = ctx.redis()
    url = server.url + "/0"
    rates: dict[int, tuple[float, bool]] = {}
    with producer(url, url) as p:
        from celery_delayq import Schedules

        for beats in (1, 2):
            p.client.flushall()
            ctx.say(f"schedules_throughput: adding {n:,} schedules due every second")
            t0 = time.monotonic()
            schedules = Schedules(p.app)
            for i in range(n):
                args, kwargs = job_call(i)
                schedules.add(f"bench-{i}", p.task, timedelta(seconds=1), args=args, kwargs=kwargs)
            added = time.monotonic() - t0
            ctx.say(f"schedules_throughput: added in {added:.1f} s; {beats} beat(s), {warm + window:.0f} s")
            children = [ctx.start_beat(url, url) for _ in range(beats)]
            ctx.wait_beats(p.client, wake_channel(p), children)
            _drain(p.client, warm)
            # the window from the middle of a second for whole seconds: the points of each
            # second are published just after it starts, so a beat that keeps up has `window`
            # seconds' points in it, not one more or less
            _drain(p.client, 1.5 - time.time() % 1.0)
            counted = _drain(p.client, window)
            ctx.stop_all(children)
            said = [_behind_line(child.log.read_text(errors="replace")) for child in children]
            warned = [line for line in said if line]
            rate = counted / window
            kept = rate >= KEPT_UP * n and not warned
            rates[beats] = (rate, kept)
            result.notes.append(
                f"{beats} beat{'s' if beats > 1 else ''}: {counted:,} points in {window:.0f} s "
                f"({rate:,.0f}/s of {n:,}/s due): {'kept up' if kept else 'fell behind'}; "
                f"{len(warned)} of {beats} logged '{BEHIND}'"
                + (f", the first: {warned[0]}" if warned else "")
            )
    ctx.stop_redis(server)
    for beats, (rate, _) in rates.items():
        result.lines.append(
            Line(
                f"schedules_throughput: {n:,} per-second schedules, {beats} beat{'s' if beats > 1 else ''}"
                f" (vs points due)",
                rate,
                "points/s",
                baseline=float(n),
                target=f">={KEPT_UP}",
            )
        )
    result.notes.append(
        "met? = kept up: published >= 95% of the points due in the window, and no beat logged "
        f"'{BEHIND}'; a warm-up of {warm:.0f} s first; no worker (the points are counted in the "
        "broker list and removed)"
    )
    return result


def _drain(client: object, seconds: float) -> int:
    """Count and remove what lands in the broker list for ``seconds``: messages published."""
    counted = 0
    end = time.monotonic() + seconds
    while True:
        with client.pipeline(transaction=True) as pipe:  # type: ignore[attr-defined]
            pipe.llen(QUEUE)
            pipe.delete(QUEUE)
            length, _ = pipe.execute()
        counted += int(length)
        left = end - time.monotonic()
        if left <= 0:
            return counted
        time.sleep(min(0.5, left))


def _behind_line(log: str) -> str:
    """The first line of a beat's log that says it is behind, from its "delayq:" on ("")."""
    for line in log.splitlines():
        if BEHIND in line:
            return line[line.find("delayq:") :].strip()
    return ""
