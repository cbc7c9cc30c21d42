"""``python -m bench.profile [N] [--kombu]``: a pyinstrument profile of the dispatch path.

Starts a throwaway Redis server (broker and store), stores ``N`` (default 100,000)
no-argument jobs due now with ``apply_at_many``, then drains them with one in-process
:class:`~celery_delayq.dispatch.Dispatcher` (``run_once()`` until all are published)
under pyinstrument, and prints the call tree (frames under 2% of the time are left
out) and the rate with and without the profiler. ``--kombu`` sets
``delayq_atomic_publish=False`` to profile the path through kombu's publish batch. It also
prints the fence's figures of the plain run (see ``FENCE_FRACTION`` in
:mod:`celery_delayq.dispatch`): renewals, and the residual window from the last lease check to
the end of each publish or batch flush.

The profiler slows the Python side (often by half), so the profiled rate is lower
than the plain one printed next to it; the shares of the tree are what it is for.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import redis
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.dispatch import Dispatcher


def drain(app: Celery, n: int, profile: bool) -> tuple[float, str, Dispatcher]:
    """Store ``n`` due jobs, publish them all; return (seconds, profile text, the dispatcher)."""
    job = app.tasks["bench.job"]
    now = time.time()
    for start in range(0, n, 10_000):
        job.apply_at_many([(now, (), {})] * min(10_000, n - start))  # type: ignore[attr-defined]
    dispatcher = Dispatcher(app)
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
    t0 = time.perf_counter()
    while dispatcher.stats.published < n:
        dispatcher.run_once()
    elapsed = time.perf_counter() - t0
    text = ""
    if profiler is not None:
        profiler.stop()
        text = profiler.output_text(unicode=True, color=False, show_all=False, time="percent_of_total")
    dispatcher.close()
    return elapsed, text, dispatcher


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("n", nargs="?", type=int, default=100_000, help="jobs due at once (default 100,000)")
    parser.add_argument("--kombu", action="store_true", help="delayq_atomic_publish=False")
    args = parser.parse_args(argv)
    with EmbeddedRedis() as server:
        url = server.url + "/0"
        app = Celery("bench", broker=url, set_as_current=False)
        app.conf.update(delayq_url=url, task_ignore_result=True, delayq_atomic_publish=not args.kombu)

        @app.task(base=DelayedTask, name="bench.job", shared=False)
        def job() -> None:
            return None

        client = redis.Redis.from_url(url)
        plain, _, dispatcher = drain(app, args.n, profile=False)
        client.flushdb()
        profiled, text, _ = drain(app, args.n, profile=True)
        client.close()
        app.close()
    path = "atomic (deliver.lua)" if dispatcher.wire else "kombu publish batch"
    print(f"dispatch path: {path}; {args.n:,} jobs due at once, one in-process Dispatcher")
    print(f"without the profiler: {args.n / plain:,.0f} jobs/s; with it: {args.n / profiled:,.0f} jobs/s")
    count, p99, most = dispatcher.fence_window()
    print(
        f"fence (without the profiler): {dispatcher.stats.passes} passes, {dispatcher.stats.renewals} "
        f"renewal(s); residual window (last lease check -> publish sent or batch flushed) over {count:,} "
        f"publishes/flushes: p99 {p99:.1f} ms, max {most:.1f} ms"
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
