"""Flow control: ``keys``, ``key``, ``limit``, ``pause``, ``resume`` (the gate keys: their limit in
force, slots running, jobs waiting for one, paused or not) and ``batches``, ``batch`` (progress
of each batch, cancelling the waiting members of one, deleting one). See docs/flow-control.md.
"""

from __future__ import annotations

from typing import Any

import click

from ..admin.inputs import InputError, limit_of
from ..admin.jobs import check_key_target
from ..admin.views import batch_json, batch_state_text, batches_view, key_json, keys_view
from ..flow.gate import check_key
from .base import Session, json_option, session
from .errors import CliError, usage
from .render import kv_table, listing, plain_row

__all__ = [
    "batch_show",
    "batches_ls",
    "key_show",
    "keys_ls",
    "limit_key",
    "pause_key",
    "resume_key",
]


# -- keys -----------------------------------------------------------------------------------------


def _limit_text(view: dict[str, Any]) -> str:
    limit = "none" if view["limit"] is None else str(view["limit"])
    if view["override"] is not None:
        return f"{limit} (set)"
    return limit


def _key_arg(key: str) -> str:
    """KEY as the gate takes it; a usage error (exit 2) otherwise."""
    check_key(key, "KEY")  # InvalidOptions: a ScheduleError, exit 2 through the errors table
    return key


@click.command("keys", short_help="Gate keys: limit, running, waiting, paused.")
@json_option
@click.pass_context
def keys_ls(ctx: click.Context, as_json: bool) -> None:
    """Every gate key the shards know (each job's concurrency or rate key), with the limit in
    force, the slots running, the jobs waiting for one, and whether it is paused."""
    s = session(ctx)
    listing_view = keys_view(s.store)
    if as_json:
        s.emit_json(listing_view)
        return
    views = listing_view["keys"]
    console = s.console()
    if not views:
        console.print("no gate keys")
        return
    table = listing()
    for name in ("KEY", "LIMIT", "RUNNING", "WAITING", "PAUSED"):
        table.add_column(name, no_wrap=True, justify="left" if name == "KEY" else "right")
    for v in views:
        plain_row(
            table, v["key"], _limit_text(v), f"{v['running']:,}", f"{v['waiting']:,}",
            "paused" if v["paused"] else "-",
        )  # fmt: skip
    console.print(table)


def _print_key(s: Session, view: dict[str, Any]) -> None:
    override = view["override"]
    rows = [
        ("key", view["key"]),
        ("limit in force", "none (no cap)" if view["limit"] is None else str(view["limit"])),
        ("set at run time", "-" if override is None else override),
        ("running", f"{view['running']:,}"),
        ("waiting", f"{view['waiting']:,}"),
        ("paused", "yes" if view["paused"] else "no"),
    ]
    s.console().print(kv_table(f"key {view['key']}", rows))


@click.command("key", short_help="One gate key.")
@click.argument("key")
@json_option
@click.pass_context
def key_show(ctx: click.Context, key: str, as_json: bool) -> None:
    """One gate key: its limit in force and where it comes from, running, waiting, paused."""
    s = session(ctx)
    view = key_json(s.store.key_state(_key_arg(key)))
    if as_json:
        s.emit_json(view)
    else:
        _print_key(s, view)


_NEW_OPTION = click.option(
    "--new", is_flag=True,
    help="Change a key never seen (no job of it stored or gated, no limit or pause set) too.",
)  # fmt: skip


def _target(s: Session, key: str, action: str, new: bool) -> str:
    """KEY when ACTION may change it (see :func:`check_key_target`); else the one-line error
    of ``UnknownKey`` (exit 1, through the errors table)."""
    return check_key_target(s.store, _key_arg(key), action, new)


def _changed(s: Session, key: str, promoted: int, what: str, as_json: bool, limit: bool = False) -> None:
    """What a change did: the key's state after it, and how many waiting jobs it released."""
    view = key_json(s.store.key_state(key))
    if as_json:
        s.emit_json({**view, "released": promoted})
        return
    if limit:
        what += f"; limit in force: {'none' if view['limit'] is None else view['limit']}"
    released = f"; {promoted:,} waiting job(s) released" if promoted else ""
    click.echo(f"{key}: {what}{released}")


@click.command("limit", short_help="Set, lift or clear a key's run-time limit.")
@click.argument("key")
@click.argument("limit", metavar="N|none", required=False)
@click.option("--clear", is_flag=True, help="Remove the run-time limit: each job's own limit applies again.")
@_NEW_OPTION
@json_option
@click.pass_context
def limit_key(ctx: click.Context, key: str, limit: str | None, clear: bool, new: bool, as_json: bool) -> None:
    """Set KEY's run-time limit to N (a whole number >= 1), or to `none` (no cap), or --clear
    it. A run-time limit wins over the limits jobs carry; waiting jobs the new limit lets run
    are released at once. A key never seen, or a schedule's name, is refused (see --new)."""
    s = session(ctx)
    _key_arg(key)
    if clear == (limit is not None):
        usage("give N, 'none' or --clear (one of them)")
    number: int | None = None
    if not clear:
        try:
            number = limit_of(limit or "", "N")
        except InputError as exc:
            usage(str(exc))
    _target(s, key, "limit", new)
    if clear:
        promoted = s.store.clear_limit(key)
        what = "run-time limit cleared"
    elif number is None:
        promoted = s.store.set_limit(key, None)
        what = "run-time limit none (no cap)"
    else:
        promoted = s.store.set_limit(key, number)
        what = f"run-time limit {number}"
    _changed(s, key, promoted, what, as_json, limit=True)


def _switch(name: str, done: str, short_help: str, help_text: str) -> click.Command:
    """The ``pause``/``resume`` command: ``Store.<name>(KEY)``, then what it did."""

    @click.command(name, short_help=short_help, help=help_text)
    @click.argument("key")
    @_NEW_OPTION
    @json_option
    @click.pass_context
    def command(ctx: click.Context, key: str, new: bool, as_json: bool) -> None:
        s = session(ctx)
        promoted = getattr(s.store, name)(_target(s, key, name, new))
        _changed(s, key, promoted, done, as_json)

    return command


pause_key = _switch(
    "pause", "paused", "Stop releasing a key's jobs.",
    "Stop releasing KEY's jobs: they wait in Redis when due. Running ones go on. A key never "
    "seen (no job of it stored or gated, no limit or pause set), or a schedule's name, is "
    "refused unless --new (a schedule: `schedules pause NAME`).",
)  # fmt: skip
resume_key = _switch(
    "resume", "resumed", "Release a paused key's jobs again.",
    "Release KEY's jobs again: the waiting ones its limit lets run go at once. A key never "
    "seen, or a schedule's name, is refused unless --new.",
)  # fmt: skip


# -- batches ----------------------------------------------------------------------------------------


@click.command("batches", short_help="Batches and their progress.")
@json_option
@click.pass_context
def batches_ls(ctx: click.Context, as_json: bool) -> None:
    """Every stored batch with its progress, newest first."""
    s = session(ctx)
    listing_view = batches_view(s.store)
    if as_json:
        s.emit_json(listing_view)
        return
    views = listing_view["batches"]
    console = s.console()
    if not views:
        console.print("no batches")
        return
    table = listing()
    columns = ("BATCH", "CREATED", "TOTAL", "WAITING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "DONE")
    for name in columns:
        left = name in ("BATCH", "CREATED", "DONE")
        table.add_column(name, no_wrap=True, justify="left" if left else "right")
    for v in views:
        plain_row(
            table, v["id"], s.when(v["created_ms"]),
            *(f"{v[k]:,}" for k in ("total", "waiting", "running", "succeeded", "failed", "cancelled")),
            batch_state_text(v["sealed"], v["done"]),
        )  # fmt: skip
    console.print(table)


@click.command("batch", short_help="One batch's progress; --cancel its waiting members; --delete it.")
@click.argument("batch_id", metavar="ID")
@click.option("--cancel", is_flag=True, help="Remove the members that have not been released yet.")
@click.option("--delete", is_flag=True, help="Delete the batch's record (a finished batch; see --force).")
@click.option(
    "--force", is_flag=True,
    help="With --delete: delete a batch not finished too, cancelling its waiting members first.",
)  # fmt: skip
@json_option
@click.pass_context
def batch_show(
    ctx: click.Context, batch_id: str, cancel: bool, delete: bool, force: bool, as_json: bool
) -> None:
    """Batch ID's progress. --cancel removes its members not released yet (waiting, parked or
    deferred; running ones finish), counted as cancelled; once nothing is left, the batch
    completes and its on_complete runs.

    --delete removes a finished batch's record now (it expires by itself after
    delayq_batch_expires). A batch not finished is refused unless --force: then its waiting
    members are cancelled, its on_complete never runs, and members already running finish
    uncounted."""
    s = session(ctx)
    if force and not delete:
        usage("--force goes with --delete")
    if delete and cancel:
        usage("give --cancel or --delete, not both")
    if delete:
        outcome = s.store.delete_batch(batch_id, force=force)
        if outcome == "missing":
            raise CliError(f"no batch with id {batch_id!r}")
        if outcome == "pending":
            raise CliError(
                f"batch {batch_id!r} is not finished (members waiting or running): "
                "cancel it first (--cancel), or delete it anyway with --delete --force"
            )
        if as_json:
            s.emit_json({"id": batch_id, "deleted": True})
        else:
            click.echo(f"{batch_id}: deleted")
        return
    if s.store.batch_state(batch_id) is None:
        raise CliError(f"no batch with id {batch_id!r}")
    cancelled = s.store.cancel_batch(batch_id) if cancel else None
    state = s.store.batch_state(batch_id)
    if state is None:  # pragma: no cover - gone between the two reads (expired meanwhile)
        raise CliError(f"no batch with id {batch_id!r}")
    view = batch_json(state)
    if as_json:
        s.emit_json(view if cancelled is None else {**view, "cancelled_now": cancelled})
        return
    if cancelled is not None:
        click.echo(f"{batch_id}: {cancelled:,} waiting member(s) cancelled")
    rows = [
        ("batch", view["id"]),
        ("created", s.when(view["created_ms"])),
        *((name, f"{view[name]:,}") for name in
          ("total", "waiting", "running", "succeeded", "failed", "cancelled")),
        ("done", "open (not sealed)" if not view["sealed"] else ("yes" if view["done"] else "no")),
        ("expires", "-" if view["expires_ms"] is None else
         s.when(view["expires_ms"]) + ("" if view["sealed"] else " unless sealed by then")),
    ]  # fmt: skip
    s.console().print(kv_table(f"batch {batch_id}", rows))
