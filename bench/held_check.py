"""``python -m bench.held_check [N]``: what a beat's look at held capped jobs costs.

A capped job released by a beat and not started by a worker yet is *held*; with a result
backend, a beat claims it again every ``delayq_slot_ttl`` and asks the backend whether its
task ended (``lua/hold.lua``, ``results.Ran``; see docs/guarantees.md, "Redis restored from an
older snapshot"). This stores ``N`` (default 400) jobs of one key capped at ``N``, has one
in-process :class:`~celery_delayq.beat.dispatch.Dispatcher` release and hold them all (no worker:
their messages stay in the broker), waits until they are due again, and times the one pass
that takes them all again:

- with a Redis result backend (``db 2``; every lookup answers PENDING): each is looked up and
  held again, unpublished (gate decision ``held``);
- without one (``delayq_start_ttl`` = ``delayq_slot_ttl``, so they are due again as soon):
  each is released again into its slot and published (``released``), the pass a redelivery
  costs.

A throwaway Redis server is the store (db 0), the broker (db 1) and the backend (db 2). Each
case runs twice, interleaved.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import redis
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import EmbeddedRedis


def one_pass(url: str, n: int, backend: bool) -> tuple[float, dict[str, int]]:
    """Seconds of the pass that takes ``n`` held jobs again, and its gate decisions."""
    conf = {
        "delayq_url": url + "/0",
        "delayq_slot_ttl": 0.5,
        "delayq_start_ttl": 0.5,
        "broker_connection_retry_on_startup": True,
    }
    if backend:
        conf.update(result_backend=url + "/2", delayq_start_ttl=3600)
    app = Celery("bench", broker=url + "/1", set_as_current=False)
    app.conf.update(conf)

    @app.task(base=DelayedTask, name="bench.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    redis.Redis.from_url(url).flushall()
    add.apply_at_many(
        [(time.time() - 1, (i, i), None) for i in range(n)], concurrency_key="k", concurrency_limit=n
    )
    dispatcher = Dispatcher(app)
    try:
        while dispatcher.stats.held < n:
            dispatcher.run_once()
        time.sleep(0.8)  # past the check (or the start TTL)
        before = dict(dispatcher.stats.gated)
        dispatcher.wake.next = [0] * len(dispatcher.wake.next)  # every shard claimed in this pass
        started = time.perf_counter()
        dispatcher.run_once()
        seconds = time.perf_counter() - started
        after = {k: v - before.get(k, 0) for k, v in dispatcher.stats.gated.items() if v != before.get(k, 0)}
        return seconds, after
    finally:
        dispatcher.stop()
        app.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    n = int(args[0]) if args else 400
    with EmbeddedRedis() as server:
        for _ in range(2):
            for backend in (True, False):
                seconds, gated = one_pass(server.url, n, backend)
                what = "with a result backend (held again)" if backend else "without (redelivered)"
                print(
                    f"{what}: one pass over {n} held jobs: {seconds * 1000:.1f} ms, "
                    f"{seconds / n * 1e6:.0f} us a job; gate decisions {gated}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
