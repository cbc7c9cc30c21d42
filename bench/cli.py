"""``python -m bench [--smoke | --quick | --full] [--only ROW[,ROW...]] [--list]``."""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from types import FrameType

from .cluster import row_cluster_dispatch
from .dispatch import row_dispatch, row_dispatch_rabbitmq, row_scale
from .flow import row_flow
from .harness import DEFAULT, FULL, QUICK, SMOKE, Context, Sizes
from .lateness import row_lateness_burst, row_lateness_steady, row_wakeup
from .produce import row_apply_at, row_apply_at_many
from .report import RowResult, notes, table
from .resources import IdleBeat, row_idle_beat, row_redis_memory, row_worker_rss
from .schedules import row_schedules_throughput
from .spark import row_spark
from .start_records import row_start_records
from .web import row_web


@dataclass(frozen=True)
class Row:
    name: str
    title: str
    run: Callable[[Context], RowResult]


ROWS: list[Row] = [
    Row("apply_at", "apply_at one at a time vs apply_async(countdown=3600)", row_apply_at),
    Row("apply_at_many", "apply_at_many vs apply_async(countdown=) and raw ZADD+HSET", row_apply_at_many),
    Row("dispatch", "jobs/s published into a Redis broker by 1 and 2 beats", row_dispatch),
    Row("dispatch_rabbitmq", "jobs/s published into RabbitMQ by one beat", row_dispatch_rabbitmq),
    Row("lateness_steady", "1,000 jobs/s: due→publish, due→start vs Celery ETA", row_lateness_steady),
    Row("lateness_burst", "jobs due in the same second: last published (1, 2 beats)", row_lateness_burst),
    Row("idle_beat", "idle beat: Redis commands/s and CPU", row_idle_beat),
    Row("wakeup", "an earlier job wakes a sleeping beat", row_wakeup),
    Row("worker_rss", "worker RSS with jobs pending in delayq vs none, vs Celery ETA", row_worker_rss),
    Row("redis_memory", "Redis bytes per pending job vs Celery's ETA message", row_redis_memory),
    Row("scale", "dispatch rate with 1M pending vs 10k (--full: 10M)", row_scale),
    Row(
        "cluster_dispatch",
        "jobs/s from a 3-primary Redis Cluster by 1 and 4 beats (kombu path)",
        row_cluster_dispatch,
    ),
    Row(
        "start_records",
        "500 jobs/s for 60 s on the kombu path: Redis bytes per started job vs one key a job",
        row_start_records,
    ),
    Row(
        "schedules_throughput",
        "10,000 schedules due every second: points/s published by 1 and 2 beats, and kept up?",
        row_schedules_throughput,
    ),
    Row("flow", "10,000 capped jobs (100 keys, limit 2) vs uncapped; release → next start", row_flow),
    Row("web", "the dashboard with 1M pending: page p50/p99, Redis commands/s per open page", row_web),
    # Last: its JVM and cached rows are gone before any row after it would start.
    Row("spark", 'df.write.format("delayq") on local[2] vs the plain writer in 1 process', row_spark),
]
NAMES = [row.name for row in ROWS]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (about 3 minutes)")
    size.add_argument("--smoke", action="store_true", help="tinier sizes: every row runs (the smoke test)")
    size.add_argument(
        "--full",
        action="store_true",
        help="the issue's full sizes where the default cuts (1M due, 10M pending, 100k ETA)",
    )
    parser.add_argument(
        "--only",
        metavar="ROW",
        action="append",
        default=[],
        help=f"run only this row (repeatable, or comma-separated): {', '.join(NAMES)}",
    )
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker/beat logs folder")
    args = parser.parse_args(argv)
    only = [name.strip() for item in args.only for name in item.split(",") if name.strip()]
    unknown = [name for name in only if name not in NAMES]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(NAMES)}")
    args.only = only
    return args


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except Exception:
        mem = "?"
    from celery_delayq.devtools.embedded import find_server_binary

    found = find_server_binary()
    server = "?"
    if found:
        try:
            server = subprocess.run(
                [found[0], "--version"], capture_output=True, text=True, timeout=10
            ).stdout.split(" sha=")[0]
        except Exception:
            server = found[0]
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem} RAM, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, celery {version('celery')}, kombu {version('kombu')}, "
        f"redis-py {version('redis')} ({_parser()}); {server}"
    )


def _parser() -> str:
    """Which reply parser redis-py uses: hiredis (C) or its own Python one."""
    from redis.utils import HIREDIS_AVAILABLE

    return f"hiredis {version('hiredis')}" if HIREDIS_AVAILABLE else "no hiredis: Python parser"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.name:18} {row.title}")
        return 0
    sizes: Sizes = SMOKE if args.smoke else QUICK if args.quick else FULL if args.full else DEFAULT
    mode = "smoke" if args.smoke else "quick" if args.quick else "full" if args.full else "default"
    selected = args.only or NAMES
    ctx = Context(sizes, mode, selected=list(selected))
    atexit.register(ctx.cleanup)
    signal.signal(signal.SIGTERM, _on_sigterm)
    results: dict[str, RowResult] = {}
    failed = False
    idle: IdleBeat | None = None
    try:
        ctx.say(f"celery-delayq benchmark, {mode} mode, rows: {', '.join(selected)}; logs in {ctx.workdir}")
        # The idle beat's window runs alongside the other rows (it only counts its own
        # commands, on its own server, and its own CPU time).
        if "idle_beat" in selected and len(selected) > 1:
            ctx.say("idle_beat: starting the idle beat; its window runs alongside the other rows")
            idle = IdleBeat(ctx)
            try:
                idle.start()
            except Exception:
                results["idle_beat"] = RowResult("idle_beat", error=traceback.format_exc(limit=3))
                failed = True
                idle = None
        for row in ROWS:
            if row.name not in selected or row.name in results:
                continue
            if row.name == "idle_beat" and idle is not None:
                continue
            results[row.name] = _run(ctx, row.name, functools.partial(row.run, ctx))
            failed = failed or bool(results[row.name].error)
        if idle is not None:
            results["idle_beat"] = _run(ctx, "idle_beat", idle.finish)
            failed = failed or bool(results["idle_beat"].error)
    finally:
        ctx.cleanup(keep_dir=args.keep_logs or failed)
    elapsed = time.monotonic() - ctx.started
    ordered = [results[name] for name in NAMES if name in results]
    print()
    print(f"celery-delayq benchmark ({mode} mode, {elapsed:.0f} s)")
    print(f"machine: {_machine()}")
    print()
    print(table(ordered))
    print()
    print("notes:")
    print(notes(ordered))
    if failed:
        print(f"\nsome rows failed; worker/beat logs kept in {ctx.workdir}")
    return 1 if failed else 0


def _run(ctx: Context, name: str, call: Callable[[], RowResult]) -> RowResult:
    ctx.say(f"{name}: start")
    t0 = time.monotonic()
    before = ctx.owned()
    try:
        result = call()
    except Exception as exc:
        ctx.say(f"{name}: FAILED {exc!r}")
        result = RowResult(name, error=f"{exc!r}\n{traceback.format_exc(limit=4)}")
    finally:
        ctx.stop_since(before)
    result.seconds = time.monotonic() - t0
    ctx.say(f"{name}: done in {result.seconds:.1f} s")
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
