"""``schedules ...``: list, show, add, update, pause, resume, delete and run recurring schedules."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import click

from ..admin.inputs import InputError, add_schedule, options_value, rule_of, update_schedule
from ..admin.jobs import MISSING
from ..admin.views import schedule_json
from ..schedules.spec import OVERLAP_POLICIES, Schedule
from .base import DelayqGroup, Session, json_option, json_value, report, session
from .errors import CliError, usage
from .render import iso, kv_table, listing, plain_row, relative

__all__ = ["schedule_json", "schedules_group"]

F = TypeVar("F", bound=Callable[..., Any])


@click.group("schedules", cls=DelayqGroup, short_help="Recurring schedules.")
def schedules_group() -> None:
    """Recurring schedules: ls, show, add, update, pause, resume, rm, run-now."""


def _schedule_rows(s: Session, sch: Schedule) -> list[tuple[str, Any]]:
    now = time.time() * 1000

    def when(dt: datetime | None) -> str | None:
        if dt is None:
            return None
        ms = dt.timestamp() * 1000
        return f"{s.when(ms)} ({relative(ms, now)})"

    return [
        ("name", sch.name),
        ("task", sch.task),
        ("rule", sch.rule.describe()),
        ("timezone", sch.tz),
        ("DST rule", sch.dst or None),
        ("state", "active" if sch.enabled else "paused"),
        ("next run", when(sch.next_run)),
        ("last run", when(sch.last_run)),
        ("last task id", sch.last_task_id),
        ("runs", str(sch.run_count)),
        ("args", sch.args),
        ("kwargs", sch.kwargs),
        ("options", sch.options),
        ("missed", f"{sch.missed} (max {sch.max_missed}, grace {sch.grace:g} s)"),
        ("overlap", sch.overlap),
        ("origin", sch.origin),
        ("created", s.when(sch.created.timestamp() * 1000)),
        ("updated", s.when(sch.updated.timestamp() * 1000)),
    ]


def _print_schedule(s: Session, sch: Schedule, as_json: bool, title: str | None = None) -> None:
    if as_json:
        s.emit_json(schedule_json(sch))
    else:
        s.console().print(kv_table(title or f"schedule {sch.name}", _schedule_rows(s, sch)))


@schedules_group.command("ls", short_help="List the schedules.")
@click.option("--task", help="Only the schedules of this task.")
@click.option("--paused/--active", "paused", default=None, help="Only paused (or only active) schedules.")
@json_option
@click.pass_context
def schedules_ls(ctx: click.Context, task: str | None, paused: bool | None, as_json: bool) -> None:
    """Every recurring schedule, by name."""
    s = session(ctx)
    enabled = None if paused is None else not paused
    found = sorted(s.schedules.list(task=task, enabled=enabled), key=lambda x: x.name)
    if as_json:
        s.emit_json({"schedules": [schedule_json(x) for x in found], "count": len(found)})
        return
    console = s.console()
    if not found:
        console.print("no schedules")
        return
    now = time.time() * 1000
    # The OVERLAP column only when a listed schedule has a policy ("allow" shows as blank).
    overlap = any(x.overlap != "allow" for x in found)
    columns = ["NAME", "TASK", "RULE", "STATE", "NEXT RUN", "", "LAST RUN", "RUNS"]
    if overlap:
        columns.insert(4, "OVERLAP")
    table = listing()
    for name in columns:
        table.add_column(name, no_wrap=True, justify="right" if name == "RUNS" else "left")
    for x in found:
        nxt = x.next_run.timestamp() * 1000 if x.next_run else None
        last = x.last_run.timestamp() * 1000 if x.last_run else None
        policy = ["" if x.overlap == "allow" else x.overlap] if overlap else []
        plain_row(
            table,
            x.name, x.task, x.rule.describe(), "active" if x.enabled else "paused", *policy,
            s.when(nxt), relative(nxt, now) if nxt else "", s.when(last), f"{x.run_count:,}",
        )  # fmt: skip
    console.print(table)


@schedules_group.command("show", short_help="Everything about one schedule.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Everything about one schedule, with its run history."""
    s = session(ctx)
    sch = s.schedules.get(name)
    if sch is None:
        raise CliError(f"no schedule named {name!r}")
    _print_schedule(s, sch, as_json)


def _rule_of(s: Session, cron: str | None, every: str | None, at: str | None, required: bool) -> Any:
    try:
        return rule_of(cron, every, at, required, lambda text: s.parse_when(text, "--at"))
    except InputError as exc:
        usage(str(exc))


def _schedule_options(f: F) -> F:
    decorators = [
        click.option("--cron", metavar="EXPR", help="Cron expression: 5 fields, or 6 with seconds last."),
        click.option("--every", metavar="DURATION", help="Fixed interval: 30s, 5m, 1h30m, 1d."),
        click.option("--at", metavar="WHEN", help="Once, at WHEN (ISO-8601, UNIX seconds, +10m)."),
        click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON array."),
        click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, a JSON object."),
        click.option("--tz", help="IANA timezone of a cron rule (default: the app's timezone, else UTC)."),
        click.option("--queue", help="Queue to publish to (an apply_async option)."),
        click.option("--options", "options_json", metavar="JSON", help="apply_async options, a JSON object."),
        click.option("--missed", type=click.Choice(["once", "skip", "all"]), help="Missed-run policy."),
        click.option("--max-missed", type=click.IntRange(min=1), help="Most missed runs made (missed=all)."),
        click.option("--grace", type=click.FloatRange(min=0), help="Seconds late before a run is missed."),
        click.option(
            "--dst-gap",
            type=click.Choice(["cron", "jump", "skip"]),
            help="Cron: a wall time the clocks skip runs at the jump, or not (default cron: today's rule).",
        ),
        click.option(
            "--dst-fold",
            type=click.Choice(["cron", "first", "both", "last"]),
            help="Cron: a wall time that happens twice runs the first, both or last time (default cron).",
        ),
        click.option(
            "--overlap",
            type=click.Choice(OVERLAP_POLICIES),
            help="While a run is in flight, a point runs anyway (allow, the default), is skipped, "
            "waits for it (buffer_one) or revokes it and runs (cancel_previous).",
        ),
    ]
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _options_value(options_json: str | None, queue: str | None, base: dict[str, Any] | None) -> Any:
    try:
        return options_value(options_json, queue, base)
    except InputError as exc:
        usage(str(exc))


@schedules_group.command("add", short_help="Create a schedule.")
@click.argument("name")
@click.argument("task")
@_schedule_options
@click.option("--paused", is_flag=True, help="Store it paused (resume starts it).")
@click.option("--no-check-task", is_flag=True, help="Accept a task this app does not know.")
@click.option("--replace", is_flag=True, help="Replace a schedule of that name (keeps its run history).")
@json_option
@click.pass_context
def schedules_add(
    ctx: click.Context,
    name: str,
    task: str,
    cron: str | None,
    every: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    tz: str | None,
    queue: str | None,
    options_json: str | None,
    missed: str | None,
    max_missed: int | None,
    grace: float | None,
    dst_gap: str | None,
    dst_fold: str | None,
    overlap: str | None,
    paused: bool,
    no_check_task: bool,
    replace: bool,
    as_json: bool,
) -> None:
    """Create schedule NAME running TASK on a rule (--cron, --every or --at)."""
    s = session(ctx)
    rule = _rule_of(s, cron, every, at, required=True)
    args = json_value(args_json, "--args", list)
    kwargs = json_value(kwargs_json, "--kwargs", dict)
    options = _options_value(options_json, queue, None)
    settings: dict[str, Any] = {
        "tz": tz,
        "enabled": not paused,
        "options": options,
        "check_task": not no_check_task,
    }
    chosen = {"missed": missed, "max_missed": max_missed, "grace": grace, "dst_gap": dst_gap,
              "dst_fold": dst_fold, "overlap": overlap}  # fmt: skip
    settings.update((key, value) for key, value in chosen.items() if value is not None)
    try:  # the app's modules imported first (`imports`/`include`), as a worker does
        sch = add_schedule(s.schedules, name, task, rule, args, kwargs, replace, **settings)
    except InputError as exc:
        usage(str(exc))
    _print_schedule(s, sch, as_json, title=f"schedule {sch.name} stored")


@schedules_group.command("update", short_help="Change a schedule.")
@click.argument("name")
@_schedule_options
@click.option("--task", help="Run this task instead.")
@json_option
@click.pass_context
def schedules_update(
    ctx: click.Context,
    name: str,
    cron: str | None,
    every: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    tz: str | None,
    queue: str | None,
    options_json: str | None,
    missed: str | None,
    max_missed: int | None,
    grace: float | None,
    dst_gap: str | None,
    dst_fold: str | None,
    overlap: str | None,
    task: str | None,
    as_json: bool,
) -> None:
    """Change some fields of schedule NAME; a new rule counts from now."""
    s = session(ctx)
    changes: dict[str, Any] = {}
    rule = _rule_of(s, cron, every, at, required=False)
    if rule is not None:
        changes["rule"] = rule
    if args_json is not None:
        changes["args"] = json_value(args_json, "--args", list)
    if kwargs_json is not None:
        changes["kwargs"] = json_value(kwargs_json, "--kwargs", dict)
    if tz is not None:
        changes["tz"] = tz
    if task is not None:
        changes["task"] = task
    for key, value in (
        ("missed", missed),
        ("max_missed", max_missed),
        ("grace", grace),
        ("dst_gap", dst_gap),
        ("dst_fold", dst_fold),
        ("overlap", overlap),
    ):
        if value is not None:
            changes[key] = value
    schedules = s.schedules
    if options_json is not None or queue is not None:
        current = schedules.get(name)
        if current is None:
            raise CliError(f"no schedule named {name!r}")
        changes["options"] = _options_value(options_json, queue, current.options)
    if not changes:
        usage("nothing to change: give --cron/--every/--at, --args, --kwargs, --tz, --queue, --options, ...")
    try:
        sch = update_schedule(schedules, name, changes)
    except InputError as exc:
        usage(str(exc))
    _print_schedule(s, sch, as_json, title=f"schedule {sch.name} updated")


@schedules_group.command("pause", short_help="Stop running a schedule.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_pause(ctx: click.Context, name: str, as_json: bool) -> None:
    """Stop running schedule NAME (its waiting run is removed)."""
    s = session(ctx)
    _print_schedule(s, s.schedules.pause(name), as_json, title=f"schedule {name} paused")


@schedules_group.command("resume", short_help="Run a paused schedule again.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Run schedule NAME again, from now on."""
    s = session(ctx)
    _print_schedule(s, s.schedules.resume(name), as_json, title=f"schedule {name} resumed")


@schedules_group.command("rm", short_help="Delete schedules.")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
@json_option
@click.pass_context
def schedules_rm(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Delete schedules and their waiting runs."""
    s = session(ctx)
    results = []
    for name in names:
        gone = s.schedules.delete(name)
        results.append(
            {"name": name, "outcome": "deleted" if gone else MISSING,
             "message": "deleted" if gone else f"no schedule named {name!r}"}
        )  # fmt: skip
    report(s, results, {"deleted"}, as_json, key="name")


@schedules_group.command("run-now", short_help="Run a schedule's task once, now.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_run_now(ctx: click.Context, name: str, as_json: bool) -> None:
    """Run schedule NAME's task once now, outside its rule (the schedule is unchanged)."""
    s = session(ctx)
    result = s.schedules.run_now(name)
    due_ms = result.due.timestamp() * 1000 if result.due else None
    if as_json:
        s.emit_json({"name": name, "id": result.id, "due": iso(due_ms), "created": result.created})
    else:
        click.echo(f"{name}: stored {result.id}, due {s.when(due_ms)}")


# -- dead letters -------------------------------------------------------------------------------
