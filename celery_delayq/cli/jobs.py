"""The one-off job commands: ``ls``, ``show``, ``cancel``, ``reschedule``, ``run-now``, ``purge``;
and the JSON view of one job (:func:`job_view`), which the dead-letter commands show too.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import click
from rich.text import Text

from ..admin.jobs import CANCELLED, DELIVERING, MOVED
from ..admin.listing import JobFilter, jobs_page
from ..admin.status import GATED_BY
from ..admin.views import JOB_STATES, cancel_result, job_detail, job_view, move_result
from .base import Session, json_option, report, session
from .errors import CliError, usage
from .render import call_text, kv_table, listing, plain_row, relative, shown

__all__ = [
    "cancel_jobs",
    "job_view",
    "ls_jobs",
    "print_job",
    "purge_jobs",
    "reschedule_job",
    "run_now_job",
    "show_job",
]


@click.command("ls", short_help="List stored jobs in due order.")
@click.option("--task", help="Only jobs of this task (name).")
@click.option(
    "--from", "start", metavar="WHEN", help="Due at or after WHEN (ISO-8601, UNIX s, now, +10m, -1h)."
)
@click.option("--until", "end", metavar="WHEN", help="Due at or before WHEN.")
@click.option("--queue", help="Only jobs routed to this queue.")
@click.option("--state", type=click.Choice(list(JOB_STATES)), help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Most jobs shown.")
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Skip this many matching jobs first.")
@click.option("--cursor", help="Go on after the job an earlier `ls` named in its next_cursor.")
@json_option
@click.pass_context
def ls_jobs(
    ctx: click.Context,
    task: str | None,
    start: str | None,
    end: str | None,
    queue: str | None,
    state: str | None,
    limit: int,
    offset: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """Stored jobs in due order (a job being delivered, or running under flow control, is ordered
    by its lease or slot expiry)."""
    s = session(ctx)
    where = JobFilter(
        task=task,
        queue=queue,
        state=state,
        start_ms=s.parse_when(start, "--from") if start else None,
        end_ms=s.parse_when(end, "--until") if end else None,
    )
    store = s.store  # made first: a bad delayq_url is exit 3, not a bad --cursor
    try:
        view = jobs_page(store, s.app.conf.task_default_queue, where, limit, offset, cursor)
    except ValueError:
        usage(f"bad --cursor {cursor!r}: pass the next_cursor an earlier `ls` printed")
    if as_json:
        s.emit_json(view)
        return
    shown, next_cursor = view["jobs"], view["next_cursor"]
    filtered = where.narrowed
    console = s.console()
    if not shown:
        console.print("no jobs match" if (filtered or start or end or offset or cursor) else "no jobs stored")
        return
    now = time.time() * 1000
    table = listing()
    for name in ("ID", "STATE", "DUE", "", "TASK", "QUEUE", "ARGS"):
        table.add_column(name, no_wrap=name != "ARGS", overflow="ellipsis")
    for job in shown:
        plain_row(
            table,
            job["id"],
            state_text(job),
            s.when(job["due_ms"]),
            relative(job["due_ms"], now),
            job["task"] or "?",
            job["queue"] or "",
            call_text(job),
        )
    console.print(table)
    if next_cursor:
        console.print(Text(f"{len(shown)} shown; more with: --cursor '{next_cursor}'"))


def state_text(job: dict[str, Any]) -> str:
    """A listed job's state, and for a gated one what holds it back.

    >>> state_text({"state": "gated", "gated_by": "paused"}), state_text({"state": "waiting"})
    ('gated: key paused', 'waiting')
    """
    held = job.get("gated_by")
    if job["state"] != "gated" or not held:
        return str(job["state"])
    return f"gated: {GATED_BY.get(held, held)}"


def _job_detail(s: Session, job_id: str) -> dict[str, Any] | None:
    return job_detail(s.store, s.app.conf.task_default_queue, job_id)


def print_job(s: Session, view: dict[str, Any]) -> None:
    now = time.time() * 1000

    def when(text: str | None) -> str | None:
        if text is None:
            return None
        ms = datetime.fromisoformat(text).timestamp() * 1000
        return f"{s.when(ms)} ({relative(ms, now)})"

    rows: list[tuple[str, Any]] = [
        ("id", shown(view["id"])),
        ("state", view["state"]),
        *([("waits for", view["gated_reason"])] if view.get("gated_reason") else []),
        *([tuple(view["keyed"].split(":", 1))] if view.get("keyed") else []),  # debounce/throttle: key
        ("task", view["task"]),
        ("due", f"{s.when(view['due_ms'])} ({relative(view['due_ms'], now)})"),
        ("shard", str(view["shard"])),
        ("queue", view["queue"]),
        ("args", view["args"]),
        ("kwargs", view["kwargs"]),
        ("tries", str(view["tries"])),
    ]
    if view["lease_until"]:
        rows.append(("lease until", when(view["lease_until"])))
    if view["schedule"]:
        rows.append(("schedule", view["schedule"]))
    if view.get("dead"):
        rows.append(("dead reason", view["dead"]["reason"]))
        rows.append(("dead at", when(view["dead"]["dead_at"])))
        rows.append(("buried by", view["dead"]["beat"]))
    rows += [
        ("created", when(view["created"])),
        ("expires", when(view["expires"])),
        ("options", view["options"]),
        ("headers", view["headers"]),
        ("properties", view["properties"]),
        ("content", f"{view['content_type']} ({view['content_encoding']})" if view["content_type"] else None),
    ]
    if view["envelope_error"]:
        rows.append(("envelope error", view["envelope_error"]))
    s.console().print(kv_table(f"job {shown(view['id'])}", rows))


@click.command("show", short_help="Everything about one job.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def show_job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Everything about one job (waiting, being delivered, or dead-lettered)."""
    s = session(ctx)
    view = _job_detail(s, job_id)
    if view is None:
        raise CliError(f"no job with id {job_id!r}")
    if as_json:
        s.emit_json(view)
    else:
        print_job(s, view)


@click.command("cancel", short_help="Remove waiting jobs so that they never run.")
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True)
@json_option
@click.pass_context
def cancel_jobs(ctx: click.Context, job_ids: tuple[str, ...], as_json: bool) -> None:
    """Remove waiting jobs so that they never run. Exit 1 when one was not found, was being
    delivered (removed, but it may run), or is a schedule's next run."""
    s = session(ctx)
    results = [cancel_result(s.dq, s.store, job_id) for job_id in job_ids]
    report(s, results, {CANCELLED}, as_json)


def _move(ctx: click.Context, job_id: str, due_ms: int, as_json: bool, what: str) -> None:
    s = session(ctx)
    due_text = f"due {s.when(due_ms)} ({relative(due_ms, time.time() * 1000)})"
    report(s, [move_result(s.dq, s.store, job_id, due_ms, what, due_text)], {MOVED}, as_json)


@click.command("reschedule", short_help="Move a waiting job to another time.")
@click.argument("job_id", metavar="ID")
@click.argument("when", metavar="WHEN")
@json_option
@click.pass_context
def reschedule_job(ctx: click.Context, job_id: str, when: str, as_json: bool) -> None:
    """Move a waiting job to WHEN (ISO-8601, UNIX seconds, now, +10m, -1h)."""
    _move(ctx, job_id, session(ctx).parse_when(when, "WHEN"), as_json, "reschedule")


@click.command("run-now", short_help="Make a waiting job due now.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def run_now_job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Make a waiting job due now (a beat publishes it within moments)."""
    _move(ctx, job_id, session(ctx).store.server_now_ms(), as_json, "run")


@click.command("purge", short_help="Delete every pending one-off job (asks first).")
@click.option("--task", help="Only the jobs of this task.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def purge_jobs(ctx: click.Context, task: str | None, yes: bool, as_json: bool) -> None:
    """Delete every pending one-off job of this app's key prefix (asks first).

    Recurring schedules and their next runs are kept (see `schedules rm`), and so are dead
    letters (see `dead rm --all`). Other prefixes are never touched.
    """
    s = session(ctx)
    store = s.store
    stored = store.count()
    what = f"every pending job of task {task!r}" if task else "every pending one-off job"
    if not yes:
        click.confirm(
            f"Delete {what} (of {stored:,} stored) under prefix {store.config.prefix!r} "
            f"at {s.url}? Schedules and dead letters are kept.",
            abort=True,
            err=True,
        )
    counts = s.dq.purge(task=task)
    if as_json:
        s.emit_json({"removed": counts[CANCELLED] + counts[DELIVERING], **counts})
        return
    line = f"removed {counts[CANCELLED]:,} job(s)"
    if counts[DELIVERING]:
        line += f", and {counts[DELIVERING]:,} a beat was delivering (they may already be in the broker)"
    if counts["kept_points"]:
        line += f"; kept {counts['kept_points']:,} schedule point(s)"
    click.echo(line)
