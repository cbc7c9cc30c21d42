"""Producer throughput and Redis memory per pending job, against Celery's own apply_async.

    .venv/bin/python bench/producer.py [--n 20000] [--mem 100000] [--repeat 3]

Every figure runs on a throwaway server (EmbeddedRedis, a free port, never 6379)
that is flushed before each measurement. Throughput is jobs/s in this one
process, best of ``--repeat`` runs, the cases interleaved; memory is
``used_memory`` after minus before, divided by the job count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.devtools.embedded import EmbeddedRedis


def make_app(url: str) -> Celery:
    app = Celery("bench", broker=url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True)

    @app.task(base=DelayedTask, name="bench.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(base=DelayedTask, name="bench.noop", shared=False)
    def noop() -> None:
        return None

    return app


def best_rate(run: Callable[[int], Any], n: int, repeat: int, flush: Callable[[], Any]) -> float:
    best = 0.0
    for _ in range(repeat):
        flush()
        start = time.perf_counter()
        run(n)
        elapsed = time.perf_counter() - start
        best = max(best, n / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--mem", type=int, default=100000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="")
    ns = parser.parse_args()

    with EmbeddedRedis() as server:
        url = server.url + "/0"
        r = redis.Redis.from_url(url)
        app = make_app(url)
        add, noop = app.tasks["bench.add"], app.tasks["bench.noop"]
        # Warm up connections, scripts and caches.
        add.apply_async((1, 2), countdown=3600)
        add.apply_in(3600, (1, 2))
        add.apply_at_many([(time.time() + 3600, (1, 2), None)])
        eta = time.time() + 3600

        def celery_async(n: int, task: Any = add, args: Any = (1, 2)) -> None:
            for _ in range(n):
                task.apply_async(args, countdown=3600)

        def apply_in(n: int, task: Any = add, args: Any = (1, 2)) -> None:
            for _ in range(n):
                task.apply_in(3600, args)

        def apply_at(n: int, task: Any = add, args: Any = (1, 2)) -> None:
            for _ in range(n):
                task.apply_at(eta, args)

        def apply_at_many(n: int, task: Any = add, args: Any = (1, 2)) -> None:
            items = [(eta + i % 1000, args, None) for i in range(n)]
            task.apply_at_many(items)

        cases: list[tuple[str, Callable[[int], Any], int]] = [
            ("celery apply_async(countdown) add(1,2)", celery_async, ns.n // 4),
            ("apply_in add(1,2)", apply_in, ns.n // 2),
            ("apply_at add(1,2)", apply_at, ns.n // 2),
            ("apply_at_many add(1,2)", apply_at_many, ns.n * 2),
            ("celery apply_async(countdown) noop()", lambda n: celery_async(n, noop, ()), ns.n // 4),
            ("apply_in noop()", lambda n: apply_in(n, noop, ()), ns.n // 2),
            ("apply_at_many noop()", lambda n: apply_at_many(n, noop, ()), ns.n * 2),
        ]
        rates: dict[str, float] = {}
        cases = [case for case in cases if not ns.only or ns.only in case[0]]
        for _ in range(ns.repeat):  # interleaved: a slow moment of the machine hits every case
            for name, run, n in cases:
                rates[name] = max(rates.get(name, 0.0), best_rate(run, n, 1, r.flushall))
        for name, rate in rates.items():
            print(f"{name:45s} {rate:10,.0f} jobs/s")
        for kind in ("add(1,2)", "noop()"):
            base = rates.get(f"celery apply_async(countdown) {kind}")
            if base:
                for name, rate in rates.items():
                    if name.endswith(kind) and not name.startswith("celery"):
                        print(f"  {name:43s} {rate / base:6.1f}x celery")

        if ns.mem:
            for name, fill in (
                ("celery broker, noop()", lambda n: celery_async(n, noop, ())),
                ("delayq store, noop() (apply_at_many)", lambda n: apply_at_many(n, noop, ())),
                ("delayq store, noop() (apply_in)", lambda n: apply_in(n, noop, ())),
            ):
                r.flushall()
                time.sleep(0.2)
                before = int(r.info("memory")["used_memory"])
                fill(ns.mem)
                after = int(r.info("memory")["used_memory"])
                print(f"memory {name:38s} {(after - before) / ns.mem:8.0f} B/job")
            r.flushall()
        app.close()


if __name__ == "__main__":
    main()
