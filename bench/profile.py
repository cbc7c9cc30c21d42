"""``python -m bench.profile [N] [--kombu] [--broker same|redis|rabbitmq]``: a pyinstrument
profile of the dispatch path.

Starts a throwaway Redis server (the store, and by default the broker), stores ``N`` (default 100,000)
no-argument jobs due now with ``apply_at_many``, then drains them with one in-process
:class:`~celery_delayq.beat.dispatch.Dispatcher` (``run_once()`` until all are published)
under pyinstrument, and prints the call tree (frames under 2% of the time are left
out) and the rate with and without the profiler. ``--kombu`` sets
``delayq_push=False`` to profile the path through kombu's publish batch.
``--broker redis`` puts the broker on a second throwaway Redis server, ``--broker rabbitmq``
on RabbitMQ at 127.0.0.1:5672 (a queue of its own, deleted after): both take the kombu path,
as a deployment with the broker elsewhere does. It also
prints the fence's figures of the plain run (see ``FENCE_FRACTION`` in
:mod:`celery_delayq.beat.fence`): renewals, and the residual window from the last lease check to
the end of each publish or batch flush.

The profiler slows the Python side (often by half), so the profiled rate is lower
than the plain one printed next to it; the shares of the tree are what it is for.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Sequence

import redis
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import EmbeddedRedis

from .dispatch import RABBITMQ_URL


def drain(app: Celery, n: int, profile: bool, show_all: bool = False) -> tuple[float, str, Dispatcher]:
    """Store ``n`` due jobs, publish them all; return (seconds, profile text, the dispatcher)."""
    job = app.tasks["bench.job"]
    # a first job of its shape on every shard: the beat's way, which writes the shard's template for
    # pushing on claim (as a running beat has long done); its messages are dropped
    job.apply_at_many([(time.time(), (), {})] * 400)  # type: ignore[attr-defined]
    warm = Dispatcher(app)
    while warm.stats.published < 400:
        warm.run_once()
    warm.close()
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(app.conf.task_default_queue)
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
        text = profiler.output_text(unicode=True, color=False, show_all=show_all, time="percent_of_total")
    dispatcher.close()
    return elapsed, text, dispatcher


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("n", nargs="?", type=int, default=100_000, help="jobs due at once (default 100,000)")
    parser.add_argument("--kombu", action="store_true", help="delayq_push=False")
    parser.add_argument(
        "--no-push-on-claim",
        action="store_true",
        help="delayq_push_on_claim=False: the push path builds every message in the beat",
    )
    parser.add_argument(
        "--broker",
        choices=["same", "redis", "rabbitmq"],
        default="same",
        help="the store's server (default), a second Redis server, or RabbitMQ",
    )
    parser.add_argument("--show-all", action="store_true", help="library frames too (kombu, redis-py)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis())
        url = server.url + "/0"
        broker = url
        queue = "celery"
        if args.broker == "redis":
            broker = stack.enter_context(EmbeddedRedis()).url + "/0"
        elif args.broker == "rabbitmq":
            broker = RABBITMQ_URL
            queue = f"delayq-profile-{uuid.uuid4().hex[:12]}"
        app = Celery("bench", broker=broker, set_as_current=False)
        app.conf.update(
            delayq_url=url,
            task_ignore_result=True,
            delayq_push=not args.kombu,
            delayq_push_on_claim=not args.no_push_on_claim,
            task_default_queue=queue,
            broker_heartbeat=0,
        )
        if args.broker == "rabbitmq":
            stack.callback(_delete_queue, app, queue)

        @app.task(base=DelayedTask, name="bench.job", shared=False)
        def job() -> None:
            return None

        client = redis.Redis.from_url(url)
        plain, _, dispatcher = drain(app, args.n, profile=False)
        client.flushdb()
        profiled, text, _ = drain(app, args.n, profile=True, show_all=args.show_all)
        client.close()
        app.close()
    if dispatcher.stats.pushed_on_claim:
        pushed = dispatcher.stats.pushed_on_claim
        path = f"push on claim (push.lua: {pushed:,} jobs, the rest push_claimed.lua)"
    elif getattr(dispatcher, "pushing", None):
        path = "push (push_claimed.lua)"
    else:
        path = "kombu publish batch"
    print(
        f"dispatch path: {path}; {args.n:,} jobs due at once, one in-process Dispatcher; "
        f"broker: {_broker_text(args.broker)}"
    )
    print(
        f"without the profiler: {args.n / plain:,.0f} jobs/s ({plain / args.n * 1e6:.1f} us/job); "
        f"with it: {args.n / profiled:,.0f} jobs/s ({profiled / args.n * 1e6:.1f} us/job)"
    )
    count, p99, most = dispatcher.fence_window()
    print(
        f"fence (without the profiler): {dispatcher.stats.passes} passes, {dispatcher.stats.renewals} "
        f"renewal(s); residual window (last lease check -> publish sent or batch flushed) over {count:,} "
        f"publishes/flushes: p99 {p99:.1f} ms, max {most:.1f} ms"
    )
    print(text)
    return 0


def _broker_text(kind: str) -> str:
    return {
        "same": "the store's Redis server",
        "redis": "a second Redis server",
        "rabbitmq": "RabbitMQ at 127.0.0.1:5672",
    }[kind]


def _delete_queue(app: Celery, queue: str) -> None:
    """Purge and delete the profile's RabbitMQ queue (and its exchange)."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for call in (channel.queue_purge, channel.queue_delete, channel.exchange_delete):
            with contextlib.suppress(Exception):
                call(queue)


if __name__ == "__main__":
    raise SystemExit(main())
