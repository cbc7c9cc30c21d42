"""``dead ...``: list, show, requeue and forget dead letters (jobs a beat could not publish)."""

from __future__ import annotations

import time
from typing import Any

import click

from ..admin.jobs import MISSING, NO_ENVELOPE, REQUEUED
from ..admin.views import dead_page, dead_view
from .base import DelayqGroup, Session, json_option, report, session
from .errors import CliError, usage
from .jobs import print_job
from .render import ago, iso, listing, plain_row, short

__all__ = ["dead_group"]


@click.group("dead", cls=DelayqGroup, short_help="Dead-lettered jobs.")
def dead_group() -> None:
    """Dead-lettered jobs (a beat could not publish them): ls, show, requeue, rm."""


def _dead_view(s: Session, job_id: str, record: dict[str, Any], detail: bool = False) -> dict[str, Any]:
    return dead_view(s.store, s.app.conf.task_default_queue, job_id, record, detail)


@dead_group.command("ls", short_help="List dead letters, newest first.")
@click.option("--task", help="Only the dead letters of this task.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0)
@json_option
@click.pass_context
def dead_ls(ctx: click.Context, task: str | None, limit: int, offset: int, as_json: bool) -> None:
    """Dead letters, newest first (reads them all: HSCAN of each shard)."""
    s = session(ctx)
    view = dead_page(s.store, s.app.conf.task_default_queue, s.dq.dead(), task, limit, offset)
    if as_json:
        s.emit_json(view)
        return
    page, total = view["dead"], view["total"]
    console = s.console()
    if not page:
        console.print("no dead letters")
        return
    now = time.time() * 1000
    table = listing()
    for name in ("ID", "TASK", "DEAD", "DUE", "TRIES", "REASON"):
        table.add_column(name, no_wrap=name != "REASON", overflow="fold" if name == "REASON" else "ellipsis")
    for v in page:
        dead_ms = v["dead_at_ms"]
        plain_row(
            table,
            v["id"], v["task"] or "?", f"{ago(now - dead_ms)} ago" if dead_ms else "-",
            s.when(v["due_ms"]), str(v["tries"]), short(v["reason"] or "", 80),
        )  # fmt: skip
    console.print(table)
    if total > offset + len(page):
        console.print(f"{len(page)} of {total} shown; more with --offset {offset + len(page)}")


@dead_group.command("show", short_help="Everything about one dead letter.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def dead_show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Everything about one dead letter: why, when, and the message it holds."""
    s = session(ctx)
    record = s.store.dead_record(job_id)
    if record is None:
        raise CliError(f"no dead letter with id {job_id!r}")
    view = _dead_view(s, job_id, record, detail=True)
    if as_json:
        s.emit_json(view)
    else:
        print_job(s, view)


@dead_group.command("requeue", short_help="Put dead letters back as waiting jobs.")
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True)
@click.option("--at", "when", metavar="WHEN", help="Due at WHEN instead of now.")
@json_option
@click.pass_context
def dead_requeue(ctx: click.Context, job_ids: tuple[str, ...], when: str | None, as_json: bool) -> None:
    """Put dead letters back as waiting jobs (due now, or --at WHEN); their dead letters go."""
    s = session(ctx)
    due_ms = s.parse_when(when, "--at") if when else None
    texts = {
        MISSING: "no dead letter with id {id!r}",
        "stored": "{id!r} not requeued: a job with this id is stored (see `delayq show {id}`)",
        NO_ENVELOPE: "{id!r} not requeued: its dead letter holds no message",
    }
    results = []
    for job_id in job_ids:
        at = due_ms if due_ms is not None else s.store.server_now_ms()
        outcome = s.dq.requeue_dead(job_id, at / 1000.0)
        message = f"requeued, due {s.when(at)}" if outcome == REQUEUED else texts[outcome].format(id=job_id)
        results.append({"id": job_id, "outcome": outcome, "message": message, "due": iso(at)})
    report(s, results, {REQUEUED}, as_json)


@dead_group.command("rm", short_help="Forget dead letters.")
@click.argument("job_ids", metavar="ID...", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of this prefix (asks first).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (--all).")
@json_option
@click.pass_context
def dead_rm(ctx: click.Context, job_ids: tuple[str, ...], all_: bool, yes: bool, as_json: bool) -> None:
    """Forget dead letters (the jobs are not run)."""
    s = session(ctx)
    if all_ == bool(job_ids):
        usage("give dead letter ids, or --all")
    if all_:
        total = s.store.count_dead()
        if not yes:
            click.confirm(
                f"Delete all {total:,} dead letters under prefix {s.store.config.prefix!r} at {s.url}?",
                abort=True,
                err=True,
            )
        removed = s.dq.delete_all_dead()
        if as_json:
            s.emit_json({"removed": removed})
        else:
            click.echo(f"removed {removed:,} dead letter(s)")
        return
    results = []
    for job_id in job_ids:
        gone = s.dq.delete_dead(job_id)
        results.append(
            {"id": job_id, "outcome": "deleted" if gone else MISSING,
             "message": "deleted" if gone else f"no dead letter with id {job_id!r}"}
        )  # fmt: skip
    report(s, results, {"deleted"}, as_json)
